"""A message's frame as a list of buffers for one gather write (``transport.writelines``, ``socket.sendmsg``).

The msgpack header pieces are packed as usual and joined per stretch; every large ``bin`` value (an
array's data) is not copied at all but sent from the array's own memory, which for an array decoded from a
received frame is that frame's buffer. ``b"".join(frame_buffers(kind, m))`` is byte for byte
``encode_message_frame(kind, m.to_wire())`` (tests/test_gather.py checks it against the shared vectors).
"""

from __future__ import annotations

import threading
from typing import Any, Final

import msgpack

from broker.protocol.codec import encode_message_frame
from broker.protocol.framing import HEADER, Buffer, bin_header
from broker.protocol.hot import encode_hot_godot_frame, hot_frame_buffers
from broker.protocol.kinds import BodyKind
from broker.protocol.messages import Batch, GameActions, GameStep, Message, TrainerAct

# A bin value at least this large is sent from its own memory; below it copying is cheaper than a buffer
# more to walk and write. A message with less array data than this is encoded in one buffer.
GATHER_MIN_BYTES: Final = 16 * 1024
MAX_BUFFERS: Final = 512  # well under IOV_MAX (1024 on Linux), what one sendmsg takes
# Free-form maps are packed whole (never walked): they hold no arrays.
_PACKED_WHOLE: Final = frozenset({"infos", "status"})


class _Packer(threading.local):
    def __init__(self) -> None:
        self.packer = msgpack.Packer(use_bin_type=True)


_packers = _Packer()


def array_bytes(message: Message) -> int:
    """Bytes of array data a hot-path message carries (0 for the others)."""
    if isinstance(message, Batch):
        return sum(a.nbytes for a in message.data.obs.values())
    if isinstance(message, GameStep):
        return sum(a.nbytes for data in message.groups.values() for a in data.obs.values())
    if isinstance(message, TrainerAct):
        return sum(a.nbytes for a in message.actions.values())
    if isinstance(message, GameActions):
        return sum(a.nbytes for arrays in message.groups.values() for a in arrays.values())
    return 0


def frame_buffers(kind: BodyKind, message: Message, writable_too: bool = False) -> list[Buffer]:
    """The message's frame, header included, as buffers to write in order with one gather write.

    Only read-only array memory (arrays decoded from a frame, ``bytes``) is referenced unless
    ``writable_too``: a transport that buffers what the socket does not take at once (asyncio) must not
    hold memory its owner may still change. A blocking ``sendmsg`` loop, which returns only once all is
    sent, may pass ``writable_too``.
    """
    if kind is not BodyKind.MSGPACK:
        return [whole_frame(kind, message)]
    buffers = hot_frame_buffers(message, GATHER_MIN_BYTES, writable_too)
    if buffers is not None:
        return buffers if len(buffers) <= MAX_BUFFERS else [b"".join(buffers)]
    if array_bytes(message) < GATHER_MIN_BYTES:
        return [whole_frame(kind, message)]
    return wire_buffers(message.to_wire(), writable_too=writable_too)


def whole_frame(kind: BodyKind, message: Message) -> bytes:
    """The message's frame as one buffer: a per-step message to a Godot peer from the C codec, anything
    else (and what it leaves) through ``to_wire`` and the codec's encoder."""
    frame = encode_hot_godot_frame(message) if kind is BodyKind.GODOT else None
    return frame if frame is not None else encode_message_frame(kind, message.to_wire())


def wire_buffers(wire: dict[str, Any], min_bytes: int = GATHER_MIN_BYTES, writable_too: bool = False) -> list[Buffer]:
    """A wire map's msgpack frame as buffers: bin values of ``min_bytes`` or more by reference (read-only
    ones only, unless ``writable_too``), the rest packed."""
    parts: list[Buffer] = []
    tail = _walk(wire, parts, bytearray(), _packers.packer, min_bytes if writable_too else -min_bytes)
    if tail or not parts:
        parts.append(tail)
    if len(parts) > MAX_BUFFERS:
        parts = [b"".join(parts)]
    size = sum(memoryview(p).nbytes for p in parts)
    parts[0] = HEADER.pack(size) + parts[0]  # a map's body begins with its packed header, never a bin
    return parts


def _walk(value: Any, parts: list[Buffer], small: bytearray, packer: msgpack.Packer, min_bytes: int) -> bytearray:
    """Append ``value``'s msgpack form: packed into ``small``, or (a large bin) as a buffer of its own
    after ``small``, which then starts afresh. Returns the current small piece. ``min_bytes`` < 0: only
    read-only bins of at least -``min_bytes`` are referenced."""
    kind = type(value)
    if kind is dict:
        small += packer.pack_map_header(len(value))
        for key, item in value.items():
            small += packer.pack(key)
            if key in _PACKED_WHOLE and type(key) is str:
                small += packer.pack(item)
            else:
                small = _walk(item, parts, small, packer, min_bytes)
        return small
    if kind is memoryview or kind is bytes:
        view = memoryview(value)
        size = view.nbytes
        if size >= abs(min_bytes) and (min_bytes > 0 or view.readonly):
            small += bin_header(size)
            parts.append(small)
            parts.append(value)
            return bytearray()
    small += packer.pack(value)
    return small
