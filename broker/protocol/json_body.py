"""JSON bodies: the godot_rl plugin protocol's frames, ASCII only, within the limits every codec shares.

orjson decodes a text when it gives what the standard library gives; NaN, infinities, integers beyond 64
bits, lone surrogates and bad UTF-8 take the standard library's path, which refuses or keeps them as it does.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

import orjson

from broker.protocol.errors import ErrorCode, RemoteProtocolError, summarize
from broker.protocol.limits import INT_MAX, INT_MIN, MAX_FRAME_ELEMENTS, MAX_JSON_INT_DIGITS, MAX_NESTING


def pack_json(obj: dict[str, Any]) -> bytes:
    """JSON exactly as godot_rl's Python side writes it: default separators, ASCII only."""
    return json.dumps(obj).encode("ascii")


def unpack_json(body: bytes | memoryview) -> dict[str, Any]:
    """Decode a JSON object, within the limits every codec shares: at most MAX_FRAME_ELEMENTS values and
    MAX_NESTING levels (checked on the raw bytes, before parsing), integers of 64 bits, no lone surrogates
    (``"\\ud800"``: nothing could encode them again). Any failure is the peer's."""
    raw = body if type(body) is bytes else bytes(body)
    escaped = b"\\" in raw
    _check_json_bounds(raw, escaped)
    if _LONG_DIGITS not in raw.translate(_DIGITS_ONLY):  # every integer fits 64 bits: orjson decodes it alike
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:  # NaN, infinities, lone surrogates, bad UTF-8: the stdlib path says which
            pass
        else:
            if not isinstance(obj, dict):
                raise RemoteProtocolError(ErrorCode.MALFORMED, "JSON message must be an object")
            return obj
    try:
        text = str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"JSON body is not UTF-8: {exc}") from None
    try:
        obj = json.loads(text, parse_int=_json_int)
    except ValueError as exc:  # JSONDecodeError, and _json_int's refusals
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"undecodable JSON body: {exc}") from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(ErrorCode.MALFORMED, "JSON message must be an object")
    if escaped and _SURROGATE_ESCAPE.search(raw) is not None:  # rare: only then look at every string
        _check_strings(obj)
    return obj


_SURROGATE_ESCAPE: Final = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# 19 digits in a row: maybe an integer beyond 64 bits, which orjson would make a float; the stdlib's parse_int
# refuses it. Every other text is decoded by orjson, ~6-30x faster than json.loads with parse_int.
# Every digit becomes "0", every other byte a space: then a substring search finds a run (a regex: 10x slower).
_DIGITS_ONLY: Final = bytes(48 if 48 <= c <= 57 else 32 for c in range(256))
_LONG_DIGITS: Final = b"0" * 19
_INNERMOST: Final = re.compile(rb"\[\]|\{\}")
_STRUCTURE: Final = b'[]{}"'
_ALL_BUT_STRUCTURE: Final = bytes(c for c in range(256) if c not in _STRUCTURE)


def _check_json_bounds(raw: bytes, escaped: bool) -> None:
    """Refuse a JSON text with too many values or too deep a nesting, at C speed for ordinary texts.

    Every value but the first follows a comma, a colon or an opening bracket, so their count bounds the
    values (those inside strings included: an upper bound). For nesting the text is cut down to its
    structure: escaped backslashes and quotes are removed (when there are any), then every byte but
    brackets and quotes; the brackets outside strings are traced, only when there are more than
    MAX_NESTING of them in all.
    """
    if len(raw) > MAX_FRAME_ELEMENTS:  # a shorter text cannot hold more values than it has bytes
        marks = 0
        for mark in (b",", b"[", b"{", b":"):  # one pass each; a huge list is refused after the first
            marks += raw.count(mark)
            if marks > MAX_FRAME_ELEMENTS:
                raise RemoteProtocolError(
                    ErrorCode.MALFORMED, f"JSON body holds more than {MAX_FRAME_ELEMENTS} values ({len(raw)} bytes)"
                )
    if escaped:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = raw.translate(None, _ALL_BUT_STRUCTURE)
    opened = skeleton.count(b"[") + skeleton.count(b"{")
    if opened <= MAX_NESTING:
        return
    # Peel the innermost pairs of the brackets outside strings, one level per C-speed pass; a text whose
    # brackets do not pair up is traced byte by byte below.
    brackets = b"".join(skeleton.split(b'"')[::2])
    for _ in range(MAX_NESTING):
        peeled = _INNERMOST.sub(b"", brackets)
        if not peeled:
            return
        if len(peeled) == len(brackets):
            break
        brackets = peeled
    depth = 0
    for outside in skeleton.split(b'"')[::2]:  # the even pieces lie outside strings
        for bracket in outside:
            if bracket in b"[{":
                depth += 1
                if depth > MAX_NESTING:
                    raise RemoteProtocolError(ErrorCode.MALFORMED, f"JSON body nests deeper than {MAX_NESTING} levels")
            else:
                depth -= 1


def _json_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise ValueError(f"integer of {len(digits)} digits does not fit 64 bits")
    value = int(digits)
    if not INT_MIN <= value <= INT_MAX:
        raise ValueError(f"integer {value} does not fit 64 bits")
    return value


def _check_strings(value: Any, where: str = "JSON body") -> None:
    """Every string (keys too) must be encodable as UTF-8, as every codec and log line needs."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RemoteProtocolError(
                ErrorCode.MALFORMED, f"{where}: string {summarize(value)} holds a lone surrogate escape"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, where)
            _check_strings(item, where)
    elif isinstance(value, list):
        for item in value:
            _check_strings(item, where)
