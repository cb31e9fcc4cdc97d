"""The broker inside another program's process: a ``BrokerServer`` whose event loop is run by the thread
that needs it (games still connect over its port), and trainers attached to its hub without a socket.

``attach_trainer(server_thread, hello)`` gives a blocking handle for any thread: ``send`` hands a message
to the hub, ``recv`` returns the next message the hub sent, ``close`` leaves. The hub sees an ordinary
trainer whose link is a bounded inbox. Peers use these through ``clients.inprocess.InProcessBroker``.

Who runs the loop is chosen when the server starts, from ``local_trainers``, the number of trainers the
program will attach here:

* **One** (the default; a single SB3 model, as godot_rl users train): the trainer waiting in ``recv`` runs the
  loop on its own thread until the hub has sent it a message, so a game's step reaches the policy with no
  thread hop (as in godot_rl); its actions go to the hub on its thread too, within ``send``. One thread runs
  the loop at a time (the *driver*). While no trainer waits (between rollouts, during a policy update) the
  ``ServerThread``'s own daemon thread runs the loop, once it has been idle for ``FALLBACK_GRACE_S``, and
  hands it back to the next trainer that waits; so games, hold
  deadlines and new connections are served at most that much later than by a loop on a thread of its own.
  The loop is the standard asyncio one, since it is started and stopped every step, which costs more with
  uvloop (docs/performance_history.md, "Eighth round"). Should more trainers attach after all, the daemon thread runs
  the loop for all of them (one thread hop each way), since handing it between their threads costs more.
  A trainer whose thread already runs another event loop (a notebook) cannot run this one: its ``recv`` has
  the daemon thread run it and waits on its inbox, one thread hop as before.
* **None or several** (several policies trained in one process, or the broker serving trainers over
  sockets only): the daemon thread runs a uvloop loop the whole time, as ``gdrl-broker serve`` does, and each
  trainer hands its actions to it and waits on its inbox (one thread hop each way).
"""

from __future__ import annotations

import asyncio
import os
import queue
import selectors
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from broker.protocol.errors import ErrorCode, ProtocolError
from broker.protocol.messages import Close, Error, Hello, Message, TrainerAct, TrainerReset
from broker.server.config import ServerConfig
from broker.server.server import BrokerServer, new_event_loop
from broker.tuning import SPIN_WAIT_S, SpinBudget

INBOX_LIMIT = 64  # messages queued for one in-process trainer; lock-step needs a handful
CALL_TIMEOUT_S = 30.0  # a call onto the loop that takes longer means the loop is stuck
# How long the loop may go unrun before the daemon thread runs it: longer than a policy's step between
# step_wait calls (so a stepping trainer keeps the loop), short against hold deadlines (20-100 ms).
FALLBACK_GRACE_S = 0.005

T = TypeVar("T")


class _Wake:
    """Put into a waiting trainer's inbox when the loop is free for it to run (never returned by recv)."""


WAKE = _Wake()


class SpinningSelector(selectors.DefaultSelector):
    """The selector of the loop a waiting trainer runs on its own thread: its first wait is for the games' next
    step, which a wait that polls for a while (``SpinBudget``, as the clients' sockets wait) takes without a
    wake-up; then it sleeps as usual."""

    def __init__(self, spin_s: float = SPIN_WAIT_S, polls: bool = True) -> None:
        super().__init__()
        self.budget = SpinBudget(spin_s)
        self.polls = polls  # set by the loop's runner: off, every select sleeps at once

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self.polls and (timeout is None or timeout > 0):
            spin_s = self.budget.next_spin()
            if spin_s:
                started = time.perf_counter()
                until = started + (spin_s if timeout is None else min(spin_s, timeout))
                while True:
                    ready = super().select(0)
                    if ready:
                        self.budget.found()
                        return ready
                    if time.perf_counter() >= until:
                        break
                    os.sched_yield()
                self.budget.missed()
                if timeout is not None:
                    timeout = max(0.0, timeout - (time.perf_counter() - started))
        return super().select(timeout)


