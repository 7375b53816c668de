"""A robust mean of the members' outer gradients: CenteredClip (Karimireddy, He & Jaggi 2021; BTARD, Gorbunov et
al. 2022, the reduction hivemind's btard work runs per part).

    v_0     = the medoid: the input whose median distance to the others is least
    τ       = multiplier × that median distance
    v_{l+1} = v_l + (1/n) Σ_j clip(x_j − v_l, τ),   clip(z, τ) = z · min(1, τ/‖z‖)

Every member weighs 1/n: the receiver fixes the weights, no member's claim enters them. An input farther than τ from
the centre pulls it by at most τ/n per iteration, whatever it holds, so k hostile members among n move the result by
at most about k·τ/(n − k) from where the honest ones put it. With k < n/2 the medoid is an honest input. When every
input lies within τ of the plain mean (honest members whose spread is even), the plain mean is the fixed point and
is returned as it is (told from the Gram matrix, with no iteration). With two members no rule can tell the honest
one: neither is clipped and the result is their mean (the caller's check against its own Δ, maths/robust_mean.py,
stays the guard there). Cost: one n × n Gram matrix and the mean, or at most ITERATIONS passes over the n inputs
when some lie beyond τ (a coordinate-wise median as the start cost 5 to 10 times more: a sort of n × d values).

The result depends only on the inputs and their order, never on who computes it: members that hold the same inputs
(sorted by sender) compute the same mean, which is what keeps DiLoCo's peers in step (sync/exchange_allreduce.py).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

import torch

from p2ptrain.maths.robust import HARD_CLIP_FACTOR

ITERATIONS = 8  # fixed (not "until converged"): every member runs the same arithmetic and lands on the same bits


@dataclasses.dataclass
class RobustMean:
    """CenteredClip's result: the mean, the radius it clipped at, and each input's distance from the mean."""

    mean: list[torch.Tensor]
    radius: float
    distances: list[float]  # ‖x_j − mean‖, in the order of the inputs
    lengths: list[float]  # ‖x_j‖, in the order of the inputs

    def far_inputs(self) -> list[int]:
        """Inputs so far from the mean that they were not disagreeing (> HARD_CLIP_FACTOR × τ): offences."""
        return [j for j, d in enumerate(self.distances) if self.radius > 0 and d > HARD_CLIP_FACTOR * self.radius]


def centered_clip(inputs: Sequence[Sequence[torch.Tensor]], multiplier: float = 2.0,
                  iterations: int = ITERATIONS) -> RobustMean:
    """CenteredClip of `inputs` (each a list of tensors of the same shapes, finite: the caller checks). fp32."""
    if not inputs:
        raise ValueError("centered_clip needs at least one input")
    if multiplier <= 0:
        raise ValueError(f"the clipping multiplier must be > 0, got {multiplier}")
    stacked = _stack(inputs)  # n × d
    gram = _gram(stacked)
    apart = _pairwise_distances(gram)
    medians = _medians_to_others(apart)
    start = min(range(len(inputs)), key=lambda j: (medians[j], j))
    radius = multiplier * medians[start]
    lengths = _finite(stacked.norm(dim=1))
    to_mean = _distances_to_mean(gram)
    if radius == 0:  # most inputs are the medoid itself: with τ = 0 nothing moves it
        return RobustMean(_unflatten(stacked[start].clone(), inputs[0]), radius, _finite(apart[start]), lengths)
    if bool((to_mean <= radius).all()):  # nothing to clip around the plain mean: it is the fixed point
        return RobustMean(_unflatten(stacked.mean(dim=0), inputs[0]), radius, _finite(to_mean), lengths)
    centre = stacked[start].clone()
    gaps = stacked - centre
    for _ in range(iterations):
        scales = torch.clamp(radius / torch.clamp(gaps.norm(dim=1).double(), min=1e-300), max=1.0).float()
        centre = centre + (gaps * scales[:, None]).sum(dim=0) / len(inputs)
        gaps = stacked - centre
    return RobustMean(_unflatten(centre, inputs[0]), radius, _finite(gaps.norm(dim=1)), lengths)


def _gram(stacked: torch.Tensor) -> torch.Tensor:
    """The n × n Gram matrix of the inputs less the first (one BLAS call; its fp32 precision is enough to pick the
    start, set τ and tell whether any input lies beyond it), in fp64."""
    diffs = stacked - stacked[0]
    return (diffs @ diffs.T).double()


def _pairwise_distances(gram: torch.Tensor) -> torch.Tensor:
    squares = gram.diagonal()
    return (squares[:, None] + squares[None, :] - 2 * gram).clamp(min=0).sqrt()


def _distances_to_mean(gram: torch.Tensor) -> torch.Tensor:
    """‖x_j − mean‖ for each input, from the Gram matrix alone (no pass over the inputs)."""
    return (gram.diagonal() - 2 * gram.mean(dim=1) + gram.mean()).clamp(min=0).sqrt()


def _medians_to_others(apart: torch.Tensor) -> list[float]:
    """Each input's median distance to the other inputs (0 for a lone input)."""
    rows = apart.tolist()
    return [statistics.median([d for k, d in enumerate(row) if k != j]) if len(row) > 1 else 0.0
            for j, row in enumerate(rows)]


def _stack(inputs: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """The inputs as the rows of one n × d fp32 matrix, each copied once (straight into its row)."""
    shapes = [t.shape for t in inputs[0]]
    stacked = torch.empty((len(inputs), sum(s.numel() for s in shapes)), dtype=torch.float32)
    for row, tensors in zip(stacked, inputs, strict=True):
        if [t.shape for t in tensors] != shapes:
            raise ValueError("centered_clip's inputs differ in shapes")
        torch.cat([t.detach().reshape(-1) for t in tensors], out=row)
    return stacked


def _finite(lengths: torch.Tensor) -> list[float]:
    return [d if math.isfinite(d) else math.inf for d in lengths.tolist()]


def _unflatten(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `vector` (a fresh tensor nothing else holds) in the shapes of `like`."""
    out, offset = [], 0
    for t in like:
        out.append(vector[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out
