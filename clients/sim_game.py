"""A built-in simulated game with two agent groups whose spaces differ, vectorised with numpy.

* ``mover`` (continuous): reach a target on a plane. Observation ``obs`` = position and offset to
  the target (4 floats); action ``move`` = a 2-d velocity in [-1, 1]. Reward: progress toward the
  target, +1 on arrival (terminated); truncated after ``mover_horizon`` ticks.
* ``picker`` (discrete): walk along a corridor to a goal. Observation ``obs`` (3 floats) and
  ``goal_side`` (Discrete(3): left, here, right); action ``move`` = Discrete(3) (left, stay, right).
  Reward -0.05 a tick, +1 at the goal (terminated); truncated after ``picker_horizon`` ticks.

Episodes end per agent; the game resets those agents itself and reports their final observation.
"""

from __future__ import annotations

import argparse
import sys
from typing import Final

import numpy as np
import structlog

from broker.protocol import DEFAULT_ADDRESS
from broker.protocol.messages import StepData
from broker.protocol.spaces import (
    BoxSpace,
    ContinuousAction,
    DiscreteAction,
    DiscreteSpace,
    GroupSpec,
    PolicySpaces,
)
from clients.transport import DEFAULT_TIMEOUT_RECONNECT

MOVER: Final = "mover"
PICKER: Final = "picker"
CORRIDOR: Final = 8
log = structlog.get_logger("gdrl.sim_game")


def mover_spaces() -> PolicySpaces:
    return PolicySpaces((("obs", BoxSpace((4,), "float32", -2.0, 2.0)),), (("move", ContinuousAction(2)),))


def picker_spaces() -> PolicySpaces:
    return PolicySpaces(
        (("obs", BoxSpace((3,), "float32", -1.0, 1.0)), ("goal_side", DiscreteSpace(3))),
        (("move", DiscreteAction(3)),),
    )


