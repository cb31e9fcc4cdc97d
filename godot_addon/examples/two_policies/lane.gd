extends Node2D
## One lane of the two-policy example. The player walks to the goal; between it and the goal is a
## pit that it can only cross standing on the platform, which another policy moves. Two agent groups
## with different spaces: "player" (continuous move) and "platform" (discrete left/stay/right).
## Both share the outcome: +1 when the player reaches the goal, -1 when it falls.
## Written as for godot_rl_agents: the controllers know nothing about the broker.

const LANE_WIDTH: float = 1000.0
const START_X: float = 100.0
const PIT_START: float = 400.0
const PIT_END: float = 600.0
const GOAL_X: float = 900.0
const PLAYER_SPEED: float = 250.0
const PLATFORM_SPEED: float = 300.0
const PLATFORM_HALF_WIDTH: float = 50.0
const PLATFORM_MIN_X: float = PIT_START + PLATFORM_HALF_WIDTH
const PLATFORM_MAX_X: float = PIT_END - PLATFORM_HALF_WIDTH

## Set by the player's controller: -1 (left) to 1 (right).
var player_move: float = 0.0
## Set by the platform's controller: -1, 0 or 1.
var platform_move: int = 0
var player_x: float = START_X
var platform_x: float = PLATFORM_MIN_X

@onready var player_ai: AIController2D = $Player/AIController2D
@onready var platform_ai: AIController2D = $Platform/AIController2D


func _ready() -> void:
	player_ai.init(self)
	platform_ai.init(self)
	_reset()


func _physics_process(delta: float) -> void:
	if player_ai.needs_reset or platform_ai.needs_reset:
		_reset()
		return
	if player_ai.heuristic == "human":
		player_move = Input.get_axis("ui_left", "ui_right")
	if platform_ai.heuristic == "human":
		platform_move = int(Input.is_key_pressed(KEY_D)) - int(Input.is_key_pressed(KEY_A))
	var distance_before: float = absf(GOAL_X - player_x)
	player_x = clampf(player_x + player_move * PLAYER_SPEED * delta, 0.0, LANE_WIDTH)
	platform_x = clampf(
		platform_x + platform_move * PLATFORM_SPEED * delta, PLATFORM_MIN_X, PLATFORM_MAX_X
	)
	player_ai.reward += (distance_before - absf(GOAL_X - player_x)) / LANE_WIDTH
	if is_over_pit():
		platform_ai.reward += 0.01
		if not is_on_platform():
			_end_episode(-1.0)  # fell
	elif player_x >= GOAL_X:
		_end_episode(1.0)
	else:
		platform_ai.reward -= 0.001 * absf(player_x - platform_x) / LANE_WIDTH
	queue_redraw()


func _draw() -> void:
	draw_line(Vector2(0, 0), Vector2(PIT_START, 0), Color.DIM_GRAY, 4.0)
	draw_line(Vector2(PIT_END, 0), Vector2(LANE_WIDTH, 0), Color.DIM_GRAY, 4.0)
	draw_rect(Rect2(GOAL_X - 5, -60, 10, 60), Color.GOLD)
	draw_rect(Rect2(platform_x - PLATFORM_HALF_WIDTH, 0, 2 * PLATFORM_HALF_WIDTH, 10), Color.ORANGE)
	draw_rect(Rect2(player_x - 15, -40, 30, 40), Color.DODGER_BLUE)


func is_over_pit() -> bool:
	return player_x > PIT_START and player_x < PIT_END


func is_on_platform() -> bool:
	return absf(player_x - platform_x) <= PLATFORM_HALF_WIDTH


func player_obs() -> Array:
	return [
		(GOAL_X - player_x) / LANE_WIDTH,
		(platform_x - player_x) / LANE_WIDTH,
		1.0 if is_over_pit() else 0.0,
	]


func platform_obs() -> Array:
	var pit_center: float = (PIT_START + PIT_END) / 2.0
	return [
		(player_x - platform_x) / LANE_WIDTH,
		(platform_x - pit_center) / (PIT_END - pit_center),
		(PIT_START - player_x) / LANE_WIDTH,
	]


func _end_episode(outcome: float) -> void:
	for ai in [player_ai, platform_ai]:
		ai.reward += outcome
		ai.done = true
		ai.needs_reset = true
	if outcome > 0.0:
		player_ai.set("reached_goal", true)  # read by the player controller's get_info()


func _reset() -> void:
	player_x = START_X
	platform_x = randf_range(PLATFORM_MIN_X, PLATFORM_MAX_X)
	player_move = 0.0
	platform_move = 0
	player_ai.reset()
	platform_ai.reset()
