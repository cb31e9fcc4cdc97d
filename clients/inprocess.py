"""The broker inside the trainer's own process: the daemon runs on a background thread, games still
connect over its port, and trainers here exchange messages with the hub through queues, no socket."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

from broker.core.hub import TrainerSession
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode, ProtocolError
from broker.protocol.messages import Close, Error, Hello, Message, StepOptions, TrainerAct, TrainerReset, Welcome
from broker.server.config import ServerConfig
from broker.server.server import BrokerServer, new_event_loop
from clients.errors import BrokerError
from clients.vec_env import BrokerVecEnv

INBOX_LIMIT = 64  # messages queued for one in-process trainer; lock-step needs a handful


class InProcessBroker:
    """``with InProcessBroker(expected_games=2) as broker: env = broker.vec_env("player")``."""

    def __init__(self, config: ServerConfig | None = None, **overrides: Any) -> None:
        self.config = config or ServerConfig(**{"port": 0, **overrides})
        self.server = BrokerServer(self.config)
        self.loop = new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gdrl-broker", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        self.closed = False

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.close()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.server.port}"

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the broker's loop and return its result (or raise its error)."""

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=30)

    def vec_env(self, policy: str, name: str = "", stepping: StepOptions | None = None) -> BrokerVecEnv:
        link = InProcessTrainerLink(self, policy, name or f"in-process[{policy}]", stepping)
        return BrokerVecEnv(policy, link=link)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        asyncio.run_coroutine_threadsafe(self.server.shutdown(), self.loop).result(
            timeout=self.config.timeout_shutdown + 5
        )
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> InProcessBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LoopSide:
    """The hub's view of an in-process trainer (lives on the broker's loop)."""

    def __init__(self, label: str) -> None:
        self.label = label
        # SimpleQueue (C, one lock) wakes the trainer thread several times faster than queue.Queue (a
        # Condition in Python); its bound is kept here: only this loop-side object puts into it.
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.closed = False

    def send(self, message: Message) -> None:
        if self.closed:
            return
        if self.inbox.qsize() >= INBOX_LIMIT:
            self.close(Error(ErrorCode.SLOW_PEER.value, "in-process trainer is not reading"))
            return
        self.inbox.put_nowait(message)

    def close(self, error: Error | Close | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self.inbox.put_nowait(error or Close("closed by the broker"))  # one past the bound: why it stopped


class InProcessTrainerLink:
    """The VecEnv's side: ``send`` hands messages to the hub's thread, ``recv`` reads the inbox."""

    def __init__(self, broker: InProcessBroker, policy: str, name: str, stepping: StepOptions | None = None) -> None:
        self.broker = broker
        self.side = _LoopSide(name)
        self.closed = False
        hello = Hello("trainer", PROTOCOL_VERSION, name, broker.config.token, policy=policy, stepping=stepping)

        def join() -> TrainerSession:
            return broker.server.hub.add_trainer(self.side, hello)

        try:
            self.session: TrainerSession = broker.call(join)
        except ProtocolError as exc:
            raise BrokerError(exc.code.value, exc.message) from exc

    def send(self, message: Message) -> None:
        if self.closed or self.side.closed:
            raise BrokerError("closed", "in-process trainer link is closed")
        self.broker.loop.call_soon_threadsafe(self._deliver, message)

    def _deliver(self, message: Message) -> None:
        hub = self.broker.server.hub
        try:
            if isinstance(message, TrainerAct):
                hub.trainer_act(self.session, message)
            elif isinstance(message, TrainerReset):
                hub.trainer_reset(self.session)
        except ProtocolError as exc:
            hub.remove_trainer(self.session)
            self.side.close(Error(exc.code.value, exc.message))

    def recv(self) -> Message:
        while True:
            message = self.side.inbox.get()
            if isinstance(message, Welcome):
                continue
            if isinstance(message, Error):
                raise BrokerError(message.code, message.message)
            if isinstance(message, Close):
                raise BrokerError("closed", message.reason)
            return message

    def close(self, reason: str = "") -> None:
        if self.closed:
            return
        self.closed = True
        if not self.broker.closed:
            self.broker.loop.call_soon_threadsafe(self.broker.server.hub.remove_trainer, self.session)
