extends RefCounted
## Base of the addon's test suites: expectations record failures and the test goes on.
## Every test method returns true at its end, so a script error that aborts it counts as a failure.

const Wire := preload("../wire.gd")

## name -> {"frame", "body" (PackedByteArray), "meaning", "codec", "direction"} from the vectors.
var vectors: Dictionary = {}
var failures: Array[String] = []
## The running SceneTree, for tests that add nodes to its root and await its frames.
var tree: SceneTree = null


func expect(condition: bool, what: String) -> void:
	if not condition:
		failures.append(what)


func expect_equal(actual: Variant, expected: Variant, what: String) -> void:
	if not same(actual, expected):
		failures.append("%s: got %s, expected %s" % [what, str(actual), str(expected)])


func expect_bytes(actual: PackedByteArray, expected: PackedByteArray, what: String) -> void:
	if actual == expected:
		return
	var at: int = 0
	while at < mini(actual.size(), expected.size()) and actual[at] == expected[at]:
		at += 1
	failures.append(
		"%s: %d bytes differ from the expected %d from offset %d (got %s, expected %s)"
		% [
			what,
			actual.size(),
			expected.size(),
			at,
			actual.slice(at, at + 16).hex_encode(),
			expected.slice(at, at + 16).hex_encode(),
		]
	)


## The frame body of a vector.
func body(name: String) -> PackedByteArray:
	return vectors[name]["body"]


func meaning(name: String) -> Variant:
	return vectors[name]["meaning"]


## Deep equality for test data: numbers compare as floats (JSON has no ints), dictionary keys as
## text (JSON keys are strings), and packed arrays like Arrays.
static func same(a: Variant, b: Variant) -> bool:
	var type_a: int = typeof(a)
	var type_b: int = typeof(b)
	if type_a in [TYPE_INT, TYPE_FLOAT] and type_b in [TYPE_INT, TYPE_FLOAT]:
		return is_equal_approx(float(a), float(b))
	if type_a == TYPE_DICTIONARY and type_b == TYPE_DICTIONARY:
		if a.size() != b.size():
			return false
		var by_text: Dictionary = {}
		for key in b:
			by_text[str(key)] = b[key]
		for key in a:
			if not by_text.has(str(key)) or not same(a[key], by_text[str(key)]):
				return false
		return true
	if _is_list(type_a) and _is_list(type_b):
		if a.size() != b.size():
			return false
		for i in a.size():
			if not same(a[i], b[i]):
				return false
		return true
	return type_a == type_b and a == b


static func _is_list(type: int) -> bool:
	return type == TYPE_ARRAY or (type >= TYPE_PACKED_BYTE_ARRAY and type <= TYPE_PACKED_STRING_ARRAY)
