"""Whether the mean an all-reduce hands back may be applied: judged against our own outer gradient Δ.

With the exchange all-reduce (the default, sync/exchange_allreduce.py) the mean is already robust: every member
sees every input and takes their CenteredClip mean (maths/centered_clip.py). This check is the second line there,
and the only one with hivemind's averager, which the rest of this docstring is about.

An all-reduce gives no view of the other members' contributions, only their mean, and any member can bend it at
will: it chooses its Δ and the weight it claims (hivemind sums w·Δ over the claims and divides by Σw, unchecked), and
as the reducer of its span of the vector it returns whatever it likes there (net/allreduce.py says why hivemind's
public API allows nothing better). All an honest peer can do is judge the result against what it knows, its own
Δ_i. The mean is refused (and Δ_i applied instead, as after a failed all-reduce) when it holds a non-finite value or
when

    ‖mean − Δ_i‖ > τ,   τ = multiplier × max(median of the last accepted deviations, s),
    s = max(‖Δ_i‖, the lower median of the ‖Δ_j‖ the members announced).

What honest deviations look like. With n peers on different data shards, Δ_j = g + e_j: a direction g they share
and a part e_j of their own shard (and inner-phase noise), about equally long and nearly independent across peers.
Then mean − Δ_i = ē − e_i, of length ≈ ‖e‖·√((n−1)/n), while ‖Δ_i‖ ≈ √(‖g‖² + ‖e‖²): an honest deviation stays
about ‖Δ_i‖ or below for every n (a pair: ‖Δ_j − Δ_i‖/2), and nears ‖Δ_i‖ late in training, when g is small beside
e. Honest deviations range from about 0.4–0.7 ‖Δ_i‖ (peers training one model on different shards) through 1.2
‖Δ_i‖ (peers pulled to unrelated targets) to about 2 s (a joiner's first round, one AdamW step from a fresh
optimizer state, meeting peers' five). The multiplier (ALLREDUCE_MARGIN × `sync.clip_multiplier`, 4 by default) is
the margin. A peer whose Δ is much shorter than its partners' (a joiner's first round, a paced peer: few inner
steps, so little length and weight) gets a mean near the partners' Δ, several ‖Δ_i‖ away (a joiner that ran 1 inner
step of 5: 2.3 ‖Δ_i‖): the members' announced lengths set s then. One member cannot move their lower median beyond
the honest members' claims, nor lower s below ‖Δ_i‖. The median of past deviations lets τ follow groups whose
honest disagreement sits near the floor.

What a hostile member can still do. Whatever it sends and whatever weight it claims, the mean lies on the segment
from the honest members' mean to its own value; it is applied only within τ of Δ_i, so the outer step an honest peer
takes moves at most τ from its own. An attacker far away (×1000, NaN, a huge weight on a far value) costs the group
this round's averaging, no more. An attacker aiming inside τ bends the step by up to τ each round (τ ≥ 2‖Δ_i‖ reaches
−Δ_i: benchmarks/robustness.py's aimed attack diverges honest DiLoCo peers). Clipping accepted means closer to Δ_i
would stop the reversal but changes honest means too: honest deviations reach about 2 s (a joiner, whose first Δ
is one AdamW step) — only a robust reduction per part would do better, and hivemind's
averager has none to offer (net/allreduce.py). It cannot widen τ beyond multiplier² × s: each deviation is
remembered at most at multiplier × s of its round, so accepted rounds cannot ratchet τ upward.

Cost: a few passes over the vector in float64 (‖mean − Δ_i‖, ‖Δ_i‖), nothing more on the network than one float
in the group's metadata.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Sequence

import torch

from p2ptrain.tensor_layout import distance, norm

HISTORY_ROUNDS = 16  # deviations of this many recent accepted rounds set the median
MIN_HISTORY_ROUNDS = 3  # below this many, τ rests on s alone


@dataclasses.dataclass(frozen=True)
class MeanVerdict:
    """The check of one all-reduce's mean."""

    accepted: bool
    deviation: float  # ‖mean − own Δ‖ (inf when either holds a non-finite value)
    radius: float  # τ it was compared with (inf when the check is off)
    reason: str = ""  # why it was refused: "not finite" or "too far"


class MeanCheck:
    """One peer's check of the means it gets from one all-reduce stream (DiLoCo's, or Factored's Mix2)."""

    def __init__(self, multiplier: float, enabled: bool = True, history_rounds: int = HISTORY_ROUNDS):
        if multiplier <= 0:
            raise ValueError(f"the check's multiplier must be > 0, got {multiplier}")
        self.multiplier, self.enabled = multiplier, enabled
        self._deviations: collections.deque[float] = collections.deque(maxlen=history_rounds)

    def radius(self, scale: float) -> float:
        """τ for a round whose honest outer gradients are `scale` long (`own_scale`)."""
        known = list(self._deviations)
        typical = statistics.median(known) if len(known) >= MIN_HISTORY_ROUNDS else 0.0
        return self.multiplier * max(typical, scale)

    def judge_(self, mean: Sequence[torch.Tensor], own: Sequence[torch.Tensor], claimed_norms: Sequence[float] = (),
               own_norm: float | None = None, deviation: float | None = None, stretch: float = 1.0) -> MeanVerdict:
        """Whether `mean` may be applied in place of `own`; an accepted deviation joins the history.

        `claimed_norms`: the ‖Δ‖ the group's members announced, ours included (unverified; may be empty).
        `own_norm`, `deviation`: ‖own‖ and ‖mean − own‖ where our own code already measured them (the exchange
        all-reduce's CenteredClip, from the inputs it reduced); measured here otherwise. `stretch` (≥ 1): how much
        longer our Δ would be had we run our whole inner phase: a peer cut to 1 step of 10 (to end with peers that
        started the round earlier) has a short Δ, and without the stretch finds an honest mean beyond its radius,
        refuses it and splits the swarm. An attacker who announces an
        early end of round widens the radius by at most H / `inner.min_steps`; CenteredClip still bounds each input."""
        if not self.enabled:
            return MeanVerdict(True, math.nan, math.inf)
        scale = own_scale(stretch * (norm(own) if own_norm is None else own_norm), claimed_norms)
        deviation = distance(mean, own) if deviation is None else deviation
        if not math.isfinite(deviation) or not math.isfinite(scale):
            return MeanVerdict(False, math.inf, self.radius(scale), "not finite")
        radius = self.radius(scale)
        if deviation > radius:
            return MeanVerdict(False, deviation, radius, "too far")
        self._deviations.append(min(deviation, self.multiplier * scale))
        return MeanVerdict(True, deviation, radius)


def own_scale(own_norm: float, claimed_norms: Sequence[float]) -> float:
    """How long this round's honest outer gradients are: ‖Δ_i‖, or the group's lower median claim when longer
    (more than half the members must claim at least that much to raise it)."""
    claims = sorted(claimed_norms)
    return max(own_norm, claims[(len(claims) - 1) // 2]) if claims else own_norm

