class_name BrokerSync
extends Node
## Connects this game to godot-rl-broker: one connection carries every agent group of the scene.
##
## Put it in the scene in place of godot_rl_agents' Sync node; the AIControllers stay as they are.
## It finds the AIControllers (node group "AGENT"), groups the TRAINING ones by policy_name,
## announces each group's spaces, and at every decision tick (every action_repeat physics ticks)
## sends all groups' observations, rewards and episode ends in one step message, waits (at most
## wait_for_actions_ms) for the actions and applies them; an answer later than that keeps the tree
## paused until a later physics tick brings it. A group the broker leaves out of an answer is
## held: its agents keep their previous action. HUMAN agents are played by you; ONNX_INFERENCE
## agents run their policy's .onnx file (Godot .NET, see docs/godot_addon.md).
## Command line, as godot_rl games take it: --host= --port= --token= --speedup= --action_repeat=
## --env_seed= --wait_for_actions_ms= (the game quits when the broker closes the connection).

enum ControlModes { HUMAN, TRAINING, ONNX_INFERENCE }

const Wire := preload("wire.gd")
const Client := preload("broker_client.gd")
const Messages := preload("messages.gd")
const Spaces := preload("spaces.gd")
const AgentGroup := preload("agent_group.gd")
const OnnxPolicy := preload("onnx_policy.gd")
const StepEncoder := preload("step_encoder.gd")
# An AIController's control_mode values (godot_rl's ControlModes order).
const AGENT_INHERIT: int = 0
const AGENT_HUMAN: int = 1
const AGENT_TRAINING: int = 2
const AGENT_ONNX: int = 3
const AGENT_RECORD_DEMOS: int = 4
const BASE_PHYSICS_TICKS: int = 60
## The seed without --env_seed=, as godot_rl's Sync.
const DEFAULT_SEED: int = 1

## Mode of the agents whose control_mode is INHERIT_FROM_SYNC.
@export var control_mode: ControlModes = ControlModes.TRAINING
## Broker host name or IP address (every address a name resolves to is tried); --host= overrides it.
@export var host: String = "127.0.0.1"
## Broker port (one port for every game and trainer); --port= overrides it.
@export var port: int = 11008
## Shared token, when the broker requires one; empty: the GDRL_BROKER_TOKEN environment variable;
## --token= overrides both.
@export var token: String = ""
## Physics ticks per decision (an action is applied that long); --action_repeat= overrides it.
@export_range(1, 32, 1, "or_greater") var action_repeat: int = 8
## Game speed: physics_ticks_per_second = 60 x speed_up, time_scale = speed_up; --speedup=.
@export_range(1.0, 10.0, 0.5, "or_greater") var speed_up: float = 1.0
## The .onnx file of each policy for ONNX_INFERENCE agents: {"player": "res://player.onnx"}.
@export var onnx_models: Dictionary = {}
## Seconds to keep retrying the connection before the game gives up (and quits).
@export var timeout_connect: float = 60.0
## This game's name in the broker's logs (default: the project name and the process id).
@export var game_name: String = ""
## Milliseconds a decision tick waits for the broker's answer right after sending its step, as
## godot_rl's Sync blocks for its answer: the actions then act from that same tick. The default
## covers the broker's hold deadline (20 to 100 ms), so a held answer lands in the same tick too.
## An answer later than this (a barrier-stepped trainer that is busy) is picked up by a later
## physics tick while the tree stays paused, so the game never freezes longer than this. 0: never
## wait in a tick (one decision per rendered frame at most). --wait_for_actions_ms= overrides it.
@export_range(0.0, 1000.0, 1.0, "or_greater") var wait_for_actions_ms: float = 100.0

## Command-line arguments as a Dictionary (like godot_rl's Sync.args), for game code to read.
var args: Dictionary = {}
## Tick of the next step message (0 is the first observation).
var tick: int = 0

