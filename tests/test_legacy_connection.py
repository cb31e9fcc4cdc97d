"""A godot_rl plugin game's connection and the relay of a trainer's ``call``, without sockets or a loop:
bytes in, events and bytes out, plain equality on what comes back."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from broker.legacy.calls import CallDeadline, CallDone, CallRelay
from broker.legacy.game_connection import REFUSAL_GRACE_S, CallAnswered, GodotRlGameConnection
from broker.legacy.godot_rl_game import CallResult
from broker.legacy.wire import encode_message
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.connection import BrokerConnection, Farewell, LegacyMessage, Refusal, Refused
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import Close, Error, GameActions, GameStep, Hello, Welcome

ENV_INFO = {
    "type": "env_info",
    "observation_space": [{"obs": {"size": [2], "space": "box"}}] * 2,
    "action_space": [{"move": {"size": 1, "action_type": "continuous"}}] * 2,
    "n_agents": 2,
    "agent_policy_names": ["mover", "mover"],
}
RESET_REPLY = {"type": "reset", "obs": [{"obs": [0.0, 0.1]}, {"obs": [1.0, 1.1]}]}
CLOSE = encode_message({"type": "close"})
ACTIONS = GameActions(0, {"mover": {"move": np.array([[0.5], [-0.5]], np.float32)}})
ACTION_REQUEST = encode_message({"type": "action", "action": [{"move": [0.5]}, {"move": [-0.5]}]})


def connect(first: dict[str, Any]) -> GodotRlGameConnection:
    """What the server does: the first frame of an accepted connection is JSON, so the godot_rl side takes over."""
    frames = BrokerConnection()
    frames.receive_data(encode_message(first))
    event = frames.next_event()
    assert isinstance(event, LegacyMessage)
    return GodotRlGameConnection(frames, event, "127.0.0.1:5000")


def feed(connection: GodotRlGameConnection, body: dict[str, Any]) -> object:
    connection.receive_data(encode_message(body))
    return connection.next_event()


def stepping_game() -> GodotRlGameConnection:
    """Joined (the hub's welcome became the reset request) and past its reset reply."""
    connection = connect(ENV_INFO)
    hello = connection.next_event()
    assert isinstance(hello, Hello) and [g.policy for g in hello.groups] == ["mover"]
    assert connection.send(Welcome(PROTOCOL_VERSION, 1, 0)) == encode_message({"type": "reset"})
    assert connection.game_index == 0
    step = feed(connection, RESET_REPLY)
    assert isinstance(step, GameStep) and step.tick == 0
    return connection


def test_the_hub_sees_an_ordinary_game_and_its_actions_become_the_action_request() -> None:
    connection = stepping_game()
    assert connection.next_event() is None  # nothing more until bytes arrive
    assert connection.send(ACTIONS) == ACTION_REQUEST


def test_actions_wait_while_a_call_is_open_and_follow_its_answer() -> None:
    connection = stepping_game()
    assert connection.call_request("ping") == encode_message({"type": "call", "method": "ping"})
    assert connection.call_request("ping") is None  # one request at a time: lock-step
    assert connection.send(ACTIONS) == b""  # deferred
    answer = feed(connection, {"type": "call", "returns": ["a", "b"]})
    assert answer == CallAnswered(CallResult("ping", ["a", "b"]), ACTION_REQUEST)


def test_a_bad_env_info_is_refused_with_the_reason_as_a_call_then_close() -> None:
    connection = connect({**ENV_INFO, "n_agents": 0})
    refused = connection.next_event()
    assert isinstance(refused, Refused) and refused.refusal.grace_s == REFUSAL_GRACE_S
    reason = "gdrl-broker refused this game (bad_hello): the godot_rl game has no agent in training mode"
    method = refused.refusal.now[4:].decode()
    assert method.startswith('{"type": "call", "method": "' + reason)
    assert feed(connection, {"type": "call", "returns": [None]}) == Farewell(CLOSE)  # its answer: goodbye


def test_a_hub_refusal_drops_what_waited_and_the_next_frame_gets_close() -> None:
    connection = stepping_game()
    connection.call_request("ping")
    assert connection.send(ACTIONS) == b""
    refusal = connection.refuse(RemoteProtocolError(ErrorCode.BAD_STEP, "tick 3, expected 1"))
    expected = encode_message(
        {"type": "call", "method": "gdrl-broker refused this game (bad_step): tick 3, expected 1"}
    )
    assert refusal == Refusal(expected, REFUSAL_GRACE_S)
    assert connection.call_request("ping") is None
    assert feed(connection, {"type": "call", "returns": [1, 2]}) == Farewell(CLOSE)  # not the deferred actions


def test_the_last_word_is_close_or_silence_and_a_broken_frame_is_the_stream_s_fault() -> None:
    connection = stepping_game()
    assert connection.last_word(Close("broker shutting down")) == CLOSE  # the plugin quits its game
    assert connection.last_word(Error("slow_peer", "not reading")) == b""  # it knows no error frame
    connection.receive_data(b"\x03\x00\x00\x00{no")
    with pytest.raises(RemoteProtocolError) as caught:
        connection.next_event()
    assert caught.value.code is ErrorCode.MALFORMED


def test_a_frame_sent_out_of_turn_is_refused() -> None:
    connection = stepping_game()
    refused = feed(connection, {"type": "step", "obs": []})  # nothing was asked
    assert isinstance(refused, Refused)
    assert b"(unexpected_message)" in refused.refusal.now


# --- the relay of a godot_rl trainer's call -----------------------------------------------------------


def test_a_call_with_no_plugin_game_is_answered_at_once() -> None:
    relay: CallRelay[str, str] = CallRelay(timeout_s=5.0)
    assert relay.start("trainer", "mover", "ping", []) == CallDone(0, "trainer", [])


def test_answers_join_in_slot_order_whatever_order_they_arrive_in() -> None:
    relay: CallRelay[str, str] = CallRelay(timeout_s=5.0)
    assert relay.start("trainer", "mover", "ping", ["slot0", "slot1"]) == CallDeadline(0, 5.0)
    assert relay.answered("slot1", CallResult("ping", [3, 4])) is None
    assert relay.answered("slot0", CallResult("ping", [1, 2])) == CallDone(0, "trainer", [1, 2, 3, 4])
    assert relay.expire(CallDeadline(0, 5.0)) is None  # the timer fires after the answer: nothing to do


def test_an_unanswered_call_expires_with_what_came_and_a_late_answer_is_dropped() -> None:
    relay: CallRelay[str, str] = CallRelay(timeout_s=5.0)
    deadline = relay.start("trainer", "mover", "ping", ["slot0", "slot1"])
    assert isinstance(deadline, CallDeadline)
    assert relay.answered("slot0", CallResult("ping", [1])) is None
    assert relay.expire(deadline) == CallDone(0, "trainer", [1])
    assert relay.answered("slot1", CallResult("ping", [2])) is None
