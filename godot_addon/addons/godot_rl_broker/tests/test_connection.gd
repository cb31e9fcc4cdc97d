extends "test_case.gd"
## The client on real loopback sockets, against a TCPServer the test plays the broker with:
## host resolution (every address tried) and the bounded wait for an answer.

const Client := preload("../broker_client.gd")
const Messages := preload("../messages.gd")
const CONNECT_TIMEOUT_MSEC: int = 10000


## A client whose host name resolves to fixed addresses (the first ones refuse).
class FixedAddressesClient:
	extends Client
	var fixed: PackedStringArray

	func _resolve(_host: String) -> PackedStringArray:
		return fixed


func test_localhost_connects() -> bool:
	var server := TCPServer.new()
	expect_equal(error_string(server.listen(0, "127.0.0.1")), error_string(OK), "listen")
	var client := Client.new()
	client.start("localhost", server.get_local_port(), _hello(), 10.0)
	var peer: StreamPeerTCP = await _accept(server, client)
	expect(peer != null, "connected to 127.0.0.1 through the name localhost")
	client.close("test over")
	server.stop()
	return true


func test_every_resolved_address_is_tried() -> bool:
	var server := TCPServer.new()
	expect_equal(error_string(server.listen(0, "127.0.0.1")), error_string(OK), "listen")
	var client := FixedAddressesClient.new()
	# ::1 and 127.0.0.2 have nobody on this port (or no IPv6 at all): refused, so try the next.
	client.fixed = PackedStringArray(["::1", "127.0.0.2", "127.0.0.1"])
	client.start("broker.example", server.get_local_port(), _hello(), 10.0)
	var peer: StreamPeerTCP = await _accept(server, client)
	expect(peer != null, "connected through the third address (state %d, %s)" % [
		client.state, client.error
	])
	if peer != null:
		var hello: Dictionary = await _read_message(peer)
		expect_equal(hello.get("type"), "hello", "the hello came through")
	client.close("test over")
	server.stop()
	return true


func test_unreachable_addresses_are_all_named() -> bool:
	var client := FixedAddressesClient.new()
	client.fixed = PackedStringArray(["127.0.0.2", "127.0.0.3"])
	client.start("broker.example", 1, _hello(), 0.05)
	var give_up_at: int = Time.get_ticks_msec() + CONNECT_TIMEOUT_MSEC
	while not client.is_closed() and Time.get_ticks_msec() < give_up_at:
		client.poll()
		await tree.process_frame
	expect(client.is_closed(), "gave up after the connect timeout")
	expect(client.error.contains("127.0.0.2, 127.0.0.3"), "names every address: %s" % client.error)
	return true


func test_wait_for_message_is_bounded_and_returns_with_the_answer() -> bool:
	var server := TCPServer.new()
	expect_equal(error_string(server.listen(0, "127.0.0.1")), error_string(OK), "listen")
	var client := Client.new()
	client.start("127.0.0.1", server.get_local_port(), _hello(), 10.0)
	var peer: StreamPeerTCP = await _accept(server, client)
	if peer == null:
		expect(false, "no connection: %s" % client.error)
		return true
	await _read_message(peer)  # the hello
	for greeting in [
		{"type": "handshake", "major_version": "0", "minor_version": "7", "broker_protocol": 1},
		{"type": "env_info"},
	]:
		peer.put_data(Wire.encode_frame(JSON.stringify(greeting).to_utf8_buffer()))
	peer.put_data(Wire.encode_message({"type": "welcome", "game_index": 0, "peer_id": 7}))
	var give_up_at: int = Time.get_ticks_msec() + CONNECT_TIMEOUT_MSEC
	while not client.is_ready() and not client.is_closed() and Time.get_ticks_msec() < give_up_at:
		client.poll()
		await tree.process_frame
	expect(client.is_ready(), "READY after the welcome (%s)" % client.error)
	var started: int = Time.get_ticks_usec()
	client.wait_for_message(30000)
	expect(Time.get_ticks_usec() - started >= 30000, "no answer: waited the whole bound")
	expect(client.take_message().is_empty(), "and returned without a message")
	peer.put_data(Wire.encode_message({"type": "actions", "tick": 0, "groups": {}}))
	client.wait_for_message(CONNECT_TIMEOUT_MSEC * 1000)
	expect_equal(client.take_message().get("type"), "actions", "returned with the answer")
	peer.put_data(Wire.encode_message({"type": "close", "reason": "done"}))
	client.wait_for_message(CONNECT_TIMEOUT_MSEC * 1000)
	expect(client.is_closed(), "a close ends the wait too")
	expect_equal(client.close_reason, "done", "close reason")
	server.stop()
	return true


func _hello() -> Dictionary:
	return Messages.hello("test-game", "", [])


## Polls the client until the server has its connection; the server's side of it, or null.
func _accept(server: TCPServer, client: Client) -> StreamPeerTCP:
	var give_up_at: int = Time.get_ticks_msec() + CONNECT_TIMEOUT_MSEC
	while Time.get_ticks_msec() < give_up_at and not client.is_closed():
		client.poll()
		if server.is_connection_available() and client.state == Client.State.HANDSHAKE:
			return server.take_connection()
		await tree.process_frame
	return null


## The next frame the peer receives, decoded (a Variant Dictionary), or {}.
func _read_message(peer: StreamPeerTCP) -> Dictionary:
	var frames := preload("../frame_buffer.gd").new()
	var give_up_at: int = Time.get_ticks_msec() + CONNECT_TIMEOUT_MSEC
	while Time.get_ticks_msec() < give_up_at:
		peer.poll()
		if peer.get_available_bytes() > 0:
			frames.feed(peer.get_data(peer.get_available_bytes())[1])
			var body: PackedByteArray = frames.pop()
			if not body.is_empty():
				return Wire.decode_message(body)
		await tree.process_frame
	return {}
