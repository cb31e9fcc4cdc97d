"""Godot 4 Variant binary serialization (``var_to_bytes`` / ``bytes_to_var``), sans-IO.

The Godot addon writes message maps with ``var_to_bytes(dict)`` and reads them with ``bytes_to_var``;
this module is the Python side of that codec, for the subset of Variant types a message can hold.

Format (Godot "Binary serialization API", checked against the engine's ``core/io/marshalls.cpp``):

* every value starts with a 4-byte little-endian header: byte 0 is the ``Variant::Type``, byte 1 is
  unused, bytes 2-3 carry flags (``1 << 16`` = 64-bit for INT and FLOAT; container type kinds for
  typed ARRAY and DICTIONARY);
* everything is little-endian and padded to 4 bytes with zeros;
* INT is 32-bit unless the value needs 64; FLOAT is 32-bit when the value survives a round trip
  through a C ``float``, else 64-bit. The encoder follows the same rules, so for the same map it writes
  the same bytes as Godot does.

Python mapping: NIL <-> None, BOOL <-> bool, INT <-> int, FLOAT <-> float, STRING and STRING_NAME ->
str, DICTIONARY <-> dict, ARRAY <-> list, PACKED_BYTE_ARRAY <-> bytes (so array maps decode with
:func:`broker.protocol.arrays.decode_array` unchanged), PACKED_INT32/INT64/FLOAT32/FLOAT64_ARRAY ->
list of numbers, PACKED_STRING_ARRAY -> list of str.

``decode`` returns a dict or raises ``RemoteProtocolError(MALFORMED)``, for any input: declared
counts are checked against the bytes left before anything is allocated, and nesting (MAX_NESTING) and
the values of a body in all (MAX_FRAME_ELEMENTS, packed array items included) are bounded.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from broker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from broker.protocol.limits import MAX_FRAME_ELEMENTS, MAX_NESTING

# Variant::Type values of Godot 4 (the ones this codec reads or writes).
NIL: Final = 0
BOOL: Final = 1
INT: Final = 2
FLOAT: Final = 3
STRING: Final = 4
STRING_NAME: Final = 21
DICTIONARY: Final = 27
ARRAY: Final = 28
PACKED_BYTE_ARRAY: Final = 29
PACKED_INT32_ARRAY: Final = 30
PACKED_INT64_ARRAY: Final = 31
PACKED_FLOAT32_ARRAY: Final = 32
PACKED_FLOAT64_ARRAY: Final = 33
PACKED_STRING_ARRAY: Final = 34
VARIANT_MAX: Final = 39  # PACKED_VECTOR4_ARRAY (38) is the last type of Godot 4.3+

FLAG_64: Final = 1 << 16
TYPE_MASK: Final = 0xFF
UNUSED_BYTE_MASK: Final = 0xFF00
# Typed containers: a 2-bit "type kind" per element (ARRAY: bits 16-17; DICTIONARY: key 16-17, value 18-19).
KIND_NONE: Final = 0
KIND_BUILTIN: Final = 1
MAX_DEPTH: Final = MAX_NESTING  # messages nest about 6 deep; Godot's own limit is 1024
INT32_MIN: Final = -(1 << 31)
INT32_MAX: Final = (1 << 31) - 1
INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
COUNT_MASK: Final = 0x7FFFFFFF  # DICTIONARY / ARRAY counts: the top bit is Godot's old "shared" flag

_U32: Final = struct.Struct("<I")
_I32: Final = struct.Struct("<i")
_I64: Final = struct.Struct("<q")
_F32: Final = struct.Struct("<f")
_F64: Final = struct.Struct("<d")
_PACKED_ITEM: Final = {
    PACKED_INT32_ARRAY: "i",
    PACKED_INT64_ARRAY: "q",
    PACKED_FLOAT32_ARRAY: "f",
    PACKED_FLOAT64_ARRAY: "d",
}
_PAD: Final = (b"", b"\0\0\0", b"\0\0", b"\0")  # indexed by length % 4


def _malformed(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.MALFORMED, f"Godot Variant body: {message}")


# --- decoding -------------------------------------------------------------------------------------


def decode(body: bytes | bytearray | memoryview) -> dict[Any, Any]:
    """``bytes_to_var`` of a whole frame body, which must be exactly one Dictionary."""
    data = bytes(body)
    # The common case first: a message of plain types, read without per-read bound checks (a short
    # read raises struct.error instead). Anything else, valid or not, is read again by the checked
    # decoder below, which gives the same values or the precise error. The fast reader keeps no value
    # budget: it only takes bodies too short to hold more than MAX_FRAME_ELEMENTS values (each value
    # it reads has a 4-byte header; packed arrays other than bytes are left to the checked decoder).
    if len(data) <= FAST_MAX_BYTES:
        try:
            value, end = _fast_value(data, 0, 0)
            if end == len(data) and type(value) is dict:
                return value
        except (_Unusual, struct.error, UnicodeDecodeError, RecursionError):
            pass
    try:
        value, end = _Decoder(data).value(0, 0)
    except RecursionError:  # unreachable with MAX_DEPTH, kept so the contract holds regardless
        raise _malformed("nested too deeply") from None
    if end != len(data):
        raise _malformed(f"{len(data) - end} trailing bytes after the message")
    if not isinstance(value, dict):
        raise _malformed(f"message must be a Dictionary, got {type(value).__name__}")
    return value


# Bodies up to this size are read by the fast reader (and by the C codec's, broker/protocol/_native.c, which
# takes what the fast reader takes); a longer body could hold more than MAX_FRAME_ELEMENTS values.
FAST_MAX_BYTES: Final = 4 * MAX_FRAME_ELEMENTS


class _Unusual(Exception):
    """Raised by the fast decoder for anything it does not read itself: the checked decoder does."""


_unpack_u32 = _U32.unpack_from
_unpack_i32 = _I32.unpack_from
_unpack_i64 = _I64.unpack_from
_unpack_f32 = _F32.unpack_from
_unpack_f64 = _F64.unpack_from
_INT64_HEADER: Final = INT | FLAG_64
_FLOAT64_HEADER: Final = FLOAT | FLAG_64


def _fast_value(data: bytes, pos: int, depth: int) -> tuple[Any, int]:
    """The value at ``pos`` for the types a message holds (untyped containers); else ``_Unusual``."""
    (header,) = _unpack_u32(data, pos)
    pos += 4
    if header == STRING:
        (length,) = _unpack_u32(data, pos)
        end = pos + 4 + length
        padded = end + len(_PAD[length % 4])
        if padded > len(data):
            raise _Unusual
        return data[pos + 4 : end].decode("utf-8"), padded
    if header == DICTIONARY:
        (count,) = _unpack_u32(data, pos)
        pos += 4
        if count > COUNT_MASK or depth >= MAX_DEPTH or pos + count * 8 > len(data):
            raise _Unusual
        out: dict[Any, Any] = {}
        for _ in range(count):
            key, pos = _fast_value(data, pos, depth + 1)
            if type(key) is dict or type(key) is list:
                raise _Unusual
            out[key], pos = _fast_value(data, pos, depth + 1)
        return out, pos
    if header == PACKED_BYTE_ARRAY:
        (count,) = _unpack_u32(data, pos)
        start = pos + 4
        end = start + count + len(_PAD[count % 4])
        if end > len(data):
            raise _Unusual
        return data[start : start + count], end
    if header == INT:
        return _unpack_i32(data, pos)[0], pos + 4
    if header == FLOAT:
        return _unpack_f32(data, pos)[0], pos + 4
    if header == ARRAY:
        (count,) = _unpack_u32(data, pos)
        pos += 4
        if count > COUNT_MASK or depth >= MAX_DEPTH or pos + count * 4 > len(data):
            raise _Unusual
        items: list[Any] = []
        for _ in range(count):
            item, pos = _fast_value(data, pos, depth + 1)
            items.append(item)
        return items, pos
    if header == BOOL:
        (raw,) = _unpack_u32(data, pos)
        if raw > 1:
            raise _Unusual
        return raw == 1, pos + 4
    if header == NIL:
        return None, pos
    if header == _INT64_HEADER:
        return _unpack_i64(data, pos)[0], pos + 8
    if header == _FLOAT64_HEADER:
        return _unpack_f64(data, pos)[0], pos + 8
    raise _Unusual


class _Decoder:
    """Reads values from ``data``; every read checks the bytes left before touching them."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.budget = MAX_FRAME_ELEMENTS  # values this body may still hold

    def _spend(self, count: int, pos: int) -> None:
        """Count ``count`` more values before they are built."""
        self.budget -= count
        if self.budget < 0:
            raise _malformed(f"more than {MAX_FRAME_ELEMENTS} values in one body (at offset {pos})")

    def _need(self, pos: int, size: int, what: str) -> None:
        if size < 0 or pos + size > len(self.data):
            raise _malformed(f"{what} needs {size} bytes at offset {pos}, only {len(self.data) - pos} left")

    def _u32(self, pos: int, what: str) -> int:
        self._need(pos, 4, what)
        return int(_U32.unpack_from(self.data, pos)[0])

    def value(self, pos: int, depth: int) -> tuple[Any, int]:
        """The value at ``pos`` and the offset just after it."""
        if depth > MAX_DEPTH:
            raise _malformed(f"nested deeper than {MAX_DEPTH} levels")
        header = self._u32(pos, "value header")
        kind = header & TYPE_MASK
        flags = header >> 16
        if header & UNUSED_BYTE_MASK:
            raise _malformed(f"header 0x{header:08x} at offset {pos} sets the unused byte")
        pos += 4
        if kind in (INT, FLOAT):
            if flags not in (0, 1):
                raise _malformed(f"unknown flags 0x{flags:04x} on type {kind} at offset {pos - 4}")
            return self._number(kind, flags == 1, pos)
        if kind == DICTIONARY:
            return self._dictionary(pos, flags, depth)
        if kind == ARRAY:
            return self._array(pos, flags, depth)
        if flags:
            raise _malformed(f"unknown flags 0x{flags:04x} on type {kind} at offset {pos - 4}")
        if kind == NIL:
            return None, pos
        if kind == BOOL:
            raw = self._u32(pos, "bool")
            if raw > 1:
                raise _malformed(f"bool at offset {pos} is {raw}, not 0 or 1")
            return raw == 1, pos + 4
        if kind in (STRING, STRING_NAME):
            return self._string(pos)
        if kind == PACKED_BYTE_ARRAY:
            count = self._u32(pos, "PackedByteArray size")
            self._need(pos + 4, count, "PackedByteArray data")
            start = pos + 4
            end = start + count + len(_PAD[count % 4])
            self._need(start, end - start, "PackedByteArray padding")
            return self.data[start : start + count], end
        if kind in _PACKED_ITEM:
            return self._packed_numbers(kind, pos)
        if kind == PACKED_STRING_ARRAY:
            return self._packed_strings(pos)
        if kind >= VARIANT_MAX:
            raise _malformed(f"unknown Variant type {kind} at offset {pos - 4}")
        raise _malformed(f"Variant type {kind} at offset {pos - 4} cannot appear in a message")

    def _number(self, kind: int, wide: bool, pos: int) -> tuple[Any, int]:
        size = 8 if wide else 4
        self._need(pos, size, "number")
        if kind == INT:
            codec = _I64 if wide else _I32
            return int(codec.unpack_from(self.data, pos)[0]), pos + size
        codec = _F64 if wide else _F32
        return float(codec.unpack_from(self.data, pos)[0]), pos + size

    def _string(self, pos: int) -> tuple[str, int]:
        length = self._u32(pos, "string length")
        padded = length + len(_PAD[length % 4])
        self._need(pos + 4, padded, "string")
        raw = self.data[pos + 4 : pos + 4 + length]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _malformed(f"string at offset {pos} is not UTF-8") from None
        return text, pos + 4 + padded

    def _container_type(self, kind: int, pos: int, what: str) -> int:
        """Skip a typed container's element type (builtin types only; objects are not message data)."""
        if kind == KIND_NONE:
            return pos
        if kind != KIND_BUILTIN:
            raise _malformed(f"{what} at offset {pos} is typed with a class or script; only builtin types")
        element_type = self._u32(pos, f"{what} element type")
        if element_type >= VARIANT_MAX:
            raise _malformed(f"{what} at offset {pos} is typed with unknown type {element_type}")
        return pos + 4

    def _dictionary(self, pos: int, flags: int, depth: int) -> tuple[dict[Any, Any], int]:
        if flags & ~0b1111:
            raise _malformed(f"unknown Dictionary flags 0x{flags:04x}")
        pos = self._container_type(flags & 0b11, pos, "Dictionary key")
        pos = self._container_type((flags >> 2) & 0b11, pos, "Dictionary value")
        count = self._u32(pos, "Dictionary size") & COUNT_MASK
        pos += 4
        self._need(pos, count * 8, f"Dictionary of {count} entries")  # each key and value >= 4 bytes
        self._spend(2 * count, pos)
        out: dict[Any, Any] = {}
        for _ in range(count):
            key, pos = self.value(pos, depth + 1)
            value, pos = self.value(pos, depth + 1)
            if isinstance(key, (dict, list)):
                raise _malformed(f"Dictionary key at offset {pos} is a {type(key).__name__}")
            out[key] = value
        return out, pos

    def _array(self, pos: int, flags: int, depth: int) -> tuple[list[Any], int]:
        if flags & ~0b11:
            raise _malformed(f"unknown Array flags 0x{flags:04x}")
        pos = self._container_type(flags, pos, "Array")
        count = self._u32(pos, "Array size") & COUNT_MASK
        pos += 4
        self._need(pos, count * 4, f"Array of {count} elements")  # each element >= 4 bytes
        self._spend(count, pos)
        out: list[Any] = []
        for _ in range(count):
            item, pos = self.value(pos, depth + 1)
            out.append(item)
        return out, pos

    def _packed_numbers(self, kind: int, pos: int) -> tuple[list[Any], int]:
        item = _PACKED_ITEM[kind]
        count = self._u32(pos, "packed array size")
        size = count * struct.calcsize(item)
        self._need(pos + 4, size, f"packed array of {count} items")
        self._spend(count, pos)
        values = struct.unpack_from(f"<{count}{item}", self.data, pos + 4)
        return list(values), pos + 4 + size

    def _packed_strings(self, pos: int) -> tuple[list[str], int]:
        count = self._u32(pos, "PackedStringArray size")
        pos += 4
        self._need(pos, count * 4, f"PackedStringArray of {count} strings")
        self._spend(count, pos)
        out: list[str] = []
        for _ in range(count):
            text, pos = self._string(pos)
            out.append(text[:-1] if text.endswith("\0") else text)  # Godot counts the terminator
        return out, pos


