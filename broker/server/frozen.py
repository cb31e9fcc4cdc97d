"""Frozen groups: policies the broker plays itself, from an ONNX file or a self-play snapshot pool.

A ``FrozenGroup`` is a server-side trainer session: it enters the hub with an ordinary trainer ``hello``
(through ``BrokerServer.enter``, like any peer), receives the group's ``policy`` and ``batch`` messages
and answers each batch with ``act``, so the hub needs no special case. A batch covers every agent of the
group in every game; it is run in onnxruntime on a small shared thread pool, off the event loop, one
inference in flight per group (the hub keeps one batch open per policy anyway), so other policies are
never stalled: in hold stepping a slow inference only holds this group's agents.

A fixed model file is reloaded when its modification time or size changes (checked every
``RELOAD_CHECK_S``). A pool group swaps opponents as ``broker.server.pool`` says. Episode outcomes of
the group's agents feed one Elo table (``broker.core.elo``), persisted with each pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from broker.core.elo import EloTable, outcome_score
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode, ProtocolError
from broker.protocol.messages import (
    Batch,
    Close,
    Control,
    Error,
    Hello,
    Message,
    PolicyInfo,
    PolicySpaces,
    TrainerAct,
    TrainerReset,
)
from broker.server.onnx_model import FileStamp, ModelError, OnnxModel
from broker.server.pool import PoolSettings, SnapshotPool, saved_settings

if TYPE_CHECKING:
    from broker.server.server import BrokerServer

log = structlog.get_logger("gdrl.frozen")

RELOAD_CHECK_S = 1.0  # how often a model file (or a pool directory) is looked at for changes
INFERENCE_THREADS = 2  # shared by every frozen group: the machine also runs games and trainers


class ControlError(ValueError):
    """A control request that cannot be carried out; its text goes back to the control peer."""


def parse_frozen_target(text: str) -> tuple[str, str]:
    """``GROUP=PATH`` -> (group, path) (ValueError if malformed)."""
    group, sep, path = text.partition("=")
    if not sep or not group or not path:
        raise ValueError(f"expected GROUP=PATH, got {text!r}")
    return group, path


class FrozenGroup:
    """One group answered by an ONNX model; the hub sees a trainer whose link is this object."""

    def __init__(
        self,
        registry: FrozenGroups,
        group: str,
        model_path: str | None = None,
        pool: SnapshotPool | None = None,
        rivals: tuple[str, ...] | None = None,
    ) -> None:
        self.registry = registry
        self.server = registry.server
        self.group = group
        self.label = f"frozen[{group}]"
        self.link_kind = "frozen"
        self.model_path = model_path  # fixed file; None for a pool group
        self.pool = pool
        self.model: OnnxModel | None = None
        self.player = ""  # the Elo player the model plays as
        self.version = 0  # models loaded so far
        self.error: str | None = None
        self.spaces: PolicySpaces | None = None
        self.closed = False
        self.in_flight = False
        self.loading: str | None = None  # path being loaded
        self.failed_stamp: FileStamp | None = None  # the model file as it was when it last failed to load
        self.pending: Batch | None = None  # a batch that came while no model was usable
        self.batches = 0
        self.agent_steps = 0
        self.episodes = 0
        self.returns = np.zeros(0, np.float64)
        self._timer: asyncio.TimerHandle | None = None
        self._pool_dirty = False
        self.rivals = rivals  # who it plays, if not the pool's learner (a --team-change partner)
        self.on_answered: Callable[[], None] | None = None  # a team change counts the idle team's steps

    # --- Link, as the hub sees us ----------------------------------------------------------------

    def send(self, message: Message) -> None:
        if self.closed:
            return
        if isinstance(message, Batch):
            self._on_batch(message)
        elif isinstance(message, PolicyInfo):
            self._on_policy(message)

    def close(self, error: Error | Close | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        if isinstance(error, Error):
            self.error = f"{error.code}: {error.message}"
            log.error("frozen group closed by the hub", group=self.group, error=self.error)
        self._stop_timer()

    # --- life ------------------------------------------------------------------------------------

    def attach(self) -> None:
        """Enter the hub as the group's trainer (ProtocolError if the group already has one)."""
        hello = Hello("trainer", PROTOCOL_VERSION, self.label, policy=self.group)
        self.server.enter(self, hello)
        self._schedule_check()

    def detach(self) -> None:
        if not self.closed:
            self.closed = True
            self.server.leave(self)
        self._stop_timer()
        self.save_pool()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule_check(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(RELOAD_CHECK_S, self._check_files)

    def _check_files(self) -> None:
        """Reload a changed model file; in a pool, pick an opponent when one is due; save the pool."""
        self._timer = None
        if self.closed:
            return
        try:
            if self.model_path is not None:
                stamp = FileStamp.of(self.model_path)
                loaded = self.model.stamp if self.model else None
                if stamp is not None and self.loading is None and stamp not in (loaded, self.failed_stamp):
                    self.failed_stamp = stamp  # until it loads: a broken file is reported once, not every check
                    self.start_load(self.model_path, Path(self.model_path).name)
            else:
                self._maybe_swap()
            self.save_pool()
        except Exception:
            log.exception("frozen group check failed", group=self.group)
        self._schedule_check()

    # --- models ----------------------------------------------------------------------------------

    def start_load(self, path: str, player: str) -> asyncio.Future[OnnxModel]:
        """Load ``path`` off the loop; once loaded (and fitting the group's spaces) it answers from then on.
        The returned future has the model, or the ModelError that kept the old one in place."""
        self.loading = path
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.registry.executor, OnnxModel.load, path)
        result: asyncio.Future[OnnxModel] = loop.create_future()
        result.add_done_callback(lambda f: f.cancelled() or f.exception())  # a reload's error is in status
        future.add_done_callback(lambda f: self._loaded(f, path, player, result))
        return result

    def _loaded(
        self, future: asyncio.Future[OnnxModel], path: str, player: str, result: asyncio.Future[OnnxModel]
    ) -> None:
        self.loading = None
        try:
            model = future.result()
            if self.spaces is not None:
                model.check(self.spaces)
        except ModelError as exc:
            self.error = str(exc)
            log.error("frozen model not loaded", group=self.group, path=path, error=self.error)
            result.set_exception(exc)
            return
        except Exception as exc:  # the file passed onnxruntime but is not usable: keep the old model
            self.error = f"{path}: {exc}"
            log.error("frozen model not loaded", group=self.group, path=path, error=self.error)
            result.set_exception(ModelError(self.error))
            return
        self.model, self.player, self.error, self.failed_stamp = model, player, None, None
        self.version += 1
        log.info("frozen model loaded", group=self.group, path=path, version=self.version, player=player)
        result.set_result(model)
        if self.pending is not None and not self.in_flight and not self.closed:
            batch, self.pending = self.pending, None
            self._infer(batch)

    def _maybe_swap(self) -> None:
        pool = self.pool
        if pool is None or self.loading is not None:
            return
        snapshots = pool.snapshots()
        if self.model is None and pool.opponent in {s.name for s in snapshots}:
            pick = next(s for s in snapshots if s.name == pool.opponent)  # resumed: the same opponent again
        elif pool.due(snapshots):
            pick = pool.choose(snapshots)
            self._pool_dirty = True
            log.info("opponent swapped", group=self.group, opponent=pick.name, swaps=pool.swaps)
        else:
            return
        self.start_load(pick.model_path, pool.player(pick.name))

    def save_pool(self) -> None:
        if self.pool is not None and self._pool_dirty:
            self.pool.elo = self.registry.elo
            try:
                self.pool.save_state()
                self._pool_dirty = False
            except OSError as exc:
                log.error("pool state not saved", group=self.group, error=str(exc))

    # --- the hub's messages ----------------------------------------------------------------------

    def _on_policy(self, info: PolicyInfo) -> None:
        self.spaces = info.spaces
        self.returns = np.zeros(info.n_envs, np.float64)
        if self.model is not None:
            try:
                self.model.check(info.spaces)
            except ModelError as exc:
                self.error = str(exc)
                self.model = None
                log.error("frozen model does not fit the group", group=self.group, error=self.error)
        asyncio.get_running_loop().call_soon(self._enter, TrainerReset())

    def _on_batch(self, batch: Batch) -> None:
        self._record_outcomes(batch)
        if self.model is None or self.in_flight:
            self.pending = batch  # answered once a model is loaded; meanwhile the hub holds the agents
            return
        self._infer(batch)

    def _infer(self, batch: Batch) -> None:
        model, spaces = self.model, self.spaces
        assert model is not None and spaces is not None
        self.in_flight = True
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.registry.executor, model.act, batch.data.obs, spaces)
        future.add_done_callback(lambda f: self._inferred(f, batch))

    def _inferred(self, future: asyncio.Future[dict[str, np.ndarray]], batch: Batch) -> None:
        self.in_flight = False
        if self.closed:
            return
        try:
            actions = future.result()
        except Exception as exc:
            self.error = f"inference failed: {exc}"
            log.error("frozen inference failed", group=self.group, error=self.error)
            return
        self.batches += 1
        self.agent_steps += len(batch.data.reward)
        self._enter(TrainerAct(batch.step, actions))
        if self.pool is not None:
            self.pool.steps_since_swap += 1
            self._pool_dirty = True
            if self.pool.steps_since_swap >= self.pool.settings.swap_every:
                self._maybe_swap()
        if self.on_answered is not None:
            self.on_answered()
        if self.pending is not None and self.model is not None and not self.closed:
            pending, self.pending = self.pending, None
            self._infer(pending)

    def _enter(self, message: Message) -> None:
        if self.closed:
            return
        try:
            self.server.enter(self, message)
        except ProtocolError as exc:
            self.error = f"{exc.code.value}: {exc.message}"
            log.error("frozen group refused", group=self.group, error=self.error)
            self.detach()

    def _record_outcomes(self, batch: Batch) -> None:
        data = batch.data
        if self.returns.shape != data.reward.shape:
            self.returns = np.zeros(data.reward.shape, np.float64)
        self.returns += data.reward
        done = np.flatnonzero(data.terminated | data.truncated)
        if not len(done) or not self.player:
            self.returns[done] = 0.0
            return
        opponents = self.opponents()
        for row in done.tolist():
            info = data.infos.get(row)
            if info and info.get("game_replaced"):
                continue  # not an episode the game ended
            self.registry.elo.record(self.player, outcome_score(info, float(self.returns[row])), opponents)
            self.episodes += 1
        self.returns[done] = 0.0
        self._pool_dirty = True

    def opponents(self) -> list[str]:
        """Who this group plays: the pool's learner, else every other policy of the games."""
        if self.rivals is not None:
            return list(self.rivals)
        if self.pool is not None:
            return [self.pool.settings.learner]
        return [p for p in self.server.hub.policies if p != self.group]

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model.path if self.model else None,
            "version": self.version,
            "player": self.player or None,
            "elo": round(self.registry.elo.rating(self.player), 1) if self.player else None,
            "batches": self.batches,
            "agent_steps": self.agent_steps,
            "episodes": self.episodes,
            "error": self.error,
        }
        if self.pool is not None:
            out["pool"] = {
                **self.pool.settings.to_dict(),
                "opponent": self.pool.opponent,
                "swaps": self.pool.swaps,
                "steps_since_swap": self.pool.steps_since_swap,
                "snapshots": len(self.pool.snapshots()),
            }
        return out


