@tool
extends EditorPlugin
## Editor side of the addon: Project > Tools > "godot_rl_broker: list agent groups" prints the
## agent groups BrokerSync would announce for the open scene (policy names and agent counts).
## BrokerSync itself is a global class: add it with the Create Node dialog.

const MENU_ITEM: String = "godot_rl_broker: list agent groups"


func _enter_tree() -> void:
	add_tool_menu_item(MENU_ITEM, _list_agent_groups)


func _exit_tree() -> void:
	remove_tool_menu_item(MENU_ITEM)


func _list_agent_groups() -> void:
	var root: Node = EditorInterface.get_edited_scene_root()
	if root == null:
		print("godot_rl_broker: open a scene first")
		return
	var groups: Dictionary = {}
	var pending: Array[Node] = [root]
	while not pending.is_empty():
		var node: Node = pending.pop_back()
		pending.append_array(node.get_children())
		if _is_agent(node):
			var policy: Variant = node.get("policy_name")
			var policy_name: String = "shared_policy" if policy == null else str(policy)
			groups[policy_name] = int(groups.get(policy_name, 0)) + 1
	if groups.is_empty():
		print("godot_rl_broker: no AIController in %s" % root.name)
		return
	for policy in groups:
		print("godot_rl_broker: group '%s': %d agents" % [policy, groups[policy]])


func _is_agent(node: Node) -> bool:
	var script: Script = node.get_script()
	while script != null:
		var path: String = script.resource_path.get_file()
		if path == "ai_controller_2d.gd" or path == "ai_controller_3d.gd":
			return true
		script = script.get_base_script()
	return false
