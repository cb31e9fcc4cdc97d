"""The fair baseline's game: godot_rl's JSON plugin protocol as lean as a game can speak it.

    python -m benchmarks.lean_plugin_game --config JSON --game-index I --ports P            (all agents, one env)
    python -m benchmarks.lean_plugin_game --config JSON --game-index I --ports P0,P1 --split (one port per policy)

It talks to godot_rl exactly as the plugin's ``sync.gd`` does (connects to 127.0.0.1:PORT, reads the
``handshake``, answers ``env_info`` with per-agent space lists and ``agent_policy_names``, answers
``reset`` and every ``action`` with a reply of ``obs``/``reward``/``done``/``info``, images as hex strings,
compact JSON, TCP_NODELAY), but it does no per-agent work while godot_rl waits: every reply is prepared at
start as bytes (the observation text once, the reward/done/info tail once per phase of the staggered time
limit) and written with one ``sendmsg`` per frame. Action frames are read into a preallocated buffer and
only their ``type`` prefix is looked at (``--check-actions`` decodes and checks every one, for the tests).
So the baseline's time is godot_rl's Python side, not the game's.

Observations are fixed text holding the values the broker's modes carry (configs.GroupWorld: four numbers
per agent, the rest zeros), written as Godot's ``JSON.stringify`` writes floats (up to 15 significant digits, ``0``
for zero); ``--dense`` fills every number instead, as a game with rich observations would (godot_rl's JSON
parsing takes about twice as long then, the broker's binary arrays the same). Only the digits would change
from step to step in a real game, and godot_rl parses any digits alike, so the text stays fixed. ``done``
marks each agent once every ``HORIZON`` steps, staggered as in configs.GroupWorld, and Godot resets it
silently (done is edge-triggered).

With ``--split`` the game holds one connection per policy, as a multi-policy godot_rl game must (each policy
is its own godot_rl env on its own port: MultiServerSync, reference §4.4). It writes every policy's reply
before it reads any action, so the per-policy trainers overlap; stock MultiServerSync takes them in turns,
which could only be slower.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import struct
import sys
import time
from typing import Any, Final

import numpy as np

from benchmarks.configs import ACTION_KEY, ACTION_SIZE, HORIZON, IMAGE_KEY, IMAGE_SHAPE, BenchConfig
from benchmarks.counting import CountingSocket, WireReport
from benchmarks.raw import FrameReader, send_parts

HEADER: Final = struct.Struct("<I")
# godot_rl's json.dumps keeps insertion order with its default separators: the type comes first.
ACTION_PREFIX: Final = b'{"type": "action"'
HANDSHAKE_VERSIONS: Final = ("0", "7")
MAX_DECIMALS: Final = 32  # Godot's String::num


class ProtocolError(RuntimeError):
    """godot_rl sent something the plugin would not have handled."""


def godot_float(value: float) -> str:
    """A float as Godot 4.2's JSON.stringify writes it (core/io/json.cpp with String::num, checked on 4.2.3).

    Positive numbers get ``14 - floor(log10(x))`` decimals; for zero and negatives that logarithm is NaN and
    String::num falls back to 14 decimals, less ``floor(log10(|x|))`` above 10. Trailing zeros are dropped."""
    magnitude = abs(value)
    if value > 0:
        decimals = 14 - math.floor(math.log10(value))
    else:
        decimals = 14 - (math.floor(math.log10(magnitude)) if magnitude > 10 else 0)
    text = f"{value:.{min(decimals, MAX_DECIMALS)}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def json_list(items: list[str]) -> bytes:
    return ("[" + ",".join(items) + "]").encode("ascii")


class SessionSpec:
    """What one connection (one Sync node) serves: its agents, their policies, and every reply's bytes."""

    def __init__(self, config: BenchConfig, game_index: int, policies: list[str], dense: bool = False) -> None:
        self.config = config
        self.policies = policies
        self.agent_policy_names = [name for name in policies for _ in range(config.agents)]
        self.n = len(self.agent_policy_names)
        # Per agent: its index inside its policy (what the staggering of configs.GroupWorld uses).
        self.row_in_policy = np.tile(np.arange(config.agents), len(policies))
        rng = np.random.default_rng(1000 + game_index)
        if dense:
            self.vectors = rng.uniform(-1, 1, (self.n, config.vector_size)).astype(np.float32)
        else:  # the values configs.GroupWorld carries in the broker's modes: 4 numbers, the rest zeros
            self.vectors = np.zeros((self.n, config.vector_size), np.float32)
            self.vectors[:, 1] = self.row_in_policy / max(config.agents, 100)
            self.vectors[:, 2:4] = rng.uniform(-1, 1, (self.n, 2))  # the last action, the position
        self.vectors[:, 0] = game_index / 100
        self.images: np.ndarray | None = None
        if config.obs == "img":
            pattern = (np.arange(int(np.prod(IMAGE_SHAPE))) * 7 % 256).astype(np.uint8)
            self.images = np.broadcast_to(pattern, (self.n, pattern.size)).copy()
            self.images[:, 0] = game_index % 256
            self.images[:, 1] = np.arange(self.n) % 256
        self.rewards = -np.abs(rng.uniform(-1, 1, (HORIZON, self.n))).astype(np.float32)
        self.age0 = (self.row_in_policy + game_index * 7) % HORIZON

    def env_info(self) -> dict[str, Any]:
        space: dict[str, Any] = {"obs": {"size": [self.config.vector_size], "space": "box"}}
        if self.images is not None:
            space[IMAGE_KEY] = {"size": list(IMAGE_SHAPE), "space": "box"}
        action = {ACTION_KEY: {"size": ACTION_SIZE, "action_type": "continuous"}}
        return {
            "type": "env_info",
            "observation_space": [space] * self.n,
            "action_space": [action] * self.n,
            "n_agents": self.n,
            "agent_policy_names": self.agent_policy_names,
        }

    def observations(self) -> list[dict[str, Any]]:
        """The observations as the game holds them (what godot_rl must decode them to)."""
        rows: list[dict[str, Any]] = []
        for i in range(self.n):
            row: dict[str, Any] = {"obs": [float(godot_float(float(v))) for v in self.vectors[i]]}
            if self.images is not None:
                row[IMAGE_KEY] = self.images[i].reshape(IMAGE_SHAPE)
            rows.append(row)
        return rows

    def done_at(self, tick: int) -> np.ndarray:
        """Which agents report done in the reply to the ``tick``-th action (1-based)."""
        return (self.age0 + tick) % HORIZON == 0

    def reward_at(self, tick: int) -> np.ndarray:
        return self.rewards[tick % HORIZON]

    def obs_text(self) -> bytes:
        rows = []
        for i in range(self.n):
            row = '{"obs":[' + ",".join(godot_float(float(v)) for v in self.vectors[i]) + "]"
            if self.images is not None:
                row += f',"{IMAGE_KEY}":"{self.images[i].tobytes().hex()}"'
            rows.append(row + "}")
        return json_list(rows)

    def step_tails(self) -> list[bytes]:
        """The reply after its observations, one per phase of the time limit: reward, done, info."""
        infos = json_list(["{}"] * self.n)
        tails = []
        for phase in range(HORIZON):
            rewards = json_list([godot_float(float(r)) for r in self.reward_at(phase)])
            done = json_list(["true" if d else "false" for d in self.done_at(phase).tolist()])
            tails.append(b',"reward":' + rewards + b',"done":' + done + b',"info":' + infos + b"}")
        return tails


