extends "test_case.gd"
## Agent groups and the controller base classes, with real controller nodes; and BrokerSync in the
## running tree (no broker: no agent trains) for what it does to HUMAN agents and the seed.

const AgentGroup := preload("../agent_group.gd")
const BrokerSyncScript := preload("../broker_sync.gd")
const HUMAN_MODE: int = 1  # AIController ControlModes.HUMAN


## A controller written for godot_rl before October 2024: no get_info(), no base class of ours.
class LegacyAgent:
	extends Node
	var done: bool = false
	var reward: float = 0.0
	var position: float = 0.25

	func get_obs() -> Dictionary:
		return {"obs": [position, -position]}

	func get_obs_space() -> Dictionary:
		return {"obs": {"size": [2], "space": "box"}}

	func get_action_space() -> Dictionary:
		return {"move": {"size": 1, "action_type": "continuous"}}

	func get_reward() -> float:
		return reward

	func set_action(action) -> void:
		position = action["move"][0]

	func zero_reward() -> void:
		reward = 0.0

	func set_done_false() -> void:
		done = false


## This addon's controller, counting get_obs() calls; may end its episode inside get_obs().
class CountingAgent:
	extends AIController2D
	var obs_calls: int = 0
	var end_inside_get_obs: bool = false

	func get_obs() -> Dictionary:
		obs_calls += 1
		if end_inside_get_obs:
			done = true  # a controller that checks its end while observing (recursed before)
		return {"obs": [float(obs_calls)]}

	func get_action_space() -> Dictionary:
		return {"move": {"size": 1, "action_type": "continuous"}}

	func set_action(_action) -> void:
		pass


func test_get_info_is_optional() -> bool:
	var agents: Array = [LegacyAgent.new(), LegacyAgent.new()]
	agents[1].done = true
	var group: AgentGroup = AgentGroup.new("legacy", agents)
	expect_equal(group.error, "", "a controller without get_info() is accepted")
	group.scan_episode_ends()
	var data: Dictionary = group.collect_step()
	expect(not data.has("error"), "step data: %s" % str(data.get("error", "")))
	expect(not data.has("infos"), "no infos without get_info()")
	expect_equal(
		Wire.bytes_to_values("bool", data["terminated"]["data"]), [false, true], "episode end"
	)
	expect(not agents[1].done, "the reported end is cleared")
	for agent in agents:
		agent.free()
	return true


func test_setting_done_never_calls_get_obs() -> bool:
	var agent := CountingAgent.new()
	agent.done = true
	expect_equal(agent.obs_calls, 0, "setting done calls no sensor")
	agent.done = false
	agent.end_inside_get_obs = true
	agent.get_obs()  # sets done inside get_obs(): recursed through the old done setter
	expect(agent.done, "done set inside get_obs()")
	expect_equal(agent.obs_calls, 1, "get_obs() ran once")
	var group: AgentGroup = AgentGroup.new("counting", [agent])
	expect_equal(group.error, "", "group")
	var calls_before: int = agent.obs_calls
	group.scan_episode_ends()
	expect_equal(agent.obs_calls, calls_before + 1, "the end is observed once, at the scan")
	agent.end_inside_get_obs = false
	var data: Dictionary = group.collect_step()
	expect(data.has("final"), "the episode's last observation is sent")
	expect_equal(Wire.bytes_to_values("bool", data["terminated"]["data"]), [true], "terminated")
	expect(not agent.done, "cleared once reported")
	agent.free()
	return true


func test_reset_after_counts_as_truncated() -> bool:
	var agent := CountingAgent.new()
	agent.reset_after = 2
	var group: AgentGroup = AgentGroup.new("counting", [agent])
	for i in 3:
		group.scan_episode_ends()
		agent._physics_process(0.0)
	expect(agent.needs_reset, "needs_reset after reset_after ticks")
	group.scan_episode_ends()
	var data: Dictionary = group.collect_step()
	expect_equal(Wire.bytes_to_values("bool", data["truncated"]["data"]), [true], "truncated")
	expect_equal(Wire.bytes_to_values("bool", data["terminated"]["data"]), [false], "terminated")
	group.scan_episode_ends()  # the game has not reset yet: the same timeout is not reported again
	data = group.collect_step()
	expect_equal(Wire.bytes_to_values("bool", data["truncated"]["data"]), [false], "once")
	agent.free()
	return true


## Subclasses written for godot_rl (or its PR #65) may declare what this addon's base class once
## declared itself: they must still compile.
func test_godot_rl_subclasses_declaring_their_own_members_compile() -> bool:
	var members: String = "\n".join([
		"var truncated: bool = false",
		"var obs_done: Dictionary = {}",
		"var store_obs_done: bool = true",
		"func get_obs_done():",
		"\treturn obs_done",
		"func get_truncated():",
		"\treturn truncated",
		"func set_truncated_false():",
		"\ttruncated = false",
	])
	for base in ["AIController2D", "AIController3D"]:
		var script := GDScript.new()
		script.source_code = "extends %s\n%s\n" % [base, members]
		expect_equal(error_string(script.reload()), error_string(OK), "a subclass of %s" % base)
	return true


func test_human_agents_have_done_cleared_every_decision_tick() -> bool:
	var agent := CountingAgent.new()
	agent.control_mode = HUMAN_MODE
	var sync: Node = BrokerSyncScript.new()
	sync.action_repeat = 2
	tree.root.add_child(agent)
	tree.root.add_child(sync)
	await tree.physics_frame  # BrokerSync initializes after its first frame (call_deferred)
	await tree.physics_frame
	expect_equal(agent.heuristic, "human", "a HUMAN agent is played by the game")
	for episode in 3:
		agent.done = true
		for i in sync.action_repeat + 1:
			await tree.physics_frame
		expect(not agent.done, "done cleared by a decision tick (episode %d)" % episode)
	sync.queue_free()
	agent.queue_free()
	await tree.process_frame
	return true


func test_seed_is_1_without_env_seed() -> bool:
	seed(1)
	var expected: Array = [randi(), randi(), randi()]
	randomize()
	var sync: Node = BrokerSyncScript.new()
	tree.root.add_child(sync)  # the test's command line has no --env_seed
	await tree.process_frame
	await tree.physics_frame
	expect_equal([randi(), randi(), randi()], expected, "seeded with 1, as godot_rl")
	sync.queue_free()
	await tree.process_frame
	return true
