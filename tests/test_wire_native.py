"""A plugin game's per-step JSON in C (broker/legacy/_wire.c) against the Python way (orjson, then wire.py):
the same step from every reply C reads, nothing accepted that the Python way refuses, and byte for byte the
same action requests.

The Python way here is a ``GodotRlGame`` without its C plan, fed the decoded body, as every reply C declines
is. ``.ci/run`` sets ``GDRL_REQUIRE_COMPILED=1``, so there these tests fail rather than skip without C.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from benchmarks.lean_plugin_game import godot_float
from broker.legacy import wire
from broker.legacy.game_connection import GodotRlGameConnection
from broker.legacy.godot_rl_game import GodotRlGame, Phase
from broker.legacy.godot_rl_trainer import GodotRlTrainer
from broker.protocol.connection import BrokerConnection, LegacyMessage
from broker.protocol.errors import RemoteProtocolError
from broker.protocol.framing import encode_frame
from broker.protocol.json_body import unpack_json
from broker.protocol.limits import MAX_FRAME_ELEMENTS
from broker.protocol.messages import Batch, GameActions, GameLayout, GameStep, PolicyInfo, StepData
from broker.protocol.spaces import DiscreteSpace, PolicySpaces
from tests.test_legacy_wire import feed


@pytest.fixture(autouse=True)
def c_built() -> None:
    if wire._C is not None:
        return
    reason = "broker/legacy/_wire.c is not in use (a pure build, GDRL_BROKER_PURE=1, or a stale build)"
    if os.environ.get("GDRL_REQUIRE_COMPILED") == "1":
        pytest.fail(f"GDRL_REQUIRE_COMPILED=1 but {reason}")
    pytest.skip(reason)


# --- games and replies -------------------------------------------------------------------------------


def env_info(rng: random.Random) -> dict[str, Any]:
    """A random plugin game: 1-3 policies, each with its own box/image keys and actions, agents interleaved."""
    policies = []
    for p in range(rng.randint(1, 3)):
        obs: dict[str, Any] = {}
        for k in range(rng.randint(1, 3)):
            if rng.random() < 0.2:
                obs[f"camera_2d_{k}"] = {"size": [rng.randint(1, 3), rng.randint(1, 3), 3], "space": "box"}
            else:
                size = [rng.randint(1, 9)] if rng.random() < 0.8 else [rng.randint(1, 3), rng.randint(1, 3)]
                obs[f"obs{k}" if k else "obs"] = {"size": size, "space": "box"}
        actions: dict[str, Any] = {}
        for k in range(rng.randint(1, 2)):
            kind = rng.choice(["continuous", "discrete"])
            actions[f"act{k}"] = {"size": rng.randint(1, 4), "action_type": kind}
        policies.append((f"policy{p}", obs, actions))
    names = list(range(len(policies))) + [rng.randrange(len(policies)) for _ in range(rng.randint(0, 7))]
    rng.shuffle(names)  # every policy has an agent; policies interleave in Godot's agent order
    return {
        "type": "env_info",
        "n_agents": len(names),
        "observation_space": [policies[p][1] for p in names],
        "action_space": [policies[p][2] for p in names],
        "agent_policy_names": [policies[p][0] for p in names],
    }


def plugin_env_info(observation: dict[str, Any], n: int = 1, move: int = 1) -> dict[str, Any]:
    """A plugin game's env_info: ``n`` agents, each with these observation spaces and ``move`` continuous actions."""
    action = {"move": {"size": move, "action_type": "continuous"}}
    return {"type": "env_info", "n_agents": n, "observation_space": [observation] * n, "action_space": [action] * n}


def number_text(rng: random.Random, value: float) -> str:
    """A number as one of the writers a game may have: Godot's JSON.stringify, repr, %g, an integer."""
    style = rng.randrange(8)
    if style == 0:
        return godot_float(value)
    if style == 1:
        return repr(value)
    if style == 2:
        return f"{value:.17g}"
    if style == 3:
        return f"{value:.9g}"
    if style == 4:
        return str(int(value * 1000))
    if style == 5:
        return f"{value:.3e}"
    if style == 6:  # small numbers: a run of 19+ digits, which sends the Python way to the standard library
        return f"{value * 1e-6:.25f}"
    return rng.choice(["0", "-0", "0.0", "-0.0", "1", "-1", "1e-05", "1E+2", "3.4028234663852886e+38"])


