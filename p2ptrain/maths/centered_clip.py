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
stays the guard there). Cost: one copy of the inputs into an n × d matrix (`stack`, which the agreement digest
hashes too), one n × n Gram matrix (two when the inputs are nearly identical, `_gram_`) and the mean, or at most
ITERATIONS passes over the n inputs when some lie beyond τ (a coordinate-wise median as the start costs 5 to 10 times
more: a sort of n × d values). The tiny model's 6 inputs of 117,120 values: 0.4 ms to stack, 0.3 ms for the rest.

The result depends only on the inputs and their order, never on who computes it: members that hold the same inputs
(sorted by sender) compute the same mean, which is what keeps DiLoCo's peers in step (sync/exchange_allreduce.py).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # what DDP uses

from p2ptrain.maths.robust import FAR_CLIP_FACTOR, HARD_CLIP_FACTOR, SPREAD
from p2ptrain.tensor_layout import norm

ITERATIONS = 8  # fixed (not "until converged"): every member runs the same arithmetic and lands on the same bits
GRAM_ERROR = 4 * 2.0**-24  # × √d: how far off a squared distance from an fp32 Gram matrix can be (4× the typical)
GRAM_TOLERANCE = 0.1  # of the typical squared distance: the error a Gram matrix may carry to be used as it is


@dataclasses.dataclass
class RobustMean:
    """CenteredClip's result: the mean, the radius it clipped at, and each input's distance from the mean."""

    mean: list[torch.Tensor]
    radius: float
    distances: list[float]  # ‖x_j − mean‖, in the order of the inputs
    lengths: list[float]  # ‖x_j‖, in the order of the inputs

    # whether each input points against most of the others (⟨x_j, x_i⟩ < 0 for a majority of i ≠ j): honest outer
    # gradients of one round descend one loss from one start and point together; a sign-flipped or scaled-negative Δ
    # points against them. Measured between inputs, not against the mean, which the far input itself pulls by
    # up to τ/(n − k). Empty: not measured (the plain mean without `sync.robust`)
    against: list[bool] = dataclasses.field(default_factory=list)

    def far_inputs(self) -> list[int]:
        """Inputs that were not disagreeing but offending: farther than HARD_CLIP_FACTOR × τ from the mean, or
        farther than SPREAD × τ and pointing against the others."""
        return [j for j in range(len(self.distances)) if self._offence(j) is not None]

    def offence_of(self, j: int) -> str:
        """The offence of far input `j`: `clipped_far` (a ban at once) beyond FAR_CLIP_FACTOR × τ, or beyond
        HARD_CLIP_FACTOR × τ pointing against the others; `reversed` nearer, pointing against them; else `clipped`."""
        return self._offence(j) or "clipped"

    def _offence(self, j: int) -> str | None:
        d, tau = self.distances[j], self.radius
        against = bool(self.against) and self.against[j]
        if tau <= 0 or d <= (SPREAD if against else HARD_CLIP_FACTOR) * tau:
            return None
        if d > FAR_CLIP_FACTOR * tau or (against and d > HARD_CLIP_FACTOR * tau):
            return "clipped_far"
        return "reversed" if against else "clipped"


def centered_clip(inputs: Sequence[Sequence[torch.Tensor]], multiplier: float = 2.0,
                  iterations: int = ITERATIONS) -> RobustMean:
    """CenteredClip of `inputs` (each a list of tensors of the same shapes, finite: the caller checks). fp32."""
    if not inputs:
        raise ValueError("centered_clip needs at least one input")
    return centered_clip_rows_(stack(inputs), inputs[0], multiplier, iterations)