class Session:
    """One connection to one godot_rl env: handshake, env_info, then lock-step replies from prepared bytes."""

    def __init__(self, sock: Any, spec: SessionSpec, check_actions: bool, godot_wait: bool = False) -> None:
        self.sock = sock
        self.spec = spec
        self.check_actions = check_actions
        self.reader = FrameReader(self.sock, godot_wait=godot_wait)
        obs = spec.obs_text()
        self.obs = memoryview(obs)
        # Each reply is [header + '{"type":...,"obs":', obs, tail]: three buffers, one sendmsg.
        self.step_heads: list[memoryview] = []
        self.step_tails = [memoryview(tail) for tail in spec.step_tails()]
        for tail in self.step_tails:
            head = b'{"type":"step","obs":'
            self.step_heads.append(memoryview(HEADER.pack(len(head) + len(obs) + len(tail)) + head))
        reset_head = b'{"type":"reset","obs":'
        reset_tail = b',"info":' + json_list(["{}"] * spec.n) + b"}"
        self.reset_parts = [
            memoryview(HEADER.pack(len(reset_head) + len(obs) + len(reset_tail)) + reset_head),
            self.obs,
            memoryview(reset_tail),
        ]
        self.tick = 0
        self.pending: str | None = None  # the command read and not yet answered

    # --- reading ----------------------------------------------------------------------------------

    def read_frame(self) -> memoryview:
        try:
            return self.reader.read_frame()
        except ConnectionError:
            raise ConnectionError("godot_rl closed the connection") from None

    def read_json(self) -> dict[str, Any]:
        message = json.loads(bytes(self.read_frame()).decode("ascii"))
        if not isinstance(message, dict):
            raise ProtocolError(f"not a JSON object: {message!r:.80}")
        return message

    def handshake(self) -> None:
        hello = self.read_json()
        if hello.get("type") != "handshake" or (hello.get("major_version"), hello.get("minor_version")) != (
            HANDSHAKE_VERSIONS
        ):
            raise ProtocolError(f"expected the 0.7 handshake first, got {hello!r:.120}")
        if self.read_json().get("type") != "env_info":
            raise ProtocolError("expected the env_info request after the handshake")
        body = json.dumps(self.spec.env_info(), separators=(",", ":")).encode("ascii")
        send_parts(self.sock, [memoryview(HEADER.pack(len(body)) + body)])

    def read_command(self) -> None:
        """Read godot_rl's next command (blocking), as Sync.handle_message does."""
        frame = self.read_frame()
        if frame[: len(ACTION_PREFIX)] == ACTION_PREFIX and not self.check_actions:
            self.pending = "action"
            return
        message = json.loads(bytes(frame).decode("ascii"))
        kind = message.get("type")
        if kind == "action":
            self._check(message.get("action"))
        elif kind == "call":  # the plugin would call a method on every agent; no benchmark trainer calls
            raise ProtocolError(f"the benchmark game has no methods to call: {message!r:.100}")
        elif kind not in ("reset", "close"):
            raise ProtocolError(f"message was not handled: {message!r:.100} (a real game would hang here)")
        self.pending = kind

    def _check(self, actions: Any) -> None:
        if not isinstance(actions, list) or len(actions) != self.spec.n:
            raise ProtocolError(f"action must list {self.spec.n} agents, got {actions!r:.100}")
        for i, action in enumerate(actions):
            value = action.get(ACTION_KEY) if isinstance(action, dict) and list(action) == [ACTION_KEY] else None
            if not isinstance(value, list) or len(value) != ACTION_SIZE or not all(isinstance(v, float) for v in value):
                raise ProtocolError(f"agent {i}: bad action {action!r:.100}")

    # --- replying ---------------------------------------------------------------------------------

    def reply(self) -> bool:
        """Answer the pending command; False once godot_rl said ``close``."""
        kind, self.pending = self.pending, None
        if kind == "close":
            return False
        if kind == "reset":
            send_parts(self.sock, list(self.reset_parts))
            return True
        self.tick += 1
        phase = self.tick % HORIZON
        send_parts(self.sock, [self.step_heads[phase], self.obs, self.step_tails[phase]])
        return True