var _client: Client = null
var _step_encoder: StepEncoder = StepEncoder.new()
var _groups: Array = []
var _onnx_agents: Array = []
var _human_agents: Array = []
var _onnx_models: Dictionary = {}
var _ticks_left: int = 0
var _awaiting_actions: bool = false
var _started: bool = false
var _quitting: bool = false


func _enter_tree() -> void:
	# Before any node's _ready(): a game that resets (draws random numbers) in _ready() is
	# seeded too, wherever this node sits; godot_rl's Sync resets every agent at start instead.
	args = Wire.parse_args(OS.get_cmdline_args() + OS.get_cmdline_user_args())
	_apply_args()


func _ready() -> void:
	process_mode = Node.PROCESS_MODE_ALWAYS  # keeps polling while the tree waits, paused
	process_priority = -1000  # first of the tick: actions land before the game's nodes move
	if "process_physics_priority" in self:
		set("process_physics_priority", -1000)
	_initialize.call_deferred()  # after every AIController's _ready() has joined group "AGENT"


func _physics_process(_delta: float) -> void:
	if not _started or _quitting:
		return
	# Nothing is due from the broker unless a step awaits its answer: polling there would cost every
	# tick (a close is seen by the wait after the next step).
	if _client != null and (_awaiting_actions or not _client.is_ready()):
		_client.poll()
		if _client.is_closed():
			_on_broker_closed()
			return
		if not _client.is_ready() or not _handle_messages():
			return
	if _awaiting_actions:
		return
	for group in _groups:
		group.scan_episode_ends()
	if _ticks_left > 0:
		_ticks_left -= 1
		return
	_decision_tick()


func _notification(what: int) -> void:
	if what == NOTIFICATION_WM_CLOSE_REQUEST:
		_shut_down("game quit")


func _exit_tree() -> void:
	_shut_down("game quit")


func _initialize() -> void:
	var training: Dictionary = _collect_agents()
	_started = true
	if training.is_empty():
		print("BrokerSync: no agent is in TRAINING mode; not connecting to a broker")
		return
	var specs: Array = []
	for policy in training:
		var group: AgentGroup = AgentGroup.new(policy, training[policy])
		if not group.error.is_empty():
			_fail(group.error)
			return
		_groups.append(group)
		specs.append(group.spec())
	var name_for_broker: String = game_name
	if name_for_broker.is_empty():
		name_for_broker = "%s#%d" % [
			str(ProjectSettings.get_setting("application/config/name", "godot")), OS.get_process_id()
		]
	_client = Client.new()
	_client.start(host, port, Messages.hello(name_for_broker, token, specs), timeout_connect)
	get_tree().paused = true  # the world waits for the broker's first actions
	print(
		"BrokerSync: connecting to the broker at %s:%d with groups %s"
		% [host, port, ", ".join(_group_summaries())]
	)


func _apply_args() -> void:
	if args.has("host"):
		if str(args["host"]).strip_edges().is_empty():
			push_error("BrokerSync: --host needs a value (--host=NAME_OR_ADDRESS); using %s" % host)
		else:
			host = str(args["host"]).strip_edges()
	port = _int_arg("port", port, 1, 65535)
	if token.is_empty():  # the same environment variable as gdrl-broker serve and gdrl-train read
		token = OS.get_environment("GDRL_BROKER_TOKEN")
	token = str(args.get("token", token))
	action_repeat = _int_arg("action_repeat", action_repeat, 1, 1 << 20)
	if args.has("speedup"):
		var text: String = str(args["speedup"])
		if text.is_valid_float() and text.to_float() > 0.0:
			speed_up = text.to_float()
		else:
			push_error("BrokerSync: --speedup=%s is not a positive number; using %s" % [text, speed_up])
	if args.has("wait_for_actions_ms"):
		var wait_text: String = str(args["wait_for_actions_ms"])
		if wait_text.is_valid_float() and wait_text.to_float() >= 0.0:
			wait_for_actions_ms = wait_text.to_float()
		else:
			push_error(
				"BrokerSync: --wait_for_actions_ms=%s is not a number >= 0; using %s"
				% [wait_text, wait_for_actions_ms]
			)
	seed(_int_arg("env_seed", DEFAULT_SEED, -(1 << 62), 1 << 62))
	Engine.physics_ticks_per_second = roundi(BASE_PHYSICS_TICKS * speed_up)
	Engine.time_scale = speed_up


