"""Bounding what one partner can move us by: ClippedGossip's clipping with a radius learnt from honest partners.

He, Karimireddy & Jaggi ("Byzantine-robust decentralized learning via ClippedGossip") mix
``x_i += w · clip(x_j − x_i, τ_i)``: a Byzantine partner then moves x_i by at most w·τ_i per exchange, whatever it
sends, while honest partners (closer than τ_i) mix unclipped. τ_i must track how far honest partners really are:
a fixed multiple of ‖x_i‖ is far too loose (an attacker sending −7× our value stays inside a bound of 10×), and an
attacker that learns our value can aim just inside any fixed bound. Here

    τ = multiplier × max(median over partners of their latest distance, own_scale)

with each partner's latest distance recorded at most at multiplier × own_scale (an attacker is one entry however
often it calls) and `own_scale` the caller's honest yardstick (how far our own value moved this round, ‖own Δ‖,
...): it keeps τ meaningful before enough partners are known and when they all agree closely. The cap keeps τ
within [multiplier, multiplier²] × own_scale. Recording clipped distances at τ itself would let τ ratchet: with 3
partners, an attacker (always at τ) and one honest partner clipped once make the median τ and double it, and an
aimed attacker then pushes its victim by ever more.

Clipping bounds what an exchange does; `net.responder_limits.OfferLimit` bounds how often one partner may open one
with us (an exchange opened and never committed shows the opener our exact value, and costs us an encode of the
whole model).
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from p2ptrain.maths.drift_excuse import DriftExcuse
from p2ptrain.tensor_layout import distance

MIN_PARTNERS_FOR_MEDIAN = 3  # below this many known partners, τ rests on own_scale alone
# how far honest partners may be, × max(their median distance, own_scale): partners' distances are remembered up
# to this × own_scale, so the median cannot ratchet τ up; HARD_CLIP_FACTOR × this is where an offence starts
SPREAD = 2.0
HARD_CLIP_FACTOR = 4.0
# × spread × typical: a partner clipped beyond this, exchange after exchange, without closing in, is held apart (an
# offence from its third such clip, with a drift excuse: maths/drift_excuse.py); half the hard radius
HELD_CLIP_FACTOR = HARD_CLIP_FACTOR / 2
# an input this many × τ from the robust mean is no one's disagreement but an attack (an honest Δ is at most a few τ
# away; a ×−1000 Δ sat about 500 τ away): one such offence bans at once (`clipped_far`), where a hard clip costs 1
FAR_CLIP_FACTOR = 64.0


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite: nothing else may be sent, mixed or applied."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class AdaptiveClip:
    """One peer's clipping radius for one kind of value (parameters, outer gradients), learnt per partner."""

    def __init__(self, multiplier: float = 2.0, max_partners: int = 64, spread: float = SPREAD,
                 excuse: DriftExcuse | None = None):
        """`excuse`: for values that persist between exchanges (gossiped parameters), hard clips of honest
        partners that drifted apart and are closing in again are no offences (`maths/drift_excuse.py`)."""
        if multiplier <= 0 or spread <= 0:
            raise ValueError(f"the clipping multiplier and spread must be > 0, got {multiplier}, {spread}")
        self.multiplier, self.spread, self.max_partners = multiplier, spread, max_partners
        self.excuse = excuse
        self._distances: OrderedDict[str, float] = OrderedDict()  # partner → its latest (clipped) distance

    def typical(self, own_scale: float) -> float:
        """How far an honest partner is: the median of the partners' latest distances, at least `own_scale`."""
        known = list(self._distances.values())
        return max(statistics.median(known) if len(known) >= MIN_PARTNERS_FOR_MEDIAN else 0.0, own_scale)

    def radius(self, own_scale: float) -> float:
        """τ: a partner farther than this is clipped to it."""
        return self.multiplier * self.typical(own_scale)

    def held_radius(self, own_scale: float) -> float:
        """Beyond this a run of clips that does not close in is an offence (`excuse`, values that persist only)."""
        return HELD_CLIP_FACTOR * self.spread * self.typical(own_scale)

    def hard_radius(self, own_scale: float) -> float:
        """A partner farther than this was not disagreeing (an offence): set by `spread`, not by τ, so a tight
        τ (it bounds what an aimed attacker moves us by) does not make honest partners offenders."""
        return HARD_CLIP_FACTOR * self.spread * self.typical(own_scale)

    def clip(self, partner_id: str, theirs: Sequence[torch.Tensor], own: Sequence[torch.Tensor],
             own_scale: float, rounds: tuple[int, object] | None = None,
             judged: bool = True) -> tuple[list[torch.Tensor], float, bool]:
        """(own + clip(theirs − own, τ), the distance before clipping, whether it was clipped hard: an offence).

        The returned value stands in for the partner's in any mix: an exchange then moves us by at most w·τ.
        `rounds`: (our round, the partner's claimed round), for the `excuse`. `judged` False: no clip can be an
        offence yet (we have no yardstick), and the excuse keeps no record of it (a run of clips it began would
        stay unexcused once we have one). Raises ValueError for a non-finite partner value (nothing to clip toward).
        """
        radius, hard_radius, typical = self.radius(own_scale), self.hard_radius(own_scale), self.typical(own_scale)
        held_radius = self.held_radius(own_scale)
        gap = distance(theirs, own)
        if not math.isfinite(gap):
            raise ValueError("partner's value is not finite")
        self._remember(partner_id, min(gap, self.spread * own_scale))
        if not judged:
            excused = True
        elif self.excuse is not None:
            excused = self.excuse.excused(partner_id, gap, hard_radius, radius, typical, rounds, held_radius)
        else:
            excused = gap <= hard_radius
        if gap <= radius:
            return [t.clone() for t in theirs], gap, False
        scale = radius / gap
        clipped = [o + (t - o) * scale for t, o in zip(theirs, own, strict=True)]
        return clipped, gap, not excused

    def _remember(self, partner_id: str, value: float) -> None:
        self._distances.pop(partner_id, None)
        self._distances[partner_id] = value
        while len(self._distances) > self.max_partners:
            self._distances.popitem(last=False)


def own_move(new: Sequence[torch.Tensor], old: Sequence[torch.Tensor], shift: Sequence[torch.Tensor] | None) -> float:
    """How far our own step moved our value: ‖new − (old + shift)‖, `shift` being what mixing moved it by meanwhile
    (a partner could otherwise inflate our yardstick, hence τ, round after round). One tensor at a time (no copy of
    the whole model)."""
    if shift is None:
        return distance(new, old)
    total = math.fsum(distance([n], [o + s]) ** 2 for n, o, s in zip(new, old, shift, strict=True))
    return math.sqrt(total)


def mixing_weight(claimed: Any, own: float) -> float | None:
    """The weight both ends of a parameter exchange use: the smaller of `own` and the partner's `claimed` one (the
    receiver chooses: no claim can raise it), which must lie in (0, 1/2]; None if it does not."""
    if not isinstance(claimed, float) or not 0 < claimed <= 0.5:
        return None
    return min(claimed, own)
