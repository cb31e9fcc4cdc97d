extends "test_case.gd"
## Frames, the broker's greeting, and the client's handshake, fed from the shared vectors.

const FrameBuffer := preload("../frame_buffer.gd")
const Client := preload("../broker_client.gd")
const PLAIN_GODOT_RL_HANDSHAKE: String = (
	'{"type": "handshake", "major_version": "0", "minor_version": "7"}'
)


func test_frames_split_from_any_chunking() -> bool:
	var stream := PackedByteArray()
	var expected: Array = []
	for name in vectors:
		stream.append_array(vectors[name]["frame"])
		expected.append(vectors[name]["body"])
	for chunk in [1, 3, 7, 64, stream.size()]:
		var frames := FrameBuffer.new()
		var got: Array = []
		for start in range(0, stream.size(), chunk):
			frames.feed(stream.slice(start, start + chunk))
			var next: PackedByteArray = frames.pop()
			while not next.is_empty():
				got.append(next)
				next = frames.pop()
		expect(frames.error.is_empty(), "chunks of %d: %s" % [chunk, frames.error])
		expect_equal(got.size(), expected.size(), "frames from chunks of %d" % chunk)
		expect(got == expected, "bodies from chunks of %d equal the vectors'" % chunk)
		expect_equal(frames.buffered_bytes(), 0, "bytes left after chunks of %d" % chunk)
	return true


func test_encode_frame_matches_every_vector() -> bool:
	for name in vectors:
		expect_bytes(Wire.encode_frame(vectors[name]["body"]), vectors[name]["frame"], name)
	return true


func test_oversized_frame_is_refused_before_buffering() -> bool:
	var frames := FrameBuffer.new()
	frames.max_frame_bytes = 16
	var header := PackedByteArray([17, 0, 0, 0])
	frames.feed(header)
	expect(frames.pop().is_empty(), "no body from an oversized frame")
	expect(not frames.error.is_empty(), "an oversized frame sets error")
	frames.feed(PackedByteArray([1, 2, 3]))
	expect_equal(frames.buffered_bytes(), 0, "nothing buffered after the error")
	return true


func test_empty_frame_is_refused() -> bool:
	var frames := FrameBuffer.new()
	frames.feed(PackedByteArray([0, 0, 0, 0]))
	expect(frames.pop().is_empty() and not frames.error.is_empty(), "an empty frame is an error")
	return true


func test_greeting_of_the_broker_is_accepted() -> bool:
	expect_equal(Wire.check_greeting(0, body("greeting_handshake")), "", "handshake")
	expect_equal(Wire.check_greeting(1, body("greeting_env_info")), "", "env_info request")
	return true


func test_greeting_refusals() -> bool:
	var plain: String = Wire.check_greeting(0, PLAIN_GODOT_RL_HANDSHAKE.to_utf8_buffer())
	expect(plain.contains("godot_rl"), "a plain godot_rl trainer is named: %s" % plain)
	var other: Dictionary = {
		"type": "handshake", "major_version": "0", "minor_version": "7", "broker_protocol": 2
	}
	var version: String = Wire.check_greeting(0, JSON.stringify(other).to_utf8_buffer())
	expect(version.contains("protocol 2"), "a version mismatch is named: %s" % version)
	expect(not Wire.check_greeting(0, body("hello_game")).is_empty(), "a non-JSON greeting")
	expect(not Wire.check_greeting(0, body("greeting_env_info")).is_empty(), "frames swapped")
	expect(not Wire.check_greeting(1, body("greeting_handshake")).is_empty(), "frames swapped")
	return true


func test_client_reads_the_welcome_after_the_greeting() -> bool:
	var client := _handshaking_client()
	client.receive_bytes(_frames(["greeting_handshake", "greeting_env_info", "welcome_game"]))
	expect(client.is_ready(), "ready after welcome: %s" % client.error)
	expect_equal(client.game_index, 0, "game_index")
	expect_equal(client.peer_id, 7, "peer_id")
	expect(client.take_message().is_empty(), "the welcome is not queued")
	return true


func test_client_queues_actions_then_closes() -> bool:
	var client := _handshaking_client()
	var names: Array = [
		"greeting_handshake", "greeting_env_info", "welcome_game", "actions_all_groups", "close"
	]
	client.receive_bytes(_frames(names))
	expect(client.is_closed() and client.error.is_empty(), "an orderly close: %s" % client.error)
	expect_equal(client.close_reason, "broker shutting down", "close reason")
	var actions: Dictionary = client.take_message()
	expect_equal(actions.get("type"), "actions", "the queued message")
	expect_equal(actions.get("tick"), 5, "its tick")
	return true


func test_client_reports_a_broker_error() -> bool:
	var client := _handshaking_client()
	client.receive_bytes(_frames(["greeting_handshake", "greeting_env_info", "error_version"]))
	expect(client.is_closed(), "closed after an error frame")
	expect(client.error.contains("version_mismatch"), "error names the code: %s" % client.error)
	return true


func test_client_refuses_a_plain_godot_rl_server() -> bool:
	var client := _handshaking_client()
	client.receive_bytes(Wire.encode_frame(PLAIN_GODOT_RL_HANDSHAKE.to_utf8_buffer()))
	expect(client.is_closed() and client.error.contains("godot_rl"), "refused: %s" % client.error)
	return true


func _handshaking_client() -> Client:
	var client := Client.new()
	client.begin_handshake_without_socket()
	return client


func _frames(names: Array) -> PackedByteArray:
	var stream := PackedByteArray()
	for name in names:
		stream.append_array(vectors[name]["frame"])
	return stream
