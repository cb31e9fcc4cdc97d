extends RefCounted
## Builds the message maps this addon sends (hello, step, close) and splits the broker's actions
## into one godot_rl action Dictionary per agent. Key order matters: it is the order var_to_bytes()
## writes, and it matches the broker's own encoder, so the shared test vectors compare bytes.

const Wire := preload("wire.gd")
const Spaces := preload("spaces.gd")


## One agent group as hello announces it:
## {"policy", "n_agents", "observation_space", "action_space"}.
static func group_spec(policy: String, n_agents: int, spaces: Dictionary) -> Dictionary:
	return {
		"policy": policy,
		"n_agents": n_agents,
		"observation_space": spaces["observation_space"],
		"action_space": spaces["action_space"],
	}


static func hello(game_name: String, token: String, groups: Array) -> Dictionary:
	var message: Dictionary = {
		"type": "hello",
		"protocol": Wire.PROTOCOL_VERSION,
		"role": "game",
		"name": game_name,
	}
	if not token.is_empty():
		message["token"] = token
	message["groups"] = groups
	return message


static func step(tick: int, groups: Dictionary) -> Dictionary:
	return {"type": "step", "tick": tick, "groups": groups}


static func close(reason: String) -> Dictionary:
	return {"type": "close", "reason": reason}


## What packing or splitting a space map needs, worked out once per group (these lookups cost
## every step): one [key, space, wire dtype, row shape (ints), elements per row] per key, in order.
static func space_plan(space_map: Dictionary) -> Array:
	var plan: Array = []
	for key in space_map:
		var space: Dictionary = space_map[key]
		var row: Array = Array(PackedInt64Array(Spaces.row_shape(space)))
		plan.append([key, space, Spaces.wire_dtype(space), row, Wire.element_count(row)])
	return plan


## One group's step data (docs/protocol.md, "Step data") from per-agent values:
## obs_rows[i] is agent i's get_obs(); finals maps an agent index to the observation its episode
## ended on; infos maps an agent index to its non-empty get_info(). rewards are numbers, terminated
## and truncated bools; obs_plan is space_plan(observation_space), when the caller keeps one.
## Returns {"error"} on bad values.
static func group_step(
	observation_space: Dictionary,
	obs_rows: Array,
	rewards: Array,
	terminated: Array,
	truncated: Array,
	finals: Dictionary,
	infos: Dictionary,
	obs_plan: Array = []
) -> Dictionary:
	if obs_plan.is_empty():
		obs_plan = space_plan(observation_space)
	var n: int = obs_rows.size()
	var obs: Dictionary = _pack_obs(obs_plan, obs_rows, "obs")
	if obs.has("error"):
		return obs
	# Array maps written out (Wire.make_array's form): a call per array costs every step.
	var data: Dictionary = {
		"obs": obs,
		"reward": {"dtype": "float32", "shape": [n], "data": PackedFloat32Array(rewards).to_byte_array()},
		# Arrays of bools: the engine converts them to 0/1 bytes in one call.
		"terminated": {"dtype": "bool", "shape": [n], "data": PackedByteArray(terminated)},
		"truncated": {"dtype": "bool", "shape": [n], "data": PackedByteArray(truncated)},
	}
	if not finals.is_empty():
		var rows: Array = finals.keys()
		rows.sort()
		var final_rows: Array = []
		for row in rows:
			final_rows.append(finals[row])
		var final_obs: Dictionary = _pack_obs(obs_plan, final_rows, "final obs")
		if final_obs.has("error"):
			return final_obs
		data["final"] = {
			"index": Wire.make_array("int32", [rows.size()], Wire.values_to_bytes("int32", rows)),
			"obs": final_obs,
		}
	if not infos.is_empty():
		data["infos"] = infos
	return data


