"""The broker inside another program's process: a ``BrokerServer`` on its own event loop in a background
thread (games still connect over its port), and trainers attached to its hub without a socket.

``attach_trainer(server_thread, hello)`` gives a blocking handle for any thread: ``send`` hands a message
to the loop's thread, ``recv`` waits on a bounded inbox, ``close`` leaves. The hub sees an ordinary
trainer whose link is that inbox. Peers use these through ``clients.inprocess.InProcessBroker``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from broker.protocol.errors import ErrorCode, ProtocolError
from broker.protocol.messages import Close, Error, Hello, Message, TrainerAct, TrainerReset
from broker.server.config import ServerConfig
from broker.server.server import BrokerServer, new_event_loop

INBOX_LIMIT = 64  # messages queued for one in-process trainer; lock-step needs a handful
CALL_TIMEOUT_S = 30.0  # a call onto the loop that takes longer means the loop is stuck

T = TypeVar("T")


class ServerThread:
    """A ``BrokerServer`` listening from a daemon thread of this process; ``close()`` shuts it down."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.server = BrokerServer(config)
        self.loop = new_event_loop()
        self.closed = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gdrl-broker", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

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

    @property
    def native_id(self) -> int | None:
        """The OS id of the broker's thread (benchmarks count its CPU time apart from the trainer's)."""
        return self._thread.native_id

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the broker's loop and return its result (or raise its error)."""

        async def run() -> T:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=CALL_TIMEOUT_S)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        asyncio.run_coroutine_threadsafe(self.server.shutdown(), self.loop).result(
            timeout=self.config.timeout_shutdown + 5
        )
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class _HubSide:
    """The hub's link to an in-process trainer (used on the broker's loop only)."""

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


class InProcessTrainer:
    """A trainer attached to the hub of a ``ServerThread``; its methods are called from the trainer's thread.

    ``recv`` returns every message the hub sent, ``welcome`` first; the hub's last word is an ``error`` or
    ``close`` message, after which ``closed`` is true."""

    def __init__(self, server: ServerThread, hello: Hello) -> None:
        self._server = server
        self._side = _HubSide(hello.name)
        self._left = False

        server.call(server.server.enter, self._side, hello)  # a refusal raises its ProtocolError here

    @property
    def closed(self) -> bool:
        """The hub closed this trainer, or the trainer left."""
        return self._left or self._side.closed

    def send(self, message: Message) -> None:
        """Hand ``message`` (``act`` or ``reset``) to the hub; a bad one closes the trainer with its error."""
        self._server.loop.call_soon_threadsafe(self._deliver, message)

    def _deliver(self, message: Message) -> None:
        if self._side.closed or not isinstance(message, (TrainerAct, TrainerReset)):
            return
        try:
            self._server.server.enter(self._side, message)
        except ProtocolError as exc:
            self._server.server.leave(self._side)
            self._side.close(Error(exc.code.value, exc.message))

    def recv(self) -> Message:
        """The next message from the hub (blocks)."""
        return self._side.inbox.get()

    def close(self) -> None:
        """Leave the hub: the policy's open batch waits for its next trainer."""
        if self._left:
            return
        self._left = True
        if not self._server.closed:
            self._server.loop.call_soon_threadsafe(self._server.server.leave, self._side)


def attach_trainer(server: ServerThread, hello: Hello) -> InProcessTrainer:
    """Attach a trainer saying ``hello`` to ``server``'s hub, as if it had connected; a refusal raises
    the hub's ``ProtocolError`` (``unknown_policy``, ``policy_taken``, ``auth_failed``, ...)."""
    return InProcessTrainer(server, hello)
