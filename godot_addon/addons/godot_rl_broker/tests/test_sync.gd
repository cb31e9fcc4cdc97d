extends "test_case.gd"
## BrokerSync in the running tree against a broker the test plays on a real loopback socket, from a
## thread (so it can answer while the game's tick waits): when do the actions act?

const BrokerSyncScript := preload("../broker_sync.gd")
const FrameBuffer := preload("../frame_buffer.gd")
const DECISIONS: int = 6
const GIVE_UP_MSEC: int = 20000


## A training agent that notes the physics frame of every observation and every action.
class FrameNotingAgent:
	extends AIController2D
	var obs_frames: Array[int] = []
	var action_frames: Array[int] = []

	func get_obs() -> Dictionary:
		obs_frames.append(Engine.get_physics_frames())
		return {"obs": [0.0]}

	func get_action_space() -> Dictionary:
		return {"move": {"size": 1, "action_type": "continuous"}}

	func set_action(_action) -> void:
		action_frames.append(Engine.get_physics_frames())


## The broker's side of one game connection: greeting, welcome, then an answer to every step.
class ThreadBroker:
	var server := TCPServer.new()
	var answered: int = 0
	var problem: String = ""
	var _frames := FrameBuffer.new()

	func run() -> void:
		var give_up_at: int = Time.get_ticks_msec() + GIVE_UP_MSEC
		while not server.is_connection_available():
			if Time.get_ticks_msec() > give_up_at:
				problem = "the game never connected"
				return
		var peer: StreamPeerTCP = server.take_connection()
		peer.set_no_delay(true)
		for greeting in [{"type": "handshake", "broker_protocol": 1}, {"type": "env_info"}]:
			peer.put_data(Wire.encode_frame(JSON.stringify(greeting).to_utf8_buffer()))
		if _read(peer, give_up_at).get("type") != "hello":
			problem = "no hello"
			return
		peer.put_data(Wire.encode_message({"type": "welcome", "game_index": 0, "peer_id": 1}))
		while true:  # until the game closes
			var step: Dictionary = _read(peer, give_up_at)
			if step.get("type") != "step":
				return
			var move: Dictionary = Wire.make_array(
				"float32", [1, 1], Wire.values_to_bytes("float32", [0.5])
			)
			var actions: Dictionary = {
				"type": "actions", "tick": step["tick"], "groups": {"noter": {"move": move}}
			}
			peer.put_data(Wire.encode_message(actions))
			answered += 1

	func _read(peer: StreamPeerTCP, give_up_at: int) -> Dictionary:
		while Time.get_ticks_msec() < give_up_at:
			peer.poll()
			if peer.get_status() != StreamPeerTCP.STATUS_CONNECTED:
				return {}
			if peer.get_available_bytes() > 0:
				_frames.feed(peer.get_data(peer.get_available_bytes())[1])
			var body: PackedByteArray = _frames.pop()
			if not body.is_empty():
				return Wire.decode_message(body)
		return {}


func test_actions_act_from_the_tick_of_their_step() -> bool:
	var agent: FrameNotingAgent = await _play(5000.0)
	expect(agent.action_frames.size() >= DECISIONS, "actions came: %s" % str(agent.action_frames))
	for frame in agent.action_frames:
		expect(frame in agent.obs_frames, "action in frame %d, the frame of its step (%s)" % [
			frame, str(agent.obs_frames)
		])
	agent.free()
	return true


func test_without_the_wait_actions_come_a_later_tick() -> bool:
	var agent: FrameNotingAgent = await _play(0.0)
	expect(agent.action_frames.size() >= DECISIONS, "actions came: %s" % str(agent.action_frames))
	for frame in agent.action_frames:
		expect(frame not in agent.obs_frames, "action in frame %d, after its step's frame (%s)" % [
			frame, str(agent.obs_frames)
		])
	agent.free()
	return true


## Runs BrokerSync with one agent against a ThreadBroker until DECISIONS actions came; the agent.
func _play(wait_for_actions_ms: float) -> FrameNotingAgent:
	var broker := ThreadBroker.new()
	expect_equal(error_string(broker.server.listen(0, "127.0.0.1")), error_string(OK), "listen")
	var thread := Thread.new()
	thread.start(broker.run)
	var agent := FrameNotingAgent.new()
	agent.control_mode = 2  # TRAINING
	agent.policy_name = "noter"
	var sync: Node = BrokerSyncScript.new()
	sync.port = broker.server.get_local_port()
	sync.action_repeat = 2
	sync.wait_for_actions_ms = wait_for_actions_ms
	tree.root.add_child(agent)
	tree.root.add_child(sync)
	var give_up_at: int = Time.get_ticks_msec() + GIVE_UP_MSEC
	while agent.action_frames.size() < DECISIONS and Time.get_ticks_msec() < give_up_at:
		await tree.physics_frame
	tree.root.remove_child(sync)  # closes the connection: the broker's thread ends
	sync.free()
	tree.root.remove_child(agent)
	thread.wait_to_finish()
	broker.server.stop()
	expect_equal(broker.problem, "", "the test's broker")
	tree.paused = false
	return agent