def connect(port: int, timeout: float) -> socket.socket:
    """Connect as the plugin does (127.0.0.1, TCP_NODELAY), retrying until godot_rl listens on the port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    return sock


def session_specs(config: BenchConfig, game_index: int, split: bool, dense: bool = False) -> list[SessionSpec]:
    """One spec with every policy's agents, or (``split``) one per policy."""
    if split:
        return [SessionSpec(config, game_index, [name], dense) for name in config.policy_names]
    return [SessionSpec(config, game_index, config.policy_names, dense)]


def play(sessions: list[Session], report: WireReport | None = None) -> int:
    """Lock-step: read every connection's command, then answer them all. Returns the actions answered."""
    while True:
        for session in sessions:
            session.read_command()
        if not all([session.reply() for session in sessions]):
            return sessions[0].tick
        if report is not None and sessions[0].tick:
            report.tick()


def run(
    config: BenchConfig,
    game_index: int,
    ports: list[int],
    split: bool,
    check_actions: bool,
    dense: bool = False,
    godot_wait: bool = False,
) -> int:
    specs = session_specs(config, game_index, split, dense)
    if len(ports) != len(specs):
        raise SystemExit(f"need {len(specs)} port(s) for {'one per policy' if split else 'one env'}, got {ports}")
    sessions: list[Session] = []
    counters: list[CountingSocket] = []
    try:
        for spec, port in zip(specs, ports, strict=True):  # in order: each godot_rl env accepts after the one before
            counter = CountingSocket(connect(port, timeout=120))
            counters.append(counter)
            session = Session(counter, spec, check_actions, godot_wait)
            session.handshake()
            sessions.append(session)
        return play(sessions, WireReport(MultiCount(counters)))
    except (ConnectionError, OSError):
        return sessions[0].tick if sessions else 0  # godot_rl stopped: the benchmark is over
    finally:
        for counter in counters:
            counter.close()


class MultiCount:
    """The bytes of every connection of one game, for WireReport."""

    def __init__(self, counters: list[CountingSocket]) -> None:
        self.counters = counters

    @property
    def bytes_in(self) -> int:
        return sum(c.bytes_in for c in self.counters)

    @property
    def bytes_out(self) -> int:
        return sum(c.bytes_out for c in self.counters)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a BenchConfig as JSON")
    parser.add_argument("--game-index", type=int, default=0)
    parser.add_argument("--ports", required=True, help="one port (all agents), or one per policy with --split")
    parser.add_argument("--split", action="store_true", help="one connection per policy (MultiServerSync)")
    parser.add_argument("--check-actions", action="store_true", help="decode and check every action frame")
    parser.add_argument("--dense", action="store_true", help="every observation number non-zero (15 digits)")
    parser.add_argument("--godot-wait", action="store_true", help="wait for actions as sync.gd does")
    args = parser.parse_args(argv)
    config = BenchConfig.from_json(json.loads(args.config))
    ports = [int(p) for p in args.ports.split(",")]
    try:
        ticks = run(config, args.game_index, ports, args.split, args.check_actions, args.dense, args.godot_wait)
    except ProtocolError as exc:
        print(f"lean plugin game: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"event": "finished", "actions": ticks}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
