"""Checking a mean that one member computed for the others: the verified reduce-scatter's arithmetic (the
transport is sync/scatter_allreduce.py), after BTARD (Gorbunov et al. 2022, "Secure Distributed Training at Scale").

Each member of a group owns one span of the flattened outer gradient ("chunk"); the others send it their values of
that span, it returns CenteredClip's mean v of them (maths/centered_clip.py, run until it stops moving) and the
radius τ it clipped at. Nobody else saw the inputs, but each member i knows its own, x_i, and CenteredClip's fixed
point satisfies

    Σ_i clip(x_i − v, τ) = 0

so each member sketches its residual r_i = clip(x_i − v, τ) and the members check that the sketches sum to zero.
A sketch is a count sketch: coordinate c adds ±r[c] to one of SKETCH_BUCKETS buckets, both drawn from a seed that
hashes every chunk's mean, so no owner knows the buckets before it has committed its mean. Sums of sketches are
sketches of sums, and the squares of a sketch add up to ‖r‖² on average.

What a lie costs. An owner that returns v + δ shifts the residual of each of the m members its lie does not put
beyond τ by −δ: their sketches sum to about −m·δ's sketch, which the owner must cancel with its own claim (or a
colluder's). A claim is a residual, at most τ long (`CLAIM_SLACK`): k colluders cancel at most about k·τ·CLAIM_SLACK
/ m, the same order as what k hostile inputs move CenteredClip by anyway. A member whose sketch does not match the
input it sent is found out exactly by an honest owner, which holds that input (`sketch_matches`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import blake3
import torch

SKETCH_BUCKETS = 32  # floats per sketch: 32 chunks' worth stay well inside one exchange header
SUM_TOLERANCE = 0.05  # the sketches' sum may be this × the chunk's scale long (CenteredClip stops at CONVERGED)
CLAIM_SLACK = 1.5  # a sketch may read this × τ long (a count sketch's estimate of a norm varies around it)
RADIUS_CAP = 3.0  # τ ≤ this × the clip multiplier × the median input length (its medoid's median distance is less)
CONVERGED = 1e-3  # CenteredClip steps until it moves by at most this × τ: the residuals then sum to ≤ n × this × τ
MAX_ITERATIONS = 200  # a chunk still moving after these fails the check, and the group falls back (honest: rare)
MATCH_TOLERANCE = 1e-4  # × the chunk's scale: fp32 differences between two computations of one residual


def chunk_spans(total: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous spans [start, end) covering `total` entries, as even as integers allow."""
    if parts < 1 or total < 0:
        raise ValueError(f"cannot split {total} entries into {parts} chunks")
    bounds = [total * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=False))


def radius_problem(radius: float, lengths: Sequence[float], multiplier: float) -> str | None:
    """Why an owner's τ cannot be CenteredClip's for inputs of these (announced) lengths; None when it can be."""
    if not (math.isfinite(radius) and radius >= 0) or not lengths or not all(math.isfinite(x) for x in lengths):
        return f"radius {radius!r} or input lengths not finite"
    if radius > RADIUS_CAP * multiplier * statistics.median(lengths):
        return f"radius {radius:.3g} beyond {RADIUS_CAP:g} × {multiplier:g} × the median input length"
    return None


def scale(radius: float, lengths: Sequence[float]) -> float:
    """What the check's tolerances are fractions of: τ, or the median input length where that is longer."""
    return max(radius, statistics.median(lengths) if lengths else 0.0)


def residual(own: torch.Tensor, mean: torch.Tensor, radius: float) -> torch.Tensor:
    """clip(own − mean, τ); with τ = 0 (the inputs were one value) unclipped: then they all must equal the mean."""
    gap = own.float() - mean.float()
    length = float(gap.norm())
    return gap.mul_(radius / length) if 0 < radius < length else gap


def sketch_layout(seed: bytes, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket, sign) of each of `length` coordinates, from BLAKE3's output for `seed`: the same on every member."""
    codes = torch.frombuffer(bytearray(blake3.blake3(seed).digest(length=max(length, 1))), dtype=torch.uint8)
    codes = codes[:length].long()
    return codes & (SKETCH_BUCKETS - 1), 1.0 - 2.0 * ((codes >> 5) & 1).double()


def sketch(vector: torch.Tensor, layout: tuple[torch.Tensor, torch.Tensor]) -> list[float]:
    """The count sketch of `vector` (float64: the sum of members' sketches must cancel to well below τ)."""
    buckets, signs = layout
    out = torch.zeros(SKETCH_BUCKETS, dtype=torch.float64)
    return out.index_add_(0, buckets, vector.double().reshape(-1) * signs).tolist()


def sketch_length(values: Sequence[float]) -> float:
    return math.sqrt(math.fsum(v * v for v in values))


def is_sketch(value: object) -> bool:
    """A well-formed sketch from a member's header (unverified: only its form)."""
    return isinstance(value, list) and len(value) == SKETCH_BUCKETS and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)


def judge_sketches(sketches: Mapping[str, Sequence[float]], radius: float, lengths: Sequence[float]) -> str | None:
    """Whether a chunk's mean is the fixed point its members' residual sketches say: None, or why not."""
    bound = CLAIM_SLACK * radius + SUM_TOLERANCE * scale(radius, lengths)
    for member, values in sorted(sketches.items()):
        if not sketch_length(values) <= bound:
            return f"{member}'s residual sketch is {sketch_length(values):.3g} long (τ {radius:.3g})"
    total = [math.fsum(column) for column in zip(*sketches.values(), strict=True)]
    if not sketch_length(total) <= SUM_TOLERANCE * scale(radius, lengths):
        return (f"the residuals of {len(sketches)} members sum to {sketch_length(total):.3g}, not 0 (τ "
                f"{radius:.3g}): the mean is not their CenteredClip")
    return None


def sketch_matches(claimed: Sequence[float], exact: Sequence[float], radius: float,
                   lengths: Sequence[float]) -> bool:
    """Whether a member's sketch is that of the residual of the input it sent (computed by the chunk's owner)."""
    gap = sketch_length([a - b for a, b in zip(claimed, exact, strict=True)])
    return gap <= MATCH_TOLERANCE * scale(radius, lengths)
