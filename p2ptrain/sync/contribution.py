"""What each partner's outer gradients show of its work: a free rider is an offence, and the tokens a partner claims
are counted as verified only for values that did work.

A peer that trains nothing (no inner steps that move it: a learning rate of ~0, or a Δ scaled to ~0) still sends a
value every round and takes the swarm's mean in return. Honest outer gradients of one round are of one scale: each
holds at least one inner AdamW step, which moves every parameter by about the step's learning rate, and at most a
round's H steps at the schedule's highest rate; with H ≤ 1000 and a cosine floor of 1/10, the shortest honest Δ is
over IDLE_FRACTION = 1e-4 of the longest. A partner's Δ shorter than that fraction of ours is `idle` (an offence:
three within a half-life ban), except the first value we judge of it (a joiner's first round, whatever its warmup).

What a partner claims: the tokens its round's inner phase trained (`tokens` in its exchange header, unverified).
A value that is neither idle nor replayed (sync/replay_check.py) verifies its claim, up to MAX_CLAIM_FACTOR × our own
round's tokens (a faster GPU trains more tokens in the round's time, but not without bound). Judged per partner on
the exchanges that carry an outer gradient (the exchange all-reduce's all-to-all, gossip Mix2), with `sync.robust`.

GASLoC's values are parameters, which show no one round's work: each of its headers carries, as `work`, the
sender's latest outer gradient at STATE_SAMPLE coordinates every peer of the run draws alike (`work_sample`), judged
as the length of an outer gradient is against ours at the same coordinates; a header without a valid one shows no
work (idle). Not judged: Factored's Mix1 (its Mix2 judges the round's Δ) and a reduce-scatter's chunks, which show no
one partner's whole Δ.

What remains: a partner that trains a small fraction of what it claims passes, with its Δ; a copy of another
member's Δ of the round, or of the last mean, passes unless it is a bit-for-bit replay of the partner's own. A GASLoC
sample is a claim checked for its length and against replay only (the same bits shown for a later round:
exchange_driver's `work_replays`): one made up (not trained) passes, and it is not what is mixed.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from p2ptrain.net.discovery import MAX_TOKENS, MAX_VOUCHES, short_id
from p2ptrain.sync.state_evidence import parse_sample, sample_at

IDLE_FRACTION = 1e-4  # a Δ shorter than this × ours is no training (see above)
MAX_CLAIM_FACTOR = 16.0  # a claim verifies at most this × our own round's tokens
MAX_ROUND_TOKENS = 10**12  # a header's claim beyond this is malformed (500 steps × 4096 sequences × 8192 tokens: 2e10)
MAX_PARTNERS = 256  # partners remembered (identities are cheap: the one judged least recently goes first)


@dataclasses.dataclass(frozen=True)
class OwnWork:
    """Our own outer gradient of a round, as the yardstick of partners': its length and the tokens we claim for it;
    `sample`, where values are parameters: the `work_sample` partners show their work by (its length is `norm`)."""

    norm: float
    tokens: int
    sample: tuple[float, ...] | None = None

    @classmethod
    def of_sample(cls, sample: Sequence[float], tokens: int) -> OwnWork:
        return cls(sample_length(sample), tokens, tuple(sample))


WORK_KEY = "work"  # the header field of a GASLoC value's work sample


def work_sample(outer_gradient: Sequence[torch.Tensor], run_id: str) -> list[float]:
    """Our outer gradient at the run's work coordinates (the same every round: we keep only our latest sample)."""
    return sample_at(outer_gradient, f"{run_id}/work")


def shown_sample(header: dict[str, Any]) -> list[float] | None:
    """The work sample a partner's header shows, if it is a valid one (STATE_SAMPLE finite numbers)."""
    return parse_sample(header.get(WORK_KEY))


def sample_length(sample: Sequence[float]) -> float:
    return math.sqrt(math.fsum(v * v for v in sample))


@dataclasses.dataclass
class PartnerWork:
    """One partner's values as we judged them: how many, how many idle, and the tokens it claimed and we verified."""

    first_round: int
    last_round: int
    values: int = 0
    idle: int = 0
    worked: int = 0  # values that were neither idle nor replayed
    tokens_claimed: int = 0
    tokens_verified: int = 0


def claimed_tokens(header: dict[str, object]) -> int:
    """The tokens a partner's header claims its round trained (0 when it claims none or an impossible number)."""
    tokens = header.get("tokens", 0)
    return tokens if type(tokens) is int and 0 <= tokens <= MAX_ROUND_TOKENS else 0


class Contributions:
    """Per partner, what its outer gradients showed of its work (`judge_`); thread-safe (the event loop judges, the
    round loop reads)."""

    def __init__(self, max_partners: int = MAX_PARTNERS):
        self.max_partners = max_partners
        self._work: OrderedDict[str, PartnerWork] = OrderedDict()
        self._lock = threading.Lock()

    def judge_(self, partner: str, round_: int, claimed: int, theirs_norm: float, own_norm: float, own_tokens: int,
               replayed: bool = False) -> bool:
        """Count one value of `partner` for its claimed round `round_`; True if it is idle (an offence). A value
        of a round already judged counts once (an all-reduce's stages); `replayed` values verify nothing."""
        idle = math.isfinite(own_norm) and own_norm > 0 and not theirs_norm >= IDLE_FRACTION * own_norm
        with self._lock:
            work = self._work.pop(partner, None)
            if work is None:
                work, idle = PartnerWork(round_, round_ - 1), False  # its first value: a joiner's first round
            self._work[partner] = work
            while len(self._work) > self.max_partners:
                self._work.popitem(last=False)
            if round_ <= work.last_round:
                return False
            work.last_round, work.values = round_, work.values + 1
            work.idle += idle
            work.tokens_claimed += claimed
            if not idle and not replayed:
                work.worked += 1
                cap = MAX_CLAIM_FACTOR * own_tokens if own_tokens > 0 else math.inf
                work.tokens_verified += int(min(claimed, cap))
        return idle

    def vouches_for(self, partner: str) -> bool:
        """Whether at least one of `partner`'s values did work: its round counts in ours (join_rules.py's quorum),
        and it comes first as a donor or a witness. An identity costs nothing; a value that trained does."""
        with self._lock:
            work = self._work.get(partner)
            return work is not None and work.worked > 0

    def work(self) -> dict[str, PartnerWork]:
        """Every remembered partner's record (copies), the most recently judged last."""
        with self._lock:
            return {partner: dataclasses.replace(work) for partner, work in self._work.items()}

    def vouches(self) -> dict[str, int]:
        """The tokens we verified of the MAX_VOUCHES partners judged most recently, by `short_id`: what our record
        says of them, for `status`."""
        with self._lock:
            recent = list(self._work.items())[-MAX_VOUCHES:]
        return {short_id(partner): min(work.tokens_verified, MAX_TOKENS) for partner, work in recent}
