"""A robust mean of the members' outer gradients: CenteredClip (Karimireddy, He & Jaggi 2021; BTARD, Gorbunov et
al. 2022, the reduction hivemind's btard work runs per part).

    v_0     = the medoid: the input whose median distance to the others is least
    τ       = multiplier × that median distance
    v_{l+1} = v_l + (1/n) Σ_j clip(x_j − v_l, τ),   clip(z, τ) = z · min(1, τ/‖z‖)

Every member weighs 1/n: the receiver fixes the weights, no member's claim enters them. An input farther than τ from
the centre pulls it by at most τ/n per iteration, whatever it holds, so k hostile members among n move the result by
at most about k·τ/(n − k) from where the honest ones put it; honest inputs (within τ of the centre, as they are when
their spread is even) are averaged exactly, so a group of honest peers gets their plain mean (and stops after one
iteration). With k < n/2 the medoid is an honest input. With two members no rule can tell the honest one: neither
is clipped and the result is their mean (the caller's check against its own Δ, maths/robust_mean.py, stays the
guard there). Cost: one n × n Gram matrix and at most ITERATIONS passes over the n inputs (a coordinate-wise median
as the start cost 5 to 10 times more: a sort of n × d values).

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
    shapes = [t.shape for t in inputs[0]]
    stacked = torch.stack([_flatten(x, shapes) for x in inputs])  # n × d
    apart = _pairwise_distances(stacked)
    start = min(range(len(inputs)), key=lambda j: (_median_to_others(apart, j), j))
    centre = stacked[start].clone()
    radius = multiplier * _median_to_others(apart, start)
    gaps = stacked - centre
    for _ in range(iterations if radius > 0 else 0):
        lengths = gaps.norm(dim=1).double()
        if bool((lengths <= radius).all()):  # nothing clipped: the step lands on the plain mean, a fixed point
            centre = stacked.mean(dim=0)
            gaps = stacked - centre
            if bool((gaps.norm(dim=1) <= radius).all()):
                break
            continue
        scales = torch.clamp(radius / torch.clamp(lengths, min=1e-300), max=1.0).float()
        centre = centre + (gaps * scales[:, None]).sum(dim=0) / len(inputs)
        gaps = stacked - centre
    return RobustMean(_unflatten(centre, inputs[0]), radius, _finite(gaps.norm(dim=1)),
                      _finite(stacked.norm(dim=1)))


def _pairwise_distances(stacked: torch.Tensor) -> torch.Tensor:
    """n × n Euclidean distances, through one Gram matrix of the inputs less the first (one BLAS call; fp32 is
    enough to pick the start and set τ)."""
    diffs = stacked - stacked[0]
    gram = (diffs @ diffs.T).double()
    squares = gram.diagonal()
    return (squares[:, None] + squares[None, :] - 2 * gram).clamp(min=0).sqrt()


def _median_to_others(apart: torch.Tensor, j: int) -> float:
    others = [float(apart[j, k]) for k in range(apart.shape[0]) if k != j]
    return statistics.median(others) if others else 0.0


def _flatten(tensors: Sequence[torch.Tensor], shapes: list[torch.Size]) -> torch.Tensor:
    if [t.shape for t in tensors] != shapes:
        raise ValueError("centered_clip's inputs differ in shapes")
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def _finite(lengths: torch.Tensor) -> list[float]:
    return [d if math.isfinite(d) else math.inf for d in lengths.tolist()]


def _unflatten(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(vector[offset:offset + t.numel()].reshape(t.shape).clone())
        offset += t.numel()
    return out
