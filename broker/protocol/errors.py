"""Protocol errors, split by blame (as h11 does): the peer's fault or ours."""

from __future__ import annotations

import itertools
from enum import Enum
from typing import Any, Final

# An error text goes into an error frame and a log line; a peer must not be able to make either large.
MAX_ERROR_TEXT: Final = 512
PREVIEW_CHARS: Final = 40


class ErrorCode(str, Enum):
    """Stable machine-readable codes carried in ``error`` frames."""

    MALFORMED = "malformed"  # body is not a decodable message
    FRAME_TOO_LARGE = "frame_too_large"
    VERSION_MISMATCH = "version_mismatch"
    UNKNOWN_MESSAGE = "unknown_message"  # a ``type`` this protocol does not define
    UNEXPECTED_MESSAGE = "unexpected_message"  # a known type, at the wrong time
    BAD_HELLO = "bad_hello"
    BAD_CONTROL = "bad_control"  # a control request the broker cannot carry out (it says why)
    BAD_SPACES = "bad_spaces"
    SPACE_MISMATCH = "space_mismatch"  # a game disagrees with the spaces already known for a policy
    BAD_STEP = "bad_step"
    BAD_ACTIONS = "bad_actions"
    UNKNOWN_POLICY = "unknown_policy"
    POLICY_TAKEN = "policy_taken"
    NO_FREE_GAME = "no_free_game"  # a sampler's claim: fewer unclaimed games than it asked for
    POLICY_TRAINED = "policy_trained"  # a sampler's claim: a policy of those games has a per-policy trainer
    BROKER_FULL = "broker_full"
    AUTH_FAILED = "auth_failed"
    HELLO_TIMEOUT = "hello_timeout"
    SLOW_PEER = "slow_peer"
    NOT_SUPPORTED = "not_supported"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """Base class; raise one of the two subclasses."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        if type(self) is ProtocolError:
            raise TypeError("raise LocalProtocolError or RemoteProtocolError, not ProtocolError")
        message = cap_text(message)
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class RemoteProtocolError(ProtocolError):
    """The peer sent something invalid. Tell it, log it, close its connection only."""


class LocalProtocolError(ProtocolError):
    """We tried to send something invalid: a bug on this side."""


def cap_text(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 40]}... ({len(text) - limit + 40} more characters)"


def summarize(value: Any) -> str:
    """A peer's value for an error text: its type, its size and a short prefix, never the whole value.

    Only the prefix is ever rendered, so a megabyte string or a list of a million items costs nothing here.
    """
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        digits = value.bit_length() * 0.302 + 1  # about the number of decimal digits, without building them
        return repr(value) if digits <= PREVIEW_CHARS else f"int of about {int(digits)} digits"
    if isinstance(value, str):
        if len(value) <= PREVIEW_CHARS:
            return ascii(value)
        return f"str of {len(value)} characters {value[:PREVIEW_CHARS]!a}..."
    if isinstance(value, (bytes, bytearray, memoryview)):
        size = memoryview(value).nbytes
        return f"{type(value).__name__} of {size} bytes {bytes(memoryview(value)[:16]).hex()}" + (
            "..." if size > 16 else ""
        )
    if isinstance(value, (list, tuple)):
        items = ", ".join(summarize(v) if _scalar(v) else type(v).__name__ for v in value[:3])
        return f"{type(value).__name__} of {len(value)} items [{items}{', ...' if len(value) > 3 else ''}]"
    if isinstance(value, dict):
        keys = ", ".join(summarize(k) if _scalar(k) else type(k).__name__ for k in itertools.islice(value, 3))
        return f"map of {len(value)} entries (keys {keys}{', ...' if len(value) > 3 else ''})"
    return type(value).__name__


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, bytes))
