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


## One group's step data (docs/protocol.md, "Step data") from per-agent values:
## obs_rows[i] is agent i's get_obs(); finals maps an agent index to the observation its episode
## ended on; infos maps an agent index to its non-empty get_info(). Returns {"error"} on bad values.
static func group_step(
	observation_space: Dictionary,
	obs_rows: Array,
	rewards: Array,
	terminated: Array,
	truncated: Array,
	finals: Dictionary,
	infos: Dictionary
) -> Dictionary:
	var n: int = obs_rows.size()
	var obs: Dictionary = _pack_obs(observation_space, obs_rows, "obs")
	if obs.has("error"):
		return obs
	var data: Dictionary = {
		"obs": obs,
		"reward": Wire.make_array("float32", [n], Wire.values_to_bytes("float32", rewards)),
		"terminated": Wire.make_array("bool", [n], Wire.values_to_bytes("bool", terminated)),
		"truncated": Wire.make_array("bool", [n], Wire.values_to_bytes("bool", truncated)),
	}
	if not finals.is_empty():
		var rows: Array = finals.keys()
		rows.sort()
		var final_rows: Array = []
		for row in rows:
			final_rows.append(finals[row])
		var final_obs: Dictionary = _pack_obs(observation_space, final_rows, "final obs")
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
## Returns {"actions": Array} or {"error"}.
static func split_actions(action_space: Dictionary, n_agents: int, arrays: Variant) -> Dictionary:
	if typeof(arrays) != TYPE_DICTIONARY:
		return {"error": "actions must be a map of action key to array"}
	var per_agent: Array = []
	for i in n_agents:
		per_agent.append({})
	for key in action_space:
		var space: Dictionary = action_space[key]
		var read: Dictionary = Wire.read_array(arrays.get(key), "action '%s'" % key)
		if read.has("error"):
			return read
		var row: Array = Spaces.row_shape(space)
		var expected: Array = [n_agents] + row
		if read["shape"] != expected or read["dtype"] != Spaces.wire_dtype(space):
			return {
				"error": "action '%s': expected %s %s, got %s %s"
				% [key, Spaces.wire_dtype(space), str(expected), read["dtype"], str(read["shape"])]
			}
		var values: Array = read["values"]
		var width: int = Wire.element_count(row)
		for i in n_agents:
			if row.is_empty():
				per_agent[i][key] = int(values[i])
			else:
				per_agent[i][key] = values.slice(i * width, (i + 1) * width)
	return {"actions": per_agent}


static func _pack_obs(observation_space: Dictionary, rows: Array, what: String) -> Dictionary:
	var out: Dictionary = {}
	for key in observation_space:
		var space: Dictionary = observation_space[key]
		var floats: Variant = _flat_floats(space, rows, key)
		if floats != null:  # the usual case: one conversion for every agent's values of the key
			var shape_of_floats: Array = [rows.size()] + Spaces.row_shape(space)
			out[key] = Wire.make_array("float32", shape_of_floats, floats.to_byte_array())
			continue
		var data := PackedByteArray()
		for i in rows.size():
			var row: Variant = rows[i]
			if typeof(row) != TYPE_DICTIONARY or not row.has(key):
				return {"error": "%s of agent %d has no key '%s'" % [what, i, key]}
			var packed: Dictionary = Spaces.row_bytes(space, row[key], "")
			if packed.has("error"):  # the label only now: formatting it every row costs every step
				return Spaces.row_bytes(space, row[key], "%s '%s' of agent %d" % [what, key, i])
			data.append_array(packed["bytes"])
		var shape: Array = [rows.size()] + Spaces.row_shape(space)
		out[key] = Wire.make_array(Spaces.wire_dtype(space), shape, data)
	return out


## Every row's value of a float32 key as one PackedFloat32Array, when each is a flat Array (or
## packed float array) of the right size; else null (the row-by-row path checks and reports).
static func _flat_floats(space: Dictionary, rows: Array, key: String) -> Variant:
	if Spaces.wire_dtype(space) != "float32":
		return null
	var count: int = Wire.element_count(Spaces.row_shape(space))
	var values: Array = []
	for row in rows:
		if typeof(row) != TYPE_DICTIONARY or not row.has(key):
			return null
		var value: Variant = row[key]
		if not Spaces.is_flat_numbers(value, count):
			return null
		values.append_array(value if typeof(value) == TYPE_ARRAY else Array(value))
	return PackedFloat32Array(values)
