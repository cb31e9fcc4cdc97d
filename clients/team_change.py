"""The trainer's side of a team change (``gdrl-train --policy A --team-change B``, asymmetric games).

Two trainer processes take turns; the broker decides whose turn it is (broker/server/team_change.py) and
plays the idle team from that team's own latest snapshot. This trainer asks the broker (control command
``team_change``) at start and after every rollout. When its turn is over it writes a snapshot of its
policy into its pool, closes its trainer session and says so (``detached``); the broker then freezes its
team at that snapshot and lets the partner's trainer in. While idle it collects and learns nothing: it
asks every ``POLL_S`` until its turn comes back, then joins again and goes on with the same model. The
rotation lives in the broker and the pools, so a restarted broker or trainer continues it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from stable_baselines3.common.callbacks import BaseCallback

from broker.protocol.errors import ErrorCode
from broker.protocol.snapshots import snapshot_name
from broker.protocol.spaces import PolicySpaces
from clients.errors import BrokerError
from clients.self_play import prune, snapshot_indices, write_snapshot
from clients.status import send_control

log = structlog.get_logger("gdrl.team_change")

POLL_S = 0.5  # seconds between asks while waiting for the turn
ASK_TIMEOUT_S = 5.0  # a poll during learning gives up this soon if the broker is away (it is asked again)
REFUSALS_FOR_S = 60.0  # a waiting trainer gives up after being refused this long


@dataclass(frozen=True)
class Turn:
    learner: str
    learns: bool  # this trainer's team learns now, its turn not yet over
    turns: int
    steps: int
    every: int

    @classmethod
    def of(cls, reply: dict[str, Any]) -> Turn:
        state = reply["team_change"]
        return cls(
            str(state["learner"]), bool(state["learns"]), int(state["turns"]), int(state["steps"]), int(state["every"])
        )


class TeamChange:
    @classmethod
    def of_options(cls, options: Any, spaces: PolicySpaces) -> TeamChange:
        pool = options.pool_dir or f"pool-{options.policy}"
        change = cls(
            options.broker, options.token, options.policy, options.team_change, pool, options.team_change_every, spaces
        )
        change.keep = options.keep
        return change

    def __init__(
        self,
        address: str,
        token: str | None,
        team: str,
        partner: str,
        pool: str | Path,
        every: int,
        spaces: PolicySpaces,
    ) -> None:
        self.address, self.token = address, token
        self.team, self.partner = team, partner
        self.pool = Path(pool).resolve()
        self.every = every
        self.spaces = spaces
        self.snapshot_steps: int | None = None  # the model's steps when its newest snapshot was written
        self.keep = 0  # snapshots kept in the pool (0: all)

    def ask(self, detached: bool = False, timeout: float = 30.0, finished: bool = False) -> Turn:
        """Whose turn it is (BrokerError ``bad_control`` with the broker's reason if the request is refused).
        ``finished``: this trainer stops for good, so its turn goes to the partner now."""
        args = {"team": self.team, "partner": self.partner, "pool": str(self.pool), "every": self.every}
        args |= {"detached": detached, "finished": finished}
        return Turn.of(send_control(self.address, "team_change", args, self.token, timeout))

    def finish(self, model: Any) -> None:
        """The target is reached: the newest snapshot, then the turn handed to the partner (which would
        otherwise wait for this team until a trainer of it came back). Best effort: the broker may be gone."""
        self.snapshot(model)
        model.get_env().close()
        try:
            self.ask(detached=True, finished=True)
        except (BrokerError, OSError) as exc:
            log.warning("could not hand the turn over", team=self.team, partner=self.partner, error=str(exc))

    def start(self, model: Any) -> Turn:
        """A snapshot of this model if the pool's newest is not of it, then the broker asked."""
        self.pool.mkdir(parents=True, exist_ok=True)
        indices = snapshot_indices(self.pool)
        if indices:
            meta = json.loads((self.pool / f"{snapshot_name(indices[-1])}.json").read_text(encoding="utf-8"))
            self.snapshot_steps = int(meta.get("steps", -1))
        self.snapshot(model)
        return self.ask()

    def snapshot(self, model: Any) -> None:
        """The model as the pool's newest snapshot, unless it has not learned since the last one."""
        if self.snapshot_steps != int(model.num_timesteps):
            write_snapshot(self.pool, model, self.spaces, self.team)
            self.snapshot_steps = int(model.num_timesteps)
            prune(self.pool, self.keep)

    def wait_for_turn(self) -> Turn:
        """Ask until this team learns again. A broker that is away is asked again; one that refuses (e.g. a
        restarted broker whose games are not back yet) is asked again for ``REFUSALS_FOR_S``."""
        refused_since: float | None = None
        while True:
            try:
                turn = self.ask(detached=True)
                refused_since = None
                if turn.learns:
                    return turn
            except BrokerError as exc:
                if exc.code == ErrorCode.BAD_CONTROL.value:
                    refused_since = refused_since or time.monotonic()
                    if time.monotonic() - refused_since > REFUSALS_FOR_S:
                        raise
            except OSError:
                pass
            time.sleep(POLL_S)


class TurnCallback(BaseCallback):
    """Asks the broker after each rollout; the first step after the turn is over stops learning, so the
    last full rollout is trained on and nothing is collected against a partner that learns."""

    def __init__(self, change: TeamChange) -> None:
        super().__init__()
        self.change = change
        self.over = False

    def _on_rollout_end(self) -> None:
        try:
            self.over = not self.change.ask(timeout=ASK_TIMEOUT_S).learns
        except BrokerError as exc:
            if exc.code == ErrorCode.BAD_CONTROL.value:
                raise
        except OSError:
            pass  # the broker is away; the env reconnects, and the next rollout asks again

    def _on_step(self) -> bool:
        return not self.over


def learn_in_turns(
    model: Any,
    change: TeamChange,
    turn: Turn,
    connect: Callable[[], Any],
    learn: Callable[[int, BaseCallback, bool], None],
    target: int,
) -> None:
    """Learn until ``model.num_timesteps`` reaches ``target``, only in this team's turns (``turn``: the
    broker's first answer, from ``TeamChange.start``).

    ``connect()`` gives a new env for a returning turn; ``learn(steps, callback, first)`` runs
    ``model.learn``. Reaching the target mid-turn hands the turn to the partner; Ctrl-C hands nothing over:
    a restarted trainer continues the turn."""
    attached, first, opened = True, True, []
    try:
        while model.num_timesteps < target:
            if turn.learns:
                if not attached:
                    opened.append(connect())
                    model.set_env(opened[-1])
                    attached = True
                callback = TurnCallback(change)
                learn(target - model.num_timesteps, callback, first)
                first = False
                if not callback.over:
                    change.finish(model)
                    return
            change.snapshot(model)
            if attached:
                model.get_env().close()
                attached = False
            turn = change.wait_for_turn()  # its first ask hands the turn over
    finally:
        for env in opened:
            env.close()


def check_options(options: Any) -> None:
    """gdrl-train's --team-change flags (ValueError if they do not fit)."""
    if options.team_change == options.policy:
        raise ValueError("--team-change must name another group than --policy")
    if options.opponent is not None:
        raise ValueError("--team-change and --opponent do not go together (take turns, or play your snapshots)")
    if options.inference:
        raise ValueError("--team-change trains in turns: it does not go with --inference")
    if options.team_change_every < 1:
        raise ValueError("--team-change-every must be positive")


def learn_options_in_turns(
    model: Any, change: TeamChange, turn: Turn, options: Any, callbacks: list[BaseCallback], tb_name: str
) -> None:
    """``learn_in_turns`` for gdrl-train: its callbacks and TensorBoard run go on over the turns."""
    from stable_baselines3.common.vec_env import VecMonitor

    from clients.train import connect

    def learn(steps: int, turn_callback: BaseCallback, first: bool) -> None:
        model.learn(
            total_timesteps=steps,
            callback=[*callbacks, turn_callback],
            tb_log_name=tb_name,
            reset_num_timesteps=first and not options.resume_model_path,
        )

    base = 0 if not options.resume_model_path else int(model.num_timesteps)
    learn_in_turns(model, change, turn, lambda: VecMonitor(connect(options)), learn, base + options.total_timesteps)
