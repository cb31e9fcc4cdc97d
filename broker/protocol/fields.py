"""The field tables behind the protocol's messages: one row per field (check, wire decoder, encoder), and
the generic construction check, ``to_wire`` and ``from_wire`` every message class shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from broker.protocol.arrays import decode_array, encode_array
from broker.protocol.errors import ErrorCode, RemoteProtocolError, summarize
from broker.protocol.limits import INT_MAX
from broker.protocol.spaces import MAX_NAME

MAX_TEXT = MAX_NAME * 8
MAX_ARRAY_KEYS = 64


def malformed(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.MALFORMED, message)


# --- field checks: (value, message label, key) -> None, raising for a value the message cannot hold ------


def is_int(value: Any) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def counter(minimum: int = 0) -> Callable[[Any, str, str], None]:
    def check(value: Any, what: str, key: str) -> None:
        if not is_int(value) or not minimum <= value <= INT_MAX:
            raise malformed(f"{what}.{key} must be an integer >= {minimum}, got {summarize(value)}")

    return check


def check_text(value: Any, what: str, key: str) -> None:
    if type(value) is not str or len(value) > MAX_TEXT:
        raise malformed(f"{what}.{key} must be a string of at most {MAX_TEXT} characters, got {summarize(value)}")


def check_array_map(value: Any, what: str, key: str) -> None:
    if type(value) is not dict or len(value) > MAX_ARRAY_KEYS:
        raise malformed(f"{what}.{key} must be a map of key to array")
    for name, array in value.items():
        if type(name) is not str or not isinstance(array, np.ndarray):
            raise malformed(f"{what}.{key}: entry {summarize(name)} must map a string to an array")


# --- wire decoders: (wire value or None when absent, label, key) -> the field's value -------------------


def decode_named_array(obj: Any, what: str, key: str) -> np.ndarray:
    """``decode_array`` naming the array ``what.key``; the name is only built for an error message."""
    try:
        return decode_array(obj, key)
    except RemoteProtocolError:
        return decode_array(obj, f"{what}.{key}")  # raises again, with the full name


def decode_named_arrays(obj: Any, what: str) -> dict[str, np.ndarray]:
    if not isinstance(obj, dict) or len(obj) > MAX_ARRAY_KEYS:
        raise malformed(f"{what} must be a map of key to array")
    return {(k if type(k) is str else str(k)): decode_named_array(v, what, str(k)) for k, v in obj.items()}


def encode_arrays(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: encode_array(v) for k, v in arrays.items()}


def decode_array_field(value: Any, what: str, key: str) -> dict[str, np.ndarray]:
    return decode_named_arrays(value, f"{what}.{key}")


@dataclass(frozen=True, slots=True)
class Field:
    """One row of a message's field table.

    ``check`` runs on construction; ``decode`` turns the wire value (None when the key is absent) into the
    field's value, raising the peer's error (default: ``check`` it and keep it); ``encode`` gives the wire
    value (default: the value itself). ``wire`` None merges the encoded map into the message's own map
    (and hands ``decode`` the whole message map). ``sent`` decides, per message, whether the key is written;
    ``absent`` stands in for a missing key (an explicit nil is still checked as nil).
    """

    name: str
    check: Callable[[Any, str, str], None]
    decode: Callable[[Any, str, str], Any] | None = None
    encode: Callable[[Any], Any] | None = None
    wire: str | None = ""
    sent: Callable[[Any], bool] | None = None
    absent: Any = None  # what ``decode`` gets when the key is missing
    key: str = field(init=False)  # the wire key (the name, unless ``wire`` says otherwise)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", self.wire or self.name)


class WireMessage:
    """Generic construction check, ``to_wire`` and ``from_wire`` driven by the subclass's ``FIELDS``."""

    __slots__ = ()
    TYPE: ClassVar[str]
    FIELDS: ClassVar[tuple[Field, ...]] = ()

    def __post_init__(self) -> None:
        what = self.TYPE
        for f in self.FIELDS:
            f.check(getattr(self, f.name), what, f.key)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": self.TYPE}
        for f in self.FIELDS:
            if f.sent is not None and not f.sent(self):
                continue
            value = getattr(self, f.name)
            if f.encode is not None:
                value = f.encode(value)
            if f.wire is None:
                wire.update(value)
            else:
                wire[f.key] = value
        return wire

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Any:
        what = cls.TYPE
        message = object.__new__(cls)
        for f in cls.FIELDS:
            raw = obj if f.wire is None else obj.get(f.key, f.absent)
            if f.decode is None:
                f.check(raw, what, f.key)
            else:
                raw = f.decode(raw, what, f.key)
            object.__setattr__(message, f.name, raw)  # checked (decoded) already: no second check
        return message

    @classmethod
    def _trusted(cls, values: dict[str, Any]) -> Any:
        """Build from values already checked, without checking them again."""
        message = object.__new__(cls)
        for name, value in values.items():
            object.__setattr__(message, name, value)
        return message
