"""An emulator of the godot_rl_agents plugin's game side (``sync.gd``): the JSON protocol, for tests and
as the "godot_rl baseline game" of the benchmarks. Written from the protocol reference, not from Godot.

What it does, as the plugin does:

* connects to 127.0.0.1:``--port``, reads the ``handshake`` (no reply) and the ``env_info`` request, and
  answers ``env_info`` (spaces as lists, one entry per agent, plus ``agent_policy_names``);
* answers ``reset`` with the agents' observations, ``action`` with a ``step`` reply (``obs``, ``reward``,
  ``done``, ``info``), ``call`` with ``returns``; quits on ``close``;
* images (keys containing "2d") go out as hex strings of their bytes; ``done`` is edge-triggered and the
  game resets its own agents; a time-limit reset is silent unless ``--terminal-obs-info`` (plugin PR #65:
  then ``done`` with ``info["TimeLimit.truncated"]`` and ``info["terminal_observation"]``);
* ``--variant=old`` sends single-dict spaces, no policy names and no step ``info``, like older plugins.

Unlike the plugin it is strict: a message the plugin would not handle (the real game would hang), an
action list of the wrong length, wrong keys or key order, or non-ASCII text raises ``EmulatorError``.

Observations encode who is who, so tests can check routing: ``obs[0]`` = game id / 100, ``obs[1]`` =
agent index / 100, ``obs[2]`` = the first number of the agent's last action (discrete: value / 10);
``obs[3]``/``obs[4]`` are the task (position, offset to a target on a line). Image bytes start with the
game id, the agent index and the tick. Rewards: progress toward the target, +1 on arrival (done).

Arguments are read like ``sync.gd`` reads them (``--key=value``), so the emulator can stand in for a
game executable launched with godot_rl's arguments (``--port=P --env_seed=S --action_repeat=A ...``).
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from broker.protocol import DEFAULT_HOST, DEFAULT_PORT
from broker.protocol.spaces import BoxSpace, ContinuousAction, DiscreteAction, PolicySpaces

HEADER: Final = struct.Struct("<I")
ACTION_SPACES: Final[dict[str, dict[str, dict[str, Any]]]] = {
    "continuous": {"move": {"size": 2, "action_type": "continuous"}},
    "discrete": {"turn": {"size": 3, "action_type": "discrete"}},
    # Not alphabetical on purpose: the broker must answer in Godot's key order.
    "mixed": {"move": {"size": 2, "action_type": "continuous"}, "jump": {"size": 2, "action_type": "discrete"}},
}
MIN_OBS: Final = 5


class EmulatorError(RuntimeError):
    """The broker sent something the plugin would not have handled."""


@dataclass(frozen=True)
class PolicyGroup:
    name: str
    count: int
    action: str = "continuous"  # a key of ACTION_SPACES


@dataclass
class EmulatorConfig:
    groups: tuple[PolicyGroup, ...] = (PolicyGroup("shared_policy", 4),)
    interleave: bool = False  # agents of the groups alternate in Godot's agent order (a, b, a, b, ...)
    obs_size: int = 8
    image_key: str | None = None  # e.g. "camera_2d"
    image_shape: tuple[int, ...] = (3, 4, 4)
    horizon: int = 50  # decision steps before a time-limit reset
    terminal_obs_info: bool = False
    variant: str = "current"  # or "old"
    port: int = DEFAULT_PORT
    seed: int = 0
    game_id: int | None = None
    action_repeat: int = 1
    host: str = DEFAULT_HOST
    connect_delay: float = 0.0  # the plugin sleeps 1 s before connecting; tests need not
    check_actions: bool = True  # benchmarks may skip the per-agent checks (--fast)

    @property
    def policy_names(self) -> list[str]:
        blocks = [[g.name] * g.count for g in self.groups]
        if not self.interleave:
            return [name for block in blocks for name in block]
        longest = max(len(b) for b in blocks)
        return [b[i] for i in range(longest) for b in blocks if i < len(b)]

    def action_kind(self, policy: str) -> str:
        return next(g.action for g in self.groups if g.name == policy)


def observation_space_of(config: EmulatorConfig) -> dict[str, Any]:
    space: dict[str, Any] = {"obs": {"size": [config.obs_size], "space": "box"}}
    if config.image_key:
        space[config.image_key] = {"size": list(config.image_shape), "space": "box"}
    return space


def policy_spaces(config: EmulatorConfig, policy: str) -> PolicySpaces:
    """The spaces the broker derives for ``policy`` (for a native game that shares the policy)."""
    obs: list[tuple[str, Any]] = [("obs", BoxSpace((config.obs_size,), "float32", -1.0, 1.0))]
    if config.image_key:
        obs.append((config.image_key, BoxSpace(config.image_shape, "uint8", 0.0, 255.0)))
    actions: list[tuple[str, Any]] = []
    for key, spec in ACTION_SPACES[config.action_kind(policy)].items():
        actions.append(
            (
                key,
                ContinuousAction(spec["size"]) if spec["action_type"] == "continuous" else DiscreteAction(spec["size"]),
            )
        )
    return PolicySpaces(tuple(obs), tuple(actions))


@dataclass
class EmulatorStats:
    steps: int = 0
    resets: int = 0
    episodes: int = 0
    calls: int = 0
    closed_by_broker: bool = False
    messages: list[str] = field(default_factory=list)  # types received, first 64 only


class PluginEmulator:
    """One plugin game connection. ``run()`` plays until the broker says ``close`` (or ``max_steps``)."""

    def __init__(self, config: EmulatorConfig) -> None:
        if config.obs_size < MIN_OBS:
            raise ValueError(f"obs_size must be at least {MIN_OBS}")
        self.config = config
        self.names = config.policy_names
        self.n = len(self.names)
        self.game_id = config.seed if config.game_id is None else config.game_id
        self.rng = np.random.default_rng(config.seed)
        self.kinds = [config.action_kind(name) for name in self.names]
        self.action_keys = [list(ACTION_SPACES[kind]) for kind in self.kinds]
        self.pos = np.zeros(self.n)
        self.target = np.zeros(self.n)
        self.age = np.zeros(self.n, np.int64)
        self.echo = np.zeros(self.n)
        self.tick = 0
        self.stats = EmulatorStats()
        self._new_episodes(np.ones(self.n, bool))
        self.sock: socket.socket | None = None
        self._buffer = bytearray()

    # --- game -------------------------------------------------------------------------------------

    def _new_episodes(self, mask: np.ndarray) -> None:
        k = int(mask.sum())
        self.pos[mask] = self.rng.uniform(-1, 1, k)
        self.target[mask] = self.rng.uniform(-1, 1, k)
        self.age[mask] = 0

    def observations(self) -> list[dict[str, Any]]:
        vec = np.zeros((self.n, self.config.obs_size))
        vec[:, 0] = self.game_id / 100
        vec[:, 1] = np.arange(self.n) / 100
        vec[:, 2] = self.echo
        vec[:, 3] = self.pos
        vec[:, 4] = self.target - self.pos
        rows: list[dict[str, Any]] = [{"obs": row} for row in vec.tolist()]
        if self.config.image_key:
            size = int(np.prod(self.config.image_shape))
            pattern = (np.arange(size) * 7 % 256).astype(np.uint8)
            for i, row in enumerate(rows):
                image = pattern.copy()
                image[:3] = (self.game_id % 256, i % 256, self.tick % 256)
                row[self.config.image_key] = image.tobytes().hex()
        return rows

    def _apply(self, actions: list[dict[str, Any]]) -> tuple[list[float], list[bool], list[dict[str, Any]]]:
        step = np.zeros(self.n)
        for i, action in enumerate(actions):
            if self.kinds[i] == "discrete":
                step[i] = (action["turn"] - 1) * 0.2
                self.echo[i] = action["turn"] / 10
            else:
                step[i] = 0.2 * float(np.clip(action["move"][0], -1, 1))
                self.echo[i] = action["move"][0]
        reward = np.zeros(self.n)
        arrived = np.zeros(self.n, bool)
        for _ in range(self.config.action_repeat):
            before = np.abs(self.target - self.pos)
            self.pos = np.clip(self.pos + step * ~arrived, -1, 1)
            after = np.abs(self.target - self.pos)
            reward += (5 * (before - after) - 0.01) * ~arrived
            arrived |= after < 0.1
        self.age += 1
        self.tick += 1
        timed_out = ~arrived & (self.age >= self.config.horizon)
        reward += arrived
        done = arrived | (timed_out if self.config.terminal_obs_info else np.zeros(self.n, bool))
        infos: list[dict[str, Any]] = [{} for _ in range(self.n)]
        if self.config.terminal_obs_info and done.any():
            final = self.observations()
            for i in np.flatnonzero(done).tolist():
                infos[i]["terminal_observation"] = final[i]
                if timed_out[i]:
                    infos[i]["TimeLimit.truncated"] = True
        self.stats.episodes += int((arrived | timed_out).sum())
        self._new_episodes(arrived | timed_out)  # the game resets its agents itself
        return reward.tolist(), done.tolist(), infos

    # --- protocol ---------------------------------------------------------------------------------

    def env_info(self) -> dict[str, Any]:
        obs_space = observation_space_of(self.config)
        act_spaces = [ACTION_SPACES[kind] for kind in self.kinds]
        if self.config.variant == "old":
            if len(set(self.kinds)) != 1:
                raise ValueError("the old plugin variant has one space for all agents")
            return {
                "type": "env_info",
                "observation_space": obs_space,
                "action_space": act_spaces[0],
                "n_agents": self.n,
            }
        return {
            "type": "env_info",
            "observation_space": [obs_space] * self.n,
            "action_space": act_spaces,
            "n_agents": self.n,
            "agent_policy_names": self.names,
        }

    def _check_actions(self, actions: Any) -> list[dict[str, Any]]:
        if not isinstance(actions, list) or len(actions) != self.n:
            raise EmulatorError(f"action must list {self.n} agents, got {actions!r:.100}")
        for i, action in enumerate(actions):
            if not isinstance(action, dict) or list(action) != self.action_keys[i]:
                raise EmulatorError(f"agent {i}: action keys must be {self.action_keys[i]} in that order: {action!r}")
            for key, spec in ACTION_SPACES[self.kinds[i]].items():
                value = action[key]
                if spec["action_type"] == "continuous":
                    ok = isinstance(value, list) and len(value) == spec["size"]
                    ok = ok and all(isinstance(v, float) for v in value)
                else:
                    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < spec["size"]
                if not ok:
                    raise EmulatorError(f"agent {i}: bad '{key}' value {value!r} for {spec}")
        return actions

    def connect(self, timeout: float = 30.0) -> None:
        time.sleep(self.config.connect_delay)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.create_connection((self.config.host, self.config.port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        handshake = self.receive()
        if handshake.get("type") != "handshake":
            raise EmulatorError(f"expected the handshake first, got {handshake!r}")
        if handshake.get("major_version") != "0" or handshake.get("minor_version") != "7":
            raise EmulatorError(f"versions must be the strings '0'/'7': {handshake!r}")
        request = self.receive()
        if request.get("type") != "env_info":
            raise EmulatorError(f"expected the env_info request, got {request!r}")
        self.send(self.env_info())

    def send(self, message: dict[str, Any]) -> None:
        assert self.sock is not None
        body = json.dumps(message, separators=(",", ":")).encode("ascii")  # Godot writes compact JSON
        self.sock.sendall(HEADER.pack(len(body)) + body)

    def send_raw(self, data: bytes) -> None:
        assert self.sock is not None
        self.sock.sendall(data)

    def receive(self) -> dict[str, Any]:
        assert self.sock is not None
        while True:
            if len(self._buffer) >= HEADER.size:
                (length,) = HEADER.unpack_from(self._buffer)
                if len(self._buffer) >= HEADER.size + length:
                    body = bytes(self._buffer[HEADER.size : HEADER.size + length])
                    del self._buffer[: HEADER.size + length]
                    try:
                        message = json.loads(body.decode("ascii"))
                    except (UnicodeDecodeError, ValueError) as exc:
                        raise EmulatorError(f"not ASCII JSON: {body[:80]!r}: {exc}") from None
                    if len(self.stats.messages) < 64:
                        self.stats.messages.append(str(message.get("type")))
                    return message
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the broker closed the connection")
            self._buffer += data

    def run(self, max_steps: int | None = None) -> EmulatorStats:
        """Serve commands until ``close`` (returns) or ``max_steps`` steps (returns, connection left open)."""
        if self.sock is None:
            self.connect()
        while max_steps is None or self.stats.steps < max_steps:
            message = self.receive()
            kind = message.get("type")
            if kind == "reset":
                self.stats.resets += 1
                self.send({"type": "reset", "obs": self.observations(), "info": [{} for _ in range(self.n)]})
            elif kind == "action":
                actions: list[dict[str, Any]] = message.get("action", [])
                reward, done, infos = self._apply(
                    self._check_actions(actions) if self.config.check_actions else actions
                )
                self.stats.steps += 1
                reply: dict[str, Any] = {"type": "step", "obs": self.observations(), "reward": reward, "done": done}
                if self.config.variant != "old":
                    reply["info"] = infos
                self.send(reply)
            elif kind == "call":
                self.stats.calls += 1
                method = message.get("method")
                self.send({"type": "call", "returns": [[method, self.game_id, i] for i in range(self.n)]})
            elif kind == "close":
                self.stats.closed_by_broker = True
                break
            else:
                raise EmulatorError(f"message was not handled: {message!r:.100} (a real game would hang here)")
        return self.stats

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


# --- command line, read like sync.gd reads it -----------------------------------------------------


def godot_args(argv: list[str]) -> dict[str, str]:
    """``--key=value`` -> {key: value}; a bare ``--flag`` -> {flag: ""} (as ``sync.gd _get_args``)."""
    args = {}
    for arg in argv:
        key, _, value = arg.lstrip("-").partition("=")
        args[key] = value
    return args


def parse_groups(text: str) -> tuple[PolicyGroup, ...]:
    """``NAME[:COUNT[:ACTION]],...`` e.g. ``runner:2:continuous,tagger:2:discrete``."""
    groups = []
    for part in text.split(","):
        name, count, action = ([*part.split(":"), "", ""])[:3]
        groups.append(PolicyGroup(name, int(count or 1), action or "continuous"))
    return tuple(groups)


def config_from_args(argv: list[str]) -> EmulatorConfig:
    args = godot_args(argv)
    config = EmulatorConfig(port=int(args.get("port", DEFAULT_PORT)), seed=int(args.get("env_seed", 0)))
    if "policies" in args:
        config.groups = parse_groups(args["policies"])
    elif "agents" in args:
        config.groups = (PolicyGroup("shared_policy", int(args["agents"]), args.get("action", "continuous")),)
    config.interleave = "interleave" in args
    config.obs_size = int(args.get("obs_size", config.obs_size))
    if "image_key" in args:
        config.image_key = args["image_key"]
        config.image_shape = tuple(int(d) for d in args.get("image_shape", "3,4,4").split(","))
    config.horizon = int(args.get("horizon", config.horizon))
    config.terminal_obs_info = "terminal_obs_info" in args
    config.variant = args.get("variant", config.variant)
    config.action_repeat = int(args.get("action_repeat", 1) or 1)
    config.check_actions = "fast" not in args
    if "game_id" in args:
        config.game_id = int(args["game_id"])
    return config


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(sys.argv[1:] if argv is None else argv)
    args = godot_args(sys.argv[1:] if argv is None else argv)
    emulator = PluginEmulator(config)
    max_steps = int(args["max_steps"]) if "max_steps" in args else None
    try:
        stats = emulator.run(max_steps)
    except ConnectionError as exc:
        print(f"plugin emulator: {exc}", file=sys.stderr)
        return 1
    finally:
        emulator.close()
    print(json.dumps({"steps": stats.steps, "closed_by_broker": stats.closed_by_broker}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