def space(rng: random.Random) -> str:
    return rng.choice(["", "", "", " ", "\n", " \t"])


def json_list(rng: random.Random, items: list[str]) -> str:
    sep = space(rng)
    return "[" + sep + f"{sep},{sep}".join(items) + sep + "]"


def reply_text(rng: random.Random, info: dict[str, Any], first: bool) -> bytes:
    """A reset or step reply as a game might write it: key orders, spacing and number styles vary."""
    n = info["n_agents"]
    rows = []
    for agent in range(n):
        fields = []
        for key, spec in info["observation_space"][agent].items():
            count = int(np.prod(spec["size"]))
            if "2d" in key:
                raw = bytes(rng.randrange(256) for _ in range(count)).hex()
                value = f'"{raw.upper() if rng.random() < 0.3 else raw}"'
            else:
                value = json_list(rng, [number_text(rng, rng.uniform(-2, 2)) for _ in range(count)])
            fields.append(f'"{key}":{space(rng)}{value}')
        if rng.random() < 0.1:
            fields.append('"extra": {"nested": [1, "two", null, true]}')
        rng.shuffle(fields)
        rows.append("{" + ",".join(fields) + "}")
    parts = {"type": '"reset"' if first else '"step"', "obs": json_list(rng, rows)}
    if not first or rng.random() < 0.5:
        parts["reward"] = json_list(rng, [number_text(rng, rng.uniform(-5, 5)) for _ in range(n)])
        done = [rng.random() < 0.3 for _ in range(n)]
        parts["done"] = json_list(rng, ["true" if d else "false" for d in done])
        infos = []
        for agent in range(n):
            entry: dict[str, Any] = {}
            if done[agent] and rng.random() < 0.5:
                entry["TimeLimit.truncated"] = rng.random() < 0.5
            if done[agent] and rng.random() < 0.3:
                entry["terminal_observation"] = {
                    key: (
                        bytes(int(np.prod(spec["size"]))).hex()
                        if "2d" in key
                        else [round(rng.uniform(-1, 1), 3) for _ in range(int(np.prod(spec["size"])))]
                    )
                    for key, spec in info["observation_space"][agent].items()
                }
            if rng.random() < 0.1:
                entry["score"] = rng.randint(0, 100)
            infos.append(json.dumps(entry, separators=(",", ":") if rng.random() < 0.5 else None))
        if rng.random() < 0.9:  # older plugins send no info
            parts["info"] = json_list(rng, infos)
    if rng.random() < 0.1:
        parts["unknown"] = '{"a": [1, 2, {"b": "c"}]}'
    order = list(parts)
    rng.shuffle(order)
    return ("{" + ",".join(f'"{key}":{space(rng)}{parts[key]}' for key in order) + "}").encode("ascii")


def game(info: dict[str, Any], with_c: bool) -> GodotRlGame:
    playing = GodotRlGame()
    playing.receive(info)
    if not with_c:
        playing._plan = None
    playing.reset_request()
    return playing


def same_step(a: GameStep, b: GameStep) -> bool:
    if a.tick != b.tick or list(a.groups) != list(b.groups):
        return False
    return all(same_data(a.groups[k], b.groups[k]) for k in a.groups)


