"""A game process for the reliability tests: the simulated game (``--kind sim``) or a tagged game whose
observations say where and when they come from (``--kind tagged``: ``[game, agent, tick, episode_step]``),
so that trainers and the game itself can count every step end to end.

It rewrites a JSON report (``--report``) twice a second and when it ends: ticks answered, reconnects,
how it ended. Exit codes: 0 after the broker told it to close or SIGTERM/SIGINT, 3 after any other
BrokerError (the report has its code and message).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import replace
from types import FrameType
from typing import Any

import numpy as np

from broker.protocol.messages import StepData
from broker.protocol.spaces import BoxSpace, ContinuousAction, DiscreteAction, GroupSpec, PolicySpaces
from clients.errors import BrokerError
from clients.game import GameClient
from clients.sim_game import SimGame
from clients.transport import BrokerGoneError
from tests.scripts.reliability_common import write_report

EPISODE = 25  # a tagged agent's episode ends when (tick + agent) % EPISODE == 0
DISCRETE_CHOICES = 8
TAGGED_SPACES = {
    "mover": PolicySpaces((("obs", BoxSpace((4,), "float32", -1e7, 1e7)),), (("move", ContinuousAction(2)),)),
    "picker": PolicySpaces(
        (("obs", BoxSpace((4,), "float32", -1e7, 1e7)),), (("move", DiscreteAction(DISCRETE_CHOICES)),)
    ),
}


def tagged_actions(policy: str, tick: np.ndarray, agent: np.ndarray) -> np.ndarray:
    """What a tagged trainer answers for rows showing ``tick`` and ``agent`` (exact in float32)."""
    if policy == "mover":
        return np.stack([(tick % 8 - 4) / 4, (agent % 8 - 4) / 4], axis=1).astype(np.float32)
    return ((tick + agent) % DISCRETE_CHOICES).astype(np.int64)


class TaggedGame:
    def __init__(self, n_agents: dict[str, int]) -> None:
        self.n_agents = {p: n for p, n in n_agents.items() if n}
        self.episode_step = {p: np.zeros(n, np.int64) for p, n in self.n_agents.items()}

    def group_specs(self) -> list[GroupSpec]:
        return [GroupSpec(p, n, TAGGED_SPACES[p]) for p, n in self.n_agents.items()]

    def observe(self, policy: str, game: int, tick: int, episode_step: np.ndarray) -> np.ndarray:
        n = self.n_agents[policy]
        return np.stack([np.full(n, game), np.arange(n), np.full(n, tick), episode_step], axis=1).astype(np.float32)

    def outcome(self, game: int, tick: int) -> dict[str, StepData]:
        out = {}
        for policy, n in self.n_agents.items():
            agents = np.arange(n)
            ended = (tick > 0) & ((tick + agents) % EPISODE == 0)
            final_obs = self.observe(policy, game, tick, self.episode_step[policy])[ended]
            self.episode_step[policy][ended] = 0
            data = StepData(
                {"obs": self.observe(policy, game, tick, self.episode_step[policy])},
                np.ones(n, np.float32),
                ended if policy == "mover" else np.zeros(n, np.bool_),
                ended if policy == "picker" else np.zeros(n, np.bool_),
            )
            if ended.any():
                data = replace(data, final_index=np.flatnonzero(ended).astype(np.int32), final_obs={"obs": final_obs})
            self.episode_step[policy] += 1
            out[policy] = data
        return out

    def check(self, actions: dict[str, dict[str, np.ndarray]], held: set[str], tick: int, exact: bool) -> list[str]:
        """Actions must be the ones derived from this game's rows (for this very tick when ``exact``)."""
        problems = []
        for policy, n in self.n_agents.items():
            if policy in held:
                continue
            agents = np.arange(n)
            got = actions[policy]["move"]
            if policy == "mover":
                want = tagged_actions(policy, np.full(n, tick), agents)
                ok = np.array_equal(got[:, 1], want[:, 1]) and (not exact or np.array_equal(got, want))
            else:
                ok = not exact or np.array_equal(got, tagged_actions(policy, np.full(n, tick), agents))
            if not ok:
                problems.append(f"tick {tick} {policy}: {got[:3].tolist()}...")
        return problems


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--kind", choices=("sim", "tagged"), default="sim")
    parser.add_argument("--movers", type=int, default=4)
    parser.add_argument("--pickers", type=int, default=4)
    parser.add_argument("--name", default="reliability-game")
    parser.add_argument("--report", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-reconnect", type=float, default=60.0)
    parser.add_argument("--reconnect-on-shutdown", action="store_true")
    parser.add_argument("--exact", action="store_true", help="lock-step: actions answer this very tick")
    parser.add_argument("--token", default=None)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)

    report: dict[str, Any] = {"ticks": 0, "reconnects": 0, "mismatches": 0, "examples": [], "end": None}
    sim = SimGame(args.movers, args.pickers, args.seed) if args.kind == "sim" else None
    tagged = TaggedGame({"mover": args.movers, "picker": args.pickers}) if args.kind == "tagged" else None
    specs = (
        sim.group_specs()
        if sim is not None
        else TaggedGame({"mover": args.movers, "picker": args.pickers}).group_specs()
    )
    code = 0
    client: GameClient | None = None
    try:
        client = GameClient(
            args.address,
            specs,
            name=args.name,
            token=args.token,
            timeout_reconnect=args.timeout_reconnect,
            reconnect_on_shutdown=args.reconnect_on_shutdown,
        )
        report["game_index"] = client.game_index
        game_tick = 0  # tags the observations; unlike client.tick it does not restart after a reconnect
        if sim is not None:
            data = sim.first_step()
        else:
            assert tagged is not None
            data = tagged.outcome(client.game_index or 0, game_tick)
        last_write = 0.0
        while True:
            actions = client.step(data)
            report["ticks"] += 1
            if sim is not None:
                data = sim.apply(actions)
            else:
                assert tagged is not None
                problems = tagged.check(actions, client.held, game_tick, args.exact)
                report["mismatches"] += len(problems)
                report["examples"] = (report["examples"] + problems)[:10]
                game_tick += 1
                data = tagged.outcome(client.game_index or 0, game_tick)
            report.update(reconnects=client.reconnects, game_index=client.game_index, session_tick=client.tick)
            now = time.monotonic()
            if now - last_write > 0.5:
                last_write = now
                write_report(args.report, report)
    except KeyboardInterrupt:
        report["end"] = "signal"
    except BrokerError as exc:
        report.update(end=exc.code, message=exc.message, gone=isinstance(exc, BrokerGoneError))
        code = 0 if exc.code == "closed" else 3
    finally:
        if client is not None:
            report.update(reconnects=client.reconnects)
            client.close()
        write_report(args.report, report)
    return code


if __name__ == "__main__":
    sys.exit(main())
