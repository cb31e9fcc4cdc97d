extends RefCounted
## The few wire helpers GDScript has to write itself: frames, the broker's greeting, array maps
## and command-line arguments. Message maps are encoded with var_to_bytes() and decoded with
## bytes_to_var(): the broker reads and writes Godot Variant bodies (docs/protocol.md).
##
## Every helper is static and side-effect free, so tests/run_tests.gd checks them against the shared
## test vectors. Errors are returned as text (never assert: release exports strip asserts).

const PROTOCOL_VERSION: int = 1
const HEADER_BYTES: int = 4
const DEFAULT_MAX_FRAME_BYTES: int = 64 * 1024 * 1024
## Bytes per element of each wire dtype (numpy names, little-endian).
const ITEM_SIZE: Dictionary = {
	"bool": 1,
	"int8": 1,
	"uint8": 1,
	"int16": 2,
	"uint16": 2,
	"int32": 4,
	"uint32": 4,
	"int64": 8,
	"uint64": 8,
	"float32": 4,
	"float64": 8,
}
const MAX_NDIM: int = 8


# --- frames -------------------------------------------------------------------------------------


## One frame: u32 little-endian body length, then the body, in one array (one put_data call).
static func encode_frame(body: PackedByteArray) -> PackedByteArray:
	var frame := PackedByteArray()
	frame.resize(HEADER_BYTES)
	frame.encode_u32(0, body.size())
	frame.append_array(body)
	return frame


## A message map as a frame body, as the broker expects from this addon.
static func encode_message(message: Dictionary) -> PackedByteArray:
	return encode_frame(var_to_bytes(message))


## A frame body from the broker, after the greeting: a Godot Dictionary with a String "type".
## Returns {"error": text} when it is anything else.
static func decode_message(body: PackedByteArray) -> Dictionary:
	if body.size() < 2 or body[0] != 0x1B or body[1] != 0x00:
		return {"error": "the broker sent a frame that is not a Godot Dictionary"}
	var value: Variant = bytes_to_var(body)
	if typeof(value) != TYPE_DICTIONARY:
		return {"error": "the broker sent an undecodable frame (%d bytes)" % body.size()}
	var message: Dictionary = value
	if typeof(message.get("type")) != TYPE_STRING:
		return {"error": "the broker sent a message without a type"}
	return message


# --- the greeting -------------------------------------------------------------------------------


## Checks greeting frame number `index` (0: handshake, 1: env_info request). "" when it is right.
static func check_greeting(index: int, body: PackedByteArray) -> String:
	if body.is_empty() or body[0] != 0x7B:  # "{"
		return "the server did not greet with JSON: is this godot-rl-broker?"
	var parsed: Variant = JSON.parse_string(body.get_string_from_utf8())
	if typeof(parsed) != TYPE_DICTIONARY:
		return "the server's greeting is not a JSON object"
	var greeting: Dictionary = parsed
	if index == 1:
		if str(greeting.get("type")) != "env_info":
			return "the second greeting frame must be the env_info request"
		return ""
	if str(greeting.get("type")) != "handshake":
		return "the server's first frame is not a handshake"
	if not greeting.has("broker_protocol"):
		return (
			"the server greeted like a plain godot_rl trainer, not godot-rl-broker "
			+ "(no broker_protocol): use godot_rl's Sync node for it, or start gdrl-broker"
		)
	var version: Variant = greeting["broker_protocol"]
	if typeof(version) not in [TYPE_INT, TYPE_FLOAT] or int(version) != PROTOCOL_VERSION:
		return (
			"the broker speaks protocol %s, this addon speaks %d: update one of them"
			% [str(version), PROTOCOL_VERSION]
		)
	return ""


# --- array maps ---------------------------------------------------------------------------------


## {"dtype", "shape", "data"}: the wire form of an array (docs/protocol.md, "Arrays").
static func make_array(dtype: String, shape: Array, data: PackedByteArray) -> Dictionary:
	# Every dimension an int, converted by the engine in one call (a loop costs every step).
	return {"dtype": dtype, "shape": Array(PackedInt64Array(shape)), "data": data}


## Number of elements of a shape.
static func element_count(shape: Array) -> int:
	var count: int = 1
	for dim in shape:
		count *= int(dim)
	return count


