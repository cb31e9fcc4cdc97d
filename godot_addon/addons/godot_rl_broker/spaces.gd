extends RefCounted
## Observation and action spaces: godot_rl's AIController forms converted to the broker's, and one
## agent's observation value turned into the raw bytes of one array row.
##
## godot_rl                                     broker (docs/protocol.md, "Spaces")
## {"size": [3], "space": "box"}             -> {"space": "box", "shape": [3], "dtype": "float32",
##                                                "low": -1.0, "high": 1.0}
## key containing "2d", {"size": [3, 36, 36]} -> uint8 box, low 0, high 255 (an image)
## {"size": 4, "space": "discrete"}          -> {"space": "discrete", "n": 4}
## {"size": 2, "action_type": "continuous"}  -> {"action_type": "continuous", "size": 2}
## The broker's own forms (with "shape", "n", "nvec", "dtype", "low", "high") pass through as well.
## Functions return {"error": text} for anything they cannot convert.

const Wire := preload("wire.gd")


## godot_rl observation space entry -> the broker's form.
static func observation_space(key: String, space: Variant) -> Dictionary:
	if typeof(space) != TYPE_DICTIONARY:
		return {"error": "observation space '%s' must be a Dictionary, got %s" % [key, str(space)]}
	var kind: String = str(space.get("space", "box"))  # str(): any value compares safely
	if kind == "box":
		var shape: Variant = space.get("shape", space.get("size"))
		var dims: Array = _positive_ints(shape)
		if dims.is_empty():
			return {"error": "observation '%s': size must list positive ints, got %s" % [key, str(shape)]}
		var image: bool = key.contains("2d")
		var dtype: String = str(space.get("dtype", "uint8" if image else "float32"))
		if not Wire.ITEM_SIZE.has(dtype) or dtype == "bool":
			return {"error": "observation '%s': dtype %s is not a numeric wire dtype" % [key, dtype]}
		var uint8: bool = dtype == "uint8"
		return {
			"space": "box",
			"shape": dims,
			"dtype": dtype,
			"low": float(space.get("low", 0.0 if uint8 else -1.0)),
			"high": float(space.get("high", 255.0 if uint8 else 1.0)),
		}
	if kind == "discrete":
		var n: Variant = space.get("n", space.get("size"))
		if typeof(n) not in [TYPE_INT, TYPE_FLOAT] or int(n) < 1:
			return {"error": "observation '%s': discrete size must be a positive int" % key}
		return {"space": "discrete", "n": int(n)}
	if kind == "multi_discrete":
		var nvec: Array = _positive_ints(space.get("nvec"))
		if nvec.is_empty():
			return {"error": "observation '%s': nvec must list positive ints" % key}
		return {"space": "multi_discrete", "nvec": nvec}
	return {
		"error": "observation '%s': unknown space %s (box, discrete, multi_discrete)" % [key, kind]
	}


## godot_rl action space entry -> the broker's form.
static func action_space(key: String, space: Variant) -> Dictionary:
	if typeof(space) != TYPE_DICTIONARY:
		return {"error": "action space '%s' must be a Dictionary, got %s" % [key, str(space)]}
	var kind: String = str(space.get("action_type"))
	if kind == "continuous" or kind == "discrete":
		var size: Variant = space.get("size")
		if typeof(size) not in [TYPE_INT, TYPE_FLOAT] or int(size) < 1:
			return {"error": "action '%s': size must be a positive int" % key}
		return {"action_type": kind, "size": int(size)}
	if kind == "multi_discrete":
		var nvec: Array = _positive_ints(space.get("nvec"))
		if nvec.is_empty():
			return {"error": "action '%s': nvec must list positive ints" % key}
		return {"action_type": "multi_discrete", "nvec": nvec}
	return {"error": "action '%s': unknown action_type %s" % [key, str(kind)]}


## An agent's get_obs_space() and get_action_space() -> {"observation_space", "action_space"}.
static func convert_spaces(obs_spaces: Variant, action_spaces: Variant) -> Dictionary:
	if typeof(obs_spaces) != TYPE_DICTIONARY or obs_spaces.is_empty():
		return {"error": "get_obs_space() must return a non-empty Dictionary"}
	if typeof(action_spaces) != TYPE_DICTIONARY or action_spaces.is_empty():
		return {"error": "get_action_space() must return a non-empty Dictionary"}
	var observation: Dictionary = {}
	for key in obs_spaces:
		var converted: Dictionary = observation_space(str(key), obs_spaces[key])
		if converted.has("error"):
			return converted
		observation[str(key)] = converted
	var action: Dictionary = {}
	for key in action_spaces:
		var converted: Dictionary = action_space(str(key), action_spaces[key])
		if converted.has("error"):
			return converted
		action[str(key)] = converted
	return {"observation_space": observation, "action_space": action}


