"""Mapping the shared-memory ring a trainer on this host offers (docs/protocol.md §3b); the ring's own logic,
where frames go and when, is sans-IO in broker/protocol/ring.py.

The broker writes into memory a peer named, so it maps only what is unmistakably that peer's offer: a path of
the form ``/proc/<pid>/fd/<fd>``, opened and then seen (through our own descriptor) to be an anonymous memory
file (``memfd``) of the offered size holding the offered random token. Anything else, or a peer that is not on
this host, keeps the socket; the trainer is not refused for it.
"""

from __future__ import annotations

import contextlib
import hmac
import mmap
import os
import re
from typing import Final

from broker.protocol.ring import TOKEN_BYTES, TOKEN_OFFSET, RingOffer, RingWriter

_OFFERED_PATH: Final = re.compile(r"/proc/[0-9]{1,10}/fd/[0-9]{1,10}")


class RingUnusable(Exception):
    """Why an offered ring is not used (said in the log; the peer keeps the socket)."""


class MappedRing:
    """An offered ring, mapped: ``writer`` places frames in it; ``close`` unmaps it."""

    def __init__(self, offer: RingOffer) -> None:
        if not _OFFERED_PATH.fullmatch(offer.path):
            raise RingUnusable(f"{offer.path!r} is not a /proc/<pid>/fd/<fd> path")
        try:
            fd = os.open(offer.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:  # another host, another PID namespace, a process gone: the socket then
            raise RingUnusable(f"cannot open {offer.path}: {exc.strerror or exc}") from None
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")  # what we opened, not what the path said a moment ago
            if not target.startswith("/memfd:"):
                raise RingUnusable(f"{offer.path} is not an anonymous memory file")
            if os.fstat(fd).st_size != offer.size:
                raise RingUnusable(f"{offer.path} does not hold the offered {offer.size} bytes")
            self.map = mmap.mmap(fd, offer.size)
        finally:
            os.close(fd)  # the mapping keeps the memory
        self.view = memoryview(self.map)
        if not hmac.compare_digest(bytes(self.view[TOKEN_OFFSET : TOKEN_OFFSET + TOKEN_BYTES]), offer.token):
            self.close()
            raise RingUnusable(f"{offer.path} does not hold the offered token")
        self.writer = RingWriter(self.view)

    def close(self) -> None:
        """Unmap; never raises (it runs while a connection is torn down)."""
        self.view.release()
        with contextlib.suppress(BufferError):  # a view of it still alive: the mapping goes with the last one
            self.map.close()
