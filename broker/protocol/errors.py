"""Protocol errors, split by blame (as h11 does): the peer's fault or ours."""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Stable machine-readable codes carried in ``error`` frames."""

    MALFORMED = "malformed"  # body is not a decodable message
    FRAME_TOO_LARGE = "frame_too_large"
    VERSION_MISMATCH = "version_mismatch"
    UNKNOWN_MESSAGE = "unknown_message"  # a ``type`` this protocol does not define
    UNEXPECTED_MESSAGE = "unexpected_message"  # a known type, at the wrong time
    BAD_HELLO = "bad_hello"
    BAD_SPACES = "bad_spaces"
    SPACE_MISMATCH = "space_mismatch"  # a game disagrees with the spaces already known for a policy
    BAD_STEP = "bad_step"
    BAD_ACTIONS = "bad_actions"
    UNKNOWN_POLICY = "unknown_policy"
    POLICY_TAKEN = "policy_taken"
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
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class RemoteProtocolError(ProtocolError):
    """The peer sent something invalid. Tell it, log it, close its connection only."""


class LocalProtocolError(ProtocolError):
    """We tried to send something invalid: a bug on this side."""
