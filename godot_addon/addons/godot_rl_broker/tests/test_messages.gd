extends "test_case.gd"
## Message maps against the shared vectors: Godot's own var_to_bytes() writes exactly the bytes the
## broker's encoder wrote, and the addon's hello, step and actions helpers build and read them.

const Messages := preload("../messages.gd")
const Spaces := preload("../spaces.gd")
const StepEncoder := preload("../step_encoder.gd")
const PLAYER_OBS: Dictionary = {
	"obs": {"size": [3], "space": "box"},
	"camera_2d": {"size": [2, 2, 3], "space": "box"},
}
const PLAYER_ACTIONS: Dictionary = {
	"move": {"size": 2, "action_type": "continuous"},
	"jump": {"size": 2, "action_type": "discrete"},
}
const PLATFORM_OBS: Dictionary = {
	"obs": {"size": [2], "space": "box"},
	"phase": {"size": 4, "space": "discrete"},
	"cell": {"space": "multi_discrete", "nvec": [3, 5]},
}
const PLATFORM_ACTIONS: Dictionary = {
	"dir": {"size": 3, "action_type": "discrete"},
	"gear": {"action_type": "multi_discrete", "nvec": [2, 3]},
}


func test_every_godot_vector_reencodes_identically() -> bool:
	for name in _godot_vectors():
		var value: Variant = bytes_to_var(body(name))
		expect_equal(typeof(value), TYPE_DICTIONARY, "%s decodes to a Dictionary" % name)
		expect_bytes(var_to_bytes(value), body(name), "%s re-encoded by var_to_bytes" % name)
	return true


func test_every_godot_vector_means_what_it_says() -> bool:
	for name in _godot_vectors():
		var message: Dictionary = Wire.decode_message(body(name))
		expect(not message.has("error"), "%s: %s" % [name, str(message.get("error"))])
		expect_equal(to_meaning(message), meaning(name), name)
	return true


func test_hello_is_byte_identical_to_the_vector() -> bool:
	var player: Dictionary = Spaces.convert_spaces(PLAYER_OBS, PLAYER_ACTIONS)
	var platform: Dictionary = Spaces.convert_spaces(PLATFORM_OBS, PLATFORM_ACTIONS)
	var groups: Array = [
		Messages.group_spec("player", 2, player), Messages.group_spec("platform", 1, platform)
	]
	expect_bytes(var_to_bytes(Messages.hello("level-1", "", groups)), body("hello_game"), "hello")
	return true


func test_first_step_is_byte_identical_to_the_vector() -> bool:
	var groups: Dictionary = meaning("step_first")["groups"]
	var step: Dictionary = Messages.step(
		0, {"player": _rebuild(groups["player"], false), "platform": _rebuild(groups["platform"], false)}
	)
	expect_bytes(var_to_bytes(step), body("step_first"), "step tick 0")
	return true


func test_episode_end_step_is_byte_identical_to_the_vector() -> bool:
	# Images go in as godot_rl's camera sensors give them: hex strings.
	var groups: Dictionary = meaning("step_with_episode_end")["groups"]
	var step: Dictionary = Messages.step(
		5, {"player": _rebuild(groups["player"], true), "platform": _rebuild(groups["platform"], true)}
	)
	expect_bytes(var_to_bytes(step), body("step_with_episode_end"), "step with an episode end")
	return true


func test_actions_split_per_agent() -> bool:
	var groups: Dictionary = bytes_to_var(body("actions_all_groups"))["groups"]
	var player: Dictionary = Spaces.convert_spaces(PLAYER_OBS, PLAYER_ACTIONS)
	var split: Dictionary = Messages.split_actions(player["action_space"], 2, groups["player"])
	expect_equal(split.get("actions"), [
		{"move": [0.25, -1.0], "jump": 1}, {"move": [1.0, 0.0], "jump": 0}
	], "player actions")
	var platform: Dictionary = Spaces.convert_spaces(PLATFORM_OBS, PLATFORM_ACTIONS)
	split = Messages.split_actions(platform["action_space"], 1, groups["platform"])
	expect_equal(split.get("actions"), [{"dir": 2, "gear": [1, 2]}], "platform actions")
	expect_equal(typeof(split["actions"][0]["dir"]), TYPE_INT, "a discrete action is an int")
	return true


func test_held_group_is_absent_from_actions() -> bool:
	var groups: Dictionary = bytes_to_var(body("actions_platform_held"))["groups"]
	expect(not groups.has("platform"), "the held group is left out")
	var player: Dictionary = Spaces.convert_spaces(PLAYER_OBS, PLAYER_ACTIONS)
	var split: Dictionary = Messages.split_actions(player["action_space"], 2, groups["player"])
	expect_equal(split.get("actions"), [
		{"move": [0.0, 0.5], "jump": 0}, {"move": [-0.5, 0.0], "jump": 0}
	], "player actions")
	return true


func test_actions_of_the_wrong_shape_are_refused() -> bool:
	var groups: Dictionary = bytes_to_var(body("actions_all_groups"))["groups"]
	var platform: Dictionary = Spaces.convert_spaces(PLATFORM_OBS, PLATFORM_ACTIONS)
	var split: Dictionary = Messages.split_actions(platform["action_space"], 1, groups["player"])
	expect(split.has("error"), "player actions do not fit the platform's space")
	var player: Dictionary = Spaces.convert_spaces(PLAYER_OBS, PLAYER_ACTIONS)
	split = Messages.split_actions(player["action_space"], 3, groups["player"])
	expect(split.has("error"), "2 rows do not fit 3 agents")
	return true