## Shape of one agent's value for a space (broker form), without the leading agent axis.
static func row_shape(space: Dictionary) -> Array:
	if space.has("shape"):
		return space["shape"]
	if space.has("nvec"):
		return [space["nvec"].size()]
	if str(space.get("action_type")) == "continuous":
		return [space["size"]]
	return []


## Wire dtype of a space's values (broker form).
static func wire_dtype(space: Dictionary) -> String:
	if space.has("dtype"):
		return space["dtype"]
	if str(space.get("action_type")) == "continuous":
		return "float32"
	return "int32"


## One agent's observation value for `space` as raw little-endian bytes of one row.
## Accepts what godot_rl get_obs() returns: flat or nested Arrays, packed arrays, numbers, and hex
## strings for uint8 images (godot_rl's camera sensors); returns {"bytes"} or {"error"}.
static func row_bytes(space: Dictionary, value: Variant, what: String) -> Dictionary:
	var dtype: String = wire_dtype(space)
	var count: int = Wire.element_count(row_shape(space))
	var data := PackedByteArray()
	if dtype == "uint8" and typeof(value) == TYPE_STRING:
		data = hex_to_bytes(value)
	elif dtype == "uint8" and typeof(value) == TYPE_PACKED_BYTE_ARRAY:
		data = value
	elif dtype == "float32" and is_flat_numbers(value, count):
		data = PackedFloat32Array(value).to_byte_array()  # the usual case, without flatten()
	else:
		var flat: Array = flatten(value)
		if flat.size() != count:
			return {"error": "%s has %d values, its space needs %d" % [what, flat.size(), count]}
		data = Wire.values_to_bytes(dtype, flat)
	if data.size() != count * int(Wire.ITEM_SIZE[dtype]):
		return {"error": "%s has %d bytes, its space needs %d" % [what, data.size(), count]}
	return {"bytes": data}


## Whether value is an Array (or packed float array) of exactly count numbers.
static func is_flat_numbers(value: Variant, count: int) -> bool:
	var kind: int = typeof(value)
	if kind == TYPE_PACKED_FLOAT32_ARRAY or kind == TYPE_PACKED_FLOAT64_ARRAY:
		return value.size() == count
	if kind != TYPE_ARRAY or value.size() != count:
		return false
	for item in value:
		var item_kind: int = typeof(item)
		if item_kind != TYPE_FLOAT and item_kind != TYPE_INT:
			return false
	return true


## Nested Arrays, packed arrays and numbers -> one flat Array of numbers (row-major order).
static func flatten(value: Variant) -> Array:
	var out: Array = []
	_flatten_into(value, out)
	return out


## godot_rl's image encoding (a hex string of raw bytes) -> the bytes.
static func hex_to_bytes(text: String) -> PackedByteArray:
	return text.hex_decode()


static func _flatten_into(value: Variant, out: Array) -> void:
	match typeof(value):
		TYPE_ARRAY:
			for item in value:
				_flatten_into(item, out)
		TYPE_INT, TYPE_FLOAT, TYPE_BOOL:
			out.append(value)
		TYPE_STRING:
			out.append_array(Array(hex_to_bytes(value)))
		TYPE_VECTOR2, TYPE_VECTOR2I:
			out.append_array([value.x, value.y])
		TYPE_VECTOR3, TYPE_VECTOR3I:
			out.append_array([value.x, value.y, value.z])
		_:
			if typeof(value) >= TYPE_PACKED_BYTE_ARRAY and typeof(value) <= TYPE_PACKED_FLOAT64_ARRAY:
				out.append_array(Array(value))


static func _positive_ints(value: Variant) -> Array:
	var items: Array = []
	if typeof(value) in [TYPE_INT, TYPE_FLOAT]:
		items = [value]
	elif typeof(value) == TYPE_ARRAY or typeof(value) == TYPE_PACKED_INT32_ARRAY:
		items = Array(value)
	var out: Array = []
	for item in items:
		if typeof(item) not in [TYPE_INT, TYPE_FLOAT] or int(item) < 1 or out.size() >= Wire.MAX_NDIM:
			return []
		out.append(int(item))
	return out
