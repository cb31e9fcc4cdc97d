"""Length-prefixed frames: ``u32 little-endian length`` then that many body bytes.

The same framing is used by the godot_rl plugin (JSON bodies) and by this protocol (msgpack bodies),
which is what lets both share one port.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Final

import numpy as np

from broker.protocol.errors import ErrorCode, RemoteProtocolError

HEADER: Final = struct.Struct("<I")
Buffer = bytes | bytearray | memoryview  # what a frame is written from
_BIN8, _BIN16, _BIN32 = struct.Struct(">BB"), struct.Struct(">BH"), struct.Struct(">BI")


def bin_header(size: int) -> bytes:
    """The msgpack header of a ``bin`` value of ``size`` bytes, for writing its payload from elsewhere."""
    if size < 0x100:
        return _BIN8.pack(0xC4, size)
    return _BIN16.pack(0xC5, size) if size < 0x10000 else _BIN32.pack(0xC6, size)


DEFAULT_MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
# What one read asks for while no frame body is open (headers and small frames). A larger body gets a
# buffer of its own once its header is in; at most this much of it lands here first and is copied once.
DEFAULT_READ_BYTES: Final = 8 * 1024
# A body up to this size gets its buffer as soon as its header is in. A larger one only once an eighth of
# it has arrived (what came before is kept as it came and copied once), so a header alone never makes
# us allocate more than 8x what a peer has really sent.
EAGER_BODY_BYTES: Final = 1 << 20

# Where the last get_buffer() pointed the read: the open frame's own buffer, a large frame's next piece, the
# shared scratch (small frames), or a fresh buffer sized by the last frame.
_INTO_BODY: Final = 0
_INTO_STAGING: Final = 1
_INTO_SCRATCH: Final = 2
_INTO_FRESH: Final = 3

Body = bytes | memoryview  # a frame body: a view into received bytes or a frame's own buffer when no copy was needed


def new_buffer(size: int) -> memoryview:
    """``size`` writable bytes, not zeroed (``bytearray(size)`` would write them all once more before the
    frame's bytes do), as a flat view that slice assignment fills with one copy: ``bytearray[a:b] = view``
    first copies a non-bytearray ``view`` into a temporary bytearray (CPython's ``bytearray_ass_subscript``)."""
    return np.empty(size, np.uint8).data


def encode_frame(body: bytes | bytearray | memoryview) -> bytes:
    """Header and body as one bytes object (one copy of the body), so a frame goes out in a single write."""
    return b"".join((HEADER.pack(memoryview(body).nbytes), body))


class FrameDecoder:
    """Splits a byte stream into frame bodies, sans-IO. Two ways in:

    * ``feed(data)``: bytes someone else read. A body lying inside one ``bytes`` chunk is handed out as a
      zero-copy view of it; one spread over chunks is assembled once into its own buffer.
    * ``get_buffer()`` / ``buffer_updated(n)`` (asyncio's BufferedProtocol, ``socket.recv_into``): the
      reader receives straight into memory that becomes the frames. With no frame open, a read after a
      large frame gets a fresh buffer that size and some: the frames inside it are handed out as views of
      it, and a frame that runs past the read's end is filled in place by the next reads. After a small
      frame reads share one scratch buffer, and each frame is copied out of it (a few KiB: cheaper than a
      fresh buffer). A frame larger than its read's buffer gets one of its own, and only the bytes that
      came with its header are copied.

    A frame's own buffer is never reused, so the views handed out (and arrays decoded from them) stay
    valid for as long as anyone holds them. They are read-only unless ``writable_bodies``: a client that
    alone owns what it decodes may hand such arrays on without copying them.

    The declared length is checked against ``max_frame_bytes`` when ``next_frame_view`` reaches the header
    (so a limit raised after a hello applies to the frames behind it), before the body is allocated: a
    hostile length never makes us buffer or allocate it.
    """

    def __init__(
        self,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        read_bytes: int = DEFAULT_READ_BYTES,
        writable_bodies: bool = False,
    ) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.writable_bodies = writable_bodies
        self._read_bytes = read_bytes
        self._read_size = read_bytes  # of the next fresh buffer: the last frame's size, and some
        self._scratch: memoryview | None = None  # reused for small frames: nothing handed out points into it
        self._given: memoryview | None = None  # what the last get_buffer() returned, and which kind it was
        self._given_kind = _INTO_BODY
        self._ready: deque[Body] = deque()  # complete bodies, oldest first
        self._head = bytearray()  # header bytes of the next frame, until there are 4
        self._body: memoryview | None = None  # the open frame's own buffer (new_buffer)
        self._filled = 0  # bytes of _body received
        self._length = 0  # of a large frame whose buffer is not allocated yet (0: none)
        self._pieces: list[memoryview] = []  # its bytes so far, immutable
        self._collected = 0
        self._held: deque[memoryview] = deque()  # input waiting behind a header not yet accepted
        self._buffered = 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet returned as frames (headers included)."""
        return self._buffered

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        # A caller may reuse a bytearray or memoryview after this call: keep only immutable bytes.
        chunk = data if type(data) is bytes else bytes(data)
        self._buffered += len(chunk)
        self._consume(memoryview(chunk), owned=True)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next read should go: the open frame's remaining bytes, else the scratch (after a small frame)
        or a fresh buffer (after a large one)."""
        if not self._held and self._body is not None:
            kind, given = _INTO_BODY, self._body[self._filled :]
        elif not self._held and self._length:  # reads grow with what has arrived (at most 2x of it)
            size = min(max(self._read_bytes, self._collected), self._length - self._collected)
            kind, given = _INTO_STAGING, new_buffer(size)
        elif self._read_size <= self._read_bytes:  # small frames: one buffer for every read, copied out
            if self._scratch is None:
                self._scratch = memoryview(bytearray(self._read_bytes))
            kind, given = _INTO_SCRATCH, self._scratch
        else:
            kind, given = _INTO_FRESH, new_buffer(self._read_size)
        self._given_kind, self._given = kind, given
        return given

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written at the start of the last ``get_buffer()``."""
        given, self._given = self._given, None
        if nbytes <= 0:
            return
        assert given is not None  # get_buffer() came first
        self._buffered += nbytes
        kind = self._given_kind
        if kind == _INTO_BODY:
            assert self._body is not None
            self._filled += nbytes
            if self._filled == len(self._body):
                self._finish_body()
        elif kind == _INTO_STAGING:
            self._collect(given[:nbytes])
        elif kind == _INTO_SCRATCH:
            self._consume(given[:nbytes], owned=False)
        else:  # never written again but where a frame still open in it goes on
            view = given if self.writable_bodies else given.toreadonly()
            self._consume(view[:nbytes], owned=True, room=given)

    def _consume(self, view: memoryview, owned: bool, room: memoryview | None = None) -> None:
        """Split ``view`` into frames as far as headers already accepted allow. ``owned``: ``view`` is of
        bytes nobody writes again, which may be handed out; else everything kept is copied. ``room``: the
        fresh buffer ``view`` begins, writable; a frame that fits in it past ``view`` is finished there."""
        if self._held:
            self._held.append(view if owned else memoryview(bytes(view)))
            return
        pos, size = 0, len(view)
        while pos < size:
            if self._length:
                take = min(self._length - self._collected, size - pos)
                piece = view[pos : pos + take]
                self._collect(piece if owned else memoryview(bytes(piece)))
                pos += take
                continue
            body = self._body
            if body is not None:
                take = min(len(body) - self._filled, size - pos)
                body[self._filled : self._filled + take] = view[pos : pos + take]
                self._filled += take
                pos += take
                if self._filled == len(body):
                    self._finish_body()
                continue
            if not self._head and size - pos >= HEADER.size:  # the common case: a whole header in view
                length = HEADER.unpack_from(view, pos)[0]
                if self._ready or length > self.max_frame_bytes:
                    self._head += view[pos : pos + HEADER.size]
                pos += HEADER.size
            else:
                take = min(HEADER.size - len(self._head), size - pos)
                self._head += view[pos : pos + take]
                pos += take
                if len(self._head) < HEADER.size:
                    return
                length = HEADER.unpack(self._head)[0]
                if not (self._ready or length > self.max_frame_bytes):
                    self._head.clear()
            if self._ready or length > self.max_frame_bytes:
                # Accepted only when next_frame_view reaches it, against the limit in force then.
                rest = view[pos:]
                if rest:
                    self._held.append(rest if owned else memoryview(bytes(rest)))
                return
            left = size - pos
            if length <= left:
                piece = view[pos : pos + length]
                self._ready.append(piece if owned else bytes(piece))
                pos += length
            elif room is not None and pos + length <= len(room):  # its next reads go on in place
                self._body = room[pos : pos + length]
                self._filled = left
                return
            else:
                self._open_body(length)
                rest = view[pos:]
                if rest:
                    self._consume(rest, owned)
                return

    def _open_body(self, length: int) -> None:
        if length <= EAGER_BODY_BYTES:
            self._body = new_buffer(length)
            self._filled = 0
        else:
            self._length = length

    def _collect(self, piece: memoryview) -> None:
        """Keep a piece of a large frame; allocate its buffer once an eighth of it is in."""
        self._pieces.append(piece)
        self._collected += len(piece)
        if self._collected * 8 < self._length and self._collected < self._length:
            return
        body = self._body = new_buffer(self._length)
        filled = 0
        for piece in self._pieces:
            body[filled : filled + len(piece)] = piece
            filled += len(piece)
        self._filled = filled
        self._length = self._collected = 0
        self._pieces = []
        if filled == len(body):
            self._finish_body()

    def _finish_body(self) -> None:
        assert self._body is not None
        body = self._body
        self._ready.append(body if self.writable_bodies else body.toreadonly())
        self._body = None
        self._filled = 0

    def next_frame(self) -> bytes | None:
        """The next complete body as ``bytes`` (at most one copy), or None until more data arrives."""
        body = self.next_frame_view()
        return body if body is None or type(body) is bytes else bytes(body)

    def next_frame_view(self) -> Body | None:
        """The next complete body, or None until more data arrives: zero-copy where possible."""
        if not self._ready and len(self._head) == HEADER.size:
            self._accept_header()
        if not self._ready:
            return None
        body = self._ready.popleft()
        size = HEADER.size + len(body)
        self._buffered -= size
        # The next read's buffer holds a frame like this one whole, and the read then stops short of its end.
        self._read_size = max(self._read_bytes, min(size, EAGER_BODY_BYTES) + self._read_bytes // 2)
        return body

    def _accept_header(self) -> None:
        """Take on the frame whose header waited (behind frames not yet returned, or over the limit)."""
        length = HEADER.unpack(self._head)[0]
        if length > self.max_frame_bytes:
            raise RemoteProtocolError(
                ErrorCode.FRAME_TOO_LARGE,
                f"frame declares {length} bytes; the limit is {self.max_frame_bytes}",
            )
        self._head.clear()
        if length == 0:
            self._ready.append(b"")
        else:
            self._open_body(length)
        held, self._held = self._held, deque()
        while held:
            self._consume(held.popleft(), owned=True)  # held pieces are immutable copies or fed bytes
            if self._held:  # stopped at another header: keep the rest behind it
                self._held.extend(held)
                return