func _int_arg(key: String, default: int, low: int, high: int) -> int:
	if not args.has(key):
		return default
	var text: String = str(args[key])
	if not text.is_valid_int() or text.to_int() < low or text.to_int() > high:
		push_error("BrokerSync: --%s=%s must be an integer in [%d, %d]; using %d" % [
			key, text, low, high, default
		])
		return default
	return text.to_int()


## TRAINING agents by policy (tree order); sets up HUMAN and ONNX_INFERENCE agents on the way.
func _collect_agents() -> Dictionary:
	var training: Dictionary = {}
	for agent in get_tree().get_nodes_in_group("AGENT"):
		var mode: int = _mode_of(agent)
		if mode == AGENT_TRAINING:
			var policy: String = _policy_of(agent)
			if not training.has(policy):
				training[policy] = []
			training[policy].append(agent)
			_set_heuristic(agent, "model")
		elif mode == AGENT_ONNX:
			_add_onnx_agent(agent)
		else:
			_play_as_human(agent)
	return training


func _mode_of(agent: Node) -> int:
	var mode: int = AGENT_INHERIT
	if "control_mode" in agent:
		mode = int(agent.get("control_mode"))
	if mode == AGENT_INHERIT:
		mode = [AGENT_HUMAN, AGENT_TRAINING, AGENT_ONNX][control_mode]
	if mode == AGENT_RECORD_DEMOS:
		push_warning("BrokerSync: %s records demos, which BrokerSync does not; it plays as HUMAN" % [
			str(agent.get_path())
		])
		mode = AGENT_HUMAN
	return mode


func _policy_of(agent: Node) -> String:
	if "policy_name" in agent:
		return str(agent.get("policy_name"))
	return "shared_policy"


func _play_as_human(agent: Node) -> void:
	_set_heuristic(agent, "human")
	_human_agents.append(agent)


func _set_heuristic(agent: Node, value: String) -> void:
	if agent.has_method("set_heuristic"):
		agent.call("set_heuristic", value)


func _add_onnx_agent(agent: Node) -> void:
	var policy: String = _policy_of(agent)
	var path: String = str(agent.get("onnx_model_path")) if "onnx_model_path" in agent else ""
	if path.is_empty():
		path = str(onnx_models.get(policy, ""))
	if path.is_empty():
		push_error(
			"BrokerSync: %s is in ONNX_INFERENCE mode but policy '%s' has no .onnx file: set "
			% [str(agent.get_path()), policy]
			+ "BrokerSync.onnx_models or the agent's onnx_model_path; it plays as HUMAN"
		)
		_play_as_human(agent)
		return
	if not _onnx_models.has(path):
		_onnx_models[path] = OnnxPolicy.new(path)
	var model: OnnxPolicy = _onnx_models[path]
	var spaces: Dictionary = Spaces.convert_spaces(
		agent.call("get_obs_space"), agent.call("get_action_space")
	)
	var problem: String = model.error if not model.error.is_empty() else str(spaces.get("error", ""))
	if not problem.is_empty():
		push_error("BrokerSync: %s cannot run %s (%s); it plays as HUMAN" % [
			str(agent.get_path()), path, problem
		])
		_play_as_human(agent)
		return
	_set_heuristic(agent, "model")
	_onnx_agents.append({"agent": agent, "model": model, "action_space": spaces["action_space"]})


