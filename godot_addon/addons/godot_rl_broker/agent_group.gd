extends RefCounted
## The training agents of one policy in this game: announces their spaces, collects their step data
## at each decision tick, and hands each agent its action from the broker.
##
## Agents are godot_rl AIControllers (this addon's or godot_rl_agents' own), used by duck typing.
## Episode ends are edge-triggered as in godot_rl: reported once, then cleared with
## set_done_false(). The observation an episode ended on is read when the end is seen, at the
## start of the next physics tick (BrokerSync runs first in a tick, before the game resets the
## agent), with get_obs(), or the controller's own capture when it has one (get_obs_done(), as
## godot_rl plugin PR #65 does); never from inside game code, so setting done never calls get_obs().
## A reset_after timeout counts as truncated: the controller's `truncated` flag, or for controllers
## without one, needs_reset raised by n_steps > reset_after. get_info() is optional (godot_rl
## controllers made before October 2024 lack it).

const Messages := preload("messages.gd")
const Spaces := preload("spaces.gd")
const REQUIRED_METHODS: Array[String] = [
	"get_obs",
	"get_obs_space",
	"get_action_space",
	"get_reward",
	"set_action",
	"zero_reward",
	"set_done_false",
]

var policy: String = ""
var agents: Array = []
## {"observation_space", "action_space"} in the broker's form, shared by every agent of the group.
var spaces: Dictionary = {}
## Why this group cannot be used; "" when it is fine.
var error: String = ""

var _ended: Array[bool] = []
var _truncated: Array[bool] = []
var _finals: Dictionary = {}
var _timeout_reported: Array[bool] = []
# What each controller has, looked up once: property and method lookups cost every tick.
var _has_truncated_flag: Array[bool] = []
var _can_time_out: Array[bool] = []
var _has_info: Array[bool] = []
var _obs_plan: Array = []
var _action_plan: Array = []


func _init(policy_name: String, members: Array) -> void:
	policy = policy_name
	agents = members
	for agent in agents:
		if "done" not in agent:
			error = "%s (policy '%s') has no done flag: extend AIController2D/3D" % [
				str(agent.get_path()), policy
			]
			return
		for method in REQUIRED_METHODS:
			if not agent.has_method(method):
				error = "%s (policy '%s') has no %s(): extend AIController2D/3D" % [
					str(agent.get_path()), policy, method
				]
				return
	spaces = _spaces_of(agents[0])
	if spaces.has("error"):
		error = "policy '%s': %s" % [policy, spaces["error"]]
		return
	for agent in agents:
		if _spaces_of(agent) != spaces:
			error = (
				"agents of policy '%s' announce different spaces (%s differs from %s): one policy, "
				+ "one set of spaces"
			) % [policy, str(agent.get_path()), str(agents[0].get_path())]
			return
	_obs_plan = Messages.space_plan(spaces["observation_space"])
	_action_plan = Messages.space_plan(spaces["action_space"])
	for agent in agents:
		_ended.append(false)
		_truncated.append(false)
		_timeout_reported.append(false)
		_has_truncated_flag.append("truncated" in agent)
		_can_time_out.append("n_steps" in agent and "reset_after" in agent and "needs_reset" in agent)
		_has_info.append(agent.has_method("get_info"))


## This group as hello announces it.
func spec() -> Dictionary:
	return Messages.group_spec(policy, agents.size(), spaces)


## Call every physics tick: notes episode ends and captures the observations they ended on.
## Members are read as agent.done (a name interned once), not agent.get("done"): every tick.
func scan_episode_ends() -> void:
	for i in agents.size():
		if _ended[i]:
			continue  # captured; reported at the next decision tick
		var agent: Variant = agents[i]
		var ended: bool = bool(agent.done)
		var truncated: bool = false
		if _has_truncated_flag[i]:
			truncated = bool(agent.truncated)
			ended = ended or truncated
		elif not ended and _timed_out(i, agent):
			ended = true
			truncated = true
		if ended:
			_ended[i] = true
			_truncated[i] = truncated
			_finals[i] = _final_obs(agent)


## This decision tick's step data for the group (or {"error"}); clears the reported episode ends.
func collect_step() -> Dictionary:
	var obs_rows: Array = []
	var infos: Dictionary = {}
	for i in agents.size():
		obs_rows.append(agents[i].get_obs())
		var info: Variant = agents[i].get_info() if _has_info[i] else null
		if typeof(info) == TYPE_DICTIONARY and not info.is_empty():
			infos[i] = info
	var rewards: Array = []
	var terminated: Array = []
	var truncated: Array = []
	for i in agents.size():
		rewards.append(float(agents[i].get_reward()))
		agents[i].zero_reward()
		terminated.append(_ended[i] and not _truncated[i])
		truncated.append(_ended[i] and _truncated[i])
	var data: Dictionary = Messages.group_step(
		spaces["observation_space"], obs_rows, rewards, terminated, truncated, _finals, infos, _obs_plan
	)
	for i in agents.size():
		if _ended[i]:
			agents[i].set_done_false()
			if agents[i].has_method("set_truncated_false"):
				agents[i].set_truncated_false()
			elif _has_truncated_flag[i]:
				agents[i].set("truncated", false)
		_ended[i] = false
		_truncated[i] = false
	_finals = {}
	if data.has("error"):
		return {"error": "policy '%s': %s" % [policy, data["error"]]}
	return data


## Gives every agent its action from the broker's map for this group. Returns "" or the error.
func apply_actions(arrays: Variant) -> String:
	var split: Dictionary = Messages.split_actions(
		spaces["action_space"], agents.size(), arrays, _action_plan
	)
	if split.has("error"):
		return "policy '%s': %s" % [policy, split["error"]]
	var actions: Array = split["actions"]
	for i in agents.size():
		agents[i].set_action(actions[i])
	return ""


func _spaces_of(agent: Variant) -> Dictionary:
	return Spaces.convert_spaces(agent.get_obs_space(), agent.get_action_space())


func _final_obs(agent: Variant) -> Variant:
	if agent.has_method("get_obs_done"):
		var captured: Variant = agent.get_obs_done()
		if typeof(captured) == TYPE_DICTIONARY and not captured.is_empty():
			return captured
	return agent.get_obs()


## Controllers without a truncated flag: the first tick of a reset_after timeout (once per timeout).
func _timed_out(i: int, agent: Variant) -> bool:
	if not _can_time_out[i]:
		return false
	if int(agent.n_steps) <= int(agent.reset_after):
		_timeout_reported[i] = false
		return false
	if _timeout_reported[i] or not bool(agent.needs_reset):
		return false
	_timeout_reported[i] = true
	return true
