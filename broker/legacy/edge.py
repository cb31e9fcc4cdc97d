"""asyncio glue for the godot_rl adapters: plugin games on the broker's port, and godot_rl trainers
that the broker dials.

* ``GodotRlGames`` is ``BrokerServer.legacy_handler``. A connection whose first frame is JSON belongs to
  a plugin game; its ``PeerProtocol`` stays the hub's ``Link`` (so the hub sees an ordinary game), and
  ``PeerProtocol.send`` hands hub messages to the game's ``GodotRlGame`` adapter instead of encoding them.
* ``GodotRlTrainerConnector`` keeps a connection to one godot_rl training script per policy, retrying
  with backoff, and registers it with the hub as that policy's trainer while it is connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import socket
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import structlog

from broker.legacy.godot_rl_game import CallResult, GodotRlGame, Phase
from broker.legacy.godot_rl_trainer import (
    ActionRequest,
    CallRequest,
    CloseRequest,
    EnvInfoRequest,
    GodotRlTrainer,
    ResetRequest,
    TrainerRequest,
)
from broker.legacy.wire import encode_message
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.connection import LegacyMessage
from broker.protocol.errors import ErrorCode, ProtocolError, RemoteProtocolError
from broker.protocol.messages import (
    Batch,
    Close,
    Error,
    GameActions,
    GameStep,
    Hello,
    Message,
    PolicyInfo,
    StepOptions,
    TrainerAct,
    Waiting,
    Welcome,
)

if TYPE_CHECKING:
    from broker.core.hub import TrainerSession
    from broker.server.server import BrokerServer, PeerProtocol

log = structlog.get_logger("gdrl.legacy")

DEFAULT_TIMEOUT_CALL: Final = 30.0
REFUSAL_GRACE_S: Final = 2.0  # how long a refused plugin game has to answer the reason before we close


def _is_loopback(peer: PeerProtocol) -> bool:
    if peer.transport is None:
        return False
    address = peer.transport.get_extra_info("peername")
    if not isinstance(address, tuple):
        return True  # a Unix socket is local by construction
    try:
        return ipaddress.ip_address(address[0]).is_loopback
    except ValueError:
        return False


# --- plugin games on our port ---------------------------------------------------------------------


def _drop(message: Message) -> None:
    """What a refused plugin game gets from the hub: nothing."""


class GodotRlGamePeer:
    """One plugin game: feeds its JSON messages to the adapter and the results to the hub."""

    def __init__(self, server: BrokerServer, peer: PeerProtocol) -> None:
        if server.config.token and not _is_loopback(peer):
            # The plugin cannot carry our token; it always connects from 127.0.0.1, so only loopback is allowed.
            raise RemoteProtocolError(
                ErrorCode.AUTH_FAILED, "godot_rl plugin games carry no token; they may only connect over loopback"
            )
        self.hub = server.hub
        self.peer = peer
        self.adapter = GodotRlGame(f"godot_rl@{peer.label}")
        self.game_index: int | None = None
        self._deferred: GameActions | None = None  # actions that arrived while a call was open
        self._on_call: Callable[[CallResult], None] | None = None
        peer.legacy_send = self.from_hub
        peer.legacy_close = self.goodbye

    @property
    def alive(self) -> bool:
        return not self.peer.closing and self.peer.game is not None

    def receive(self, body: dict[str, Any]) -> None:
        event = self.adapter.receive(body)
        if isinstance(event, Hello):
            self.peer.game = self.hub.add_game(self.peer, event)
            log.info(
                "godot_rl game joined",
                peer=self.peer.label,
                game=self.game_index,
                agents=self.adapter.n_agents,
                policies={g.spec.policy: len(g.agents) for g in self.adapter.groups},
            )
            self.peer.send_raw(self.adapter.reset_request())
        elif isinstance(event, GameStep):
            assert self.peer.game is not None
            self.hub.game_step(self.peer.game, event)
        else:
            self._finish_call(event)

    def from_hub(self, message: Message) -> None:
        """``PeerProtocol.send`` for this peer: what the hub says, in the plugin's words."""
        try:
            self._from_hub(message)
        except ProtocolError as exc:  # ours, not the sender's: cost this game only, never the hub's caller
            log.error("cannot forward to godot_rl game", peer=self.peer.label, code=exc.code.value, error=exc.message)
            self.peer.close()

    def _from_hub(self, message: Message) -> None:
        if isinstance(message, GameActions):
            if self.adapter.phase is Phase.AWAIT_CALL:
                self._deferred = message  # lock-step: at most one, sent once the call is answered
            else:
                self.peer.send_raw(self.adapter.actions_request(message))
        elif isinstance(message, Welcome):
            self.game_index = message.game_index
        elif isinstance(message, Close):
            self.goodbye()
        else:
            log.warning("message not meant for a game", peer=self.peer.label, type=message.TYPE)

    def goodbye(self) -> None:
        """Broker shutdown: the plugin quits its game when told ``close``."""
        if not self.peer.closing:
            self.peer.send_raw(self.adapter.close_request())
            self.peer.close()

    def call(self, method: str, on_done: Callable[[CallResult], None]) -> bool:
        """Send ``call`` if the game waits for a command; ``on_done`` gets its answer."""
        if not self.alive or not self.adapter.can_call or self._on_call is not None:
            return False
        self._on_call = on_done
        self.peer.send_raw(self.adapter.call_request(method))
        return True

    def abandon_call(self) -> None:
        self._on_call = None

    def _finish_call(self, result: CallResult) -> None:
        on_done, self._on_call = self._on_call, None
        if on_done is not None:
            on_done(result)
        if self._deferred is not None and self.adapter.phase is Phase.AWAIT_ACTIONS:
            deferred, self._deferred = self._deferred, None
            self.peer.send_raw(self.adapter.actions_request(deferred))


