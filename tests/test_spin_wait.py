"""Waiting without sleeping (clients/transport.py, ``SpinWait``): a receive first asks for data without
blocking, for a bounded time, yielding the core between asks; then it blocks as before; after a spin that
found nothing the next receives block at once, for longer after each further miss. Real sockets; the asks
are recorded by a thin wrapper around them, never timed."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.messages import Hello
from clients.errors import BrokerError
from clients.transport import _DONTWAIT, SPIN_WAIT_S, PeerSocket, SpinWait
from tests.helpers import broker_process

pytestmark = pytest.mark.skipif(not _DONTWAIT, reason="MSG_DONTWAIT is Linux's and the BSDs'")


class RecordingSocket:
    """A real socket whose ``recv_into`` calls are recorded by their flags (0: a blocking receive)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.flags: list[int] = []

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self.flags.append(flags)
        return self.sock.recv_into(buffer, nbytes, flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    listener.close()
    yield sender, receiver
    sender.close()
    receiver.close()


def test_data_already_there_is_taken_by_the_first_ask_without_blocking(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    sender.sendall(b"actions")
    recording = RecordingSocket(receiver)
    buffer = bytearray(64)
    deadline = time.monotonic() + 10
    received = 0
    while not received and time.monotonic() < deadline:  # loopback delivers at once, but never assume it
        received = SpinWait(10.0).recv_into(recording, buffer)  # type: ignore[arg-type]
    assert bytes(buffer[:received]) == b"actions"
    assert recording.flags and set(recording.flags) == {_DONTWAIT}  # never a blocking receive


def receive_late(spin: SpinWait, sender: socket.socket, recording: RecordingSocket, data: bytes) -> list[int]:
    """Receive ``data``, sent 0.2 s from now (later than any spin here); the flags of the receives it took."""
    recording.flags = []
    later = threading.Timer(0.2, sender.sendall, args=(data,))
    later.start()
    buffer = bytearray(64)
    try:
        received = spin.recv_into(recording, buffer)  # type: ignore[arg-type]
    finally:
        later.join()
    assert bytes(buffer[:received]) == data
    return recording.flags


def test_an_answer_later_than_the_spin_is_waited_for_blocking_and_the_next_waits_block_at_once(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    recording = RecordingSocket(receiver)
    spin = SpinWait(0.001)
    flags = receive_late(spin, sender, recording, b"late step")
    assert flags[-1] == 0  # it ended in one blocking receive...
    assert len(flags) >= 2 and set(flags[:-1]) == {_DONTWAIT}  # ...after asking first
    # One miss: the next receive blocks at once; then it asks again, misses again and skips 3.
    assert receive_late(spin, sender, recording, b"step 2") == [0]
    assert receive_late(spin, sender, recording, b"step 3")[0] == _DONTWAIT
    assert [receive_late(spin, sender, recording, b"skipped") for _ in range(3)] == [[0], [0], [0]]
    # An answer found by the spin: the next receive spins again, and after its miss skips only one.
    sender.sendall(b"soon")
    recording.flags = []
    buffer = bytearray(64)
    received = 0
    while not received:  # loopback delivers at once; the spin takes it when it is there
        received = spin.recv_into(recording, buffer)  # type: ignore[arg-type]
    assert bytes(buffer[:received]) == b"soon" and recording.flags[-1] == _DONTWAIT
    assert receive_late(spin, sender, recording, b"step 6")[0] == _DONTWAIT
    assert receive_late(spin, sender, recording, b"step 7") == [0]
    assert receive_late(spin, sender, recording, b"step 8")[0] == _DONTWAIT


def test_no_spin_is_one_blocking_receive(pair: tuple[socket.socket, socket.socket]) -> None:
    sender, receiver = pair
    sender.sendall(b"x")
    recording = RecordingSocket(receiver)
    buffer = bytearray(8)
    assert SpinWait(0.0).recv_into(recording, buffer) == 1  # type: ignore[arg-type]
    assert recording.flags == [0]


def test_a_closed_peer_ends_the_spin_with_zero_bytes(pair: tuple[socket.socket, socket.socket]) -> None:
    sender, receiver = pair
    sender.close()
    assert SpinWait(10.0).recv_into(receiver, bytearray(8)) == 0  # the end of the stream, asked for or waited for


def test_a_trainer_socket_spins_by_default_and_not_with_pythons_timeout_or_when_off(tmp_path: Path) -> None:
    """PeerSocket asks without blocking first (SPIN_WAIT_S); never on a socket with Python's timeout (that
    polls before every receive) or with spin_wait_s=0; and a receive timeout still ends in BrokerError."""
    hello = Hello("trainer", PROTOCOL_VERSION, "spins", policy="mover")
    with broker_process(tmp_path, "--games", "2") as (_, address):
        for spin, python_timeout, spins in ((SPIN_WAIT_S, None, True), (SPIN_WAIT_S, 0.3, False), (0.0, None, False)):
            peer = PeerSocket(address, hello, spin_wait_s=spin)
            try:
                if python_timeout is None:
                    peer.set_recv_timeout(0.3)  # the kernel's timeout: the socket stays blocking
                else:
                    peer.sock.settimeout(python_timeout)
                recording = RecordingSocket(peer.sock)
                peer.sock = recording  # type: ignore[assignment]
                with pytest.raises(BrokerError) as exc:
                    while True:
                        peer.recv()  # policy info and the broker's waiting notices first, then nothing
                assert exc.value.code == "timeout"
                assert (_DONTWAIT in recording.flags) is spins, (spin, python_timeout, recording.flags)
                assert recording.flags[-1] == 0  # the wait that timed out was a blocking one
            finally:
                peer.close()


# --- the budget, and the broker's loops ------------------------------------------------------------------


def test_the_budget_skips_1_3_7_waits_after_misses_up_to_31_and_spins_again_after_a_find() -> None:
    from broker.tuning import SpinBudget

    budget = SpinBudget(0.001)
    assert budget.next_spin() == 0.001
    pattern = []
    for _ in range(6):
        budget.missed()  # the spin last allowed found nothing
        skipped = 0
        while budget.next_spin() == 0.0:
            skipped += 1
        pattern.append(skipped)
    assert pattern == [1, 3, 7, 15, 31, 31]  # each miss doubles the skips, and one more, up to MAX_SKIPS
    budget.found()
    assert budget.next_spin() == 0.001 and budget.next_spin() == 0.001  # found: spins again, and again
    assert SpinBudget(0.0).next_spin() == 0.0


class RecordingSelector(selectors.DefaultSelector):
    """The platform's selector, with the timeout of every select recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self.timeouts.append(timeout)
        return super().select(timeout)


def test_the_in_process_loops_selector_polls_before_it_sleeps(pair: tuple[socket.socket, socket.socket]) -> None:
    from broker.server.inprocess import SpinningSelector

    class Spinning(SpinningSelector, RecordingSelector):
        pass

    sender, receiver = pair
    selector = Spinning(0.001)
    selector.register(receiver, selectors.EVENT_READ)
    later = threading.Timer(0.2, sender.sendall, args=(b"step",))
    later.start()
    try:
        ready = selector.select(None)  # the loop's wait with nothing scheduled
    finally:
        later.join()
    assert [key.fileobj for key, _ in ready] == [receiver]
    assert len(selector.timeouts) >= 2 and set(selector.timeouts[:-1]) == {0}  # polled first...
    assert selector.timeouts[-1] is None  # ...then slept until the step came
    receiver.recv(16)
    selector.timeouts = []
    sender.sendall(b"next")
    assert selector.select(5.0) and selector.timeouts[0] == 5.0  # after the miss: sleeps at once
    receiver.recv(16)
    selector.timeouts = []
    sender.sendall(b"soon")
    assert selector.select(5.0) and selector.timeouts == [0]  # then polls again, and finds it at once
    receiver.recv(16)
    selector.timeouts = []
    selector.polls = False  # its runner turned polling off: it sleeps at once
    sender.sendall(b"off")
    assert selector.select(5.0) and selector.timeouts == [5.0]
    selector.close()


def test_the_daemons_loop_keeps_polling_for_a_while_after_a_message_then_sleeps() -> None:
    import uvloop

    from broker.server.spinning import LoopSpinner

    loop = uvloop.new_event_loop()
    try:
        spinner = LoopSpinner(loop, 0.01)
        loop.call_soon(spinner.message_came)
        loop.run_until_complete(asyncio.sleep(0.001))
        assert spinner.spinning  # the loop polls: a spin callback is always ready
        loop.run_until_complete(asyncio.sleep(0.1))
        assert not spinner.spinning  # nothing came within its time: it stopped, counted as a miss
        spinner.message_came()
        assert not spinner.spinning  # so the next wait sleeps at once
        spinner.message_came()
        assert spinner.spinning  # and the one after spins again
        loop.run_until_complete(asyncio.sleep(0.001))
        spinner.message_came()  # a message during the spin: found, and the spin goes on for the next one
        assert spinner.spinning
        loop.run_until_complete(asyncio.sleep(0.1))
        assert not spinner.spinning
    finally:
        loop.close()
