"""The hub's names as callers import them today (server, legacy edge, in-process link, tests).

``Hub`` here is the link driver (broker/core/link_driver.py): the sans-IO hub (broker/core/flow.py)
with today's method API carried out on links. Servers that apply effects themselves use
``broker.core.flow.Hub`` directly; then this module goes.
"""

from __future__ import annotations

from broker.core.batching import UnencodableMessage
from broker.core.holding import IDLE_TICK_S, ROUND_WAIT_CAP_S, STALL_REPORT_S, Stall
from broker.core.link_driver import Link, LinkHub, Scheduler
from broker.core.sessions import GameSession, PolicyState, Slot, TrainerSession

Hub = LinkHub

__all__ = [
    "IDLE_TICK_S",
    "ROUND_WAIT_CAP_S",
    "STALL_REPORT_S",
    "GameSession",
    "Hub",
    "Link",
    "LinkHub",
    "PolicyState",
    "Scheduler",
    "Slot",
    "Stall",
    "TrainerSession",
    "UnencodableMessage",
]