class GodotRlGames:
    """``BrokerServer.legacy_handler``: serves unmodified godot_rl plugin games beside native peers."""

    def __init__(self, server: BrokerServer, timeout_call: float = DEFAULT_TIMEOUT_CALL) -> None:
        self.server = server
        self.timeout_call = timeout_call
        self._peers: weakref.WeakKeyDictionary[PeerProtocol, GodotRlGamePeer] = weakref.WeakKeyDictionary()
        self._refused: weakref.WeakSet[PeerProtocol] = weakref.WeakSet()  # told why; closed once they answer

    def __call__(self, peer: PeerProtocol, event: LegacyMessage) -> None:
        if peer in self._refused:  # the game's answer to our reason: now say goodbye
            self._goodbye(peer)
            return
        try:
            game = self._peers.get(peer)
            if game is None:
                game = GodotRlGamePeer(self.server, peer)
                self._peers[peer] = game
            game.receive(event.body)
        except RemoteProtocolError as exc:
            self.refuse(peer, exc)

    def refuse(self, peer: PeerProtocol, exc: RemoteProtocolError) -> None:
        """Tell a plugin game why it is refused, in words the plugin prints, then close it.

        The plugin shows no text of ours, and an unknown message type would hang it; but it runs
        ``call`` requests as a method name on each agent, and Godot prints a missing method's name:
        ``SCRIPT ERROR: Invalid call. Nonexistent function 'gdrl-broker refused this game (...)...'``.
        After it answers (or ``REFUSAL_GRACE_S``), ``close`` makes the plugin quit its game.
        """
        log.warning("godot_rl game refused", peer=peer.label, code=exc.code.value, error=exc.message)
        if peer.game is not None:
            self.server.hub.remove_game(peer.game)
            peer.game = None
        self._peers.pop(peer, None)
        peer.legacy_send = _drop  # the hub has nothing more to say to it
        peer.legacy_close = functools.partial(self._goodbye, peer)
        self._refused.add(peer)
        reason = f"gdrl-broker refused this game ({exc.code.value}): {exc.message}"
        peer.send_raw(encode_message({"type": "call", "method": reason}))
        asyncio.get_running_loop().call_later(REFUSAL_GRACE_S, self._goodbye, peer)

    def _goodbye(self, peer: PeerProtocol) -> None:
        if peer in self._refused:
            self._refused.discard(peer)
            peer.send_raw(encode_message({"type": "close"}))
            peer.close()

    def games_with(self, policy: str) -> list[GodotRlGamePeer]:
        """Live plugin games that have agents of ``policy``, in slot order."""
        games = [
            g for g in self._peers.values() if g.alive and g.peer.game is not None and policy in g.peer.game.groups
        ]
        return sorted(games, key=lambda g: g.peer.game.slot if g.peer.game else -1)

    def call(self, policy: str, method: str, on_done: Callable[[list[Any]], None]) -> None:
        """Relay a godot_rl trainer's ``call`` to every plugin game with ``policy``'s agents.

        ``on_done`` gets the games' ``returns`` lists joined in slot order. Native games have no ``call``;
        a game that does not answer within ``timeout_call`` seconds (it left, say) contributes nothing.
        """
        games = self.games_with(policy)
        results: dict[int, list[Any]] = {}
        waiting: set[int] = set()
        timer: asyncio.TimerHandle | None = None

        def finish() -> None:
            if timer is not None:
                timer.cancel()
            on_done([value for i in sorted(results) for value in results[i]])

        def answered(index: int, result: CallResult) -> None:
            waiting.discard(index)
            results[index] = result.returns
            if not waiting:
                finish()

        for index, game in enumerate(games):
            waiting.add(index)
            if not game.call(method, functools.partial(answered, index)):
                waiting.discard(index)
        if not waiting:
            finish()
            return

        def expire() -> None:
            log.warning("call unanswered", policy=policy, method=method, games=len(waiting))
            for index in list(waiting):
                games[index].abandon_call()
            waiting.clear()
            on_done([value for i in sorted(results) for value in results[i]])

        timer = asyncio.get_running_loop().call_later(self.timeout_call, expire)