class FrozenGroups:
    """Every frozen group of one broker, the inference threads they share, and the Elo table."""

    def __init__(self, server: BrokerServer) -> None:
        self.server = server
        self.groups: dict[str, FrozenGroup] = {}
        self.elo = EloTable()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        from broker.server.team_change import TeamChanges  # it builds on FrozenGroup

        self.team_changes = TeamChanges(self)

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(INFERENCE_THREADS, thread_name_prefix="gdrl-frozen")
        return self._executor

    def start(self) -> None:
        """The ``--frozen`` groups of the config (their files were checked before listening)."""
        for target in self.server.config.frozen:
            group, path = parse_frozen_target(target)
            self.freeze(group, path)
        for target in self.server.config.self_play_pools:
            group, directory = parse_frozen_target(target)
            self.self_play(group, saved_settings(directory))

    def freeze(self, group: str, path: str) -> asyncio.Future[OnnxModel]:
        """Play ``group`` from the model at ``path`` (ControlError if the group has a trainer)."""
        frozen = self._attach(FrozenGroup(self, group, model_path=path))
        return frozen.start_load(path, Path(path).name)

    def self_play(self, group: str, settings: PoolSettings) -> FrozenGroup:
        """Play ``group`` from ``settings.directory``'s snapshots; the same request again is a no-op."""
        existing = self.groups.get(group)
        if existing is not None and existing.pool is not None and existing.pool.settings == settings:
            return existing
        try:
            pool = SnapshotPool(settings)
        except ValueError as exc:
            raise ControlError(str(exc)) from None
        for player, rating in pool.elo.ratings.items():
            self.elo.ratings[player] = rating
            self.elo.games[player] = pool.elo.games.get(player, 0)
        if existing is not None:
            self.unfreeze(group)
        frozen = self._attach(FrozenGroup(self, group, pool=pool))
        frozen._maybe_swap()
        return frozen

    def _attach(self, frozen: FrozenGroup) -> FrozenGroup:
        if frozen.group in self.groups:
            raise ControlError(f"group '{frozen.group}' is already frozen; unfreeze it first")
        try:
            frozen.attach()
        except ProtocolError as exc:
            raise ControlError(exc.message) from None
        self.groups[frozen.group] = frozen
        return frozen

    def unfreeze(self, group: str) -> None:
        frozen = self.groups.pop(group, None)
        if frozen is None:
            raise ControlError(f"group '{group}' is not frozen")
        frozen.detach()
        log.info("group unfrozen", group=group)

    async def control(self, request: Control) -> dict[str, Any]:
        """Carry out a control request; ControlError says why it cannot be."""
        args = request.args
        if request.command == "freeze":
            group, path = _text(args, "group"), _text(args, "path")
            try:
                await self.freeze(group, path)
            except ModelError as exc:
                self.unfreeze(group)
                raise ControlError(str(exc)) from None
            return {"frozen": {group: self.groups[group].status()}}
        if request.command == "unfreeze":
            self.unfreeze(_text(args, "group"))
            return {"unfrozen": _text(args, "group")}
        if request.command == "self_play":
            group = _text(args, "group")
            learner = _text(args, "learner")
            self._check_same_spaces(group, learner)
            try:
                settings = PoolSettings(
                    directory=_text(args, "pool"),
                    learner=learner,
                    window=int(args.get("window", 10)),
                    play_latest=float(args.get("play_latest", 0.5)),
                    swap_every=int(args.get("swap_every", 2000)),
                    seed=int(args.get("seed", 0)),
                )
                settings.validate()
            except (TypeError, ValueError) as exc:
                raise ControlError(f"self_play: {exc}") from None
            frozen = self.self_play(group, settings)
            return {"frozen": {group: frozen.status()}}
        if request.command == "team_change":
            return await self.team_changes.control(args)
        raise ControlError(f"unknown control command {request.command!r} (freeze, unfreeze, self_play, team_change)")

    def _check_same_spaces(self, group: str, learner: str) -> None:
        policies = self.server.hub.policies
        if group in policies and learner in policies:
            mine, theirs = policies[learner].spaces, policies[group].spaces
            if mine != theirs:
                raise ControlError(
                    f"self-play needs the same spaces: '{learner}' and '{group}' differ: "
                    + theirs.describe_difference(mine)
                )

    def shutdown(self) -> None:
        self.team_changes.save()
        for group in list(self.groups):
            self.groups.pop(group).detach()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def status(self) -> dict[str, Any]:
        return {group: frozen.status() for group, frozen in self.groups.items()}


def _text(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value:
        raise ControlError(f"control request needs '{key}' (a non-empty string)")
    return value


ERROR_CODE = ErrorCode.BAD_CONTROL