def same_arrays(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()  # -0.0 too


def same_data(a: StepData, b: StepData) -> bool:
    fields = ("reward", "terminated", "truncated", "final_index")
    return (
        list(a.obs) == list(b.obs)
        and all(same_arrays(a.obs[k], b.obs[k]) for k in a.obs)
        and all(same_arrays(getattr(a, f), getattr(b, f)) for f in fields)
        and (a.final_obs is None) == (b.final_obs is None)
        and all(same_arrays(a.final_obs[k], b.final_obs[k]) for k in a.final_obs or {})
        and a.infos == b.infos
    )


def python_way(playing: GodotRlGame, body: bytes) -> GameStep | RemoteProtocolError:
    try:
        step = playing.receive(unpack_json(body))
    except RemoteProtocolError as exc:
        return exc
    assert isinstance(step, GameStep)
    return step


def c_way(playing: GodotRlGame, body: bytes) -> GameStep | RemoteProtocolError | None:
    try:
        return playing.receive_reply(body)
    except RemoteProtocolError as exc:
        return exc


def at(playing: GodotRlGame, first: bool) -> GodotRlGame:
    playing.phase = Phase.AWAIT_RESET if first else Phase.AWAIT_STEP
    return playing


def agree(info: dict[str, Any], body: bytes, first: bool) -> GameStep | RemoteProtocolError | None:
    """C's outcome for ``body``, having checked it against the Python way's: a step C reads is the Python way's
    step, a refusal C words is the Python way's too, and C declines whatever else."""
    by_c = c_way(at(game(info, True), first), body)
    by_python = python_way(at(game(info, False), first), body)
    if isinstance(by_c, GameStep):
        assert isinstance(by_python, GameStep), by_python
        assert same_step(by_c, by_python)
    elif isinstance(by_c, RemoteProtocolError):
        assert isinstance(by_python, RemoteProtocolError)
        assert (by_c.code, by_c.message) == (by_python.code, by_python.message)
    return by_c


# --- reading -----------------------------------------------------------------------------------------


def test_random_replies_are_read_by_c_as_the_python_way_reads_them() -> None:
    rng = random.Random(19)
    read = 0
    for trial in range(400):
        info = env_info(rng)
        first = trial % 5 == 0
        outcome = agree(info, reply_text(rng, info, first), first)
        read += isinstance(outcome, GameStep)
    assert read >= 390  # C reads nearly all of them: everything generated is in its subset, bar range limits


def test_damaged_replies_are_never_accepted_by_c_alone() -> None:
    rng = random.Random(7)
    outcomes = {"read": 0, "declined": 0, "refused": 0}
    for _ in range(3000):
        info = env_info(rng)
        body = bytearray(reply_text(rng, info, False))
        for _ in range(rng.randint(1, 3)):
            cut = rng.randrange(len(body))
            action = rng.randrange(4)
            if action == 0:
                body[cut] = rng.choice(b'{}[],:"0123456789-+.eEtfn \\xu')
            elif action == 1:
                del body[cut]
            elif action == 2:
                body.insert(cut, rng.randrange(256))
            else:
                body = body[:cut]
        outcome = agree(info, bytes(body), False)
        outcomes["read" if isinstance(outcome, GameStep) else "declined" if outcome is None else "refused"] += 1
    assert outcomes["declined"] > 1000 and outcomes["read"] > 100, outcomes  # both ways were exercised


def test_the_values_a_game_writes_become_the_same_float32_and_uint8() -> None:
    info = plugin_env_info({"obs": {"size": [6], "space": "box"}, "cam_2d": {"size": [2], "space": "box"}}, n=2)
    texts = ["-0", "-0.0", "0.1", "1e-05", "0.0000012345678901234567", "3.4028234663852886e+38"]
    row = '{"obs": [' + ", ".join(texts) + '], "cam_2d": "0aFf"}'
    rest = '"reward": [1, -2.5], "done": [false, true], "info": [{}, {}]'
    body = f'{{"type": "step", "obs": [{row}, {row}], {rest}}}'
    step = agree(info, body.encode(), False)
    assert isinstance(step, GameStep)
    data = step.groups["shared_policy"]
    expected = np.array([0.0, -0.0, 0.1, 1e-05, 1.2345678901234567e-06, 3.4028234663852886e38], np.float32)
    assert data.obs["obs"].tobytes() == np.stack([expected, expected]).tobytes()
    assert data.obs["cam_2d"].tolist() == [[10, 255], [10, 255]]
    assert data.reward.tolist() == [1.0, -2.5] and data.terminated.tolist() == [False, True]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda b: b.replace(b"[0.5, 1]", b"[true, 1]"), "a boolean among numbers"),
        (lambda b: b.replace(b"[0.5, 1]", b"[[0.5], [1]]"), "nested observation lists"),
        (lambda b: b.replace(b'"obs": [{', b'"obs": [{"o\\u0062s": [0, 0], '), "an escaped key"),
        (lambda b: b.replace(b"[0.5, 1]", b"[0.5, 12345678901234567890]"), "an integer beyond 18 digits"),
        (lambda b: b.replace(b"[0.5, 1]", b"[0.5, NaN]"), "NaN"),
        (lambda b: b.replace(b'"type": "step"', b'"type": "step", "type": "step"'), "a key twice"),
        (lambda b: b.replace(b'"done": [false]', b'"done": [0]'), "done as a number"),
        (lambda b: b.replace(b'"info": [{}]', b'"info": [{"name": "caf\xc3\xa9"}]'), "non-ASCII text"),
    ],
)
def test_what_c_does_not_read_goes_the_python_way(change: Any, why: str) -> None:
    info = plugin_env_info({"obs": {"size": [2], "space": "box"}})
    body = b'{"type": "step", "obs": [{"obs": [0.5, 1]}], "reward": [0], "done": [false], "info": [{}]}'
    assert isinstance(agree(info, body, False), GameStep)
    changed = change(body)
    assert changed != body, why
    assert agree(info, changed, False) is None, why