def stack(inputs: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """The inputs as the rows of one n × d fp32 matrix, each copied once (one C++ loop over every tensor: a Python
    one costs more than the copy on small models). A row holds the same bytes as its input's tensors one after
    another: what the agreement digest hashes."""
    shapes = [t.shape for t in inputs[0]]
    if any([t.shape for t in tensors] != shapes for tensors in inputs):
        raise ValueError("centered_clip's inputs differ in shapes")
    tensors = [t for values in inputs for t in values]
    if any(t.dtype != torch.float32 for t in tensors):
        tensors = [t.float() for t in tensors]
    with torch.no_grad():
        return _flatten_dense_tensors(tensors).view(len(inputs), -1)


def centered_clip_rows_(stacked: torch.Tensor, like: Sequence[torch.Tensor], multiplier: float = 2.0,
                        iterations: int = ITERATIONS, tolerance: float = 0.0) -> RobustMean:
    """CenteredClip of the rows of `stacked` (n × d fp32, from `stack`), which it may overwrite (see `_gram_`).
    The mean comes in the shapes of `like`. `tolerance` > 0: stop once a step moves the centre by at most that × τ
    (a mean others check against its fixed point, sync/scatter_allreduce.py); 0: every member's fixed count."""
    if len(stacked) == 0:
        raise ValueError("centered_clip needs at least one input")
    if multiplier <= 0:
        raise ValueError(f"the clipping multiplier must be > 0, got {multiplier}")
    n = len(stacked)
    gram, lengths, origin = _gram_(stacked)
    apart = _pairwise_distances(gram)
    medians = _medians_to_others(apart)
    start = medians.index(min(medians))  # the first of equals
    radius = multiplier * medians[start]
    against = _against_most(apart, lengths)
    if radius == 0:  # most inputs are the medoid itself: with τ = 0 nothing moves it
        return RobustMean(_unflatten(_shifted(stacked[start].clone(), origin), like), radius, apart[start], lengths,
                          against)
    to_mean = _distances_to_mean(gram)
    if all(d <= radius for d in to_mean):  # nothing to clip around the plain mean: it is the fixed point
        mean = stacked.sum(dim=0).div_(n)  # row after row: the same bits on every CPU (a BLAS call may differ)
        return RobustMean(_unflatten(_shifted(mean, origin), like), radius, to_mean, lengths, against)
    centre, gaps = stacked[start].clone(), torch.empty_like(stacked)
    for _ in range(iterations):
        torch.sub(stacked, centre, out=gaps)
        scales = torch.clamp(radius / torch.clamp(gaps.norm(dim=1).double(), min=1e-300), max=1.0).float()
        step = gaps.mul_(scales[:, None]).sum(dim=0).div_(n)  # Σ_j clip(x_j − v, τ) / n
        centre += step
        if tolerance > 0 and float(step.norm()) <= tolerance * radius:
            break
    torch.sub(stacked, centre, out=gaps)
    return RobustMean(_unflatten(_shifted(centre, origin), like), radius, _finite(gaps.norm(dim=1)), lengths,
                      against)


def _gram_(stacked: torch.Tensor) -> tuple[list[list[float]], list[float], torch.Tensor | None]:
    """(the Gram matrix of the inputs as Python floats, their lengths, the origin they are now measured from).

    One BLAS call in fp32: each entry is off by about 2⁻²⁴·√d·‖x_i‖‖x_j‖ (rounding errors add like a random walk),
    so a squared distance taken from it, ‖x_i‖² + ‖x_j‖² − 2⟨x_i, x_j⟩, by GRAM_ERROR·√d·(‖x_i‖ + ‖x_j‖)². That is
    precise enough while inputs are apart by more than a small fraction of their lengths (honest outer gradients:
    0.4 to 1 of theirs), and only there is it used. Otherwise (near-identical inputs, or one far input's length
    next to near ones) the rows are moved in place to start from the shortest input, x_j − x_o, and the Gram matrix
    taken again: no input is farther from the shortest than twice an honest one's length, so no distance is lost to
    cancellation, wherever a far input sorts (members sort by peer id, which a member chooses)."""
    gram = (stacked @ stacked.T).tolist()
    # the lengths members compare with their own inputs' (a reduce-scatter's owner reports them): accumulated in
    # fp64, where the Gram's diagonal was 3e-4 off at 6.4M values (the `base` preset's chunk of 4)
    lengths = [norm([row]) for row in stacked]
    if _precise(gram, lengths, stacked.shape[1]):
        return gram, lengths, None
    origin = stacked[lengths.index(min(lengths))].clone()
    stacked -= origin
    return (stacked @ stacked.T).tolist(), lengths, origin


def _precise(gram: list[list[float]], lengths: list[float], d: int) -> bool:
    """Whether every squared distance taken from `gram` is within GRAM_TOLERANCE of the larger of itself and the
    typical one (the median pair's, which sets τ)."""
    apart = _pairwise_distances(gram)
    typical = min(_medians_to_others(apart)) ** 2
    error = GRAM_ERROR * math.sqrt(d)
    return all(error * (lengths[i] + lengths[j]) ** 2 <= GRAM_TOLERANCE * max(apart[i][j] ** 2, typical)
               for i in range(len(gram)) for j in range(i))


def _shifted(vector: torch.Tensor, origin: torch.Tensor | None) -> torch.Tensor:
    """`vector` measured from zero again, when the inputs were moved to start from `origin` (in place)."""
    return vector if origin is None else vector.add_(origin)


def _pairwise_distances(gram: list[list[float]]) -> list[list[float]]:
    """‖x_i − x_j‖ for each pair; a pair beyond fp32's range (a Gram entry overflowed) is infinitely far."""
    return [[_root(gram[i][i] + gram[j][j] - 2 * g) for j, g in enumerate(row)] for i, row in enumerate(gram)]


def _medians_to_others(apart: list[list[float]]) -> list[float]:
    """Each input's median distance to the other inputs (0 for a lone input)."""
    return [statistics.median(row[:j] + row[j + 1:]) if len(row) > 1 else 0.0 for j, row in enumerate(apart)]


def _against_most(apart: list[list[float]], lengths: list[float]) -> list[bool]:
    """Whether each input's inner product with most of the others is negative: ⟨x_i, x_j⟩ = (‖x_i‖² + ‖x_j‖² −
    ‖x_i − x_j‖²) / 2, from what the Gram matrix gave (distances do not depend on where they were measured from)."""
    n = len(apart)
    return [sum(lengths[i] ** 2 + lengths[j] ** 2 < apart[i][j] ** 2 for j in range(n) if j != i) > (n - 1) / 2
            for i in range(n)]


def _distances_to_mean(gram: list[list[float]]) -> list[float]:
    """‖x_j − mean‖ for each input, from the Gram matrix alone (no pass over the inputs)."""
    n = len(gram)
    total = sum(map(sum, gram)) / (n * n)
    return [_root(row[j] - 2 * sum(row) / n + total) for j, row in enumerate(gram)]


def _root(square: float) -> float:
    """√max(square, 0); inf where the square is not finite (overflowed terms)."""
    return math.sqrt(max(square, 0.0)) if math.isfinite(square) else math.inf


def _finite(lengths: torch.Tensor) -> list[float]:
    return [d if math.isfinite(d) else math.inf for d in lengths.tolist()]


def _unflatten(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `vector` (a fresh tensor nothing else holds) in the shapes of `like`."""
    return list(_unflatten_dense_tensors(vector, like))
