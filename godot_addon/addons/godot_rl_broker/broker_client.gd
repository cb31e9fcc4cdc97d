extends RefCounted
## One TCP connection to godot-rl-broker, driven by poll() once a physics tick. Only
## wait_for_message() blocks, for at most the time it is given.
##
## connect (every address the host resolves to, IPv4 and IPv6, in turn; then again with backoff
## until timeout_connect) -> send hello at once -> skip the broker's
## two JSON greeting frames (checking broker_protocol) -> welcome -> READY. Afterwards messages
## from the broker queue up for take_message(). Every frame goes out in one put_data call.

enum State { IDLE, CONNECTING, RETRY_WAIT, HANDSHAKE, READY, CLOSED }

const Wire := preload("wire.gd")
const FrameBuffer := preload("frame_buffer.gd")
const FIRST_RETRY_SEC: float = 0.1
const MAX_RETRY_SEC: float = 2.0
const MAX_QUEUED_MESSAGES: int = 16
const MAX_READ_BYTES: int = 1 << 20
## Sleep between polls in wait_for_message(), leaving the CPU to the broker and the trainers on the
## same machine: the godot_rl plugin's own value. A sleep lasts more than it asks on Linux
## (timer slack, the wake-up): 10 us about 100 us, 50 us about 145 us. Polling without sleeping
## was measured 1.07x on a quiet machine but 0.56x under load (the busy game takes the CPU the
## broker and the trainer need). At action_repeat 1, speedup 32 (docs/godot_addon.md) 50 us gave
## BrokerSync 0.94x the plugin's decisions/s over TCP, 10 us 0.99x.
const WAIT_POLL_USEC: int = 10

var state: State = State.IDLE
## Why the connection ended; "" after an orderly close (then see close_reason).
var error: String = ""
var close_reason: String = ""
var game_index: int = -1
var peer_id: int = -1
## What we are connected to, for messages: "host:port".
var address: String = ""

var _host: String = ""
## The addresses of _host tried in this round, and which one is being tried.
var _addresses := PackedStringArray()
var _address_index: int = 0
var _port: int = 0
var _hello: Dictionary = {}
var _tcp: StreamPeerTCP = null
var _frames: FrameBuffer = FrameBuffer.new()
var _greeting_frames: int = 0
var _inbox: Array[Dictionary] = []
var _deadline_msec: int = 0
var _retry_at_msec: int = 0
var _retry_sec: float = FIRST_RETRY_SEC
var _last_connect_error: String = ""


## Starts connecting; `hello` is the hello message, sent as soon as the connection is up.
func start(host: String, port: int, hello: Dictionary, timeout_connect_sec: float) -> void:
	_host = host
	_port = port
	_hello = hello
	address = "%s:%d" % [host, port]
	_deadline_msec = Time.get_ticks_msec() + int(timeout_connect_sec * 1000.0)
	_attempt()


## Advances the connection: call once a physics tick (or more often). Never blocks.
func poll() -> void:
	match state:
		State.CONNECTING:
			_poll_connecting()
		State.RETRY_WAIT:
			if Time.get_ticks_msec() >= _retry_at_msec:
				_attempt()
		State.HANDSHAKE, State.READY:
			_poll_connected()


## Polls until a message from the broker is waiting or the connection is no longer READY, for at
## most timeout_usec. Returns at once when a message is already waiting.
func wait_for_message(timeout_usec: int) -> void:
	var give_up_at: int = Time.get_ticks_usec() + timeout_usec
	while _inbox.is_empty() and state == State.READY:
		poll()
		if not _inbox.is_empty() or state != State.READY or Time.get_ticks_usec() >= give_up_at:
			return
		OS.delay_usec(WAIT_POLL_USEC)


func is_ready() -> bool:
	return state == State.READY


func is_closed() -> bool:
	return state == State.CLOSED


## The oldest message from the broker, or {} when none is waiting.
func take_message() -> Dictionary:
	if _inbox.is_empty():
		return {}
	return _inbox.pop_front()


## Sends one message map as one frame. Returns false (and closes) if the connection is gone.
func send_message(message: Dictionary) -> bool:
	return send_frame(Wire.encode_message(message))


## Sends one encoded frame (length header and body) in one call. False (and closed) when gone.
func send_frame(frame: PackedByteArray) -> bool:
	if _tcp == null or (state != State.HANDSHAKE and state != State.READY):
		return false
	var result: Error = _tcp.put_data(frame)
	if result != OK:
		_fail("could not send to the broker at %s: %s" % [address, error_string(result)])
		return false
	return true


## Orderly goodbye: tells the broker why, then disconnects.
func close(reason: String) -> void:
	if state == State.HANDSHAKE or state == State.READY:
		send_message({"type": "close", "reason": reason})
	_disconnect()
	if state != State.CLOSED:
		close_reason = reason
		state = State.CLOSED


