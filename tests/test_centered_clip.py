"""CenteredClip, the all-reduce's robust mean (maths/centered_clip.py)."""

from __future__ import annotations

import math

import pytest
import torch

from p2ptrain.maths.centered_clip import centered_clip
from p2ptrain.maths.mixing import exact_average
from p2ptrain.tensor_layout import distance, norm

SHAPES = [(6, 5), (7,)]


def honest_deltas(count: int, seed: int = 0, spread: float = 0.5) -> list[list[torch.Tensor]]:
    """Outer gradients of peers on different shards: a shared direction g plus a part e_j of their own."""
    gen = torch.Generator().manual_seed(seed)
    shared = [torch.randn(s, generator=gen) for s in SHAPES]
    return [[g + spread * torch.randn(s, generator=gen) for g, s in zip(shared, SHAPES, strict=True)]
            for _ in range(count)]


@pytest.mark.parametrize("count", [2, 3, 4, 7])
def test_honest_inputs_get_their_plain_mean(count):
    deltas = honest_deltas(count)
    result = centered_clip(deltas)
    assert distance(result.mean, exact_average(deltas)) <= 1e-5 * norm(exact_average(deltas))
    assert result.far_inputs() == []


def test_the_result_depends_only_on_the_inputs_bit_for_bit():
    deltas = honest_deltas(4) + [[t * -50 for t in honest_deltas(1, seed=3)[0]]]
    first, second = centered_clip(deltas), centered_clip([[t.clone() for t in d] for d in deltas])
    assert all(torch.equal(a, b) for a, b in zip(first.mean, second.mean, strict=True))


@pytest.mark.parametrize("factor", [-3.0, -1000.0, 1e12])
def test_one_hostile_input_among_four_moves_the_mean_by_a_bounded_amount(factor):
    honest = honest_deltas(3)
    honest_mean = exact_average(honest)
    hostile = [t * factor for t in honest[0]]
    result = centered_clip(honest + [hostile])
    moved = distance(result.mean, honest_mean)
    # k = 1 of n = 4: at most about τ/(n − k) from the honest mean, τ = 2 × the median distance from the centre
    assert moved <= result.radius / 3 + 1e-6, (moved, result.radius)
    assert moved < 0.5 * norm(honest_mean)
    if abs(factor) >= 1000:
        assert result.far_inputs() == [3]  # far beyond τ: an offence, and past FAR_CLIP_FACTOR × τ a ban at once
        assert result.offence_of(3) == "clipped_far"
    if factor == -3.0:  # beyond 2 τ, pointing against the others: a second such round bans (net/reputation.py)
        assert result.far_inputs() == [3] and result.offence_of(3) == "reversed"
    if factor == 1e12:  # far, but pointing with the others: an attack by its distance alone
        assert result.far_inputs() == [3] and result.offence_of(3) == "clipped_far"


@pytest.mark.parametrize("spread", [0.5, 1.0, 2.0])
def test_an_input_of_minus_seven_times_a_delta_is_an_offence_and_no_honest_input_is(spread):
    """−7·Δ sat 4 to 10 τ from the mean on the real path, 4 or 5 rounds from a ban at 1 a hard clip: pointing
    against the others, it costs 2.5 of the ban score of 4 (reversed) and beyond 4 τ a ban at once. The more the
    honest inputs spread (the less they agree), the larger τ, the nearer −7·Δ sits: 16 to 19 of 20 rounds offend."""
    offences, honest = [], []
    for seed in range(20):
        deltas = honest_deltas(4, seed=seed, spread=spread)
        result = centered_clip(deltas[:3] + [[t * -7.0 for t in deltas[3]]])
        offences.append(result.offence_of(3) if 3 in result.far_inputs() else None)
        honest += [j for j in result.far_inputs() if j != 3]
    assert not honest
    assert sum(o in ("reversed", "clipped_far") for o in offences) >= 16, offences


@pytest.mark.parametrize("members", [3, 4, 8, 16])
@pytest.mark.parametrize("spread", [0.5, 3.0, 10.0])
def test_honest_inputs_however_spread_are_never_offences(members, spread):
    for seed in range(10):
        assert centered_clip(honest_deltas(members, seed=seed, spread=spread)).far_inputs() == []


def test_the_plain_mean_is_what_one_hostile_input_moves_without_bound():
    honest = honest_deltas(3)
    hostile = [t * -1000.0 for t in honest[0]]
    plain = exact_average(honest + [hostile])
    assert distance(plain, exact_average(honest)) > 100 * distance(centered_clip(honest + [hostile]).mean,
                                                                    exact_average(honest))


