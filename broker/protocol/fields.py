"""The field tables behind the protocol's messages: one row per field (check, wire decoder, encoder), and
the generic construction check, ``to_wire`` and ``from_wire`` every message class shares."""

from __future__ import annotations

import dataclasses
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
    """Construction check, ``to_wire``, ``from_wire`` and ``unchecked`` compiled from the subclass's ``FIELDS``.

    Each is generated once per class (as dataclasses generates ``__init__``): straight-line code with one
    statement per field, so the table costs nothing per message over a hand-written pair.
    """

    __slots__ = ()
    TYPE: ClassVar[str]
    FIELDS: ClassVar[tuple[Field, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _compile(cls)

    def __post_init__(self) -> None:  # replaced per class by _compile
        pass

    def to_wire(self) -> dict[str, Any]:  # replaced per class by _compile
        return {"type": self.TYPE}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Any:  # replaced per class by _compile
        return object.__new__(cls)

    @classmethod
    def unchecked(cls, *values: Any) -> Any:  # replaced per class by _compile
        """Build from field values (in ``FIELDS`` order) that are already checked: the broker's own replies
        and batches, made of what it decoded and checked. Skips the construction check."""
        return object.__new__(cls)

    @classmethod
    def _trusted(cls, values: dict[str, Any]) -> Any:
        """Build from values already checked, by name, without checking them again."""
        message = object.__new__(cls)
        for name, value in values.items():
            object.__setattr__(message, name, value)
        return message


_NO_DEFAULT = object()


def _compile(cls: type[WireMessage]) -> None:
    """Generate ``cls``'s four table-driven methods as straight-line code (see WireMessage)."""
    names: dict[str, Any] = {"_new": object.__new__, "_set": object.__setattr__, "_update": dict.update}
    exec(_source(cls, names), names)  # our own generated source, as dataclasses does
    for name in ("__post_init__", "to_wire"):
        if name not in vars(cls):
            setattr(cls, name, names[name])
    for name in ("from_wire", "unchecked"):
        if name not in vars(cls):  # a class may keep a hand-written from_wire (Hello's depends on the role)
            setattr(cls, name, classmethod(names[name]))


def _source(cls: type[WireMessage], names: dict[str, Any]) -> str:
    """The four methods' source, one statement per field; what it calls is put into ``names``."""
    what = getattr(cls, "TYPE", "")
    check, encode, decode, unchecked = [], [f"    wire = {{'type': {what!r}}}"], [], []
    for i, f in enumerate(cls.FIELDS):
        names[f"check{i}"], names[f"decode{i}"], names[f"encode{i}"] = f.check, f.decode, f.encode
        names[f"sent{i}"], names[f"absent{i}"] = f.sent, f.absent
        args = f"{what!r}, {f.key!r}"
        check.append(f"    check{i}(self.{f.name}, {args})")
        value = f"self.{f.name}" if f.encode is None else f"encode{i}(self.{f.name})"
        put = f"_update(wire, {value})" if f.wire is None else f"wire[{f.key!r}] = {value}"
        encode.append(f"    if sent{i}(self): {put}" if f.sent is not None else f"    {put}")
        raw = "obj" if f.wire is None else f"obj.get({f.key!r}, absent{i})"
        if f.decode is None:
            decode += [f"    raw = {raw}", f"    check{i}(raw, {args})", f"    _set(message, {f.name!r}, raw)"]
        else:
            decode.append(f"    _set(message, {f.name!r}, decode{i}({raw}, {args}))")
        unchecked.append(f"    _set(message, {f.name!r}, {f.name})")
    params = ["cls", *_parameters(cls, names)]
    return "\n".join(
        [
            "def __post_init__(self):",
            *(check or ["    pass"]),
            "def to_wire(self):",
            *encode,
            "    return wire",
            "def from_wire(cls, obj):",
            "    message = _new(cls)",
            *decode,  # in table order, so the first bad field is the one reported
            "    return message",
            f"def unchecked({', '.join(params)}):",
            "    message = _new(cls)",
            *unchecked,
            "    return message",
        ]
    )


def _parameters(cls: type[WireMessage], names: dict[str, Any]) -> list[str]:
    """``unchecked``'s parameters: the fields in table order, with their class-level defaults (read before
    dataclass takes them off the class)."""
    params = []
    for i, f in enumerate(cls.FIELDS):
        default = vars(cls).get(f.name, _NO_DEFAULT)
        if isinstance(default, dataclasses.Field):
            default = default.default
        if default is _NO_DEFAULT or default is dataclasses.MISSING:
            params.append(f.name)
        else:
            names[f"default{i}"] = default
            params.append(f"{f.name}=default{i}")
    return params