## Feeds bytes as if read from the socket (the tests drive the protocol this way, without one).
func receive_bytes(data: PackedByteArray) -> void:
	_frames.feed(data)
	while state == State.HANDSHAKE or state == State.READY:
		var body: PackedByteArray = _frames.pop()
		if not _frames.error.is_empty():
			_fail(_frames.error)
			return
		if body.is_empty():
			return
		_handle_body(body)


## For tests: a client that already sent its hello and waits for the greeting.
func begin_handshake_without_socket() -> void:
	state = State.HANDSHAKE
	address = "test"


## Starts a round: resolves the host (again: addresses may change) and tries its first address.
func _attempt() -> void:
	_disconnect()
	_address_index = 0
	_addresses = _resolve(_host)
	if _addresses.is_empty():
		_retry_later("cannot resolve host '%s'" % _host)
		return
	_connect_current()


## Every address of host, IPv4 and IPv6 (a name like localhost may give ::1 before its IPv4 one).
func _resolve(host: String) -> PackedStringArray:
	if host.is_valid_ip_address():
		return PackedStringArray([host])
	return IP.resolve_hostname_addresses(host, IP.TYPE_ANY)


func _connect_current() -> void:
	_disconnect()
	_tcp = StreamPeerTCP.new()
	var result: Error = _tcp.connect_to_host(_addresses[_address_index], _port)
	if result != OK:
		_try_next_address("connect_to_host failed: %s" % error_string(result))
		return
	state = State.CONNECTING


## The next resolved address at once, or (all tried) the next round after the backoff.
func _try_next_address(why: String) -> void:
	_address_index += 1
	if _address_index < _addresses.size():
		_connect_current()
		return
	_retry_later("%s (tried %s)" % [why, ", ".join(_addresses)])


func _poll_connecting() -> void:
	_tcp.poll()
	match _tcp.get_status():
		StreamPeerTCP.STATUS_CONNECTED:
			_tcp.set_no_delay(true)  # a frame waits for nothing (Nagle would add ~40 ms a step)
			state = State.HANDSHAKE
			_greeting_frames = 0
			send_message(_hello)  # native peers need not wait for the greeting
		StreamPeerTCP.STATUS_CONNECTING:
			if Time.get_ticks_msec() > _deadline_msec:
				_give_up("no answer")
		_:
			_try_next_address("connection refused or failed")


func _poll_connected() -> void:
	_tcp.poll()
	if _tcp.get_status() != StreamPeerTCP.STATUS_CONNECTED:
		_disconnect()
		if state == State.HANDSHAKE:
			_fail("the broker at %s closed the connection during the handshake" % address)
		else:
			_fail("lost the broker at %s" % address)
		return
	var available: int = _tcp.get_available_bytes()
	while available > 0 and state != State.CLOSED:
		var result: Array = _tcp.get_partial_data(mini(available, MAX_READ_BYTES))
		if result[0] != OK:
			_fail("reading from the broker failed: %s" % error_string(result[0]))
			return
		receive_bytes(result[1])
		available = _tcp.get_available_bytes() if state != State.CLOSED else 0


func _handle_body(body: PackedByteArray) -> void:
	if _greeting_frames < 2:
		var problem: String = Wire.check_greeting(_greeting_frames, body)
		if not problem.is_empty():
			_fail("%s (%s)" % [problem, address])
			return
		_greeting_frames += 1
		return
	var message: Dictionary = Wire.decode_message(body)
	if message.has("error") and not message.has("type"):
		_fail(str(message["error"]))
	elif message["type"] == "error":
		_fail("broker error %s: %s" % [str(message.get("code", "?")), str(message.get("message", ""))])
	elif message["type"] == "close":
		close_reason = str(message.get("reason", ""))
		_disconnect()
		state = State.CLOSED
	elif state == State.HANDSHAKE:
		_handle_welcome(message)
	elif _inbox.size() >= MAX_QUEUED_MESSAGES:
		_fail("the broker sent %d messages the game did not read" % _inbox.size())
	else:
		_inbox.append(message)


func _handle_welcome(message: Dictionary) -> void:
	if message["type"] != "welcome":
		_fail("expected welcome from the broker, got '%s'" % str(message["type"]))
		return
	game_index = int(message.get("game_index", -1))
	peer_id = int(message.get("peer_id", -1))
	state = State.READY


func _retry_later(why: String) -> void:
	_disconnect()
	_last_connect_error = why
	if Time.get_ticks_msec() + int(_retry_sec * 1000.0) > _deadline_msec:
		_give_up(why)
		return
	state = State.RETRY_WAIT
	_retry_at_msec = Time.get_ticks_msec() + int(_retry_sec * 1000.0)
	_retry_sec = minf(_retry_sec * 2.0, MAX_RETRY_SEC)


func _give_up(why: String) -> void:
	_fail("could not reach the broker at %s before the connect timeout (%s)" % [address, why])


func _fail(why: String) -> void:
	_disconnect()
	if state != State.CLOSED:
		error = why
		state = State.CLOSED


func _disconnect() -> void:
	if _tcp != null:
		_tcp.disconnect_from_host()
		_tcp = null
