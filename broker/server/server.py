"""asyncio server: one listening port (plus an optional Unix socket) for games and trainers alike.

Each accepted connection gets a ``PeerProtocol`` (broker/server/peer.py). Every peer (connections, the
godot_rl dialer, in-process trainers) reaches the sans-IO ``Hub`` only through ``BrokerServer.enter`` and
``leave``; the effects the hub returns (sends, closes, timers) are carried out by ``entry.apply``. All three are
compiled, in broker/server/entry.py (``HubEntry`` is the server's base). Everything runs on the event loop's
thread; the hub is never entered concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from typing import Any, cast

import structlog

from broker import compiled
from broker.core.flow import Hub
from broker.legacy.game_connection import GodotRlGameConnection
from broker.protocol.errors import ErrorCode
from broker.protocol.messages import (
    Close,
    Error,
)
from broker.server.config import ServerConfig
from broker.server.entry import HubEntry
from broker.server.frozen import FrozenGroups
from broker.server.legacy_games import GodotRlCalls
from broker.server.peer import Link, PeerProtocol
from broker.server.spinning import LoopSpinner
from broker.status import wire_safe
from broker.tuning import trim_heap, tune_allocator

log = structlog.get_logger("gdrl.server")

TRIM_DELAY_S = 0.5  # heap trims after departures are coalesced: at most one per this interval


class BrokerServer(HubEntry):
    def __init__(self, config: ServerConfig, hub: Hub | None = None) -> None:
        config.validate()
        super().__init__(hub or Hub(config.expected_games, config.step_options()))
        self.config = config
        self.connections: set[PeerProtocol] = set()
        self.before_hello: dict[PeerProtocol, None] = {}  # insertion order: the oldest is shed first
        self.admitted: set[PeerProtocol] = set()
        self._trim: asyncio.TimerHandle | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._status_task: asyncio.Task[None] | None = None
        self.started = time.monotonic()
        self.godot_rl_calls = GodotRlCalls(self)  # a dialed godot_rl trainer's call, relayed to plugin games
        self.frozen = FrozenGroups(self)  # groups the broker answers itself with ONNX models
        self.spinner: LoopSpinner | None = None  # keeps the loop polling for a while after each message

    def schedule_heap_trim(self) -> None:
        """Give freed memory back to the OS soon (a large peer or a game left); coalesced."""
        if self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._trim_heap)

    def _trim_heap(self) -> None:
        self._trim = None
        trim_heap()

    @property
    def port(self) -> int:
        for server in self._servers:
            for sock in server.sockets:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    return int(sock.getsockname()[1])
        return self.config.port

    async def start(self) -> None:
        tune_allocator()
        loop = asyncio.get_running_loop()
        if self.config.spin_wait_s > 0 and not isinstance(loop, asyncio.SelectorEventLoop):
            self.spinner = LoopSpinner(loop, self.config.spin_wait_s)  # uvloop's; a standard loop's selector spins
        tcp = await loop.create_server(
            lambda: PeerProtocol(self), self.config.host, self.config.port, reuse_address=True, backlog=256
        )
        self._servers.append(tcp)
        if self.config.unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.unix_path)
            self._servers.append(await loop.create_unix_server(lambda: PeerProtocol(self), self.config.unix_path))
        if self.config.status_interval > 0:
            self._status_task = asyncio.create_task(self._log_status())
        if self.config.metrics_port is not None:
            # Loopback only: the endpoint has no token, so it never follows --host off this machine.
            metrics = await asyncio.start_server(self._serve_metrics, "127.0.0.1", self.config.metrics_port)
            self._servers.append(metrics)
        self.frozen.start()
        log.info(
            "broker listening",
            host=self.config.host,
            port=self.port,
            unix=self.config.unix_path,
            games=self.config.expected_games,
            compiled=compiled.active(),  # the per-step modules (broker/compiled.py)
        )

    async def _serve_metrics(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A minimal HTTP endpoint with the status in Prometheus text format (any path)."""
        from broker.status import prometheus_text

        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5.0)
            body = prometheus_text(wire_safe(self.status())).encode()
            head = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {len(body)}\r\n"
            writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _log_status(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_interval)
            snapshot = self.status()  # what `gdrl-broker status` shows, each trainer's link included
            games = sum(1 for g in snapshot["games"] if g["connected"])
            log.info("status", games=f"{games}/{len(snapshot['games'])}")
            for name, policy in snapshot["policies"].items():
                log.info("policy status", policy=name, **policy)

    def status(self) -> dict[str, Any]:
        snapshot = self.hub.snapshot()
        # How each policy's trainer is reached is the server's to know, not the hub's.
        for name, trainer in self.hub.trainers.items():
            policy = snapshot["policies"].get(name)
            if policy is None:
                continue
            link = cast(Link, trainer.link)  # every peer the server hands the hub is a Link
            policy["link"] = link.link_kind
            if isinstance(link, PeerProtocol) and link.ring is not None:
                policy["ring_batches"] = link.ring.writer.frames
        return {
            "uptime_s": round(time.monotonic() - self.started, 1),
            "connections": len(self.connections),
            "connections_before_hello": len(self.before_hello),
            **snapshot,
            "frozen": self.frozen.status(),
            "elo": self.frozen.elo.to_dict()["ratings"],
            "team_change": self.frozen.team_changes.status(),
        }

    async def shutdown(self, reason: str = "broker shutting down") -> None:
        """Stop listening, tell every peer why, and give them ``timeout_shutdown`` to leave."""
        self.frozen.shutdown()  # its pools saved first
        for server in self._servers:
            server.close()
        if self._status_task is not None:
            self._status_task.cancel()
        for peer in list(self.connections):
            if isinstance(peer.connection, GodotRlGameConnection):  # joined or refused: its close quits it
                peer.close(Close(reason))
            elif peer.trainer is not None or peer.sampler is not None:
                peer.close(Error(ErrorCode.SHUTTING_DOWN.value, reason))
            elif peer.game is not None:
                peer.close(Close(reason))
            else:
                peer.close()
        deadline = time.monotonic() + self.config.timeout_shutdown
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for peer in list(self.connections):
            if peer.transport is not None:
                peer.transport.abort()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        if self.config.unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.unix_path)
        log.info("broker stopped", reason=reason)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed, else the standard loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
