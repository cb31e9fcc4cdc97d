"""A blocking sampler session (docs/protocol.md, section 4a): claim games on a broker, then step every
policy of them. The building block of clients/rllib_env.py, free of Ray.

``SamplerLink(address, claim_games=2)`` connects (retrying while the broker is not up or has too few free
games), asks for every policy's batch and returns once it knows each policy's layout; ``wait()`` blocks
until every policy has a batch to answer, ``act(policy, actions)`` answers one.
"""

from __future__ import annotations

import time
from typing import Final

import numpy as np
import structlog

from broker.protocol import DEFAULT_ADDRESS, PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode
from broker.protocol.messages import (
    ALL_GAMES,
    Batch,
    Hello,
    PolicyInfo,
    StepOptions,
    TrainerAct,
    TrainerReset,
    Waiting,
)
from clients.errors import BrokerError
from clients.transport import MAX_BACKOFF, Address, PeerSocket, default_name

# Answers that mean "not yet": no broker listening yet, or its games are not all up (or not released yet
# by a sampler that just died: the broker notices a lost connection a moment later).
RETRIED_CLAIMS: Final = frozenset({"connect_failed", ErrorCode.NO_FREE_GAME.value, ErrorCode.BROKER_FULL.value})
DEFAULT_TIMEOUT_CLAIM: Final = 120.0
log = structlog.get_logger("gdrl.sampler")


class SamplerLink:
    def __init__(
        self,
        address: str | Address = DEFAULT_ADDRESS,
        claim_games: int | str = ALL_GAMES,
        *,
        name: str | None = None,
        token: str | None = None,
        stepping: StepOptions | None = None,
        timeout_claim: float = DEFAULT_TIMEOUT_CLAIM,
    ) -> None:
        self.address = Address.parse(address) if isinstance(address, str) else address
        hello = Hello(
            "sampler",
            PROTOCOL_VERSION,
            name or default_name("sampler"),
            token,
            stepping=stepping,
            claim_games=claim_games,
        )
        self._socket = self._claim(hello, timeout_claim)
        self.closed = False
        self.policies: dict[str, PolicyInfo] = {}  # in the broker's order
        self.pending: dict[str, Batch] = {}  # the batch each policy waits to have answered
        # The broker sends every policy's layout right after the welcome; the first answer to our reset
        # (a batch or a waiting notice) comes after them.
        self._socket.send(TrainerReset())
        while True:
            message = self._socket.recv()
            if not isinstance(message, PolicyInfo):
                self._take(message)
                break
            self.policies[message.policy] = message
        log.info(
            "games claimed",
            broker=str(self.address),
            games=sorted({g.game_index for info in self.policies.values() for g in info.games}),
            policies={p: info.n_envs for p, info in self.policies.items()},
        )

    def _claim(self, hello: Hello, timeout: float) -> PeerSocket:
        deadline = time.monotonic() + timeout
        delay = 0.1
        while True:
            left = deadline - time.monotonic()
            try:
                return PeerSocket(self.address, hello, timeout_connect=max(left, 1.0))
            except BrokerError as exc:
                if exc.code not in RETRIED_CLAIMS or time.monotonic() + delay > deadline:
                    raise
                log.debug("claim retried", broker=str(self.address), code=exc.code, reason=exc.message)
            time.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF)

    @property
    def games(self) -> list[int]:
        return sorted({g.game_index for info in self.policies.values() for g in info.games})

    def _take(self, message: object) -> None:
        if isinstance(message, Batch):
            self.pending[message.policy] = message
        elif not isinstance(message, Waiting):  # a waiting notice only says why a batch takes time
            raise BrokerError(ErrorCode.UNEXPECTED_MESSAGE.value, f"sampler got '{getattr(message, 'TYPE', message)}'")

    def wait(self) -> dict[str, Batch]:
        """Block until every policy has a batch to answer; those batches, by policy."""
        while len(self.pending) < len(self.policies):
            self._take(self._socket.recv())
        return dict(self.pending)

    def act(self, policy: str, actions: dict[str, np.ndarray]) -> None:
        batch = self.pending.pop(policy)
        self._socket.send(TrainerAct(batch.step, actions, policy))

    def close(self, reason: str = "sampler done") -> None:
        if not self.closed:
            self.closed = True
            self._socket.close(reason)