class ServerThread:
    """A ``BrokerServer`` listening in this process; its loop is run by waiting trainers, else by a daemon
    thread; ``close()`` shuts it down."""

    def __init__(self, config: ServerConfig, local_trainers: int = 1) -> None:
        self.trainers_drive = local_trainers == 1
        # The loop polls for a while before it sleeps (spinning.py), as the clients' sockets wait, only while a
        # trainer waiting for its batch runs it: the daemon thread runs it beside trainer threads that need the GIL
        # its polling would hold (measured 0.90x with 4 games when it polled).
        if not self.trainers_drive:
            config = replace(config, spin_wait_s=0.0)  # the daemon thread alone runs it: no LoopSpinner
        self._selector = SpinningSelector(config.spin_wait_s, polls=False) if self.trainers_drive else None
        self.config = config
        self.server = BrokerServer(config)
        # A trainer here may run the loop only when one is expected (the module's docstring says why): then the
        # standard loop, which starts and stops cheaply every step (a uvloop run also sets up signal handling
        # on the main thread each time); else uvloop, run by the daemon thread alone.
        self.loop = asyncio.SelectorEventLoop(self._selector) if self._selector is not None else new_event_loop()
        self.closed = False
        # Guards the fields below. Its lock is taken directly where nobody waits or is notified (claim, release:
        # every step): the lock's own context manager is C, the Condition's a Python method.
        self._lock = threading.Lock()
        self._state = threading.Condition(self._lock)
        self._driver: object | None = self  # who runs the loop: a trainer's _HubSide, self (daemon), None
        self._idle_since = time.monotonic()
        self._waiters: list[_HubSide] = []  # trainers blocked on their inbox while another drives
        self._hop_wanted = 0  # trainers that cannot run the loop and wait for the daemon to run it
        self._stop_asked = False  # loop.stop() was called in this run (uvloop queues it: once per run)
        self._stopping = False
        self._sides: list[_HubSide] = []
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
        finally:
            self.release(self)
        self._ready.set()
        while self._claim_for_daemon():
            try:
                self.run_loop()  # until a trainer wants to run it, or closing
            finally:
                self.release(self)

    def _claim_for_daemon(self) -> bool:
        """Wait until the loop needs the daemon thread (idle for the grace, or a trainer cannot run it) and
        claim it; False once closing."""
        with self._state:
            while not self._stopping:
                if self._driver is None:
                    idle = time.monotonic() - self._idle_since
                    if self._hop_wanted or idle >= FALLBACK_GRACE_S or not self.trainers_drive:
                        self._driver = self
                        return True
                    self._state.wait(FALLBACK_GRACE_S - idle)
                else:
                    self._state.wait(FALLBACK_GRACE_S)
            return False

    # --- who runs the loop (called from any thread) -------------------------------------------------

    def claim(self, side: _HubSide, wait: bool) -> bool:
        """Make ``side``'s thread the one running the loop, if nobody does. Otherwise, with ``wait``,
        register ``side`` for a WAKE when the loop is free, and ask the daemon thread to hand it over. Never
        when the daemon thread alone runs the loop."""
        if not self.trainers_drive:
            return False
        with self._lock:
            if self._driver is None:
                self._driver = side
                return True
            if wait:
                self._waiters.append(side)
                if self._driver is self:
                    self.loop.call_soon_threadsafe(self._end_daemon_run)  # then it releases: WAKE
            return False

    def release(self, driver: object) -> None:
        """``driver`` stopped running the loop: wake the trainers waiting to run it."""
        with self._lock:
            if self._driver is not driver:
                return
            self._driver = None
            self._idle_since = time.monotonic()
            waiters, self._waiters = self._waiters, []
            if self._hop_wanted or self._stopping:
                self._state.notify_all()
        for side in waiters:
            side.inbox.put_nowait(WAKE)

    def want_daemon(self, delta: int) -> None:
        """A trainer that cannot run the loop starts (+1) or stops (-1) waiting for the daemon to run it."""
        with self._state:
            self._hop_wanted += delta
            if self._driver is None:  # else the daemon runs the loop, or will claim it when it is released
                self._state.notify_all()

    def run_loop(self, polls: bool = False) -> None:
        """Run the loop on this thread (its driver's) until ``stop_run``; ``polls``: a trainer waits in it."""
        if self._selector is not None:
            self._selector.polls = polls
        self._stop_asked = False
        self.loop.run_forever()

    def run_here(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` now, on this thread, as a callback of the loop (the caller has claimed it; it is
        not running). A step's actions thus reach the games before ``step_wait`` runs the loop, which then
        starts by waiting for the games' answer instead of polling once for this callback. With another
        loop running on this thread (a notebook) the callback is queued for the next run instead."""
        if asyncio._get_running_loop() is not None:
            self.loop.call_soon(fn, *args)
            return
        asyncio._set_running_loop(self.loop)  # what the loop's own run sets: the hub's effects may ask for it
        try:
            fn(*args)
        finally:
            asyncio._set_running_loop(None)

    def stop_run(self) -> None:
        """End the current run (on the loop). uvloop's stop is a queued callback: a second one would be left
        over and end the next run at once, so it is asked once per run."""
        if not self._stop_asked:
            self._stop_asked = True
            self.loop.stop()

    def _end_daemon_run(self) -> None:
        if self._driver is self and not self._hop_wanted:
            self.stop_run()

    def can_run_loop(self) -> bool:
        """This thread may run the loop: trainers may, it is open, no other event loop runs on this thread,
        and it is the only trainer attached. With several, the daemon thread runs the loop for all of them:
        handing it from one trainer's thread to the next every step (wake-ups, a restart of the loop, the GIL
        passed back and forth) costs more than the one thread hop (docs/performance_history.md, "Fifth round")."""
        if not self.trainers_drive or self.loop.is_closed() or self._stopping or len(self._sides) > 1:
            return False
        return asyncio._get_running_loop() is None

    # --- the server's public handle -----------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.server.port}"

    @property
    def native_id(self) -> int | None:
        """The OS id of the daemon thread (it runs the loop only while no trainer waits for a message)."""
        return self._thread.native_id

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the broker's loop and return its result (or raise its error)."""

        async def run() -> T:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=CALL_TIMEOUT_S)

    def attach(self, side: _HubSide, hello: Hello) -> None:
        self.call(self.server.enter, side, hello)  # a refusal raises its ProtocolError here
        with self._state:
            self._sides.append(side)

    def detach(self, side: _HubSide) -> None:
        with self._state:
            if side in self._sides:
                self._sides.remove(side)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        asyncio.run_coroutine_threadsafe(self.server.shutdown(), self.loop).result(
            timeout=self.config.timeout_shutdown + 5
        )
        # In-process trainers still attached learn why, and stop running the loop.
        self.call(self._close_sides, Error(ErrorCode.SHUTTING_DOWN.value, "broker shutting down"))
        with self._state:
            self._stopping = True
            self._state.notify_all()
        self.loop.call_soon_threadsafe(self._stop_daemon_run)
        self._thread.join(timeout=10)
        with self._state:
            while self._driver is not None:  # a trainer leaves the loop once its inbox holds the error
                self._state.wait(0.05)
            self._driver = self
        self.loop.close()
        for side in self._sides:
            side.inbox.put_nowait(WAKE)  # a trainer registered as a waiter re-checks and finds the loop closed

    def _close_sides(self, error: Error) -> None:
        for side in self._sides:
            side.close(error)

    def _stop_daemon_run(self) -> None:
        if self._driver is self:
            self.stop_run()


class _HubSide:
    """The hub's link to an in-process trainer (``send`` and ``close`` run on whichever thread runs the
    loop); ``driving`` is true while the trainer's own thread runs the loop waiting for a message."""

    def __init__(self, label: str, server: ServerThread) -> None:
        self.label = label
        self.server = server
        # SimpleQueue (C, one lock) wakes the trainer thread several times faster than queue.Queue (a
        # Condition in Python); its bound is kept here: only this loop-side object puts messages into it.
        self.inbox: queue.SimpleQueue[Message | _Wake] = queue.SimpleQueue()
        self.closed = False
        self.driving = False

    @property
    def link_kind(self) -> str:
        return "in-process"

    def send(self, message: Message) -> None:
        if self.closed:
            return
        if self.inbox.qsize() >= INBOX_LIMIT:  # WAKEs count too: at most one per wait for the loop
            self.close(Error(ErrorCode.SLOW_PEER.value, "in-process trainer is not reading"))
            return
        self._put(message)

    def close(self, error: Error | Close | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self._put(error or Close("closed by the broker"))  # one past the bound: why it stopped

    def _put(self, message: Message) -> None:
        self.inbox.put_nowait(message)
        if self.driving:  # the trainer's thread runs the loop for this message: it has it now
            self.server.stop_run()


class InProcessTrainer:
    """A trainer attached to the hub of a ``ServerThread``; its methods are called from the trainer's thread.

    ``recv`` returns every message the hub sent, ``welcome`` first; the hub's last word is an ``error`` or
    ``close`` message, after which ``closed`` is true."""

    def __init__(self, server: ServerThread, hello: Hello) -> None:
        self._server = server
        self._side = _HubSide(hello.name, server)
        self._left = False
        server.attach(self._side, hello)

    @property
    def closed(self) -> bool:
        """The hub closed this trainer, or the trainer left."""
        return self._left or self._side.closed

    def send(self, message: Message) -> None:
        """Hand ``message`` (``act`` or ``reset``) to the hub; a bad one closes the trainer with its error."""
        server = self._server
        if server.loop.is_closed():
            return
        if not server.trainers_drive:  # the daemon thread runs the loop all the time
            server.loop.call_soon_threadsafe(self._deliver, message)
        elif server.claim(self._side, wait=False):  # nobody runs the loop: this thread may act as it
            try:
                server.run_here(self._deliver, message)
            finally:
                server.release(self._side)
        else:
            server.loop.call_soon_threadsafe(self._deliver, message)

    def _deliver(self, message: Message) -> None:
        if self._side.closed or not isinstance(message, (TrainerAct, TrainerReset)):
            return
        try:
            self._server.server.enter(self._side, message)
        except ProtocolError as exc:
            self._server.server.leave(self._side)
            self._side.close(Error(exc.code.value, exc.message))

    def recv(self) -> Message:
        """The next message from the hub (blocks), running the broker's loop on this thread meanwhile
        when no other thread does."""
        side, server = self._side, self._server
        while True:
            message = self._take(block=False)
            if message is not None:
                return message
            if not server.can_run_loop():
                if server.loop.is_closed():
                    return Close("the in-process broker is closed")
                if not server.trainers_drive:
                    return self._recv_from_inbox()
                return self._recv_from_daemon()
            if server.claim(side, wait=True):
                try:
                    message = self._run_loop_for_message()
                finally:
                    server.release(side)
                if message is not None:
                    return message
            else:
                message = self._take(block=True)  # a message, or None: the loop is free to run
                if message is not None:
                    return message

    def _run_loop_for_message(self) -> Message | None:
        side = self._side
        side.driving = True
        try:
            if side.inbox.empty():  # else a message came between the look and the claim
                self._server.run_loop(polls=True)  # until side._put stops it, or the broker closes
        finally:
            side.driving = False
        return self._take(block=False)

    def _recv_from_daemon(self) -> Message:
        self._server.want_daemon(+1)
        try:
            return self._recv_from_inbox()
        finally:
            self._server.want_daemon(-1)

    def _recv_from_inbox(self) -> Message:
        while True:
            message = self._take(block=True)
            if message is not None:
                return message
            if self._server.loop.is_closed():
                return Close("the in-process broker is closed")

    def _take(self, block: bool) -> Message | None:
        """The next message in the inbox, skipping WAKEs; None if there is none (not blocking) or on a WAKE."""
        inbox = self._side.inbox
        while True:
            if not block and inbox.empty():  # the usual case: no exception raised and caught
                return None
            try:
                item = inbox.get(block)
            except queue.Empty:
                return None
            if isinstance(item, _Wake):
                if block:
                    return None
                continue
            return item

    def close(self) -> None:
        """Leave the hub: the policy's open batch waits for its next trainer."""
        if self._left:
            return
        self._left = True
        self._server.detach(self._side)
        if not self._server.closed:
            self._server.loop.call_soon_threadsafe(self._server.server.leave, self._side)


def attach_trainer(server: ServerThread, hello: Hello) -> InProcessTrainer:
    """Attach a trainer saying ``hello`` to ``server``'s hub, as if it had connected; a refusal raises
    the hub's ``ProtocolError`` (``unknown_policy``, ``policy_taken``, ``auth_failed``, ...)."""
    return InProcessTrainer(server, hello)