## Little-endian bytes of flat numeric values (an Array or a packed array) as `dtype`.
static func values_to_bytes(dtype: String, values: Variant) -> PackedByteArray:
	match dtype:
		"float32":
			return PackedFloat32Array(_as_array(values)).to_byte_array()
		"float64":
			return PackedFloat64Array(_as_array(values)).to_byte_array()
		"int32":
			return PackedInt32Array(_as_array(values)).to_byte_array()
		"int64":
			return PackedInt64Array(_as_array(values)).to_byte_array()
	var items: Array = _as_array(values)
	var size: int = ITEM_SIZE.get(dtype, 1)
	var out := PackedByteArray()
	out.resize(items.size() * size)
	for i in items.size():
		var at: int = i * size
		match dtype:
			"bool":
				out.encode_u8(at, 1 if items[i] else 0)
			"int8":
				out.encode_s8(at, int(items[i]))
			"uint8":
				out.encode_u8(at, int(items[i]))
			"int16":
				out.encode_s16(at, int(items[i]))
			"uint16":
				out.encode_u16(at, int(items[i]))
			"uint32":
				out.encode_u32(at, int(items[i]))
			"uint64":
				out.encode_u64(at, int(items[i]))
	return out


## The values held by little-endian `data` of `dtype`, as an Array (bool -> bool, ints -> int).
static func bytes_to_values(dtype: String, data: PackedByteArray) -> Array:
	match dtype:
		"float32":
			return Array(data.to_float32_array())
		"float64":
			return Array(data.to_float64_array())
		"int32":
			return Array(data.to_int32_array())
		"int64":
			return Array(data.to_int64_array())
		"uint8":
			return Array(data)
	var size: int = ITEM_SIZE.get(dtype, 1)
	var out: Array = []
	for at in range(0, data.size(), size):
		match dtype:
			"bool":
				out.append(data[at] != 0)
			"int8":
				out.append(data.decode_s8(at))
			"int16":
				out.append(data.decode_s16(at))
			"uint16":
				out.append(data.decode_u16(at))
			"uint32":
				out.append(data.decode_u32(at))
			"uint64":
				out.append(data.decode_u64(at))
	return out


## Validates an array map from the broker. Returns {"dtype", "shape", "values"} or {"error"}.
static func read_array(map: Variant, what: String) -> Dictionary:
	if typeof(map) != TYPE_DICTIONARY:
		return {"error": "%s is not an array map" % what}
	var array: Dictionary = map
	var dtype: Variant = array.get("dtype")
	var shape: Variant = array.get("shape")
	var data: Variant = array.get("data")
	if typeof(dtype) != TYPE_STRING or not ITEM_SIZE.has(dtype):
		return {"error": "%s has unknown dtype %s" % [what, str(dtype)]}
	if typeof(shape) != TYPE_ARRAY or shape.size() > MAX_NDIM:
		return {"error": "%s has a bad shape %s" % [what, str(shape)]}
	for dim in shape:
		if typeof(dim) != TYPE_INT or dim < 0:
			return {"error": "%s has a bad shape %s" % [what, str(shape)]}
	if typeof(data) != TYPE_PACKED_BYTE_ARRAY:
		return {"error": "%s data is not a PackedByteArray" % what}
	var expected: int = element_count(shape) * int(ITEM_SIZE[dtype])
	if data.size() != expected:
		return {
			"error": "%s: shape %s of %s needs %d bytes, got %d"
			% [what, str(shape), dtype, expected, data.size()]
		}
	return {"dtype": dtype, "shape": shape, "values": bytes_to_values(dtype, data)}


# --- command line -------------------------------------------------------------------------------


## godot_rl's argument form: "--key=value" (any number of leading dashes); "--flag" maps to "".
static func parse_args(arguments: PackedStringArray) -> Dictionary:
	var args: Dictionary = {}
	for argument in arguments:
		var text: String = argument.lstrip("-")
		if text.is_empty():
			continue
		var equals: int = text.find("=")
		if equals < 0:
			args[text] = ""
		else:
			args[text.substr(0, equals)] = text.substr(equals + 1)
	return args


static func _as_array(values: Variant) -> Array:
	if typeof(values) == TYPE_ARRAY:
		return values
	if typeof(values) in [TYPE_INT, TYPE_FLOAT, TYPE_BOOL]:
		return [values]
	return Array(values)
