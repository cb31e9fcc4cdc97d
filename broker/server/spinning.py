"""Event loops that poll for a while before they sleep, as the clients' sockets wait (broker/tuning.py).

``SpinningSelector``: for the event loop an in-process trainer runs on its own thread.

The trainer's thread, waiting in ``step_wait``, runs the broker's loop until its batch is in (inprocess.py);
that loop's first wait is for the games' next step. Asleep in ``epoll_wait``, the loop costs each game's write
a wake-up; polling for a while first (``SpinBudget``, broker/tuning.py: the clients' sockets wait the same
way) takes a step that comes soon without one. The standard loop takes any selector; uvloop takes none, so
``LoopSpinner`` keeps a uvloop loop (the daemon's, the in-process daemon thread's) polling instead.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import time

from broker.tuning import SPIN_WAIT_S, SpinBudget


class SpinningSelector(selectors.DefaultSelector):
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


class LoopSpinner:
    """Keeps the daemon's uvloop loop polling instead of sleeping for a while after each message, for the
    next one: the loop has a callback ready, so it polls with a zero timeout, and the callback yields the core
    meanwhile. Started by each read (``PeerProtocol.data_received``), stopped when ``SpinBudget``'s time has
    passed without one; its misses make the next waits sleep at once, as for the clients."""

    def __init__(self, loop: asyncio.AbstractEventLoop, spin_s: float = SPIN_WAIT_S) -> None:
        self.loop = loop
        self.budget = SpinBudget(spin_s)
        self.until = 0.0
        self.spinning = False

    def message_came(self) -> None:
        if self.spinning:
            self.budget.found()
        spin_s = self.budget.next_spin()
        if not spin_s:
            return
        self.until = time.perf_counter() + spin_s
        if not self.spinning:
            self.spinning = True
            self.loop.call_soon(self._spin)

    def _spin(self) -> None:
        if time.perf_counter() >= self.until:
            self.spinning = False
            self.budget.missed()
            return
        os.sched_yield()
        self.loop.call_soon(self._spin)
