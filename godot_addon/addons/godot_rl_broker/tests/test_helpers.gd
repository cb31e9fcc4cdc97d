extends "test_case.gd"
## Command-line parsing, array packing for every dtype, space conversion, ONNX output decoding.

const Spaces := preload("../spaces.gd")
const OnnxPolicy := preload("../onnx_policy.gd")


func test_parse_args_like_godot_rl() -> bool:
	var arguments := PackedStringArray(
		["--port=11009", "--speedup=8", "-action_repeat=4", "--headless", "--host=10.0.0.2", "--x=a=b"]
	)
	expect_equal(Wire.parse_args(arguments), {
		"port": "11009",
		"speedup": "8",
		"action_repeat": "4",
		"headless": "",
		"host": "10.0.0.2",
		"x": "a=b",
	}, "parsed arguments")
	return true


func test_values_round_trip_for_every_dtype() -> bool:
	for dtype in Wire.ITEM_SIZE:
		var values: Array = [0, 1, 2, 3]
		if dtype == "bool":
			values = [true, false, true, true]
		elif dtype.begins_with("float"):
			values = [0.5, -2.0, 3.25, 0.0]
		elif dtype.begins_with("int"):
			values = [0, -1, 7, -128]
		var data: PackedByteArray = Wire.values_to_bytes(dtype, values)
		expect_equal(data.size(), 4 * int(Wire.ITEM_SIZE[dtype]), "%s byte count" % dtype)
		expect_equal(Wire.bytes_to_values(dtype, data), values, "%s values" % dtype)
	var floats: PackedByteArray = Wire.values_to_bytes("float32", [1.0, -0.5])
	expect_equal(floats.hex_encode(), "0000803f000000bf", "float32 is little-endian")
	return true


func test_read_array_refusals() -> bool:
	var good: Dictionary = Wire.make_array("int32", [2], Wire.values_to_bytes("int32", [1, 2]))
	expect_equal(Wire.read_array(good, "good").get("values"), [1, 2], "a good array")
	var bad: Array = [
		null,
		{"dtype": "complex64", "shape": [1], "data": PackedByteArray([0, 0, 0, 0])},
		{"dtype": "int32", "shape": [-1], "data": PackedByteArray()},
		{"dtype": "int32", "shape": [3], "data": PackedByteArray([0, 0, 0, 0])},
		{"dtype": "int32", "shape": [1], "data": [0, 0, 0, 0]},
	]
	for map in bad:
		expect(Wire.read_array(map, "bad").has("error"), "refused: %s" % str(map))
	return true


func test_godot_rl_spaces_convert() -> bool:
	var converted: Dictionary = Spaces.convert_spaces(
		{
			"obs": {"size": [4], "space": "box"},
			"camera_2d": {"size": [3, 8, 8], "space": "box"},
			"ranged": {"size": [2], "space": "box", "low": -5.0, "high": 5.0},
			"goal": {"size": 3, "space": "discrete"},
		},
		{"turn": {"size": 3, "action_type": "discrete"}}
	)
	expect_equal(converted.get("observation_space"), {
		"obs": {"space": "box", "shape": [4], "dtype": "float32", "low": -1.0, "high": 1.0},
		"camera_2d": {"space": "box", "shape": [3, 8, 8], "dtype": "uint8", "low": 0.0, "high": 255.0},
		"ranged": {"space": "box", "shape": [2], "dtype": "float32", "low": -5.0, "high": 5.0},
		"goal": {"space": "discrete", "n": 3},
	}, "observation space")
	expect_equal(converted.get("action_space"), {
		"turn": {"action_type": "discrete", "size": 3}
	}, "action space")
	var keys: Array = converted["observation_space"].keys()
	expect_equal(keys, ["obs", "camera_2d", "ranged", "goal"], "key order is kept")
	var refusals: Array = [
		[{"obs": {"size": [2], "space": "sphere"}}, {"a": {"size": 1, "action_type": "discrete"}}],
		[{"obs": {"size": [0], "space": "box"}}, {"a": {"size": 1, "action_type": "discrete"}}],
		[{"obs": {"size": [2], "space": "box"}}, {"a": {"size": 1, "action_type": "jumpy"}}],
		[{}, {"a": {"size": 1, "action_type": "discrete"}}],
	]
	for pair in refusals:
		expect(Spaces.convert_spaces(pair[0], pair[1]).has("error"), "refused: %s" % str(pair))
	return true


