"""The first message of every native peer (its checks depend on the role it names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode, RemoteProtocolError, summarize
from broker.protocol.fields import Field, WireMessage, check_text, is_int
from broker.protocol.limits import MAX_CLAIM, MAX_GROUPS
from broker.protocol.ring import RingOffer
from broker.protocol.spaces import MAX_NAME, GroupSpec
from broker.protocol.stepping import StepOptions


def _bad_hello(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.BAD_HELLO, message)


def _role(value: Any, what: str, key: str) -> None:
    if value not in ("game", "trainer", "sampler", "observer", "control"):
        raise _bad_hello(
            f"hello.role must be 'game', 'trainer', 'sampler', 'observer' or 'control', got {summarize(value)}"
        )


ALL_GAMES: Final = "all"  # a sampler's claim of every unclaimed game on the broker


def _claim(value: Any, what: str, key: str) -> None:
    if value != ALL_GAMES and (not is_int(value) or not 1 <= value <= MAX_CLAIM):
        raise _bad_hello(f"hello.claim_games must be 1 to {MAX_CLAIM} or 'all', got {summarize(value)}")


def _protocol(value: Any, what: str, key: str) -> None:
    if not is_int(value):
        raise RemoteProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"peer speaks protocol {summarize(value)}, this broker speaks {PROTOCOL_VERSION}",
        )


def _token(value: Any, what: str, key: str) -> None:
    if value is not None and not isinstance(value, str):
        raise _bad_hello("hello.token must be a string")


def _group_specs(value: Any, what: str, key: str) -> None:
    if not isinstance(value, tuple) or not all(isinstance(g, GroupSpec) for g in value):
        raise _bad_hello("hello.groups must be a tuple of GroupSpec")


def _policy_name(value: Any, what: str, key: str) -> None:
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise _bad_hello("hello.policy must be a non-empty string")


def _ring(value: Any, what: str, key: str) -> None:
    if value is not None and not isinstance(value, RingOffer):
        raise _bad_hello("hello.ring must be a RingOffer")


def _stepping(value: Any, what: str, key: str) -> None:
    if value is not None and not isinstance(value, StepOptions):
        raise _bad_hello("hello.stepping must be StepOptions")


@dataclass(frozen=True, slots=True)
class Hello(WireMessage):
    """First message of every native peer: a game, a trainer, or an observer asking for status."""

    TYPE: ClassVar[str] = "hello"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("protocol", _protocol),
        Field("role", _role),
        Field("name", check_text),
        Field("token", _token, sent=lambda m: m.token is not None),
        Field("groups", _group_specs, encode=lambda gs: [g.to_wire() for g in gs], sent=lambda m: m.role == "game"),
        Field("policy", _policy_name, sent=lambda m: m.role == "trainer"),
        Field(
            "stepping",
            _stepping,
            encode=lambda s: s.to_wire(),
            sent=lambda m: m.role in ("trainer", "sampler") and m.stepping is not None,
        ),
        Field("claim_games", _claim, sent=lambda m: m.role == "sampler"),
        Field("ring", _ring, encode=lambda r: r.to_wire(), sent=lambda m: m.role == "trainer" and m.ring is not None),
    )
    role: Literal["game", "trainer", "sampler", "observer", "control"]  # control: one Control request, answered
    protocol: int
    name: str = ""
    token: str | None = None
    groups: tuple[GroupSpec, ...] = ()  # games only
    policy: str = ""  # trainers only
    stepping: StepOptions | None = None  # trainers and samplers; None: the broker's defaults
    claim_games: int | str = ALL_GAMES  # samplers only: how many games, or ALL_GAMES
    ring: RingOffer | None = None  # trainers only: shared memory for large frames, if the broker can map it

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Hello:
        """Role-dependent: the fields a role does not use are ignored, as they always were."""
        protocol = obj.get("protocol")
        if protocol != PROTOCOL_VERSION or isinstance(protocol, bool):  # first: whatever else a hello holds
            raise RemoteProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"peer speaks protocol {summarize(protocol)}, this broker speaks {PROTOCOL_VERSION}",
            )
        role = obj.get("role")
        name = obj.get("name", "")
        check_text(name, "hello", "name")
        token = obj.get("token")
        _token(token, "hello", "token")
        values: dict[str, Any] = {"role": role, "protocol": PROTOCOL_VERSION, "name": name, "token": token}
        if role == "game":
            groups = obj.get("groups")
            if not isinstance(groups, list) or not 1 <= len(groups) <= MAX_GROUPS:
                raise _bad_hello(f"hello.groups must list 1 to {MAX_GROUPS} groups")
            specs = tuple(GroupSpec.from_wire(g, f"hello.groups[{i}]") for i, g in enumerate(groups))
            names = [g.policy for g in specs]
            if len(set(names)) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})[:3]
                raise _bad_hello(f"hello.groups names a policy twice: {twice}")
            return cls._trusted(
                {**values, "groups": specs, "policy": "", "stepping": None, "claim_games": ALL_GAMES, "ring": None}
            )
        if role == "trainer":
            policy = obj.get("policy")
            if not isinstance(policy, str) or not policy or len(policy) > MAX_NAME:
                raise _bad_hello("hello.policy must be a non-empty string")
            stepping = obj.get("stepping")
            options = None if stepping is None else StepOptions.from_wire(stepping)
            ring = obj.get("ring")
            offer = None if ring is None else RingOffer.from_wire(ring)
            return cls._trusted(
                {**values, "groups": (), "policy": policy, "stepping": options, "claim_games": ALL_GAMES, "ring": offer}
            )
        if role == "sampler":
            claim = obj.get("claim_games")
            _claim(claim, "hello", "claim_games")
            stepping = obj.get("stepping")
            options = None if stepping is None else StepOptions.from_wire(stepping)
            return cls._trusted(
                {**values, "groups": (), "policy": "", "stepping": options, "claim_games": claim, "ring": None}
            )
        _role(role, "hello", "role")
        return cls._trusted(
            {**values, "groups": (), "policy": "", "stepping": None, "claim_games": ALL_GAMES, "ring": None}
        )
