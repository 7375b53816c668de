"""sync/replay_check: a value sent again, bit for bit, for a later claimed round is a replay; nothing else is."""

from __future__ import annotations

import torch

from p2ptrain.sync.replay_check import ReplayCheck


def value(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)]


def test_the_same_value_two_claimed_rounds_later_is_a_replay_and_a_new_one_is_not() -> None:
    check = ReplayCheck()
    assert not check.repeats("p", 3, value(0))  # first seen
    assert not check.repeats("p", 4, value(1))  # a new round, a new value
    assert not check.repeats("p", 5, value(1))  # one round on: an honest GASLoC answer may hold its anchor so long
    assert check.repeats("p", 6, value(1))  # two rounds on, round 4's bytes
    assert check.repeats("p", 9, value(1))  # and again
    assert not check.repeats("q", 9, value(1))  # per partner: another may hold the same value once


def test_one_value_for_several_exchanges_of_one_round_or_a_round_claimed_backwards_is_no_replay() -> None:
    check = ReplayCheck()
    assert not check.repeats("p", 7, value(0))
    assert not check.repeats("p", 7, value(0))  # a responder answers several offers of its round with one value
    assert not check.repeats("p", 5, value(1))  # a claim that goes back judges nothing, and is not remembered
    assert check.repeats("p", 9, value(0))


def test_rounds_that_are_not_ints_are_not_judged() -> None:
    check = ReplayCheck()
    for claim in (None, "3", 3.0, True):
        assert not check.repeats("p", claim, value(0))
    assert not check.repeats("p", 3, value(0)) and check.repeats("p", 5, value(0))


def test_the_partners_remembered_are_bounded_the_least_recent_forgotten() -> None:
    check = ReplayCheck(max_partners=2)
    for partner in ("a", "b", "c"):
        check.repeats(partner, 1, value(0))
    assert not check.repeats("a", 3, value(0))  # forgotten: first seen again
    assert check.repeats("c", 3, value(0))