class SimGame:
    def __init__(
        self,
        n_movers: int = 4,
        n_pickers: int = 4,
        seed: int = 0,
        mover_horizon: int = 40,
        picker_horizon: int = 20,
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.n_movers, self.n_pickers = n_movers, n_pickers
        self.mover_horizon, self.picker_horizon = mover_horizon, picker_horizon
        self.pos = np.zeros((n_movers, 2), np.float32)
        self.target = np.zeros((n_movers, 2), np.float32)
        self.mover_t = np.zeros(n_movers, np.int64)
        self.cell = np.zeros(n_pickers, np.int64)
        self.goal = np.zeros(n_pickers, np.int64)
        self.picker_t = np.zeros(n_pickers, np.int64)
        self._reset_movers(np.ones(n_movers, bool))
        self._reset_pickers(np.ones(n_pickers, bool))

    def group_specs(self) -> list[GroupSpec]:
        groups = []
        if self.n_movers:
            groups.append(GroupSpec(MOVER, self.n_movers, mover_spaces()))
        if self.n_pickers:
            groups.append(GroupSpec(PICKER, self.n_pickers, picker_spaces()))
        return groups

    # --- episodes --------------------------------------------------------------------------------

    def _reset_movers(self, mask: np.ndarray) -> None:
        k = int(mask.sum())
        self.pos[mask] = self.rng.uniform(-1, 1, (k, 2))
        self.target[mask] = self.rng.uniform(-1, 1, (k, 2))
        self.mover_t[mask] = 0

    def _reset_pickers(self, mask: np.ndarray) -> None:
        k = int(mask.sum())
        self.cell[mask] = self.rng.integers(0, CORRIDOR + 1, k)
        offset = self.rng.integers(1, CORRIDOR + 1, k)
        self.goal[mask] = (self.cell[mask] + offset) % (CORRIDOR + 1)
        self.picker_t[mask] = 0

    def _mover_obs(self) -> dict[str, np.ndarray]:
        return {"obs": np.concatenate([self.pos, self.target - self.pos], axis=1).astype(np.float32)}

    def _picker_obs(self) -> dict[str, np.ndarray]:
        scaled = np.stack([self.cell, self.goal, self.goal - self.cell], axis=1) / CORRIDOR
        side = (np.sign(self.goal - self.cell) + 1).astype(np.int32)
        return {"obs": scaled.astype(np.float32), "goal_side": side}

    def first_step(self) -> dict[str, StepData]:
        out = {}
        if self.n_movers:
            out[MOVER] = _fresh(self._mover_obs(), self.n_movers)
        if self.n_pickers:
            out[PICKER] = _fresh(self._picker_obs(), self.n_pickers)
        return out

    def apply(self, actions: dict[str, dict[str, np.ndarray]]) -> dict[str, StepData]:
        out = {}
        if self.n_movers:
            out[MOVER] = self._step_movers(actions[MOVER]["move"])
        if self.n_pickers:
            out[PICKER] = self._step_pickers(actions[PICKER]["move"])
        return out

    def _step_movers(self, move: np.ndarray) -> StepData:
        before = np.linalg.norm(self.target - self.pos, axis=1)
        self.pos = np.clip(self.pos + 0.15 * np.clip(move, -1, 1), -1, 1).astype(np.float32)
        after = np.linalg.norm(self.target - self.pos, axis=1)
        self.mover_t += 1
        terminated = after < 0.15
        truncated = ~terminated & (self.mover_t >= self.mover_horizon)
        reward = (5.0 * (before - after) - 0.02 + terminated.astype(np.float64)).astype(np.float32)
        return self._finish(self._mover_obs, self._reset_movers, reward, terminated, truncated)

    def _step_pickers(self, move: np.ndarray) -> StepData:
        self.cell = np.clip(self.cell + (move.astype(np.int64) - 1), 0, CORRIDOR)
        self.picker_t += 1
        terminated = self.cell == self.goal
        truncated = ~terminated & (self.picker_t >= self.picker_horizon)
        reward = (terminated.astype(np.float64) - 0.05).astype(np.float32)
        return self._finish(self._picker_obs, self._reset_pickers, reward, terminated, truncated)

    @staticmethod
    def _finish(observe, reset, reward, terminated, truncated) -> StepData:  # type: ignore[no-untyped-def]
        done = terminated | truncated
        final_index = final_obs = None
        if done.any():
            final_index = np.flatnonzero(done).astype(np.int32)
            final_obs = {k: v[final_index] for k, v in observe().items()}
            reset(done)
        return StepData(observe(), reward, terminated, truncated, final_index, final_obs)


def _fresh(obs: dict[str, np.ndarray], n: int) -> StepData:
    return StepData(obs, np.zeros(n, np.float32), np.zeros(n, np.bool_), np.zeros(n, np.bool_))


def run_sim_game(
    address: str,
    n_movers: int = 4,
    n_pickers: int = 4,
    seed: int = 0,
    name: str | None = None,
    max_ticks: int | None = None,
    token: str | None = None,
    timeout_connect: float = 60.0,
    timeout_reconnect: float = DEFAULT_TIMEOUT_RECONNECT,
) -> int:
    """Play until the broker closes (or ``max_ticks``); returns the number of ticks played."""
    from clients.game import GameClient
    from clients.transport import BrokerGoneError

    game = SimGame(n_movers, n_pickers, seed)
    client = GameClient(
        address,
        game.group_specs(),
        name=name,
        token=token,
        timeout_connect=timeout_connect,
        timeout_reconnect=timeout_reconnect,
    )
    try:
        return client.play(game.first_step(), game.apply, max_ticks)
    except BrokerGoneError as exc:
        log.error("gave up on the broker", error=exc.message)  # not a normal end: say so
        raise
    finally:
        client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gdrl-broker sim-game", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    sys.exit(run_from_args(args))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="broker address, host:port or unix:/path")
    parser.add_argument("--movers", type=int, default=4, help=f"agents in the continuous '{MOVER}' group")
    parser.add_argument("--pickers", type=int, default=4, help=f"agents in the discrete '{PICKER}' group")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first instance; instance i gets SEED+i")
    parser.add_argument("--instances", type=int, default=1, help="game instances to run, one process each")
    parser.add_argument("--max-ticks", type=int, default=None, help="stop after this many ticks (default: never)")
    parser.add_argument(
        "--name",
        default=None,
        help="game name in the broker's log (default: game@HOST:PID; with --instances N: sim-0 ... sim-N-1)",
    )
    parser.add_argument("--token", default=None, help="shared token, if the broker asks for one")
    parser.add_argument(
        "--connect-timeout", type=float, default=60.0, help="seconds to keep trying to reach the broker"
    )
    parser.add_argument(
        "--reconnect-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_RECONNECT,
        help="seconds to keep reconnecting to a lost broker before giving up (0: never reconnect)",
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run the instance(s); the exit code: 0 once the broker closed every game, 1 if one could not play."""
    from broker.log import configure_logging

    configure_logging()
    if args.instances == 1:
        return _play_instance(args, args.seed, args.name)
    import multiprocessing

    procs = [
        multiprocessing.Process(target=_instance_process, args=(args, args.seed + i, f"sim-{i}"))
        for i in range(args.instances)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        for p in procs:
            p.join()  # each instance got the same Ctrl-C and ends on its own
        return 130
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def _instance_process(args: argparse.Namespace, seed: int, name: str) -> None:
    sys.exit(_play_instance(args, seed, name))


def _play_instance(args: argparse.Namespace, seed: int, name: str | None) -> int:
    """One game until the broker closes it: 0; a broker unreachable or gone for good: one line and 1."""
    from clients.errors import BrokerError

    try:
        run_sim_game(
            args.address,
            args.movers,
            args.pickers,
            seed,
            name,
            args.max_ticks,
            args.token,
            args.connect_timeout,
            args.reconnect_timeout,
        )
    except BrokerError as exc:
        print(f"gdrl-broker sim-game: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
