from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from clients.inprocess import InProcessBroker


@pytest.fixture
def inprocess_broker() -> Iterator[Callable[..., InProcessBroker]]:
    """Factory: ``inprocess_broker(expected_games=2)`` starts a broker on a free loopback port."""
    made: list[InProcessBroker] = []

    def make(**overrides: Any) -> InProcessBroker:
        broker = InProcessBroker(**{"status_interval": 0, **overrides})
        made.append(broker)
        return broker

    yield make
    for broker in made:
        broker.close()