def test_a_refusal_found_after_c_read_the_reply_is_worded_as_the_python_way_words_it() -> None:
    info = plugin_env_info({"obs": {"size": [2], "space": "box"}})
    bad_final = b'{"terminal_observation": {"obs": [1]}}'  # one number short: decode_rows refuses it
    body = b'{"type": "step", "obs": [{"obs": [0.5, 1]}], "reward": [0], "done": [true], "info": [' + bad_final + b"]}"
    outcome = agree(info, body, False)
    assert isinstance(outcome, RemoteProtocolError) and "terminal_observation" in outcome.message


def test_discrete_observations_leave_the_whole_game_to_the_python_way() -> None:
    info = plugin_env_info({"obs": {"size": [2], "space": "box"}, "cell": {"size": 4, "space": "discrete"}})
    playing = game(info, True)
    assert playing._plan is not None and playing._plan.read is None
    body = b'{"type": "step", "obs": [{"obs": [0.5, 1], "cell": 3}], "reward": [0], "done": [false]}'
    assert agree(info, body, False) is None
    assert isinstance(python_way(at(game(info, False), False), body), GameStep)


def test_the_frame_wide_value_bound_is_counted_as_json_body_counts_it() -> None:
    """More than MAX_FRAME_ELEMENTS marks (commas inside strings too) is refused by the Python way: C declines."""
    info = plugin_env_info({"obs": {"size": [1], "space": "box"}})
    commas = "," * (MAX_FRAME_ELEMENTS + 10)
    body = f'{{"type": "step", "obs": [{{"obs": [1]}}], "reward": [0], "done": [false], "note": "{commas}"}}'
    assert agree(info, body.encode(), False) is None
    assert isinstance(python_way(at(game(info, False), False), body.encode()), RemoteProtocolError)
    nested = "[" * 40 + "]" * 40
    deep = f'{{"type": "step", "obs": [{{"obs": [1]}}], "reward": [0], "done": [false], "note": {nested}}}'
    assert agree(info, deep.encode(), False) is None


def test_a_plugin_connection_reads_its_steps_in_c() -> None:
    info = plugin_env_info({"obs": {"size": [2], "space": "box"}}, n=2, move=2)
    frames = BrokerConnection()
    frames.receive_data(encode_frame(json.dumps(info).encode()))
    first = frames.next_event()
    assert isinstance(first, LegacyMessage)
    connection = GodotRlGameConnection(frames, first, "test")
    connection.next_event()  # the hello
    connection.game.reset_request()
    assert connection.game.awaits_reply_read_in_c
    reset = b'{"type": "reset", "obs": [{"obs": [1, 2]}, {"obs": [3, 4]}], "info": [{}, {}]}'
    connection.receive_data(encode_frame(reset))
    with capture_logs() as logs:  # read in C: the general way's once-per-game notice stays unsaid
        step = connection.next_event()
    assert isinstance(step, GameStep)
    assert "godot_rl game reply read the general way" not in [e["event"] for e in logs]
    assert step.groups["shared_policy"].obs["obs"].tolist() == [[1, 2], [3, 4]]
    # A reply C declines is read the general way, and the log says so once per game.
    step_reply = b'{"type": "step", "obs": [{"obs": [1, true]}, {"obs": [3, 4]}], "reward": [0, 0], "done": [0, 0]}'
    with capture_logs() as logs:
        for tick in (1, 2):
            connection.send(GameActions(tick - 1, {"shared_policy": {"move": np.zeros((2, 2), np.float32)}}))
            connection.receive_data(encode_frame(step_reply))
            step = connection.next_event()
            assert isinstance(step, GameStep) and step.tick == tick
            assert step.groups["shared_policy"].obs["obs"].tolist() == [[1, 1], [3, 4]]
    assert [e["event"] for e in logs].count("godot_rl game reply read the general way") == 1


