"""Game-claiming samplers (broker/core/claims.py), sans-IO: the hub's effects compared whole."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from broker.core.batching import DROPPED_INFO
from broker.core.effects import Close, Send
from broker.core.flow import Hub
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import (
    ALL_GAMES,
    Batch,
    Error,
    GameActions,
    GameLayout,
    GameStep,
    Hello,
    PolicyInfo,
    StepData,
    StepOptions,
    TrainerAct,
    TrainerReset,
    Waiting,
    Welcome,
)
from clients.status import render_table
from tests.test_hub import BLUE, RED, Peer, blue_act, game_hello, game_step, red_act, step_data, trainer_hello


def sampler_hello(claim: int | str, stepping: StepOptions | None = None) -> Hello:
    return Hello("sampler", PROTOCOL_VERSION, "s", stepping=stepping, claim_games=claim)


def sent(effects: list, kind: type) -> list:
    return [e.message for e in effects if isinstance(e, Send) and isinstance(e.message, kind)]


def seated_hub(games: int, timers: bool = False) -> tuple[Hub, list[Peer]]:
    hub = Hub(expected_games=games, clock=lambda: 0.0, timers=timers)
    peers = [Peer(f"g{i}") for i in range(games)]
    for peer in peers:
        hub.handle(peer, game_hello())
    return hub, peers


def test_a_sampler_claims_games_and_gets_one_policy_info_per_policy() -> None:
    hub, _ = seated_hub(3)
    s = Peer("s")
    assert hub.handle(s, sampler_hello(2)) == [
        Send(s, Welcome(PROTOCOL_VERSION, 4)),
        Send(s, PolicyInfo("red", 4, RED, (GameLayout(0, 0, 2), GameLayout(1, 2, 2)))),
        Send(s, PolicyInfo("blue", 2, BLUE, (GameLayout(0, 0, 1), GameLayout(1, 1, 1)))),
    ]
    assert [g["sampler"] for g in hub.snapshot()["games"]] == ["s", "s", None]
    # the per-policy layouts lose the claimed games: only game 2 is left for a per-policy trainer
    t = Peer("t")
    effects = hub.handle(t, trainer_hello("red"))
    assert sent(effects, PolicyInfo) == [PolicyInfo("red", 2, RED, (GameLayout(2, 0, 2),))]


def test_a_sampler_steps_every_group_of_its_games_and_trainers_share_the_broker() -> None:
    hub, (g0, g1) = seated_hub(2)
    s, t = Peer("s"), Peer("t")
    hub.handle(s, sampler_hello(1))
    hub.handle(t, trainer_hello("red"))  # trains red on game 1 only
    assert hub.handle(s, TrainerReset()) == [
        Send(s, Waiting("red", 2, 2, "waiting for game steps")),
        Send(s, Waiting("blue", 2, 2, "waiting for game steps")),
    ]
    hub.handle(t, TrainerReset())
    effects = hub.handle(g0, game_step(0, 0))
    batches = sent(effects, Batch)
    assert [(b.policy, b.step) for b in batches] == [("red", 1), ("blue", 1)]
    red, blue = batches
    np.testing.assert_array_equal(red.data.obs["obs"][:, 0], [0, 1])
    np.testing.assert_array_equal(blue.data.obs["obs"][:, 0], [10])
    effects = hub.handle(g1, game_step(0, 100))
    [to_trainer] = sent(effects, Batch)
    assert to_trainer.policy == "" and to_trainer.data.obs["obs"][:, 0].tolist() == [100, 101]
    # the sampler answers both of its policies; game 0 gets both groups' actions, game 1 is not touched
    assert hub.handle(s, TrainerAct(1, red_act(1, 2).actions, policy="red")) == []
    effects = hub.handle(s, TrainerAct(1, blue_act(1, 1).actions, policy="blue"))
    [reply] = [e for e in effects if isinstance(e, Send) and e.peer == g0]
    assert isinstance(reply.message, GameActions) and sorted(reply.message.groups) == ["blue", "red"]
    np.testing.assert_array_equal(reply.message.groups["red"]["move"], red_act(1, 2).actions["move"])
    assert not any(isinstance(e, Send) and e.peer == g1 for e in effects)


def test_claim_refusals_say_why() -> None:
    hub, (g0, g1) = seated_hub(2)
    with pytest.raises(RemoteProtocolError) as err:
        hub.handle(Peer("s"), sampler_hello(3))
    assert err.value.code is ErrorCode.NO_FREE_GAME
    assert "2 free (2 of 2 game slots seated, 0 held by samplers)" in err.value.message
    t = Peer("t")
    hub.handle(t, trainer_hello("red"))  # red is now trained per-policy on both games
    with pytest.raises(RemoteProtocolError) as err:
        hub.handle(Peer("s"), sampler_hello(1))
    assert err.value.code is ErrorCode.POLICY_TRAINED
    assert "policy 'red' of game 0 is trained per-policy by 't-red'" in err.value.message
    assert hub.sessions.keys() == {g0, g1, t}  # a refusal changes nothing


def test_all_claims_every_free_game_and_a_trainer_finds_none_left() -> None:
    hub, _ = seated_hub(2)
    s = Peer("s")
    infos = sent(hub.handle(s, sampler_hello(ALL_GAMES)), PolicyInfo)
    assert [i.n_envs for i in infos] == [4, 2]
    with pytest.raises(RemoteProtocolError) as err:
        hub.handle(Peer("s2"), sampler_hello(1))
    assert err.value.code is ErrorCode.NO_FREE_GAME
    with pytest.raises(RemoteProtocolError) as err:
        hub.handle(Peer("t"), trainer_hello("blue"))
    assert err.value.code is ErrorCode.NO_FREE_GAME and "claimed by a sampler" in err.value.message


def test_a_trainer_waiting_for_the_layout_is_refused_when_samplers_took_every_game() -> None:
    hub = Hub(expected_games=2, clock=lambda: 0.0, timers=False)
    t, s, g0, g1 = Peer("t"), Peer("s"), Peer("g0"), Peer("g1")
    hub.handle(t, trainer_hello("blue"))
    hub.handle(g0, game_hello())
    hub.handle(s, sampler_hello(1))  # before the layout is complete
    effects = hub.handle(g1, game_hello(n_blue=1))
    assert sent(effects, PolicyInfo) == [PolicyInfo("blue", 1, BLUE, (GameLayout(1, 0, 1),))]
    hub2 = Hub(expected_games=1, clock=lambda: 0.0, timers=False)
    hub2.handle(t, trainer_hello("blue"))
    g = Peer("g")
    hub2.handle(g, game_hello())
    # a single game: seat it, then the sampler claims it before the (one-slot) layout is ... already complete
    with pytest.raises(RemoteProtocolError) as err:
        hub2.handle(s, sampler_hello(1))
    assert err.value.code is ErrorCode.POLICY_TRAINED


def test_a_restarted_sampler_reclaims_the_games_its_predecessor_left() -> None:
    hub, (g0,) = seated_hub(1)
    s = Peer("s")
    hub.handle(s, sampler_hello(1))
    hub.handle(s, TrainerReset())
    hub.handle(g0, game_step(0, 0))
    hub.handle(s, TrainerAct(1, red_act(1, 2).actions, policy="red"))
    # gone mid-tick: the hold-mode game is answered without blue (held), and its slot is free again
    [reply] = hub.peer_lost(s)
    assert isinstance(reply, Send) and reply.peer == g0 and isinstance(reply.message, GameActions)
    assert list(reply.message.groups) == ["red"]  # blue held
    hub.handle(g0, game_step(1, 5))
    s2 = Peer("s2")
    infos = sent(hub.handle(s2, sampler_hello(1)), PolicyInfo)
    assert [(i.policy, i.n_envs) for i in infos] == [("red", 2), ("blue", 1)]
    batches = sent(hub.handle(s2, TrainerReset()), Batch)  # the newest tick, held for nobody meanwhile
    assert [(b.policy, b.step, b.data.obs["obs"][0, 0]) for b in batches] == [("red", 1, 5.0), ("blue", 1, 15.0)]
    assert hub.slots[0].sampler is not None and hub.slots[0].sampler.peer == s2


def test_a_claimed_slot_replacement_game_goes_to_the_sampler_truncated() -> None:
    hub, (g0,) = seated_hub(1)
    s = Peer("s")
    hub.handle(s, sampler_hello(1))
    hub.handle(s, TrainerReset())
    hub.handle(g0, game_step(0, 0))
    hub.handle(s, TrainerAct(1, red_act(1, 2).actions, policy="red"))
    hub.handle(s, TrainerAct(1, blue_act(1, 1).actions, policy="blue"))
    hub.peer_lost(g0)
    g0b = Peer("g0b")
    hub.handle(g0b, game_hello())
    batches = sent(hub.handle(g0b, game_step(0, 50)), Batch)
    red = batches[0]
    assert red.policy == "red" and red.data.truncated.tolist() == [True, True]
    assert red.data.infos == {0: {"game_replaced": True}, 1: {"game_replaced": True}}


def test_a_sampler_act_for_a_policy_it_does_not_hold_is_refused() -> None:
    hub, (g0,) = seated_hub(1)
    s = Peer("s")
    hub.handle(s, sampler_hello(1))
    hub.handle(s, TrainerReset())
    hub.handle(g0, game_step(0, 0))
    with pytest.raises(RemoteProtocolError) as err:
        hub.handle(s, TrainerAct(1, red_act(1, 2).actions, policy="green"))
    assert err.value.code is ErrorCode.UNKNOWN_POLICY and "this sampler holds blue, red" in err.value.message
    with pytest.raises(RemoteProtocolError) as err:
        hub.handle(s, TrainerAct(1, red_act(1, 2).actions))  # no policy named
    assert err.value.code is ErrorCode.UNKNOWN_POLICY


def test_barrier_sampler_holds_its_game_until_it_answers() -> None:
    hub, (g0,) = seated_hub(1, timers=True)
    s = Peer("s")
    hub.handle(s, sampler_hello(1, StepOptions(mode="barrier")))
    hub.handle(s, TrainerReset())
    effects = hub.handle(g0, game_step(0, 0))
    assert not any(isinstance(e, Send) and e.peer == g0 for e in effects)
    hub.handle(s, TrainerAct(1, red_act(1, 2).actions, policy="red"))
    effects = hub.handle(s, TrainerAct(1, blue_act(1, 1).actions, policy="blue"))
    assert [type(e.message) for e in effects if isinstance(e, Send) and e.peer == g0] == [GameActions]
    assert not any(isinstance(e, Close) for e in effects)


def test_sampler_hello_round_trips_and_bad_claims_are_bad_hellos() -> None:
    for claim in (3, ALL_GAMES):
        hello = sampler_hello(claim, StepOptions(mode="barrier"))
        assert Hello.from_wire(hello.to_wire()) == hello
    for bad in (0, -1, "some", True, None, 1.5):
        with pytest.raises(RemoteProtocolError) as err:
            Hello.from_wire({**sampler_hello(1).to_wire(), "claim_games": bad})
        assert err.value.code is ErrorCode.BAD_HELLO
    data: StepData = step_data(np.arange(2.0), 3)
    assert Batch.from_wire(Batch(4, data, "red").to_wire()).policy == "red"
    assert "policy" not in Batch(4, data).to_wire() and "policy" not in red_act(1, 2).to_wire()
    error = Error(ErrorCode.NO_FREE_GAME.value, "x")
    assert error.code == "no_free_game"


def test_large_sampler_batches_and_acts_keep_their_policy_on_the_viewing_path() -> None:
    from broker.protocol.codec import VIEW_MIN_BYTES, pack, unpack_viewing_arrays

    rows = VIEW_MIN_BYTES // 12 + 1
    data = step_data(np.arange(float(rows)), 3)
    for message in (Batch(2, data, "red"), TrainerAct(2, {"move": np.zeros((rows * 2, 2), np.float32)}, "red")):
        body = pack(message.to_wire())
        assert len(body) >= VIEW_MIN_BYTES
        decoded = type(message).from_wire(unpack_viewing_arrays(body))
        assert decoded.policy == "red" and decoded.step == 2


def test_a_sampler_batch_its_codec_cannot_carry_goes_again_without_the_infos_then_the_sampler_is_closed() -> None:
    hub, (g0,) = seated_hub(1)
    s = Peer("s")
    hub.handle(s, sampler_hello(1))
    hub.handle(s, TrainerReset())
    plain = game_step(0, 0)
    step = GameStep(0, {**plain.groups, "blue": replace(plain.groups["blue"], infos={0: {"big": 10**30}})})
    red, blue = sent(hub.handle(g0, step), Batch)
    assert (red.policy, blue.policy) == ("red", "blue") and red.step == blue.step == 1
    # the same step number in both policies: the batch's policy says which one failed
    assert hub.batch_undeliverable(s, 1, lambda value: False, policy_name="nobody") == []
    again = hub.batch_undeliverable(s, 1, lambda value: "big" not in value, policy_name="blue")
    assert again == [Send(s, Batch(1, replace(blue.data, infos={0: DROPPED_INFO}), "blue"))]
    assert hub.batch_undeliverable(s, 1, lambda value: False, policy_name="blue") == [
        Close(s, Error("internal", "the broker could not encode the batch"))
    ]
    # red was never at fault: its batch stands, and the sampler's answer to it is taken
    assert hub.handle(s, TrainerAct(1, red_act(1, 2).actions, policy="red")) == []


def test_status_shows_each_sampler_its_games_and_its_view_of_every_policy() -> None:
    hub, (g0, _) = seated_hub(2)
    s = Peer("s")
    hub.handle(s, sampler_hello(1))
    hub.handle(s, TrainerReset())
    hub.handle(g0, game_step(0, 0))
    hub.handle(s, TrainerAct(1, red_act(1, 2).actions, policy="red"))
    hub.handle(s, TrainerAct(1, blue_act(1, 1).actions, policy="blue"))
    [sampler] = hub.snapshot()["samplers"]
    assert sampler["name"] == "s" and sampler["games"] == [0]
    red, blue = sampler["policies"]["red"], sampler["policies"]["blue"]
    assert (red["agents"], red["env_steps"], red["state"]) == (2, 2, "sampling")
    assert (blue["agents"], blue["env_steps"]) == (1, 1)
    table = render_table(hub.snapshot())
    assert "sampling games 0" in table and table.count("sampling games 0") == 2
    hub.peer_lost(s)
    assert hub.snapshot()["samplers"] == []


def test_in_barrier_stepping_a_sampler_gone_mid_tick_releases_that_tick_and_the_next_sampler_gets_the_next() -> None:
    hub, (g0,) = seated_hub(1)
    barrier = StepOptions(mode="barrier")
    s = Peer("s")
    hub.handle(s, sampler_hello(1, barrier))
    hub.handle(s, TrainerReset())
    hub.handle(g0, game_step(0, 0))
    hub.handle(s, TrainerAct(1, red_act(1, 2).actions, policy="red"))
    # gone with blue's batch unanswered: nobody will answer that tick, so it is released (blue held)
    [reply] = hub.peer_lost(s)
    assert isinstance(reply, Send) and reply.peer == g0 and isinstance(reply.message, GameActions)
    assert list(reply.message.groups) == ["red"]
    # the next tick waits, lock-step, for a sampler: no reply
    assert not any(isinstance(e, Send) and e.peer == g0 for e in hub.handle(g0, game_step(1, 5)))
    s2 = Peer("s2")
    hub.handle(s2, sampler_hello(1, barrier))
    batches = sent(hub.handle(s2, TrainerReset()), Batch)
    assert [(b.policy, b.step, b.data.obs["obs"][0, 0]) for b in batches] == [("red", 1, 5.0), ("blue", 1, 15.0)]
    hub.handle(s2, TrainerAct(1, red_act(1, 2).actions, policy="red"))
    effects = hub.handle(s2, TrainerAct(1, blue_act(1, 1).actions, policy="blue"))
    [reply] = [e for e in effects if isinstance(e, Send) and e.peer == g0]
    assert isinstance(reply.message, GameActions) and reply.message.tick == 1
    assert sorted(reply.message.groups) == ["blue", "red"]
