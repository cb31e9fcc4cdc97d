"""The godot_rl-trainer dialer: the broker connects to godot_rl training scripts and serves each one
policy, as if it were a game.

``GodotRlTrainerConnector`` keeps a connection to one godot_rl training script per policy, retrying with
backoff; its ``GodotRlTrainerLink`` (the asyncio side around the sans-IO ``broker.legacy.godot_rl_trainer``
session) registers with the hub as that policy's trainer while it is connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING, Any

import structlog

from broker.core.sessions import TrainerSession
from broker.legacy.godot_rl_trainer import (
    ActionRequest,
    CallRequest,
    CloseRequest,
    EnvInfoRequest,
    GodotRlTrainer,
    ResetRequest,
    TrainerRequest,
)
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode, ProtocolError
from broker.protocol.messages import (
    Batch,
    Close,
    Error,
    Hello,
    Message,
    PolicyInfo,
    StepOptions,
    TrainerAct,
    TrainerReset,
    Waiting,
    Welcome,
)

if TYPE_CHECKING:
    from broker.server.server import BrokerServer

log = structlog.get_logger("gdrl.legacy")  # the godot_rl adapters' events, wherever they run


class GodotRlTrainerLink(asyncio.Protocol):
    """One connection to a godot_rl script; the hub's ``Link`` for that policy's trainer."""

    def __init__(self, connector: GodotRlTrainerConnector) -> None:
        self.connector = connector
        self.server = connector.server
        self.policy = connector.policy
        self.label = f"godot_rl trainer {connector.host}:{connector.port}"
        self.session = GodotRlTrainer(connector.policy, connector.server.config.max_frame_bytes)
        self.trainer: TrainerSession | None = None
        self.transport: asyncio.Transport | None = None
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closing = False
        self._open_step: int | None = None
        self._last_waiting = ""

    @property
    def link_kind(self) -> str:
        return "godot_rl script"

    # --- asyncio callbacks -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        log.info("connected to godot_rl trainer", peer=self.label, policy=self.policy)

    def data_received(self, data: bytes) -> None:
        self.session.receive_data(data)
        try:
            while not self.closing:
                request = self.session.next_event()
                if request is None:
                    break
                self._handle(request)
        except ProtocolError as exc:
            self.close(Error(exc.code.value, exc.message))
        except Exception as exc:  # a bug must cost this connection, not the broker
            log.exception("internal error", peer=self.label)
            self.close(Error(ErrorCode.INTERNAL.value, str(exc)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self.trainer is not None:
            self.server.leave(self)
        log.info("godot_rl trainer disconnected", peer=self.label, policy=self.policy, reason=str(exc or "closed"))
        if not self.finished.done():
            self.finished.set_result(None)

    # --- the script's requests -------------------------------------------------------------------

    def _handle(self, request: TrainerRequest) -> None:
        if isinstance(request, EnvInfoRequest):
            hello = Hello("trainer", PROTOCOL_VERSION, self.label, policy=self.policy, stepping=self._stepping())
            self.server.enter(self, hello)  # may answer with PolicyInfo right away
            trainer = self.server.hub.session(self)
            self.trainer = trainer if isinstance(trainer, TrainerSession) else None
        elif isinstance(request, ResetRequest):
            self.server.enter(self, TrainerReset())
        elif isinstance(request, ActionRequest):
            assert self._open_step is not None
            self.server.enter(self, TrainerAct(self._open_step, request.actions))
        elif isinstance(request, CallRequest):
            self.connector.server.godot_rl_calls.call(self, self.policy, request.method)
        elif isinstance(request, CloseRequest):
            log.info("godot_rl trainer said close", peer=self.label, policy=self.policy)
            self.close()

    def _stepping(self) -> StepOptions:
        """Lock-step for a godot_rl script's policy, as godot_rl itself steps: its SB3 knows nothing of held
        ticks (``frames``) and has no fresh start after an update, so under hold most of its transitions
        would span many ticks (docs/migration.md). ``--deadline-ms`` still bounds the wait, then holds."""
        config = self.connector.server.config
        return StepOptions("barrier", config.deadline_ms, config.hold_action)

    def call_answered(self, returns: list[Any]) -> None:
        """The relayed ``call``'s answer (``GodotRlCalls``)."""
        if not self.closing and self.transport is not None:
            self.transport.write(self.session.call_reply(returns))

    # --- Link, as the hub sees us ----------------------------------------------------------------

    def send(self, message: Message) -> None:
        if self.closing or self.transport is None:
            return
        try:
            self._send(message)
        except ProtocolError as exc:  # ours: cost this connection, never the hub's caller
            self.close(Error(exc.code.value, exc.message))

    def _send(self, message: Message) -> None:
        assert self.transport is not None
        if isinstance(message, PolicyInfo):
            try:
                reply = self.session.env_info_reply(message)
            except ValueError as exc:
                self.close(Error(ErrorCode.NOT_SUPPORTED.value, str(exc)))
                return
            log.info("serving godot_rl trainer", peer=self.label, policy=self.policy, n_agents=message.n_envs)
            self.transport.write(reply)
        elif isinstance(message, Batch):
            self._open_step = message.step
            self.transport.write(self.session.batch_reply(message))
        elif isinstance(message, Waiting):
            if message.reason != self._last_waiting:  # every step waits for game steps; say only what is new
                self._last_waiting = message.reason
                log.info(message.reason, peer=self.label, policy=self.policy)
        elif isinstance(message, (Error, Close)):
            self.close(message)
        elif not isinstance(message, Welcome):
            log.warning("message not meant for a trainer", peer=self.label, type=message.TYPE)

    def close(self, error: Error | Close | None = None) -> None:
        if self.closing:
            return
        self.closing = True
        if isinstance(error, Error):
            log.warning("godot_rl trainer connection failed", peer=self.label, code=error.code, error=error.message)
        if self.transport is not None:
            self.transport.close()


class GodotRlTrainerConnector:
    """Serve ``policy`` to the godot_rl script at ``host:port``: connect, reconnect, back off."""

    def __init__(
        self,
        server: BrokerServer,
        policy: str,
        host: str,
        port: int,
        *,
        retry_initial: float = 0.2,
        retry_max: float = 5.0,
    ) -> None:
        self.server = server
        self.policy = policy
        self.host = host
        self.port = port
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.link: GodotRlTrainerLink | None = None
        self.connections = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"godot_rl trainer {self.policy}")
        self._task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("godot_rl trainer connector failed", policy=self.policy, error=repr(task.exception()))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        delay = self.retry_initial
        told = False
        while True:
            try:
                _, link = await loop.create_connection(lambda: GodotRlTrainerLink(self), self.host, self.port)
            except OSError as exc:
                if not told:
                    log.info("waiting for godot_rl trainer", policy=self.policy, address=f"{self.host}:{self.port}")
                    told = True
                log.debug("godot_rl trainer not reachable", policy=self.policy, error=str(exc), retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max)
                continue
            self.link = link
            self.connections += 1
            delay, told = self.retry_initial, False
            await link.finished
            self.link = None
            await asyncio.sleep(self.retry_initial)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.link is not None:
            self.link.close()


def parse_trainer_target(text: str) -> tuple[str, str, int]:
    """``POLICY=HOST:PORT`` (or ``POLICY=PORT`` for loopback) -> (policy, host, port)."""
    policy, sep, address = text.partition("=")
    host, colon, port = address.rpartition(":")
    if not sep or not policy or not port.isdigit():
        raise ValueError(f"--godot-rl-trainer expects POLICY=HOST:PORT, got {text!r}")
    return policy, (host.strip("[]") if colon else "") or "127.0.0.1", int(port)
