"""What one send costs the process that makes it, by transport and by how the reader waits.

A lock-step's every message is written to a peer that is either asleep in ``recv`` (the benchmark games, a
godot_rl trainer) or polling without sleeping (the broker, its clients and the ceilings, for up to 200 us:
broker/tuning.py). Over loopback TCP the sender's ``send`` runs the receiver's side of the stack too, and
wakes a sleeping reader itself; that time is CPU of the sender, in the lock-step's chain.

    python -m benchmarks.wakeup_cost [--rounds 20000] [--sizes 80,102400]

For each transport (loopback TCP with TCP_NODELAY, a Unix socket pair), reader (``blocked`` in ``recv``;
``polling``: each message's first read waits as the broker's clients do, ``clients.transport.SpinWait``,
through the raw ceiling's ``recv_exactly``) and message size, a forked reader takes each message whole and
answers one byte; the writer times its own ``sendall`` with
``time.thread_time`` (user and kernel CPU of this thread). Prints the mean per send over the rounds (what adds
up in a process's CPU), and the median round trip. One process pair at a time, on an otherwise idle machine.

    python -m benchmarks.wakeup_cost --idle-poll      (the same with every idle core polling, benchmarks/idle.py)

On this VM an idle vCPU halts at once, and a wake-up into a halted one is a round trip through the host: with
``--idle-poll`` the idle cores poll instead, and what is left is the wake-up's own cost.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Iterator

from benchmarks.idle import IdlePollingUnavailable, idle_polling_if, idle_state
from benchmarks.raw import new_spin_wait, recv_exactly

TRANSPORTS = ("tcp", "unix")
READERS = ("blocked", "polling")


def _pair(transport: str) -> tuple[socket.socket, socket.socket]:
    if transport == "unix":
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        writer = socket.create_connection(listener.getsockname())
        reader, _ = listener.accept()
    for sock in (writer, reader):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return writer, reader


def _serve(sock: socket.socket, size: int, polling: bool) -> None:
    buffer = memoryview(bytearray(size))
    wait = new_spin_wait() if polling else None
    try:
        while True:
            recv_exactly(sock, buffer, wait)
            sock.sendall(b"k")
    except ConnectionError:
        return  # the writer is done


def measure(transport: str, reader: str, size: int, rounds: int) -> tuple[float, float]:
    """(mean writer CPU per send, median round trip), in microseconds."""
    writer, reading_end = _pair(transport)
    pid = os.fork()
    if pid == 0:  # the reader
        writer.close()
        try:
            _serve(reading_end, size, reader == "polling")
        finally:
            os._exit(0)
    reading_end.close()
    message = bytes(size)
    ack = bytearray(1)
    sends: list[float] = []
    trips: list[float] = []
    try:
        for _ in range(rounds):
            started, cpu = time.perf_counter(), time.thread_time()
            writer.sendall(message)
            sends.append(time.thread_time() - cpu)
            writer.recv_into(ack)
            trips.append(time.perf_counter() - started)
    finally:
        writer.close()
        os.waitpid(pid, 0)
    return statistics.fmean(sends) * 1e6, statistics.median(trips) * 1e6


def cases(sizes: list[int]) -> Iterator[tuple[str, str, int]]:
    for size in sizes:
        for transport in TRANSPORTS:
            for reader in READERS:
                yield transport, reader, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--sizes", default="80,102400", help="message sizes in bytes, comma-separated")
    parser.add_argument("--idle-poll", action="store_true", help="idle cores poll instead of halting (needs root)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    try:
        with idle_polling_if(args.idle_poll):
            state = idle_state()
            print(f"idle cores: driver {state['driver']}, latency request {state['qos_latency_us']} us")
            print("| transport | reader | bytes | writer CPU per send, us | round trip, us |")
            print("|---|---|---:|---:|---:|")
            for transport, reader, size in cases(sizes):
                send_us, trip_us = measure(transport, reader, size, args.rounds)
                print(f"| {transport} | {reader} | {size:,} | {send_us:.1f} | {trip_us:.1f} |", flush=True)
    except IdlePollingUnavailable as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
