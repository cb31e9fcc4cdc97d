"""The broker's uvloop loop polls for a while before it sleeps, as the clients' sockets wait (broker/tuning.py).

Asleep in ``epoll_wait``, the loop costs each peer's write a wake-up; polling for a while first (``SpinBudget``)
takes a message that comes soon without one. uvloop takes no selector, so ``LoopSpinner`` keeps a callback
ready instead. Compiled (broker/compiled.py): every read calls it. The standard loop an in-process trainer runs
on its own thread polls through its selector (``SpinningSelector``, inprocess.py).
"""

from __future__ import annotations

import asyncio
import os
import time

from broker.tuning import SPIN_WAIT_S, SpinBudget


class LoopSpinner:
    """Keeps the daemon's uvloop loop polling instead of sleeping for a while after each message, for the
    next one: the loop has a callback ready, so it polls with a zero timeout, and the callback yields the core
    meanwhile. Started by each read (``PeerProtocol.buffer_updated``), stopped when ``SpinBudget``'s time has
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
