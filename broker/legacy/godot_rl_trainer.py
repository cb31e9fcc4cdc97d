"""The broker as a godot_rl *game*, serving one policy to an unmodified godot_rl training script. Sans-IO.

Theory of operation
-------------------
A godot_rl training script (``StableBaselinesGodotEnv(env_path=None, port=P)`` and friends) listens on
its port and waits for a game. The broker connects there and plays the plugin's part for one policy:
every agent of that policy, over all games, is one of the script's envs.

===============  ============================  ===================================================
phase            the script sends              we answer (with what the hub provides)
===============  ============================  ===================================================
AWAIT_HANDSHAKE  ``handshake``                 nothing (the plugin does not reply either)
AWAIT_ENV_INFO   ``env_info``                  ``env_info`` once the hub's ``PolicyInfo`` is known
RUNNING          ``reset``                     ``reset`` reply from the next ``Batch``
RUNNING          ``action``                    ``step`` reply from the next ``Batch``
RUNNING          ``call``                      ``call`` reply
any              ``close``                     nothing; the connection ends
===============  ============================  ===================================================

``next_event`` yields one typed request at a time; the edge turns it into hub calls and, when the
hub's answer arrives, asks this object for the reply bytes. One request is open at a time, as godot_rl
is strictly lock-step.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

import numpy as np
import structlog

from broker.legacy.wire import (
    GODOT_RL_MAJOR,
    MessageDecoder,
    decode_actions,
    encode_message,
    encode_rows,
    godot_spaces,
    message_type,
    write_reply,
)
from broker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from broker.protocol.framing import DEFAULT_MAX_FRAME_BYTES
from broker.protocol.messages import Batch, PolicyInfo

log = structlog.get_logger("gdrl.legacy")


class TrainerPhase(Enum):
    AWAIT_HANDSHAKE = "await_handshake"
    AWAIT_ENV_INFO = "await_env_info"
    ENV_INFO_OPEN = "env_info_open"  # asked; waiting for the hub's PolicyInfo
    RUNNING = "running"
    REQUEST_OPEN = "request_open"  # a reset/action/call is being answered
    CLOSED = "closed"


@dataclass(frozen=True)
class EnvInfoRequest:
    pass


@dataclass(frozen=True)
class ResetRequest:
    pass


@dataclass(frozen=True)
class ActionRequest:
    actions: dict[str, np.ndarray]  # one array per action key, n_envs rows


@dataclass(frozen=True)
class CallRequest:
    method: str


@dataclass(frozen=True)
class CloseRequest:
    pass


TrainerRequest = EnvInfoRequest | ResetRequest | ActionRequest | CallRequest | CloseRequest
_OPENING: Final = {"reset", "action", "call"}


class GodotRlTrainer:
    """One connection to a godot_rl script, serving ``policy``."""

    def __init__(self, policy: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.policy = policy
        self.phase = TrainerPhase.AWAIT_HANDSHAKE
        self.info: PolicyInfo | None = None
        self._decoder = MessageDecoder(max_frame_bytes)
        self._open = ""  # the request being answered: reset, action or call

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._decoder.feed(data)

    def next_event(self) -> TrainerRequest | None:
        """The script's next request, or None until more bytes arrive. Raises RemoteProtocolError."""
        while True:
            if self.phase is TrainerPhase.CLOSED:
                return None
            body = self._decoder.next_message()
            if body is None:
                return None
            event = self._handle(body)
            if event is not None:
                return event

    def _handle(self, body: dict[str, Any]) -> TrainerRequest | None:
        kind = message_type(body)
        if kind == "close":
            self.phase = TrainerPhase.CLOSED
            return CloseRequest()
        if self.phase is TrainerPhase.AWAIT_HANDSHAKE:
            if kind != "handshake":
                raise RemoteProtocolError(
                    ErrorCode.UNEXPECTED_MESSAGE, f"a godot_rl trainer starts with 'handshake', got '{kind}'"
                )
            major = body.get("major_version")
            if major != GODOT_RL_MAJOR:
                log.warning("godot_rl version differs", policy=self.policy, major=major, ours=GODOT_RL_MAJOR)
            self.phase = TrainerPhase.AWAIT_ENV_INFO
            return None
        if self.phase is TrainerPhase.AWAIT_ENV_INFO and kind == "env_info":
            self.phase = TrainerPhase.ENV_INFO_OPEN
            return EnvInfoRequest()
        if self.phase is TrainerPhase.RUNNING and kind in _OPENING:
            assert self.info is not None
            self.phase = TrainerPhase.REQUEST_OPEN
            self._open = kind
            if kind == "reset":
                return ResetRequest()
            if kind == "call":
                method = body.get("method")
                if not isinstance(method, str):
                    raise RemoteProtocolError(ErrorCode.MALFORMED, "godot_rl 'call' needs a string 'method'")
                return CallRequest(method)
            rows = body.get("action")
            if not isinstance(rows, list) or len(rows) != self.info.n_envs:
                raise RemoteProtocolError(
                    ErrorCode.BAD_ACTIONS, f"'action' must list {self.info.n_envs} agents' actions (n_agents)"
                )
            return ActionRequest(decode_actions(self.info.spaces, rows, "action"))
        raise RemoteProtocolError(
            ErrorCode.UNEXPECTED_MESSAGE, f"godot_rl trainer sent '{kind}' in phase {self.phase.value}"
        )

    # --- replies ----------------------------------------------------------------------------------

    def env_info_reply(self, info: PolicyInfo) -> bytes:
        """Our policy as the plugin would announce it. Raises ValueError if godot_rl cannot express it."""
        if self.phase is not TrainerPhase.ENV_INFO_OPEN:
            raise LocalProtocolError(ErrorCode.INTERNAL, f"env_info reply in phase {self.phase.value}")
        observation, action = godot_spaces(info.spaces, info.policy)
        self.info = info
        self.phase = TrainerPhase.RUNNING
        return encode_message(
            {
                "type": "env_info",
                "observation_space": [observation] * info.n_envs,
                "action_space": [action] * info.n_envs,
                "n_agents": info.n_envs,
                "agent_policy_names": [info.policy] * info.n_envs,
            }
        )

    @property
    def open_request(self) -> str:
        """``reset``, ``action`` or ``call`` while one awaits its answer, else ""."""
        return self._open if self.phase is TrainerPhase.REQUEST_OPEN else ""

    def batch_reply(self, batch: Batch) -> bytes:
        """Answer the open ``reset`` or ``action`` with the hub's batch."""
        request = self._close_request(("reset", "action"))
        assert self.info is not None
        spaces = self.info.spaces
        data = batch.data
        if request == "reset":
            frame = write_reply(spaces, data.obs, None, None, {})  # in C, when it writes these arrays
            if frame is not None:
                return frame
            obs = encode_rows(spaces, data.obs)
            return encode_message({"type": "reset", "obs": obs, "info": [{} for _ in obs]})
        done = np.asarray(data.terminated) | np.asarray(data.truncated)
        infos: dict[int, dict[str, Any]] = {row: dict(info) for row, info in data.infos.items()}  # by row
        done_rows = np.flatnonzero(done).tolist()
        if done_rows:
            # SB3 bootstraps a truncated episode from info["terminal_observation"]; godot_rl passes the
            # info through untouched, so it gets plain lists (images too) that SB3 can read directly.
            finals = {int(row): j for j, row in enumerate(data.final_index if data.final_index is not None else [])}
            final_rows = encode_rows(spaces, data.final_obs, hex_images=False) if data.final_obs else []
            current = encode_rows(spaces, {k: v[done_rows] for k, v in data.obs.items()}, hex_images=False)
            for k, row in enumerate(done_rows):
                j = finals.get(row)
                info = infos.setdefault(row, {})
                info["terminal_observation"] = final_rows[j] if j is not None else current[k]
                info["TimeLimit.truncated"] = bool(data.truncated[row] and not data.terminated[row])
        frame = write_reply(spaces, data.obs, data.reward, done, infos)
        if frame is not None:
            return frame
        obs = encode_rows(spaces, data.obs)
        return encode_message(
            {
                "type": "step",
                "obs": obs,
                "reward": np.asarray(data.reward, np.float64).tolist(),
                "done": done.tolist(),
                "info": [infos.get(row, {}) for row in range(len(obs))],
            }
        )

    def call_reply(self, returns: list[Any]) -> bytes:
        self._close_request(("call",))
        return encode_message({"type": "call", "returns": returns})

    def _close_request(self, allowed: tuple[str, ...]) -> str:
        request = self.open_request
        if request not in allowed:
            raise LocalProtocolError(ErrorCode.INTERNAL, f"no open {'/'.join(allowed)} request (open: {request!r})")
        self.phase = TrainerPhase.RUNNING
        self._open = ""
        return request
