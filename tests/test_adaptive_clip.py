"""maths/robust.AdaptiveClip: τ from honest partners' distances, a clip tighter than the offence threshold."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.maths.robust import HARD_CLIP_FACTOR, AdaptiveClip
from p2ptrain.tensor_layout import distance

OWN = [torch.zeros(10)]


def at(length: float) -> list[torch.Tensor]:
    value = torch.zeros(10)
    value[0] = length
    return [value]


def test_tau_is_the_multiplier_times_the_median_partner_distance_but_at_least_the_own_scale():
    clip = AdaptiveClip(multiplier=1.0)
    assert clip.radius(own_scale=1.0) == 1.0  # too few partners known: own scale alone
    for i, gap in enumerate((1.5, 1.8, 1.6)):
        clip.clip(f"p{i}", at(gap), OWN, own_scale=1.0)
    assert clip.radius(own_scale=1.0) == pytest.approx(1.6)
    assert clip.radius(own_scale=3.0) == 3.0


def test_remembered_distances_stop_at_spread_times_own_scale_so_tau_cannot_ratchet():
    clip = AdaptiveClip(multiplier=1.0, spread=2.0)
    for i in range(5):
        clip.clip(f"far{i}", at(50.0), OWN, own_scale=1.0)
    assert clip.radius(own_scale=1.0) == 2.0


def test_a_partner_beyond_tau_is_clipped_to_it_and_an_offence_only_beyond_the_spread():
    """A tight τ bounds what an aimed attacker moves us by; honest partners a little farther are not offenders."""
    clip = AdaptiveClip(multiplier=0.5, spread=2.0)
    clipped, gap, hard = clip.clip("honest-but-far", at(3.0), OWN, own_scale=1.0)
    assert gap == 3.0 and distance(clipped, OWN) == pytest.approx(0.5) and not hard
    limit = HARD_CLIP_FACTOR * 2.0 * 1.0
    assert not clip.clip("edge", at(limit * 0.99), OWN, own_scale=1.0)[2]
    assert clip.clip("attacker", at(limit * 1.01), OWN, own_scale=1.0)[2]


def test_a_partner_within_tau_is_mixed_as_sent_and_a_non_finite_one_is_refused():
    clip = AdaptiveClip(multiplier=1.0)
    theirs = at(0.9)
    clipped, _, hard = clip.clip("p", theirs, OWN, own_scale=1.0)
    assert torch.equal(clipped[0], theirs[0]) and not hard
    with pytest.raises(ValueError):
        clip.clip("p", [torch.full((10,), float("nan"))], OWN, own_scale=1.0)


@pytest.mark.parametrize("multiplier, spread", [(0.0, 2.0), (1.0, 0.0), (-1.0, 2.0)])
def test_bad_multipliers_are_refused(multiplier, spread):
    with pytest.raises(ValueError):
        AdaptiveClip(multiplier=multiplier, spread=spread)
