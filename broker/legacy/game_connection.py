"""The broker's end of a connection to an unmodified godot_rl plugin game. Sans-IO.

``BrokerConnection`` reads the first frame of every accepted connection; when it is JSON (a
``LegacyMessage``), the server swaps in a ``GodotRlGameConnection`` built on it, which from then on turns
the plugin's JSON into typed hub messages and the hub's messages into the plugin's requests:

=======================  ==================================================================
the game sends           we report
=======================  ==================================================================
``env_info``             ``Hello(role="game")`` for the hub
``reset``/``step`` reply ``GameStep``
``call`` reply           ``CallAnswered`` (with the actions deferred meanwhile, to write next)
anything refused         ``Refused``: the reason as a ``call``, then ``close`` (below)
=======================  ==================================================================

and ``send`` turns the hub's ``Welcome`` into the ``reset`` request and its ``GameActions`` into the
``action`` request, or keeps them while a ``call`` is open (godot_rl is lock-step: one request at a time).

A refused game is told why in words the plugin prints: the plugin shows no text of ours, and an unknown
message type would hang it, but it runs ``call`` requests as a method name on each agent, and Godot
prints a missing method's name: ``SCRIPT ERROR: Invalid call. Nonexistent function 'gdrl-broker refused
this game (...)...'``. After it answers (or ``REFUSAL_GRACE_S``, a timer the server arms), ``close``
makes the plugin quit its game.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import structlog

from broker.legacy.godot_rl_game import CallResult, GodotRlGame, Phase
from broker.legacy.wire import encode_message
from broker.protocol.connection import (
    GREETING,
    BrokerConnection,
    CannotSend,
    ConnectionEvent,
    Farewell,
    LegacyMessage,
    Refusal,
    Refused,
)
from broker.protocol.errors import ProtocolError, RemoteProtocolError
from broker.protocol.gather import Buffer
from broker.protocol.kinds import BodyKind
from broker.protocol.messages import Close, Error, GameActions, GameStep, Hello, Message, Welcome

log = structlog.get_logger("gdrl.legacy")

REFUSAL_GRACE_S: Final = 2.0  # how long a refused plugin game has to answer the reason before we close


@dataclass(frozen=True)
class CallAnswered(ConnectionEvent):
    """The game answered a ``call``; ``then_send`` carries the actions that waited for that answer."""

    result: CallResult
    then_send: bytes


class GodotRlGameConnection:
    """One plugin game, as a ``ServerConnection``: JSON frames in, hub messages out, and back."""

    codec = BodyKind.JSON

    def __init__(self, frames: BrokerConnection, first: LegacyMessage, label: str) -> None:
        self._frames = frames  # still splits the stream into (JSON) frames
        self._first: dict[str, Any] | None = first.body
        self.label = label
        self.game = GodotRlGame(f"godot_rl@{label}")
        self.game_index: int | None = None
        self.refused = False
        self._deferred: GameActions | None = None  # actions that arrived while a call was open
        self._told_general_way = False

    # --- from the game ----------------------------------------------------------------------------

    @staticmethod
    def greeting() -> bytes:
        return GREETING

    @property
    def buffered_bytes(self) -> int:
        return self._frames.buffered_bytes

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._frames.receive_data(data)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        return self._frames.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._frames.buffer_updated(nbytes)

    def next_event(self) -> Hello | GameStep | CallAnswered | Refused | Farewell | None:
        if self._first is not None:
            body, self._first = self._first, None
            return self._receive(body)
        raw = self._frames.next_legacy_body()  # a broken frame raises here: a plain "peer error"
        if raw is None:
            return None
        if self.refused:  # the game's answer to our reason: now say goodbye
            return Farewell(self.game.close_request())
        in_c = self.game.awaits_reply_read_in_c
        try:
            step = self.game.receive_reply(raw)  # a step or reset reply read straight into arrays, if C reads it
        except RemoteProtocolError as exc:
            return Refused(self.refuse(exc))
        if step is not None:
            return step
        if in_c and not self._told_general_way:  # once: why this game costs more broker CPU than others
            self._told_general_way = True
            log.info(
                "godot_rl game reply read the general way",
                peer=self.label,
                note="slower: some value is outside what the fast reader takes (docs/migration.md)",
            )
        return self._receive(self._frames.legacy_json(raw))  # undecodable JSON raises: a plain "peer error"

    def _receive(self, body: dict[str, Any]) -> Hello | GameStep | CallAnswered | Refused:
        try:
            event = self.game.receive(body)
        except RemoteProtocolError as exc:
            return Refused(self.refuse(exc))
        if isinstance(event, CallResult):
            return CallAnswered(event, self._release_deferred())
        return event

    def _release_deferred(self) -> bytes:
        if self._deferred is None or self.game.phase is not Phase.AWAIT_ACTIONS:
            return b""
        deferred, self._deferred = self._deferred, None
        return self.game.actions_request(deferred)

    # --- to the game ------------------------------------------------------------------------------

    def send_buffers(self, message: Message) -> list[Buffer]:
        return [self.send(message)]  # JSON text: one buffer

    def send(self, message: Message) -> bytes:
        """What the hub says, in the plugin's words."""
        try:
            return self._send(message)
        except ProtocolError as exc:  # ours, not the sender's: cost this game only, never the hub's caller
            log.error("cannot forward to godot_rl game", peer=self.label, code=exc.code.value, error=exc.message)
            raise CannotSend(exc.message) from None

    def _send(self, message: Message) -> bytes:
        if isinstance(message, GameActions):
            if self.game.phase is Phase.AWAIT_CALL:
                self._deferred = message  # lock-step: at most one, sent once the call is answered
                return b""
            return self.game.actions_request(message)
        if isinstance(message, Welcome):
            self.game_index = message.game_index
            log.info(
                "godot_rl game joined",
                peer=self.label,
                game=self.game_index,
                agents=self.game.n_agents,
                policies={g.spec.policy: len(g.agents) for g in self.game.groups},
                replies_read_in_c=self.game.replies_read_in_c,
            )
            return self.game.reset_request()
        if isinstance(message, Close):
            return self.game.close_request()
        log.warning("message not meant for a game", peer=self.label, type=message.TYPE)
        return b""

    def call_request(self, method: str) -> bytes | None:
        """The ``call`` request if the game waits for a command, else None (it cannot take one now)."""
        if self.refused or not self.game.can_call:
            return None
        return self.game.call_request(method)

    def last_word(self, message: Error | Close) -> bytes:
        """``close`` makes the plugin quit its game; it knows no error frame, so an error closes silently."""
        if isinstance(message, Close):
            return self.game.close_request()
        return b""

    def refuse(self, error: RemoteProtocolError) -> Refusal:
        """Tell the game why it is refused, as a ``call`` the plugin prints; ``close`` follows."""
        log.warning("godot_rl game refused", peer=self.label, code=error.code.value, error=error.message)
        self.refused = True
        self._first = self._deferred = None
        reason = f"gdrl-broker refused this game ({error.code.value}): {error.message}"
        return Refusal(encode_message({"type": "call", "method": reason}), REFUSAL_GRACE_S)