# --- encoding -------------------------------------------------------------------------------------


def encode(obj: Mapping[Any, Any]) -> bytes:
    """``var_to_bytes`` of a message map: the bytes Godot writes for the same Dictionary."""
    if not isinstance(obj, Mapping):
        raise LocalProtocolError(ErrorCode.INTERNAL, f"a message must be a map, not {type(obj).__name__}")
    out = bytearray()
    _encode_value(out, obj, 0)
    return bytes(out)


def _header(out: bytearray, kind: int, flags: int = 0) -> None:
    out += _U32.pack(kind | flags)


def _encode_string(out: bytearray, text: str, kind: int = STRING) -> None:
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(ErrorCode.INTERNAL, f"string is not encodable as UTF-8: {exc}") from None
    _header(out, kind)
    out += _U32.pack(len(raw))
    out += raw
    out += _PAD[len(raw) % 4]


def _fits_float32(value: float) -> bool:
    try:
        narrowed: float = _F32.unpack(_F32.pack(value))[0]
    except OverflowError:
        return False
    return narrowed == value  # False for NaN, as in Godot's ``double(f) != d`` test


def _encode_value(out: bytearray, value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise LocalProtocolError(ErrorCode.INTERNAL, f"message nests deeper than {MAX_DEPTH} levels")
    # The exact types most message values have first: the isinstance chain below costs every value.
    kind = type(value)
    if kind is str:
        _encode_string(out, value)
    elif kind is dict:
        out += _U32.pack(DICTIONARY)
        out += _U32.pack(len(value))
        for key, item in value.items():
            _encode_value(out, key, depth + 1)
            _encode_value(out, item, depth + 1)
    elif kind is int and INT32_MIN <= value <= INT32_MAX:
        out += _U32.pack(INT)
        out += _I32.pack(value)
    elif value is None:
        _header(out, NIL)
    elif isinstance(value, (bool, np.bool_)):
        _header(out, BOOL)
        out += _U32.pack(1 if value else 0)
    elif isinstance(value, (int, np.integer)):
        number = int(value)
        if not INT64_MIN <= number <= INT64_MAX:
            raise LocalProtocolError(ErrorCode.INTERNAL, f"integer {number} does not fit a Godot int (64-bit)")
        if INT32_MIN <= number <= INT32_MAX:
            _header(out, INT)
            out += _I32.pack(number)
        else:
            _header(out, INT, FLAG_64)
            out += _I64.pack(number)
    elif isinstance(value, (float, np.floating)):
        real = float(value)
        if _fits_float32(real):
            _header(out, FLOAT)
            out += _F32.pack(real)
        else:
            _header(out, FLOAT, FLAG_64)
            out += _F64.pack(real)
    elif isinstance(value, str):
        _encode_string(out, value)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        # Array maps carry a C-contiguous memoryview of any item format: its raw bytes are the data.
        raw = value if not isinstance(value, memoryview) or value.c_contiguous else value.tobytes()
        size = raw.nbytes if isinstance(raw, memoryview) else len(raw)
        _header(out, PACKED_BYTE_ARRAY)
        out += _U32.pack(size)
        out += raw
        out += _PAD[size % 4]
    elif isinstance(value, Mapping):
        _header(out, DICTIONARY)
        out += _U32.pack(len(value))
        for key, item in value.items():
            _encode_value(out, key, depth + 1)
            _encode_value(out, item, depth + 1)
    elif isinstance(value, (list, tuple)):
        _header(out, ARRAY)
        out += _U32.pack(len(value))
        for item in value:
            _encode_value(out, item, depth + 1)
    else:
        raise LocalProtocolError(ErrorCode.INTERNAL, f"cannot encode {type(value).__name__} as a Godot Variant")
