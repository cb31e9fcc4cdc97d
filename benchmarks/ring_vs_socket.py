"""Issue 19, item 5: would a shared-memory ring beat the socket between the broker and a trainer on its host?

    python -m benchmarks.ring_vs_socket [--sizes 4096,32768,102400,348160,1048576] [--exchanges 3000] [--rounds 4]

Two processes in lock-step, as the broker and one trainer are: the *sender* (the broker's side) writes one
frame of N bytes, the *receiver* (the trainer's side) reads it and answers with a 64-byte frame (its ``act``).
Both wait for each frame as the broker and its clients do: polling without sleeping first
(``clients.transport.SpinWait``). Three ways to carry the N bytes:

* ``socket``: what the broker does now over TCP loopback. The sender writes header and body in one gather
  write from the body's own memory (``sendmsg``, as uvloop's ``writelines``); the receiver reads the header,
  then ``recv_into`` a fresh buffer of its own (``np.empty``), as ``PeerSocket`` does.
* ``ring_copy``: the lever of item 5. The sender copies the body into a ring both map (a ``memfd``, opened by
  the receiver through ``/proc/<pid>/fd``) and writes a 12-byte doorbell frame (offset, length) on the socket;
  the receiver copies the body out of the ring into a fresh buffer of its own (arrays keep owning their memory,
  as now) and publishes how far it has read in the ring's first 8 bytes, which the sender checks for room.
* ``ring_view``: the same, but the receiver keeps a view of the ring instead of a copy (a lower bound for any
  ring: the arrays would then be overwritten once the ring wraps, a contract SB3's rollout buffer does not
  keep).

Printed: per size and way, the CPU per exchange of each side and the wall time per exchange (medians over
the rounds, the ways interleaved in every round), and the ratios against ``socket``. Only ratios measured in
one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import socket
import statistics
import struct
import time
from typing import Final

import numpy as np

from benchmarks.raw import new_spin_wait, recv_exactly

HEADER: Final = struct.Struct("<I")
DOORBELL: Final = struct.Struct("<III")  # frame length (8), ring offset, body length
CURSOR: Final = 64  # the ring's first bytes: the receiver's read cursor (u64), then a cache line of room
WAYS: Final = ("socket", "ring_copy", "ring_view")
ANSWER: Final = HEADER.pack(60) + bytes(60)  # the trainer's act: a small frame


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _receiver(port: int, owner_pid: int, ring_fd: int, ring_bytes: int, way: str, exchanges: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ring = mmap.mmap(os.open(f"/proc/{owner_pid}/fd/{ring_fd}", os.O_RDWR), ring_bytes)
    ring_view = memoryview(ring)
    cursor = np.frombuffer(ring, np.uint64, 1)
    header = memoryview(bytearray(DOORBELL.size))
    spin = new_spin_wait()
    kept = None
    started = _cpu_s()
    for _ in range(exchanges):
        recv_exactly(sock, header[: HEADER.size], spin)
        (length,) = HEADER.unpack_from(header)
        if way == "socket":
            body = np.empty(length, np.uint8)
            recv_exactly(sock, body.data)
        else:
            recv_exactly(sock, header[HEADER.size :])
            _, offset, size = DOORBELL.unpack_from(header)
            if way == "ring_copy":
                body = np.empty(size, np.uint8)
                body.data[:] = ring_view[offset : offset + size]
            else:
                body = np.frombuffer(ring_view[offset : offset + size], np.uint8)
            cursor[0] = offset + size  # read up to here: the sender may write over it
        kept = body  # held until the next frame, as a VecEnv holds the last observation
        sock.sendall(ANSWER)
    cpu_s = _cpu_s() - started
    del kept, body, cursor
    sock.sendall(json.dumps({"cpu_us": cpu_s / exchanges * 1e6}).encode() + b"\n")
    sock.close()
    ring_view.release()
    ring.close()


def measure(size: int, way: str, exchanges: int) -> dict[str, float]:
    """One run of ``exchanges`` lock-steps of ``size`` bytes, carried ``way``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    ring_bytes = CURSOR + 4 * size
    ring_fd = os.memfd_create("gdrl-ring-bench")
    os.ftruncate(ring_fd, ring_bytes)
    child = os.fork()
    if child == 0:
        try:
            _receiver(listener.getsockname()[1], os.getppid(), ring_fd, ring_bytes, way, exchanges)
        finally:
            os._exit(0)
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ring = mmap.mmap(ring_fd, ring_bytes)
    ring_view = memoryview(ring)
    cursor = np.frombuffer(ring, np.uint64, 1)
    body = np.random.default_rng(0).integers(0, 255, size, np.uint8)
    answer = memoryview(bytearray(len(ANSWER)))
    spin = new_spin_wait()
    write_at = CURSOR
    started_cpu, started = _cpu_s(), time.perf_counter()
    for _ in range(exchanges):
        if way == "socket":
            sock.sendmsg([HEADER.pack(size), body.data])
        else:
            if write_at + size > ring_bytes:  # wrap: the receiver has read everything before (lock-step)
                write_at = CURSOR
            if int(cursor[0]) > write_at and int(cursor[0]) - write_at < size:
                raise RuntimeError("ring overrun")  # cannot happen in lock-step: checked as a real ring would
            ring_view[write_at : write_at + size] = body.data
            sock.sendall(DOORBELL.pack(DOORBELL.size - HEADER.size, write_at, size))
            write_at += size
        recv_exactly(sock, answer, spin)
    wall_s = time.perf_counter() - started
    sender_cpu_s = _cpu_s() - started_cpu
    report = json.loads(sock.makefile("rb").readline())
    os.waitpid(child, 0)
    sock.close()
    listener.close()
    del cursor
    ring_view.release()
    ring.close()
    os.close(ring_fd)
    return {
        "sender_cpu_us": sender_cpu_s / exchanges * 1e6,
        "receiver_cpu_us": report["cpu_us"],
        "wall_us": wall_s / exchanges * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4096,32768,102400,348160,1048576")
    parser.add_argument("--exchanges", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", help="write the medians here as JSON")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: dict[tuple[int, str], list[dict[str, float]]] = {(s, w): [] for s in sizes for w in WAYS}
    for round_index in range(args.rounds):
        for size in sizes:
            ways = WAYS if round_index % 2 == 0 else WAYS[::-1]  # interleaved, the order alternating
            for way in ways:
                runs[size, way].append(measure(size, way, args.exchanges))
    rows = []
    print("| bytes | way | sender CPU us | receiver CPU us | both | wall us | x socket (wall) | both's CPU x socket |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        medians = {
            way: {key: statistics.median(run[key] for run in runs[size, way]) for key in runs[size, way][0]}
            for way in WAYS
        }
        base = medians["socket"]
        for way in WAYS:
            m = medians[way]
            both = m["sender_cpu_us"] + m["receiver_cpu_us"]
            base_both = base["sender_cpu_us"] + base["receiver_cpu_us"]
            rows.append({"bytes": size, "way": way, **m})
            print(
                f"| {size:,} | {way} | {m['sender_cpu_us']:.1f} | {m['receiver_cpu_us']:.1f} | {both:.1f} | "
                f"{m['wall_us']:.1f} | {base['wall_us'] / m['wall_us']:.2f} | {both / base_both:.2f} |"
            )
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"exchanges": args.exchanges, "rounds": args.rounds, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