func test_observation_rows_become_bytes() -> bool:
	var box: Dictionary = Spaces.observation_space("obs", {"size": [2, 2], "space": "box"})
	var nested: Dictionary = Spaces.row_bytes(box, [[1.0, 2.0], [3.0, 4.0]], "nested")
	expect_equal(
		Wire.bytes_to_values("float32", nested.get("bytes", PackedByteArray())),
		[1.0, 2.0, 3.0, 4.0],
		"nested arrays flatten row-major"
	)
	expect(Spaces.row_bytes(box, [1.0, 2.0, 3.0], "short").has("error"), "3 values for 4")
	var image: Dictionary = Spaces.observation_space("camera_2d", {"size": [1, 2, 2], "space": "box"})
	expect_equal(Spaces.row_bytes(image, "00ff107f", "hex").get("bytes"), [0, 255, 16, 127], "hex")
	var raw := PackedByteArray([1, 2, 3, 4])
	expect_equal(Spaces.row_bytes(image, raw, "raw").get("bytes"), raw, "raw bytes")
	expect(Spaces.row_bytes(image, "00ff", "short hex").has("error"), "2 bytes for 4")
	var discrete: Dictionary = Spaces.observation_space("goal", {"size": 5, "space": "discrete"})
	expect_equal(Spaces.row_bytes(discrete, 3, "int").get("bytes"), [3, 0, 0, 0], "an int32")
	return true


func test_onnx_output_decoding() -> bool:
	var move: Dictionary = {"move": {"action_type": "continuous", "size": 2}}
	expect_equal(OnnxPolicy.decode_output([0.5, 3.0], move).get("actions"), {
		"move": [0.5, 1.0]
	}, "means only, clamped")
	expect_equal(OnnxPolicy.decode_output([0.5, -3.0, 0.1, 0.1], move).get("actions"), {
		"move": [0.5, -1.0]
	}, "means, then log-stds skipped")
	var mixed: Dictionary = {
		"move": {"action_type": "continuous", "size": 1},
		"jump": {"action_type": "discrete", "size": 2},
	}
	expect_equal(OnnxPolicy.decode_output([0.3, -1.2, 0.1, 0.9], mixed).get("actions"), {
		"move": [0.3], "jump": 1
	}, "mixed: mean, log-std, logits")
	var pick: Dictionary = {"pick": {"action_type": "discrete", "size": 3}}
	expect_equal(OnnxPolicy.decode_output([0.1, 0.7, 0.2], pick).get("actions"), {
		"pick": 1
	}, "argmax")
	var gear: Dictionary = {"gear": {"action_type": "multi_discrete", "nvec": [2, 3]}}
	expect_equal(OnnxPolicy.decode_output([1.0, 0.0, 0.0, 0.0, 5.0], gear).get("actions"), {
		"gear": [0, 2]
	}, "one argmax per column")
	expect(OnnxPolicy.decode_output([0.1, 0.2], pick).has("error"), "too few outputs")
	expect(OnnxPolicy.decode_output([0.1, 0.2, 0.3, 0.4], pick).has("error"), "too many outputs")
	return true


func test_missing_onnx_runtime_is_reported() -> bool:
	var model := OnnxPolicy.new("res://missing.onnx", "res://no/such/ONNXInference.cs")
	expect(model.error.contains("ONNXInference"), "names what is missing: %s" % model.error)
	expect(model.act({"obs": [0.0]}, {}).has("error"), "acting reports the error")
	return true
