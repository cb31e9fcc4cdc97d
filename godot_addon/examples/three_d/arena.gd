extends Node3D
## One arena of the 3D example: a reacher steers across a square floor to a target. +1 when it
## reaches the target, -1 when it leaves the floor (falls), and the progress towards the target in
## between; the episode is cut after the controller's reset_after ticks. Written as for
## godot_rl_agents: the controller knows nothing about the broker.

const FLOOR_HALF_SIZE: float = 4.0
const SPEED: float = 3.0
const REACH_DISTANCE: float = 0.6

## Set by the controller: the move on the floor, x and z in [-1, 1].
var move := Vector2.ZERO

@onready var reacher: Node3D = $Reacher
@onready var target: Node3D = $Target
@onready var ai: AIController3D = $Reacher/AIController3D


func _ready() -> void:
	ai.init(self)
	_reset()


func _physics_process(delta: float) -> void:
	if ai.needs_reset:
		_reset()
		return
	if ai.heuristic == "human":
		move = Input.get_vector("ui_left", "ui_right", "ui_up", "ui_down")
	var distance_before: float = _distance_to_target()
	reacher.position += Vector3(move.x, 0.0, move.y) * SPEED * delta
	ai.reward += (distance_before - _distance_to_target()) / FLOOR_HALF_SIZE
	if _distance_to_target() < REACH_DISTANCE:
		_end_episode(1.0)
	elif absf(reacher.position.x) > FLOOR_HALF_SIZE or absf(reacher.position.z) > FLOOR_HALF_SIZE:
		_end_episode(-1.0)


## What the reacher sees: where the target is from it, and where it stands on the floor.
func observation() -> Array:
	var to_target: Vector3 = (target.position - reacher.position) / (2.0 * FLOOR_HALF_SIZE)
	return [
		to_target.x,
		to_target.z,
		reacher.position.x / FLOOR_HALF_SIZE,
		reacher.position.z / FLOOR_HALF_SIZE,
	]


func _distance_to_target() -> float:
	return Vector2(reacher.position.x, reacher.position.z).distance_to(
		Vector2(target.position.x, target.position.z)
	)


func _end_episode(outcome: float) -> void:
	ai.reward += outcome
	ai.done = true
	ai.needs_reset = true


func _reset() -> void:
	var limit: float = FLOOR_HALF_SIZE - 1.0
	reacher.position = Vector3(randf_range(-limit, limit), 0.5, randf_range(-limit, limit))
	target.position = reacher.position
	while _distance_to_target() < 2.0 * REACH_DISTANCE:  # no episode is won before it starts
		target.position = Vector3(randf_range(-limit, limit), 0.5, randf_range(-limit, limit))
	move = Vector2.ZERO
	ai.reset()