# --- writing -----------------------------------------------------------------------------------------


def test_action_requests_are_byte_for_byte_the_python_ways() -> None:
    rng = random.Random(3)
    specials = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, 3.4e38, 0.1, -1.0]
    for _ in range(300):
        info = env_info(rng)
        with_c, without_c = game(info, True), game(info, False)
        for playing in (with_c, without_c):
            playing.receive(unpack_json(reply_text(random.Random(0), info, True)))
        groups: dict[str, dict[str, np.ndarray]] = {}
        for group in with_c.groups:
            actions = {}
            for key, array in group.spec.zero_actions().items():
                if array.dtype.kind == "f":
                    pick = lambda: rng.choice(specials) if rng.random() < 0.2 else rng.uniform(-1, 1)  # noqa: E731
                    rows = [[pick() for _ in r] for r in array]
                    values = np.asarray(rows, rng.choice([np.float32, np.float64]))
                else:
                    values = np.asarray([rng.randrange(4) for _ in array], rng.choice([np.int32, np.int64]))
                actions[key] = values
            if rng.random() < 0.8:  # a group left out is held: its last actions are spelled out again
                groups[group.spec.policy] = actions
        message = GameActions(0, groups)
        assert with_c.actions_request(message) == without_c.actions_request(message)


def test_actions_in_a_form_c_does_not_write_go_the_python_way() -> None:
    info = plugin_env_info({"obs": {"size": [1], "space": "box"}}, n=2, move=2)
    playing = game(info, True)
    playing.receive({"type": "reset", "obs": [{"obs": [0]}, {"obs": [0]}]})
    strided = np.zeros((2, 4), np.float32)[:, ::2]  # not contiguous
    assert playing._plan is not None
    assert wire.write_actions(playing._plan, [{"move": strided}], [playing.groups[0].spec.spaces]) is None
    frame = playing.actions_request(GameActions(0, {"shared_policy": {"move": strided}}))
    assert frame.endswith(b'[{"move": [0.0, 0.0]}, {"move": [0.0, 0.0]}]}')


def test_continuous_actions_are_written_as_float_repr_writes_them() -> None:
    """The writer's own shortest-repr for float32 values (1e-4 <= |x| < 1e7) and PyOS_double_to_string for the
    rest give repr's text: random float32s of every magnitude, and the edges of the fast range."""
    rng = np.random.default_rng(5)
    uniform = rng.uniform(-1, 1, 100_000).astype(np.float32)
    patterns = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = [np.float32(x) for x in (1e-4, 1e7, 2.0**23, 2.0**-13, 0.5, 0.1, 1 / 3)]
    near = [np.nextafter(e, np.float32(d)) for e in edges for d in (-np.inf, np.inf)]
    doubles = rng.uniform(-2, 2, 20_000)  # not float32 values: the general way
    for value in [*uniform, *patterns[np.isfinite(patterns)], *edges, *near, *doubles]:
        number = float(value)
        assert wire._C.float_text(number) == repr(number).encode(), repr(number)


# --- replies to a godot_rl script (gdrl-broker serve --godot-rl-trainer) ------------------------------------