## Reads what the broker sent; false once the game must stop.
func _handle_messages() -> bool:
	while true:
		var message: Dictionary = _client.take_message()
		if message.is_empty():
			return true
		if message["type"] != "actions" or not _awaiting_actions:
			_fail("unexpected '%s' message from the broker" % str(message["type"]))
			return false
		if int(message.get("tick", -1)) != tick:
			_fail("actions for tick %s answer step %d" % [str(message.get("tick")), tick])
			return false
		var groups: Variant = message.get("groups")
		if typeof(groups) != TYPE_DICTIONARY:
			_fail("actions.groups is not a map")
			return false
		for group in _groups:
			if groups.has(group.policy):  # absent: held, the agents keep their last action
				var problem: String = group.apply_actions(groups[group.policy])
				if not problem.is_empty():
					_fail(problem)
					return false
		tick += 1
		_awaiting_actions = false
		_ticks_left = action_repeat  # this tick is the first of action_repeat
		get_tree().paused = false
	return true


func _decision_tick() -> void:
	_run_onnx_agents()
	_clear_human_episode_ends()
	if _client == null:
		_ticks_left = action_repeat - 1
		return
	var groups: Dictionary = {}
	for group in _groups:
		var data: Dictionary = group.collect_step()
		if data.has("error"):
			_fail(data["error"])
			return
		groups[group.policy] = data
	if not _client.send_frame(_step_encoder.encode(Messages.step(tick, groups))):
		_on_broker_closed()
		return
	_awaiting_actions = true
	_wait_for_actions()
	if _awaiting_actions and not _quitting:
		get_tree().paused = true  # late answer: the world holds; a later physics tick picks it up


## Waits up to wait_for_actions_ms for this step's actions and applies them when they come.
func _wait_for_actions() -> void:
	if wait_for_actions_ms <= 0.0:
		return
	_client.wait_for_message(int(wait_for_actions_ms * 1000.0))
	if _client.is_closed():
		_on_broker_closed()
		return
	if _handle_messages() and not _awaiting_actions:
		_ticks_left -= 1  # the actions act from this very tick, the first of action_repeat


func _run_onnx_agents() -> void:
	var failed: Array = []
	for entry in _onnx_agents:
		var agent: Node = entry["agent"]
		var result: Dictionary = entry["model"].act(agent.call("get_obs"), entry["action_space"])
		if result.has("error"):
			push_error("BrokerSync: %s: %s; it plays as HUMAN" % [str(agent.get_path()), result["error"]])
			_play_as_human(agent)
			failed.append(entry)
			continue
		agent.call("set_action", result["actions"])
		if agent.has_method("set_done_false"):
			agent.call("set_done_false")  # nobody reports inference episodes: clear as godot_rl does
	for entry in failed:
		_onnx_agents.erase(entry)


## Nobody reports a HUMAN agent's episodes: clear their done flag every decision tick, as godot_rl.
func _clear_human_episode_ends() -> void:
	for agent in _human_agents:
		if agent.has_method("set_done_false") and "done" in agent and bool(agent.get("done")):
			agent.call("set_done_false")


func _group_summaries() -> PackedStringArray:
	var out := PackedStringArray()
	for group in _groups:
		out.append("%s (%d agents)" % [group.policy, group.agents.size()])
	return out


func _on_broker_closed() -> void:
	if _quitting:
		return
	_quitting = true
	if not _client.error.is_empty():
		push_error("BrokerSync: %s" % _client.error)
		get_tree().quit(1)
		return
	print("BrokerSync: the broker closed the connection (%s); quitting" % _client.close_reason)
	get_tree().quit()


func _fail(problem: String) -> void:
	push_error("BrokerSync: %s" % problem)
	_quitting = true
	if _client != null:
		_client.close("game error: %s" % problem)
	get_tree().quit(1)


func _shut_down(reason: String) -> void:
	if _client != null and not _client.is_closed():
		_client.close(reason)
	for path in _onnx_models:
		_onnx_models[path].release()
	_onnx_models.clear()
	_onnx_agents.clear()
	_human_agents.clear()
