"""maths/drift_excuse: honest gossip partners that drifted apart are clipped but not offenders while they close in;
a partner far away with no drift to explain it pays for every clip."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.maths.drift_excuse import FREE_HELD_CLIPS, MAX_DRIFT_ROUNDS, DriftExcuse, claimed_round
from p2ptrain.maths.robust import HARD_CLIP_FACTOR, HELD_CLIP_FACTOR, SPREAD, AdaptiveClip

OWN = [torch.zeros(10)]
HARD = HARD_CLIP_FACTOR * SPREAD  # one partner, own_scale 1: τ = 1, offences beyond 8
HELD = HELD_CLIP_FACTOR * SPREAD  # and beyond 4 for a run of clips that does not close in


def at(length: float) -> list[torch.Tensor]:
    value = torch.zeros(10)
    value[0] = length
    return [value]


def offences(exchanges: list[tuple[float, tuple[int, object] | None]], excuse: bool = True) -> list[bool]:
    """Whether each (gap, (our round, its claimed round)) exchange with one partner was an offence."""
    clip = AdaptiveClip(multiplier=1.0, excuse=DriftExcuse() if excuse else None)
    return [clip.clip("p", at(gap), OWN, own_scale=1.0, rounds=rounds)[2] for gap, rounds in exchanges]


def test_a_partner_that_trained_alone_for_rounds_is_excused_while_it_closes_in_and_again_after_the_next_drift():
    """The CI case: we stalled one round while it trained 25 alone; it comes back 15 steps away, then closer."""
    back = [(1.0, (5, 5)), (HARD + 7, (6, 30)), (HARD + 6, (7, 31)), (HARD + 5, (8, 32)), (2.0, (9, 33))]
    assert offences(back) == [False, False, False, False, False]
    assert offences(back, excuse=False) == [False, True, True, True, False]  # the rule before: banned after 5
    # from its side the drift is its own rounds, which it counts itself
    assert offences([(1.0, (5, 5)), (HARD + 7, (30, 6))]) == [False, False]


def test_a_partner_far_away_with_no_drift_to_explain_it_pays_for_every_clip_even_closing_in():
    """An attacker that follows our value from afar (−7 × ours) comes closer as we move: still an offence."""
    in_step = [(1.0, (r, r)) for r in range(3)] + [(HARD + 20 - i, (3 + i, 3 + i)) for i in range(4)]
    assert offences(in_step) == [False] * 3 + [True] * 4
    assert offences([(HARD + 20 - i, (i, i)) for i in range(3)]) == [True] * 3  # met far away at once


def test_an_excused_run_ends_in_offences_once_the_partner_stops_closing_in():
    drifted = [(1.0, (0, 0)), (HARD + 10, (1, 20))]
    assert offences(drifted + [(HARD + 10, (2, 21)), (HARD + 11, (3, 22))]) == [False, False, True, True]
    assert offences(drifted + [(HARD + 9.95, (2, 21))]) == [False, False, True]  # less than 0.1 τ closer
    # wandering out and back in again: excused only for a new closest
    wander = drifted + [(HARD + 9, (2, 21)), (HARD + 10, (3, 22)), (HARD + 9, (4, 23)), (HARD + 8, (5, 24))]
    assert offences(wander) == [False, False, False, True, True, False]


def test_a_claimed_round_excuses_at_most_max_drift_rounds_and_a_claim_that_is_no_round_excuses_nothing():
    beyond = HARD + 2 * MAX_DRIFT_ROUNDS + 5  # more than the cap (ours 1 + theirs capped) explains
    assert offences([(1.0, (0, 0)), (beyond, (1, 10**9))]) == [False, True]
    assert offences([(1.0, (0, 0)), (HARD + MAX_DRIFT_ROUNDS, (1, 10**9))]) == [False, False]
    for claim in ("30", 30.0, True, -5, None, [30], 2**41):
        assert claimed_round(claim) is None
        assert offences([(1.0, (0, 0)), (HARD + 7, (1, claim))]) == [False, True], claim
    assert offences([(1.0, (0, 40)), (HARD + 7, (1, 10))]) == [False, True]  # a round that went back: no drift


def test_partners_remembered_are_bounded():
    excuse = DriftExcuse(max_partners=4)
    clip = AdaptiveClip(multiplier=1.0, excuse=excuse)
    for i in range(10):
        clip.clip(f"p{i}", at(HARD + 5), OWN, own_scale=1.0, rounds=(i, i))
    assert len(excuse._rounds) <= 4 and len(excuse._runs) <= 4


@pytest.mark.parametrize("gap", [0.5, 3.0, HELD])
def test_within_the_held_radius_nothing_is_an_offence_and_a_run_ends(gap: float):
    assert offences([(gap, (r, r)) for r in range(6)]) == [False] * 6
    assert offences([(HARD + 3, (0, 8)), (gap, (1, 9)), (HARD + 3, (2, 10))]) == [False, False, True]  # in step


def test_a_partner_held_between_the_held_and_hard_radius_pays_from_its_third_clip_unless_it_closes_in():
    """The red team's noisy replay (θ_0 plus fresh noise): clipped to τ every exchange, never beyond the hard radius,
    never closer: it moved its victims toward θ_0 unpenalised."""
    held = [(HELD + 1 + 0.05 * r, (r, r)) for r in range(6)]
    assert offences(held) == [False] * FREE_HELD_CLIPS + [True] * (6 - FREE_HELD_CLIPS)
    assert offences(held, excuse=False) == [False] * 6  # the rule before: inside the hard radius, never
    closing = [(HARD - 0.5 * r, (r, r)) for r in range(8)]  # an honest drifted partner: half a τ closer each time
    assert offences(closing) == [False] * 8
    wavering = [(HELD + 1, (0, 0)), (HELD + 1.05, (1, 1)), (HELD + 0.95, (2, 2)), (HELD + 0.98, (3, 3))]
    assert offences(wavering) == [False, False, True, True]  # less than 0.1 τ closer than the closest
    assert offences([(HELD + 1, (r, r)) for r in range(2)] + [(1.0, (2, 2)), (HELD + 1, (3, 3))]) == [False] * 4


def test_a_partner_that_started_late_is_excused_by_the_rounds_since_round_0_while_it_closes_in():
    """CI on 6331488: an honest peer whose round 0 ran while we trained 8 rounds is first met far away. Both values
    began as the run's initial state, so its drift counts from round 0 on both sides (it paid from the first clip,
    5 times: banned)."""
    late = [(HARD + 3, (8, 0)), (HARD + 2, (9, 1)), (HARD + 1, (10, 2)), (2.0, (11, 3))]
    assert offences(late) == [False] * 4
    assert offences([(HARD + 3, (0, 8)), (HARD + 2, (1, 9))]) == [False, False]  # from its side
    assert offences([(HARD + 3, (0, 0)), (HARD + 2, (1, 1))]) == [True, True]  # far at round 0: nothing explains it


def test_a_clipped_exchange_is_no_new_start_for_the_drift():
    """The rounds count from the latest exchange in step: one clipped hard since then moved neither side back."""
    assert offences([(1.0, (0, 0)), (HARD + 5, (1, 10)), (1.0, (2, 11))]) == [False] * 3
    # excused at (1, 10) by its 10 rounds; after in step again at (2, 11), a new gap counts from there
    assert offences([(1.0, (0, 0)), (HARD + 5, (1, 10)), (1.0, (2, 11)), (HARD + 5, (3, 12))]) == [False] * 3 + [True]


def test_a_second_clip_in_the_same_rounds_repeats_the_verdict_of_the_first():
    """CI on 1d16960: a late-started honest peer, 5.3 τ away at rounds (8, 1), met twice there with the same gap (both
    sides offered at once): the third clip of its run, not closer, was an offence, though nobody had trained since."""
    late = [(HELD + 2.5, (7, 0)), (HELD + 1.5, (8, 1)), (HELD + 1.5, (8, 1)), (HELD + 1.0, (9, 2))]
    assert offences(late) == [False] * 4
    held = [(HELD + 1, (r, r)) for r in range(3)]  # a partner held apart still pays from its third round
    assert offences(held + [(HELD + 1, (2, 2)), (HELD + 1, (3, 3))]) == [False, False, True, True, True]
    # a gap grown in the same rounds is no repeat: judged anew (held apart: an offence from the third clip)
    assert offences([(HELD + 1, (0, 0)), (HELD + 1, (1, 1)), (HELD + 2, (1, 1))]) == [False, False, True]
    # beyond the hard radius, an unexcused run pays for every repeat too
    assert offences([(HARD + 3, (0, 0)), (HARD + 3, (0, 0))]) == [True, True]


def test_a_clip_before_we_have_a_yardstick_is_no_offence_and_leaves_no_record():
    """Our round 0 (no own step to measure τ by): a far partner is clipped, judged nothing, and the run of clips it
    would begin does not make the next, judged, clip an offence."""
    excuse = DriftExcuse()
    clip = AdaptiveClip(multiplier=1.0, excuse=excuse)
    assert clip.clip("p", at(HARD + 3), OWN, own_scale=1.0, rounds=(0, 8), judged=False)[2] is False
    assert not excuse._runs and not excuse._rounds
    assert clip.clip("p", at(HARD + 2), OWN, own_scale=1.0, rounds=(1, 9))[2] is False  # 10 rounds explain it