def random_batch_parts(rng: random.Random) -> tuple[PolicySpaces, dict[str, np.ndarray], StepData]:
    """A policy's spaces and a batch as the hub hands it to a dialed godot_rl script: box, image and discrete
    keys, rewards, ended rows with and without final observations, infos."""
    observation: dict[str, Any] = {}
    for k in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.2:
            observation[f"cam_2d_{k}"] = {"space": "box", "shape": [2, 2, 3], "dtype": "uint8", "low": 0, "high": 255}
        elif kind < 0.35:
            observation[f"cell{k}"] = {"space": "discrete", "n": 5}
        else:
            observation[f"obs{k}"] = {"space": "box", "shape": [rng.randint(1, 6)], "dtype": "float32"}
    spaces = PolicySpaces.from_wire(observation, {"move": {"action_type": "continuous", "size": 2}}, "test")
    n = rng.randint(1, 12)
    specials = [0.0, -0.0, 1e-05, 0.1, 3.4e38, -2.5, 1e-30]

    def rows(space: Any) -> np.ndarray:
        if isinstance(space, DiscreteSpace):
            return np.asarray([rng.randrange(space.n) for _ in range(n)], np.int32)
        if space.dtype == "uint8":
            return np.asarray([[rng.randrange(256) for _ in range(12)] for _ in range(n)], np.uint8).reshape(n, 2, 2, 3)
        width = space.shape[0]
        pick = [
            [rng.choice(specials) if rng.random() < 0.2 else rng.uniform(-3, 3) for _ in range(width)] for _ in range(n)
        ]
        return np.asarray(pick, np.float32)

    obs = {key: rows(space) for key, space in spaces.observation}
    terminated = np.asarray([rng.random() < 0.2 for _ in range(n)])
    truncated = np.asarray([rng.random() < 0.2 for _ in range(n)]) & ~terminated
    ended = np.flatnonzero(terminated | truncated)
    with_final = [int(r) for r in ended if rng.random() < 0.5]
    final_index = np.asarray(with_final, np.int32) if with_final else None
    final_obs = {key: rows(space)[: len(with_final)] for key, space in spaces.observation} if with_final else None
    infos = {r: {"score": rng.randint(0, 9), "note": 'a"b'} for r in range(n) if rng.random() < 0.2}
    reward = np.asarray(
        [rng.choice(specials) if rng.random() < 0.2 else rng.uniform(-9, 9) for _ in range(n)], np.float32
    )
    data = StepData(obs, reward, terminated, truncated, final_index, final_obs, infos)
    return spaces, obs, data


def script_session(spaces: PolicySpaces, data: StepData, request: dict[str, Any]) -> GodotRlTrainer:
    """The broker's end of a dialed godot_rl script, past the handshake and env_info, with ``request`` open."""
    session = GodotRlTrainer("p")
    n = len(data.reward)
    feed(session, {"type": "handshake", "major_version": "0", "minor_version": "7"}, {"type": "env_info"})
    session.env_info_reply(PolicyInfo("p", n, spaces, (GameLayout(0, 0, n),)))
    if request["type"] == "action":
        feed(session, {"type": "reset"})
        session.batch_reply(Batch(0, data))
    assert len(feed(session, request)) == 1
    return session


def test_replies_to_a_godot_rl_script_are_byte_for_byte_the_python_ways() -> None:
    rng = random.Random(11)
    written_in_c = 0
    for trial in range(300):
        spaces, _, data = random_batch_parts(rng)
        n = len(data.reward)
        request = {"type": "reset"} if trial % 4 == 0 else {"type": "action", "action": [{"move": [0, 0]}] * n}
        with_c = script_session(spaces, data, request).batch_reply(Batch(1, data))
        saved, wire._C = wire._C, None  # the Python way
        try:
            without_c = script_session(spaces, data, request).batch_reply(Batch(1, data))
        finally:
            wire._C = saved
        assert with_c == without_c
        written_in_c += wire.write_reply(spaces, data.obs, data.reward, np.zeros(n, bool), {}) is not None
    assert written_in_c >= 290


def test_a_reply_c_does_not_write_goes_the_python_way() -> None:
    spaces = PolicySpaces.from_wire(
        {"obs": {"space": "box", "shape": [2, 2], "dtype": "float32"}},
        {"move": {"action_type": "continuous", "size": 1}},
        "t",
    )
    obs = {"obs": np.arange(8, dtype=np.float32).reshape(2, 2, 2)}  # nested rows: encode_rows' tolist
    assert wire.write_reply(spaces, obs, None, None, {}) is None
    flat = PolicySpaces.from_wire(
        {"obs": {"space": "box", "shape": [2], "dtype": "float32"}},
        {"move": {"action_type": "continuous", "size": 1}},
        "t",
    )
    strided = {"obs": np.zeros((2, 4), np.float32)[:, ::2]}
    assert wire.write_reply(flat, strided, None, None, {}) is None
    nan_reward = np.asarray([np.nan, 0.0], np.float32)  # json.dumps writes NaN: left to it
    assert wire.write_reply(flat, {"obs": np.zeros((2, 2), np.float32)}, nan_reward, np.zeros(2, bool), {}) is None
