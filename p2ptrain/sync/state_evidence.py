"""Whether DiLoCo's peers hold the same state, shown by samples of it rather than told by a flag.

DiLoCo peers average outer gradients, never parameters: a peer that once applied something other than its round's
mean (a refused mean, a round whose members were out of step) holds other parameters from then on, however often
it averages with the others. A flag saying whether a peer's latest group held the swarm's majority cannot show
this: nothing checks it against the parameters, and once no peer of a round is synced nobody can catch up (a
killed peer can leave a round in which two members reduce one input set and two another; all four apply their own
Δ and, trusting flags, would train on as four states for the rest of the run).

So each member of DiLoCo's exchange all-reduce shows its anchor in the header of its outer gradient: the values of
θ at STATE_SAMPLE coordinates drawn from the run and the round (every member draws the same ones). Members within
ALIGNED_MAX_DISTANCE of each other (relative; peers in step differ by float rounding at most) hold one state.
`state_in_step` judges ours against the group's: in step when ours is held by the most members; where states tie, the
one held by the lowest peer id wins, so that a swarm split into states of one member each (as above) still agrees
on one state, whose holder is synced and the others catch up from it.

Samples are claims: a member may show any values. A liar counts as one more member holding the state it shows;
liars outnumbering the largest honest state can mark honest peers out of step, who then ask the liars for their
state, which the joining checks (witnesses, the validation loss) refuse and penalise.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import torch

STATE_SAMPLE = 64  # coordinates of θ each member shows (its relative distance estimates the full one to ~12 %)
MAX_SAMPLE_VALUE = 1e15  # beyond, a sample's squares could overflow, and an infinite gap pass for a match
# ‖θ_a − θ_b‖ / ‖θ_a‖ of DiLoCo peers in step: float rounding only (5e-9 to 8e-9 relative on the tiny model, against
# 0.1–0.2 between rounds); a lie must come this close to pass (joining.py's witnesses use it too)
ALIGNED_MAX_DISTANCE = 1e-3


def state_sample(tensors: Sequence[torch.Tensor], round_: int, run_id: str) -> list[float]:
    """θ at STATE_SAMPLE coordinates of the tensors flattened end to end, drawn from the run and the round."""
    return sample_at(tensors, f"{run_id}/state/{round_}")


def sample_at(tensors: Sequence[torch.Tensor], key: str) -> list[float]:
    """The tensors flattened end to end, at STATE_SAMPLE coordinates drawn from `key` (every peer draws the same)."""
    sizes = torch.tensor([t.numel() for t in tensors], dtype=torch.long)
    total = int(sizes.sum())
    if total == 0:
        return []
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    positions = torch.randint(total, (STATE_SAMPLE,), generator=torch.Generator().manual_seed(seed % 2**63))
    ends = sizes.cumsum(0)
    owners = torch.searchsorted(ends, positions, right=True)
    starts = ends - sizes
    return [float(tensors[int(i)].detach().reshape(-1)[int(p - starts[i])].float())
            for i, p in zip(owners, positions, strict=True)]


def parse_sample(value: object) -> list[float] | None:
    """A member's sample from its header: STATE_SAMPLE numbers within ±MAX_SAMPLE_VALUE, or None (it then shows
    nothing)."""
    if not isinstance(value, list) or len(value) != STATE_SAMPLE:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= MAX_SAMPLE_VALUE
               for v in value):  # NaN fails the comparison too
        return None
    return [float(v) for v in value]


def same_state(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two samples show one state: ‖a − b‖ ≤ ALIGNED_MAX_DISTANCE × the larger of ‖a‖, ‖b‖."""
    gap = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    scale = max(math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b)))
    return gap <= ALIGNED_MAX_DISTANCE * scale


def state_in_step(own_id: str, own: Sequence[float], others: Mapping[str, Sequence[float]]) -> bool | None:
    """Whether our state is the group's: held by the most members (ourselves included), ties going to the state
    of the lowest peer id among its holders. None without another member's sample (nothing to judge by).

    Each member's state is the set of members whose samples lie within the tolerance of its own; ours wins when
    no member's set is larger than ours, or as large with a lower peer id in it."""
    if not others:
        return None
    samples = {own_id: list(own), **{peer: list(s) for peer, s in others.items()}}
    holders = {peer: {p for p, s in samples.items() if same_state(sample, s)} for peer, sample in samples.items()}
    rank = {peer: (-len(members), min(members)) for peer, members in holders.items()}
    return min(rank.values()) == rank[own_id]
