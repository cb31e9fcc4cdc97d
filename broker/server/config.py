"""Every knob of the daemon, in one place; command-line flags map onto these fields."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from broker.protocol import DEFAULT_HOST, DEFAULT_PORT
from broker.protocol.framing import DEFAULT_MAX_FRAME_BYTES
from broker.protocol.messages import HOLD_ACTIONS, STEPPING_MODES, StepOptions
from broker.tuning import SPIN_WAIT_S

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass
class ServerConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    unix_path: str | None = None
    expected_games: int = 1
    token: str | None = None
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_pending_bytes: int = 256 * 1024 * 1024  # unsent bytes to one peer before we drop it
    limit_connections: int = 256  # admitted peers (after hello)
    limit_before_hello: int = 128  # connections that have not said hello yet; the oldest is shed when full
    timeout_hello: float = 30.0
    timeout_frame: float = 10.0  # once a frame has started after hello, it must be complete within this
    timeout_shutdown: float = 5.0
    status_interval: float = 10.0
    metrics_port: int | None = None  # Prometheus text endpoint, always on loopback (127.0.0.1); off by default
    # How long the loop polls for the next message before it sleeps (broker/server/spinning.py); 0: never
    spin_wait_s: float = SPIN_WAIT_S
    # stepping defaults for policies whose trainer does not choose (docs/protocol.md, hold-and-accumulate)
    stepping: str = "hold"
    # None: no deadline in barrier mode; in hold mode one that adapts between 20 and 100 ms to each trainer
    # (StepOptions.deadline_s, HOLD_DEADLINE_DEFAULT_TEXT)
    deadline_ms: float | None = None
    hold_action: str = "repeat"
    # godot_rl compatibility: games the broker launches, and godot_rl training scripts it serves
    env_path: str | None = None
    n_parallel: int = 1
    speedup: float | None = None
    action_repeat: int | None = None
    seed: int = 0
    headless: bool = False
    godot_rl_trainers: tuple[str, ...] = ()  # "POLICY=HOST:PORT" each
    frozen: tuple[str, ...] = ()  # "GROUP=PATH.onnx" each: groups the broker plays itself (frozen.py)
    self_play_pools: tuple[str, ...] = ()  # "GROUP=DIR" each: GROUP played from a self-play pool (pool.py)

    def validate(self) -> None:
        if not self.is_loopback() and not self.token:
            raise ValueError(
                f"binding {self.host} exposes the broker beyond this machine; "
                "set a shared token with --token or GDRL_BROKER_TOKEN"
            )
        if self.expected_games < 1:
            raise ValueError("--games must be at least 1")
        if self.stepping not in STEPPING_MODES:
            raise ValueError(f"--stepping must be one of {STEPPING_MODES}")
        if self.hold_action not in HOLD_ACTIONS:
            raise ValueError(f"--hold-action must be one of {HOLD_ACTIONS}")
        if self.deadline_ms is not None and self.deadline_ms < 0:
            raise ValueError("--deadline-ms must be >= 0")
        if self.limit_connections < 1 or self.limit_before_hello < 1:
            raise ValueError("--limit-connections and --limit-before-hello must be at least 1")
        if self.spin_wait_s < 0:
            raise ValueError("--spin-wait-us must be >= 0")
        if self.timeout_frame <= 0:
            raise ValueError("--timeout-frame must be > 0")
        if self.n_parallel < 1:
            raise ValueError("--n-parallel must be at least 1")
        if self.action_repeat is not None and self.action_repeat < 1:
            raise ValueError("--action-repeat must be at least 1")

    def step_options(self) -> StepOptions:
        return StepOptions(self.stepping, self.deadline_ms, self.hold_action)

    def is_loopback(self) -> bool:
        if self.host in LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