## A decoded message with its arrays shown as the vectors show them ({"__array__": ...}).
static func to_meaning(value: Variant) -> Variant:
	if typeof(value) == TYPE_DICTIONARY:
		if value.size() == 3 and value.has("dtype") and value.has("shape") and value.has("data"):
			var array: Dictionary = Wire.read_array(value, "array")
			if array.has("error"):
				return array
			var values: Variant = nest(array["values"], array["shape"])
			return {"__array__": {"dtype": array["dtype"], "shape": array["shape"], "values": values}}
		var out: Dictionary = {}
		for key in value:
			out[key] = to_meaning(value[key])
		return out
	if typeof(value) == TYPE_ARRAY:
		var items: Array = []
		for item in value:
			items.append(to_meaning(item))
		return items
	return value


## Flat row-major values -> nested Arrays of `shape` (a scalar for shape []).
static func nest(values: Array, shape: Array) -> Variant:
	if shape.is_empty():
		return values[0]
	var rest: Array = shape.slice(1)
	var width: int = Wire.element_count(rest)
	var out: Array = []
	for i in int(shape[0]):
		out.append(nest(values.slice(i * width, (i + 1) * width), rest))
	return out


func test_step_encoder_writes_the_engines_bytes() -> bool:
	var encoder: StepEncoder = StepEncoder.new()
	var groups: Dictionary = meaning("step_first")["groups"]
	var first: Dictionary = Messages.step(
		0, {"player": _rebuild(groups["player"], false), "platform": _rebuild(groups["platform"], false)}
	)
	expect_bytes(encoder.encode(first), Wire.encode_frame(body("step_first")), "first steady step")
	expect(encoder.is_learned(), "the layout is learned from the first steady step")
	# Later steps of the layout: other ticks (one beyond 32 bits) and other data.
	for tick in [1, 2, 70000, 1 << 40, -3]:
		var step: Dictionary = first.duplicate(true)
		step["tick"] = tick
		var player: Dictionary = step["groups"]["player"]
		player["reward"]["data"] = PackedFloat32Array([tick * 0.5, -1.0]).to_byte_array()
		player["terminated"]["data"] = PackedByteArray([absi(tick) % 2, 1])
		player["obs"]["obs"]["data"] = PackedFloat32Array([tick, 2, 3, 4, 5, 6]).to_byte_array()
		step["groups"]["platform"]["truncated"]["data"] = PackedByteArray([1])
		expect_bytes(encoder.encode(step), Wire.encode_message(step), "step at tick %d" % tick)
	# Another size of data (the shape with it) is not the layout: the engine encodes it.
	var wider: Dictionary = first.duplicate(true)
	var one_reward := PackedByteArray([0, 0, 0, 0])
	wider["groups"]["player"]["reward"] = Wire.make_array("float32", [1], one_reward)
	expect_bytes(encoder.encode(wider), Wire.encode_message(wider), "data of another size")
	var ended_groups: Dictionary = meaning("step_with_episode_end")["groups"]
	var ended: Dictionary = Messages.step(
		5,
		{
			"player": _rebuild(ended_groups["player"], true),
			"platform": _rebuild(ended_groups["platform"], true),
		}
	)
	expect_bytes(
		encoder.encode(ended), Wire.encode_frame(body("step_with_episode_end")), "an episode end"
	)
	return true


func _godot_vectors() -> Array:
	var names: Array = []
	for name in vectors:
		if vectors[name]["codec"] == "godot":
			names.append(name)
	return names


## A group's step data rebuilt from per-agent values taken out of a vector's meaning, the way
## BrokerSync collects them from AIControllers, then packed by Messages.group_step.
func _rebuild(group: Dictionary, images_as_hex: bool) -> Dictionary:
	var n: int = int(group["reward"]["__array__"]["shape"][0])
	var keys: Array = group["obs"].keys()
	var obs_rows: Array = _rows(group["obs"], keys, n, images_as_hex)
	var finals: Dictionary = {}
	if group.has("final"):
		var index: Array = group["final"]["index"]["__array__"]["values"]
		var final_rows: Array = _rows(group["final"]["obs"], keys, index.size(), images_as_hex)
		for j in index.size():
			finals[int(index[j])] = final_rows[j]
	var infos: Dictionary = {}
	for row in group.get("infos", {}):
		infos[int(row)] = group["infos"][row]
	var observation_space: Dictionary = {}
	for key in keys:
		observation_space[key] = _space_of(group["obs"][key]["__array__"], key)
	return Messages.group_step(
		observation_space,
		obs_rows,
		group["reward"]["__array__"]["values"],
		group["terminated"]["__array__"]["values"],
		group["truncated"]["__array__"]["values"],
		finals,
		infos
	)


func _rows(arrays: Dictionary, keys: Array, n: int, images_as_hex: bool) -> Array:
	var rows: Array = []
	for i in n:
		var row: Dictionary = {}
		for key in keys:
			var array: Dictionary = arrays[key]["__array__"]
			var value: Variant = array["values"][i]
			if images_as_hex and array["dtype"] == "uint8":
				value = Wire.values_to_bytes("uint8", Spaces.flatten(value)).hex_encode()
			row[key] = value
		rows.append(row)
	return rows


## The broker-form space of an obs key, from its array in a vector (the test's stand-in for an
## agent's get_obs_space()).
func _space_of(array: Dictionary, key: String) -> Dictionary:
	var row: Array = array["shape"].slice(1)
	if array["dtype"] == "int32" and row.is_empty():
		return Spaces.observation_space(key, {"size": 4, "space": "discrete"})
	if array["dtype"] == "int32":
		return Spaces.observation_space(key, {"space": "multi_discrete", "nvec": [9, 9]})
	return Spaces.observation_space(key, {"size": row, "space": "box"})
