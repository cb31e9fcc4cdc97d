"""How this machine's idle cores wait, and a way to keep them from halting for a run.

A thread woken on a core that has nothing to run pays that core's way out of idle. Here (a Firecracker VM,
2 vCPUs) an idle vCPU halts at once: the kernel's command line sets ``cpuidle_haltpoll.force=1
haltpoll.guest_halt_poll_ns=0``, so the guest never polls before it halts, and every wake-up into a halted vCPU
is an interrupt through the host and back. On bare metal the same wake-up costs the exit from the C-state the
core chose, from a microsecond to about a hundred.

A lock-step is a chain: at most one of its processes works at a time and on 2 cores the other core idles. So
who waits how decides what a wake-up costs: a process that polls before it sleeps (the broker, its clients and
the ceilings, broker/tuning.py) is never woken, and a process woken while every core is busy goes to a busy
core without the host's round trip. godot_rl's trainer and the games sleep in ``recv``.

``hold_idle_polling()`` asks the kernel, through the CPU latency QoS device, to keep every core out of any idle
state with an exit latency above 0: the cpuidle driver then polls instead of halting, for as long as the
device stays open (``tuned``'s latency-performance profile does the same). That is how a machine whose idle
cores wake fast behaves, and it applies to every process alike; ``python -m benchmarks.run --idle-poll`` runs
all modes under it. It needs root (the device is 0600).

Only a cpuidle driver heeds that request. A kernel without one (``current_driver`` reads ``none``, as on some
builds of this VM) halts idle cores in its default idle routine whatever is asked, so there ``hold_idle_polling()``
refuses with that reason rather than let a run claim polling it did not get.

``idle_state()`` reads what there is to know about it: the cpuidle driver and governor, each idle state's name
and entry count on every core (the counts' change over a run says whether its cores halted or polled), the
halt-polling parameters and the QoS in force.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

QOS_DEVICE = Path("/dev/cpu_dma_latency")
CPUIDLE = Path("/sys/devices/system/cpu/cpuidle")
HALTPOLL_PARAMETERS = Path("/sys/module/haltpoll/parameters")
KERNEL_COMMAND_LINE = Path("/proc/cmdline")
_QOS_VALUE = struct.Struct("=i")  # the device reads and writes one native int, in microseconds


class IdlePollingUnavailable(RuntimeError):
    """The CPU latency QoS device cannot be held here (not Linux, or not root)."""


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def qos_latency_us() -> int | None:
    """The CPU latency every core is held to now, in microseconds (2,000,000,000: no request); None if unreadable."""
    try:
        fd = os.open(QOS_DEVICE, os.O_RDONLY)
    except OSError:
        return None
    try:
        (value,) = _QOS_VALUE.unpack(os.read(fd, _QOS_VALUE.size))
    except (OSError, struct.error):
        return None
    finally:
        os.close(fd)
    return int(value)


def idle_state() -> dict[str, Any]:
    """The idle settings and each idle state's entries so far, summed over the cores, shallowest state first."""
    usage: dict[str, int] = {}
    states = Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpuidle/state[0-9]*")
    for state in sorted(states, key=lambda path: int(path.name.removeprefix("state"))):
        name, count = _read(state / "name"), _read(state / "usage")
        if name is not None and count is not None and count.isdigit():
            usage[name] = usage.get(name, 0) + int(count)
    arguments = (_read(KERNEL_COMMAND_LINE) or "").split()
    return {
        "driver": _read(CPUIDLE / "current_driver"),
        "governor": _read(CPUIDLE / "current_governor"),
        "state_entries": usage,
        "guest_halt_poll_ns": _read(HALTPOLL_PARAMETERS / "guest_halt_poll_ns"),
        "kernel_idle_arguments": [a for a in arguments if "poll" in a or a.startswith(("idle=", "cpuidle"))],
        "qos_latency_us": qos_latency_us(),
    }


def request_keeps_cores_polling() -> bool:
    """Whether a CPU latency request can keep idle cores polling here. Only a cpuidle driver's governor reads
    it: a kernel without one halts idle cores in its default idle routine whatever is asked, unless booted
    with ``idle=poll`` (then they always poll)."""
    driver = _read(CPUIDLE / "current_driver")
    return driver not in (None, "none") or "idle=poll" in (_read(KERNEL_COMMAND_LINE) or "").split()


@contextlib.contextmanager
def hold_idle_polling() -> Iterator[None]:
    """Keep every core polling when idle (a CPU latency request of 0 us) until the block ends."""
    fd = -1
    try:
        fd = os.open(QOS_DEVICE, os.O_RDWR)
        heeded = request_keeps_cores_polling()  # asked before the request is made: nothing held in vain
        if heeded:
            os.write(fd, _QOS_VALUE.pack(0))
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        raise IdlePollingUnavailable(
            f"cannot hold {QOS_DEVICE} ({exc.strerror}): idle polling needs Linux and root"
        ) from None
    if not heeded:  # held, it would change nothing: say so rather than claim polling
        os.close(fd)
        raise IdlePollingUnavailable(
            "this kernel has no cpuidle driver: its idle cores halt whatever CPU latency is asked "
            "(only booting with idle=poll keeps them polling)"
        )
    try:
        yield
    finally:
        os.close(fd)  # the request ends with the last open file of it


def idle_polling_if(wanted: bool) -> contextlib.AbstractContextManager[None]:
    """``hold_idle_polling()`` when ``wanted`` (a benchmark's ``--idle-poll``), else nothing."""
    return hold_idle_polling() if wanted else contextlib.nullcontext()


def entries_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """How often the cores entered each idle state between two ``idle_state()`` readings."""
    was = before.get("state_entries", {})
    return {name: count - was.get(name, 0) for name, count in after.get("state_entries", {}).items()}