def test_identical_inputs_and_a_single_input_come_back_unchanged():
    one = honest_deltas(1)[0]
    assert all(torch.equal(a, b) for a, b in zip(centered_clip([one]).mean, one, strict=True))
    same = centered_clip([one, [t.clone() for t in one], [t.clone() for t in one]])
    assert same.radius == 0 and all(torch.equal(a, b) for a, b in zip(same.mean, one, strict=True))


def test_bad_calls_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        centered_clip([])
    with pytest.raises(ValueError, match="shapes"):
        centered_clip([[torch.zeros(3)], [torch.zeros(4)]])
    with pytest.raises(ValueError, match="multiplier"):
        centered_clip(honest_deltas(2), multiplier=0.0)


def test_huge_but_bounded_values_keep_the_mean_finite():
    honest = honest_deltas(3)
    hostile = [torch.full(s, 1e15) for s in SHAPES]  # the exchange's bound on a member's values
    result = centered_clip(honest + [hostile])
    assert all(bool(torch.isfinite(t).all()) for t in result.mean)
    assert math.isinf(result.distances[3]) is False and result.far_inputs() == [3]


@pytest.mark.parametrize("value", [1e6, 1e15])
def test_a_huge_input_is_clipped_wherever_it_sorts(value):
    """Members' inputs are sorted by peer id, which a member chooses: one that sorts first must not become the point
    the arithmetic is taken from (distances of honest inputs measured from 1e15 away are lost to cancellation)."""
    honest = honest_deltas(5)
    hostile = [torch.full(s, value) for s in SHAPES]
    first, last = centered_clip([hostile] + honest), centered_clip(honest + [hostile])
    assert first.far_inputs() == [0] and last.far_inputs() == [5]
    assert first.radius == pytest.approx(last.radius, rel=1e-4) and first.radius > 0
    assert distance(first.mean, last.mean) <= 1e-4 * norm(last.mean)
    assert distance(first.mean, exact_average(honest)) <= first.radius / 5 + 1e-6


def reference(inputs: list[list[torch.Tensor]], multiplier: float = 2.0) -> tuple[torch.Tensor, float]:
    """CenteredClip written out plainly in fp64 (pairwise distances one by one): the mean, flattened, and τ."""
    x = torch.stack([torch.cat([t.double().reshape(-1) for t in value]) for value in inputs])
    apart = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")
    n = len(x)
    others = n - 1
    medians = [float(torch.cat([apart[j, :j], apart[j, j + 1:]]).sort().values[(others - 1) // 2:others // 2 + 1]
                     .mean()) for j in range(n)]
    start = medians.index(min(medians))
    radius = multiplier * medians[start]
    if bool(((x - x.mean(dim=0)).norm(dim=1) <= radius).all()):
        return x.mean(dim=0), radius
    centre = x[start].clone()
    for _ in range(8):
        gaps = x - centre
        centre = centre + (gaps * (radius / gaps.norm(dim=1)).clamp(max=1.0)[:, None]).sum(dim=0) / n
    return centre, radius


@pytest.mark.parametrize("case", ["spread", "near_identical", "huge_first"])
def test_the_mean_and_radius_match_a_plain_fp64_computation(case):
    """The fp32 Gram matrix is used as it is only where it is precise: near-identical inputs (their distances are a
    millionth of their lengths, lost to cancellation in ‖x_i‖² + ‖x_j‖² − 2⟨x_i, x_j⟩) are measured again from
    the shortest input."""
    gen = torch.Generator().manual_seed(5)
    if case == "near_identical":
        base = [100 * torch.randn(s, generator=gen) for s in SHAPES]
        inputs = [[b + 1e-4 * torch.randn(s, generator=gen) for b, s in zip(base, SHAPES, strict=True)]
                  for _ in range(5)]
    else:
        inputs = honest_deltas(5, seed=5)
    if case == "huge_first":
        inputs = [[torch.full(s, -1e15) for s in SHAPES]] + inputs
    expected, radius = reference(inputs)
    result = centered_clip(inputs)
    flat = torch.cat([t.double().reshape(-1) for t in result.mean])
    assert result.radius == pytest.approx(radius, rel=1e-3)
    # within a thousandth of the inputs' spread, or of fp32's own precision at their length
    assert float((flat - expected).norm()) <= max(1e-3 * radius, 1e-6 * float(expected.norm()))
