extends RefCounted
## One exported policy (.onnx, one file per agent group, as gdrl-train --onnx-export-path writes it)
## run inside the game through godot_rl_agents' C# ONNXInference.
##
## Needs the Godot .NET build and the godot_rl_agents plugin's addons/godot_rl_agents/onnx/ folder
## (its C# ONNXInference and the Microsoft.ML.OnnxRuntime package); this addon holds no C# code.
## Contract (docs/godot_addon.md, "ONNX inference"): one float input per observation key, named
## after it, plus state_ins; a rank-2 `output` read in the AIController's action-key order:
## discrete logits -> argmax, continuous means clamped to [-1, 1] (each followed by as many
## log-stds, skipped, unless every key is continuous and the output holds exactly the means).

const Spaces := preload("spaces.gd")
const DEFAULT_INFERENCE_SCRIPT: String = "res://addons/godot_rl_agents/onnx/csharp/ONNXInference.cs"

var path: String = ""
## Why this model cannot run; "" when it is fine.
var error: String = ""
## The model's output width as ONNXInference reports it (-1 if it does not).
var output_size: int = -1

var _inferencer: Object = null
var _takes_dictionary: bool = true


func _init(model_path: String, inference_script: String = DEFAULT_INFERENCE_SCRIPT) -> void:
	path = model_path
	if not ResourceLoader.exists(inference_script):
		error = (
			"ONNX inference needs the Godot .NET build and godot_rl_agents' C# ONNXInference at %s "
			+ "(copy addons/godot_rl_agents/onnx/ from the godot_rl_agents plugin)"
		) % inference_script
		return
	if not FileAccess.file_exists(model_path):
		error = "ONNX model %s not found (exported games must include *.onnx files)" % model_path
		return
	var script: Variant = load(inference_script)
	if not (script is Script) or not script.can_instantiate():
		error = "%s cannot be instantiated: build the C# project first" % inference_script
		return
	_inferencer = script.new()
	var size: Variant = _inferencer.call("Initialize", model_path, 1)
	if typeof(size) == TYPE_INT:
		output_size = size
	_takes_dictionary = _run_takes_dictionary()


## The action Dictionary (godot_rl form) the model picks for one agent's get_obs().
## `action_space` is in the broker's form. Returns {"actions"} or {"error"}.
func act(obs: Dictionary, action_space: Dictionary) -> Dictionary:
	if not error.is_empty():
		return {"error": error}
	var inputs: Variant = null
	if _takes_dictionary:
		var named: Dictionary = {}
		for key in obs:
			named[key] = _as_floats(obs[key])
		inputs = named
	else:  # plugin builds before whole-dictionary inputs: one "obs" input
		inputs = _as_floats(obs.get("obs", []))
	var result: Variant = _inferencer.call("RunInference", inputs, 1)
	if typeof(result) != TYPE_DICTIONARY or not result.has("output"):
		return {"error": "ONNX inference with %s failed (see the output above)" % path}
	return decode_output(Array(result["output"]), action_space)


## Frees the C# inference object (a Node that is never in the tree).
func release() -> void:
	if _inferencer == null:
		return
	if _inferencer.has_method("FreeDisposables"):
		_inferencer.call("FreeDisposables")
	if not (_inferencer is RefCounted):
		_inferencer.free()
	_inferencer = null


## The model's output vector -> the godot_rl action Dictionary, following the contract above.
## Returns {"actions"} or {"error"}.
static func decode_output(output: Array, action_space: Dictionary) -> Dictionary:
	var continuous_total: int = 0
	var continuous_only: bool = true
	for key in action_space:
		if str(action_space[key].get("action_type")) == "continuous":
			continuous_total += int(action_space[key]["size"])
		else:
			continuous_only = false
	var means_only: bool = continuous_only and continuous_total == output.size()
	var actions: Dictionary = {}
	var at: int = 0
	for key in action_space:
		var space: Dictionary = action_space[key]
		var kind: String = str(space.get("action_type"))
		var widths: Array = [int(space.get("size", 0))]
		if kind == "multi_discrete":
			widths = space["nvec"]
		var needed: int = 0
		for n in widths:
			needed += int(n)
		if kind == "continuous" and not means_only:
			needed *= 2  # the means, then as many log-stds
		if at + needed > output.size():
			return {"error": "the model outputs %d values, too few for action '%s'" % [output.size(), key]}
		if kind == "continuous":
			var means: Array = []
			for j in widths[0]:
				means.append(clampf(float(output[at + j]), -1.0, 1.0))
			actions[key] = means
		elif kind == "discrete":
			actions[key] = _argmax(output, at, widths[0])
		else:
			var picks: Array = []
			var start: int = at
			for n in widths:
				picks.append(_argmax(output, start, int(n)))
				start += int(n)
			actions[key] = picks
		at += needed
	if at != output.size():
		return {"error": "the model outputs %d values; the action space reads %d" % [output.size(), at]}
	return {"actions": actions}


static func _argmax(values: Array, start: int, count: int) -> int:
	var best: int = 0
	for j in range(1, count):
		if float(values[start + j]) > float(values[start + best]):
			best = j
	return best


static func _as_floats(value: Variant) -> Array:
	var out: Array = []
	for item in Spaces.flatten(value):
		out.append(float(item))
	return out


func _run_takes_dictionary() -> bool:
	for method in _inferencer.get_method_list():
		if method["name"] == "RunInference":
			var args: Array = method["args"]
			return args.is_empty() or int(args[0]["type"]) != TYPE_ARRAY
	return true
