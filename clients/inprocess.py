"""The broker inside the trainer's own process: games still connect over its port, and trainers here
exchange messages with the hub through bounded inboxes, no socket. A single VecEnv waiting in ``step_wait`` runs
the broker's event loop on its own thread until its batch is complete (no thread hop); with several VecEnvs
(one per policy, each on its own thread if you like; say so with ``local_trainers``), and while none waits (a
PPO update), the broker's daemon thread serves the games.

Only the broker's public server API is used (``broker.server``: ``ServerThread``, ``attach_trainer``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ProtocolError
from broker.protocol.messages import Close, Error, Hello, Message, StepOptions, Welcome
from broker.server import InProcessTrainer, ServerConfig, ServerThread, attach_trainer
from clients.errors import BrokerError
from clients.vec_env import BrokerVecEnv

T = TypeVar("T")


class InProcessBroker:
    """``with InProcessBroker(expected_games=2) as broker: env = broker.vec_env("player")``.

    ``local_trainers`` is how many VecEnvs this program will take from it at once: with one (the default), that
    VecEnv's thread runs the broker's loop while it waits, no thread hop; with several policies trained here
    (``local_trainers=2``), or none (trainers connect over the port), the broker's own thread runs it on uvloop,
    which serves them faster. Any number works either way; only the speed differs."""

    def __init__(self, config: ServerConfig | None = None, *, local_trainers: int = 1, **overrides: Any) -> None:
        self.config = config or ServerConfig(**{"port": 0, **overrides})
        self.server_thread = ServerThread(self.config, local_trainers=local_trainers)
        self.server = self.server_thread.server
        self.loop = self.server_thread.loop

    @property
    def address(self) -> str:
        return self.server_thread.address

    @property
    def closed(self) -> bool:
        return self.server_thread.closed

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the broker's loop and return its result (or raise its error)."""
        return self.server_thread.call(fn, *args)

    def vec_env(self, policy: str, name: str = "", stepping: StepOptions | None = None) -> BrokerVecEnv:
        link = InProcessTrainerLink(self, policy, name or f"in-process[{policy}]", stepping)
        return BrokerVecEnv(policy, link=link)

    def close(self) -> None:
        self.server_thread.close()

    def __enter__(self) -> InProcessBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessTrainerLink:
    """The VecEnv's side: the broker's ``InProcessTrainer`` with its last words as ``BrokerError``."""

    def __init__(self, broker: InProcessBroker, policy: str, name: str, stepping: StepOptions | None = None) -> None:
        hello = Hello("trainer", PROTOCOL_VERSION, name, broker.config.token, policy=policy, stepping=stepping)
        try:
            self.trainer: InProcessTrainer = attach_trainer(broker.server_thread, hello)
        except ProtocolError as exc:
            raise BrokerError(exc.code.value, exc.message) from exc

    @property
    def closed(self) -> bool:
        return self.trainer.closed

    def send(self, message: Message) -> None:
        if self.trainer.closed:
            raise BrokerError("closed", "in-process trainer link is closed")
        self.trainer.send(message)

    def recv(self) -> Message:
        while True:
            message = self.trainer.recv()
            if isinstance(message, Welcome):
                continue
            if isinstance(message, Error):
                raise BrokerError(message.code, message.message)
            if isinstance(message, Close):
                raise BrokerError("closed", message.reason)
            return message

    def close(self, reason: str = "") -> None:
        self.trainer.close()
