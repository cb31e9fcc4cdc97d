extends SceneTree
## Unit tests of the addon's GDScript codec against the shared test vectors
## (tests/vectors/protocol_v1_godot.json of the godot-rl-broker repository). From a project that
## has the addon in addons/godot_rl_broker:
##   godot --headless -s addons/godot_rl_broker/tests/run_tests.gd
##   godot --headless -s addons/godot_rl_broker/tests/run_tests.gd -- --vectors=PATH
## Without --vectors it looks for tests/vectors/ in the project's folder and the folders above it.
## Exits 0 when every test passes; the last line reads "N passed, N failed".

const VECTORS_FILE: String = "tests/vectors/protocol_v1_godot.json"
const SUITES: Array = [
	preload("test_frames.gd"),
	preload("test_messages.gd"),
	preload("test_helpers.gd"),
	preload("test_agents.gd"),
	preload("test_connection.gd"),
	preload("test_sync.gd"),
]
const MAX_FOLDERS_UP: int = 6


# _initialize, not _init: the tree runs, so a test may add nodes to root and await its frames.
func _initialize() -> void:
	var vectors: Dictionary = _load_vectors(_vectors_path())
	if vectors.is_empty():
		quit(2)
		return
	var passed: int = 0
	var failed: int = 0
	for suite_script in SUITES:
		var suite: Variant = suite_script.new()
		suite.vectors = vectors
		suite.tree = self
		for method in suite.get_method_list():
			var test_name: String = method["name"]
			if not test_name.begins_with("test_"):
				continue
			suite.failures.clear()
			var finished: Variant = await suite.call(test_name)  # a test may await frames
			if finished != true:
				suite.failures.append("did not finish (script error above)")
			if suite.failures.is_empty():
				passed += 1
				continue
			failed += 1
			for failure in suite.failures:
				printerr("FAIL %s: %s" % [test_name, failure])
	print("%d passed, %d failed" % [passed, failed])
	quit(0 if failed == 0 else 1)


func _vectors_path() -> String:
	for argument in OS.get_cmdline_user_args():
		if argument.begins_with("--vectors="):
			return argument.trim_prefix("--vectors=")
	var folder: String = ProjectSettings.globalize_path("res://").trim_suffix("/")
	for i in MAX_FOLDERS_UP:
		var candidate: String = folder.path_join(VECTORS_FILE)
		if FileAccess.file_exists(candidate):
			return candidate
		var parent: String = folder.get_base_dir()
		if parent == folder:
			break
		folder = parent
	return ""


func _load_vectors(path: String) -> Dictionary:
	if path.is_empty() or not FileAccess.file_exists(path):
		printerr("test vectors not found (%s): pass --vectors=PATH after --" % VECTORS_FILE)
		return {}
	var parsed: Variant = JSON.parse_string(FileAccess.get_file_as_string(path))
	if typeof(parsed) != TYPE_DICTIONARY or typeof(parsed.get("vectors")) != TYPE_ARRAY:
		printerr("%s is not a test vector file" % path)
		return {}
	var vectors: Dictionary = {}
	for vector in parsed["vectors"]:
		var frame: PackedByteArray = str(vector["hex"]).hex_decode()
		vectors[vector["name"]] = {
			"frame": frame,
			"body": frame.slice(4),
			"meaning": vector["meaning"],
			"codec": vector["codec"],
			"direction": vector["direction"],
		}
	print("test vectors: %s (%d frames)" % [path, vectors.size()])
	return vectors