## The broker's per-group actions -> one godot_rl action Dictionary per agent, in agent order:
## continuous keys give an Array of floats, discrete keys an int, multi-discrete an Array of ints.
## action_plan is space_plan(action_space), when the caller keeps one.
## Returns {"actions": Array} or {"error"}.
static func split_actions(
	action_space: Dictionary, n_agents: int, arrays: Variant, action_plan: Array = []
) -> Dictionary:
	if typeof(arrays) != TYPE_DICTIONARY:
		return {"error": "actions must be a map of action key to array"}
	if action_plan.is_empty():
		action_plan = space_plan(action_space)
	var per_agent: Array = []
	for i in n_agents:
		per_agent.append({})
	for entry in action_plan:
		var key: String = entry[0]
		var dtype: String = entry[2]
		var row: Array = entry[3]
		var width: int = entry[4]
		var expected: Array = [n_agents] + row
		var values: Variant = _plain_values(arrays.get(key), dtype, expected, n_agents * width)
		if values == null:  # not the expected array: the checked path reads it, or says what is wrong
			var read: Dictionary = Wire.read_array(arrays.get(key), "action '%s'" % key)
			if read.has("error"):
				return read
			if read["shape"] != expected or read["dtype"] != dtype:
				return {
					"error": "action '%s': expected %s %s, got %s %s"
					% [key, dtype, str(expected), read["dtype"], str(read["shape"])]
				}
			values = read["values"]
		for i in n_agents:
			if row.is_empty():
				per_agent[i][key] = int(values[i])
			else:
				per_agent[i][key] = Array(values.slice(i * width, (i + 1) * width))
	return {"actions": per_agent}


## The values of an array map that is exactly `dtype` of shape `expected` (float32 or int32, as
## actions are), decoded in one engine call; null for anything else.
static func _plain_values(map: Variant, dtype: String, expected: Array, count: int) -> Variant:
	if typeof(map) != TYPE_DICTIONARY:
		return null
	var data: Variant = map.get("data")
	var shape: Variant = map.get("shape")
	if typeof(map.get("dtype")) != TYPE_STRING or map["dtype"] != dtype:
		return null
	if typeof(shape) != TYPE_ARRAY or shape != expected or typeof(data) != TYPE_PACKED_BYTE_ARRAY:
		return null
	if dtype == "float32" and data.size() == count * 4:
		return data.to_float32_array()
	if dtype == "int32" and data.size() == count * 4:
		return data.to_int32_array()
	return null


static func _pack_obs(plan: Array, rows: Array, what: String) -> Dictionary:
	var out: Dictionary = {}
	var n: int = rows.size()
	for entry in plan:
		var key: String = entry[0]
		if entry[2] == "float32":  # the usual case: every agent's values of the key in one array
			var floats: Variant = _flat_floats(rows, key, entry[4])
			if floats != null:
				out[key] = {"dtype": "float32", "shape": [n] + entry[3], "data": floats.to_byte_array()}
				continue
		var space: Dictionary = entry[1]
		var data := PackedByteArray()
		for i in n:
			var row: Variant = rows[i]
			if typeof(row) != TYPE_DICTIONARY or not row.has(key):
				return {"error": "%s of agent %d has no key '%s'" % [what, i, key]}
			var packed: Dictionary = Spaces.row_bytes(space, row[key], "")
			if packed.has("error"):  # the label only now: formatting it every row costs every step
				return Spaces.row_bytes(space, row[key], "%s '%s' of agent %d" % [what, key, i])
			data.append_array(packed["bytes"])
		out[key] = Wire.make_array(entry[2], [n] + entry[3], data)
	return out


## Every row's value of a float32 key as one PackedFloat32Array, when each is a flat Array of
## numbers (or a packed float array) of `count` values; else null (the row-by-row path checks and
## reports). Written out rather than with Spaces.is_flat_numbers: calls cost every step.
static func _flat_floats(rows: Array, key: String, count: int) -> Variant:
	var values := PackedFloat32Array()
	for row in rows:
		if typeof(row) != TYPE_DICTIONARY:
			return null
		var value: Variant = row.get(key)
		var kind: int = typeof(value)
		if kind == TYPE_ARRAY:
			if value.size() != count:
				return null
			for item in value:
				var item_kind: int = typeof(item)
				if item_kind != TYPE_FLOAT and item_kind != TYPE_INT:
					return null
		elif kind != TYPE_PACKED_FLOAT32_ARRAY and kind != TYPE_PACKED_FLOAT64_ARRAY:
			return null
		elif value.size() != count:
			return null
		values.append_array(PackedFloat32Array(value))
	return values