# --- godot_rl trainers that we dial ---------------------------------------------------------------


class GodotRlTrainerLink(asyncio.Protocol):
    """One connection to a godot_rl script; the hub's ``Link`` for that policy's trainer."""

    def __init__(self, connector: GodotRlTrainerConnector) -> None:
        self.connector = connector
        self.hub = connector.server.hub
        self.policy = connector.policy
        self.label = f"godot_rl trainer {connector.host}:{connector.port}"
        self.session = GodotRlTrainer(connector.policy, connector.server.config.max_frame_bytes)
        self.trainer: TrainerSession | None = None
        self.transport: asyncio.Transport | None = None
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closing = False
        self._open_step: int | None = None
        self._last_waiting = ""

    # --- asyncio callbacks -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        log.info("connected to godot_rl trainer", peer=self.label, policy=self.policy)

    def data_received(self, data: bytes) -> None:
        self.session.receive_data(data)
        try:
            while not self.closing:
                request = self.session.next_event()
                if request is None:
                    break
                self._handle(request)
        except ProtocolError as exc:
            self.close(Error(exc.code.value, exc.message))
        except Exception as exc:  # a bug must cost this connection, not the broker
            log.exception("internal error", peer=self.label)
            self.close(Error(ErrorCode.INTERNAL.value, str(exc)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self.trainer is not None:
            self.hub.remove_trainer(self.trainer)
        log.info("godot_rl trainer disconnected", peer=self.label, policy=self.policy, reason=str(exc or "closed"))
        if not self.finished.done():
            self.finished.set_result(None)

    # --- the script's requests -------------------------------------------------------------------

    def _handle(self, request: TrainerRequest) -> None:
        if isinstance(request, EnvInfoRequest):
            hello = Hello("trainer", PROTOCOL_VERSION, self.label, policy=self.policy, stepping=self._stepping())
            self.trainer = self.hub.add_trainer(self, hello)  # may answer with PolicyInfo right away
        elif isinstance(request, ResetRequest):
            assert self.trainer is not None
            self.hub.trainer_reset(self.trainer)
        elif isinstance(request, ActionRequest):
            assert self.trainer is not None and self._open_step is not None
            self.hub.trainer_act(self.trainer, TrainerAct(self._open_step, request.actions))
        elif isinstance(request, CallRequest):
            games = self.connector.server.legacy_handler
            if isinstance(games, GodotRlGames):
                games.call(self.policy, request.method, self._call_answered)
            else:
                self._call_answered([])
        elif isinstance(request, CloseRequest):
            log.info("godot_rl trainer said close", peer=self.label, policy=self.policy)
            self.close()

    def _stepping(self) -> StepOptions:
        """Lock-step for a godot_rl script's policy, as godot_rl itself steps: its SB3 knows nothing of held
        ticks (``frames``) and has no fresh start after an update, so under hold most of its transitions
        would span many ticks (docs/migration.md). ``--deadline-ms`` still bounds the wait, then holds."""
        config = self.connector.server.config
        return StepOptions("barrier", config.deadline_ms, config.hold_action)

    def _call_answered(self, returns: list[Any]) -> None:
        if not self.closing and self.transport is not None:
            self.transport.write(self.session.call_reply(returns))

    # --- Link, as the hub sees us ----------------------------------------------------------------

    def send(self, message: Message) -> None:
        if self.closing or self.transport is None:
            return
        try:
            self._send(message)
        except ProtocolError as exc:  # ours: cost this connection, never the hub's caller
            self.close(Error(exc.code.value, exc.message))

    def _send(self, message: Message) -> None:
        assert self.transport is not None
        if isinstance(message, PolicyInfo):
            try:
                reply = self.session.env_info_reply(message)
            except ValueError as exc:
                self.close(Error(ErrorCode.NOT_SUPPORTED.value, str(exc)))
                return
            log.info("serving godot_rl trainer", peer=self.label, policy=self.policy, n_agents=message.n_envs)
            self.transport.write(reply)
        elif isinstance(message, Batch):
            self._open_step = message.step
            self.transport.write(self.session.batch_reply(message))
        elif isinstance(message, Waiting):
            if message.reason != self._last_waiting:  # every step waits for game steps; say only what is new
                self._last_waiting = message.reason
                log.info(message.reason, peer=self.label, policy=self.policy)
        elif isinstance(message, (Error, Close)):
            self.close(message)
        elif not isinstance(message, Welcome):
            log.warning("message not meant for a trainer", peer=self.label, type=message.TYPE)

    def close(self, error: Error | Close | None = None) -> None:
        if self.closing:
            return
        self.closing = True
        if isinstance(error, Error):
            log.warning("godot_rl trainer connection failed", peer=self.label, code=error.code, error=error.message)
        if self.transport is not None:
            self.transport.close()


class GodotRlTrainerConnector:
    """Serve ``policy`` to the godot_rl script at ``host:port``: connect, reconnect, back off."""

    def __init__(
        self,
        server: BrokerServer,
        policy: str,
        host: str,
        port: int,
        *,
        retry_initial: float = 0.2,
        retry_max: float = 5.0,
    ) -> None:
        self.server = server
        self.policy = policy
        self.host = host
        self.port = port
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.link: GodotRlTrainerLink | None = None
        self.connections = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"godot_rl trainer {self.policy}")
        self._task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("godot_rl trainer connector failed", policy=self.policy, error=repr(task.exception()))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        delay = self.retry_initial
        told = False
        while True:
            try:
                _, link = await loop.create_connection(lambda: GodotRlTrainerLink(self), self.host, self.port)
            except OSError as exc:
                if not told:
                    log.info("waiting for godot_rl trainer", policy=self.policy, address=f"{self.host}:{self.port}")
                    told = True
                log.debug("godot_rl trainer not reachable", policy=self.policy, error=str(exc), retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max)
                continue
            self.link = link
            self.connections += 1
            delay, told = self.retry_initial, False
            await link.finished
            self.link = None
            await asyncio.sleep(self.retry_initial)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.link is not None:
            self.link.close()


def parse_trainer_target(text: str) -> tuple[str, str, int]:
    """``POLICY=HOST:PORT`` (or ``POLICY=PORT`` for loopback) -> (policy, host, port)."""
    policy, sep, address = text.partition("=")
    host, colon, port = address.rpartition(":")
    if not sep or not policy or not port.isdigit():
        raise ValueError(f"--godot-rl-trainer expects POLICY=HOST:PORT, got {text!r}")
    return policy, (host.strip("[]") if colon else "") or "127.0.0.1", int(port)
