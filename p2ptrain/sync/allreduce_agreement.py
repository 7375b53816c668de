"""Whether the members of an exchange all-reduce reduced the same inputs: DiLoCo's peers must hold the same bits.

Members whose views of the round differ (a record read a moment late, a joiner, a member that left mid-round, a
hostile member that answers some and not others) can end a round with different input sets, hence different means
and parameters that never meet again (DiLoCo averages outer gradients, not parameters). Two checks keep them in
step, both on `Reduction`s: what a member reduced (its round, each input's hash, and their digest).

1. Confirmation, within the round (`confirmation_verdict`). Members swap their digests before applying anything. A
   member applies the mean when a strict majority of its members (itself included; one it refuses by then, say one
   this very reduction banned, is not asked) reduced the same inputs; if not, nobody applies anything this round:
   each puts its parameters back at the round's anchor, which the members shared, so they stay in step and lose
   one round. A member that sees others agree on a reduction it does not hold (they may have applied it) is out of
   step: it keeps the anchor too, and the next round's state samples (state_evidence.py) show whether the others
   did apply and it must catch up from a synced peer's state. One member's word, sent differently to different
   members, cannot move a member whose honest co-members form a majority.
2. Reports, the next round (`outvoted`, `equivocators`). Each member's headers carry its previous `Reduction`
   (DISCARDED as its digest if it applied nothing). A member whose state more of this round's members do not share
   than do (a confirmation lost to the network, a hostile confirmation) learns it is out of step. And a member
   whose reported hashes disagree, with no strict majority for the one we got, sent different values to different
   members: an offence, and every member leaves its Δ out of this round.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import blake3
import torch

DIGEST = re.compile(r"[0-9a-f]{64}")
MAX_MEMBERS = 32  # members one peer exchanges with in a round at most (memory: one copy of Δ each)
MAX_PEER_ID = 64  # characters of a base58 peer id in a report (46 for the RSA and Ed25519 ids libp2p makes)
MIN_REPORTERS = 3  # members (ourselves included) whose reports on a sender it takes to call it an equivocator
APPLY, DISCARD, OUT_OF_STEP = "apply", "discard", "out of step"


def largest_group(group_size: int | None) -> int:
    """The most members a round's group of about `group_size` may hold (exchange_allreduce.round_groups draws
    groups by hash, so their sizes vary): twice that size, at most MAX_MEMBERS (None: one group, MAX_MEMBERS)."""
    return min(2 * group_size, MAX_MEMBERS) if group_size else MAX_MEMBERS


def value_hash(tensors: Sequence[torch.Tensor]) -> str:
    """BLAKE3 of a member's decoded Δ: its fp32 bytes, tensor after tensor (a row of `centered_clip.stack`'s matrix
    hashes alike). BLAKE3 is collision-resistant like SHA-256 (a member cannot make two values that hash alike and
    send one to some members, the other to the rest), and every member hashes every input every round, where
    BLAKE3 is several times faster than SHA-256 or blake2b (even on a core with SHA extensions)."""
    digest = blake3.blake3()
    for t in tensors:  # the buffer itself, as bytes: no copy
        digest.update(t.detach().float().reshape(-1).contiguous().numpy().view("u1").data)
    return digest.hexdigest()


DISCARDED = "0" * 64  # the digest a member reports for a round it applied nothing in (it kept the shared anchor)


@dataclasses.dataclass(frozen=True)
class Reduction:
    """What one all-reduce reduced: its round, each member's value hash, and their digest (equal for members that
    reduced the same inputs; DISCARDED when nothing was applied). A member's report of its own is unverified."""

    round: int
    digest: str
    hashes: dict[str, str]  # member → value_hash of what it sent

    @classmethod
    def of(cls, round_: int, inputs: Sequence[tuple[str, Sequence[torch.Tensor]]]) -> Reduction:
        hashes = {peer: value_hash(tensors) for peer, tensors in inputs}
        digest = blake3.blake3("".join(f"{peer}:{h};" for peer, h in sorted(hashes.items())).encode()).hexdigest()
        return cls(round_, digest, hashes)

    def discarded(self) -> Reduction:
        """The same inputs, reported as not applied: members that all kept the anchor agree on DISCARDED."""
        return dataclasses.replace(self, digest=DISCARDED)

    def header(self) -> dict[str, Any]:
        return {"agreed": [self.round, self.digest], "inputs": self.hashes}

    @classmethod
    def parse(cls, header: Mapping[str, Any]) -> Reduction | None:
        """A partner's report from its header; None when absent or malformed (it then only loses its vote)."""
        agreed, hashes = header.get("agreed"), header.get("inputs")
        if not (isinstance(agreed, list) and len(agreed) == 2 and type(agreed[0]) is int
                and is_digest(agreed[1])):
            return None
        if not (isinstance(hashes, dict) and len(hashes) <= MAX_MEMBERS and all(
                isinstance(k, str) and len(k) <= MAX_PEER_ID and is_digest(v) for k, v in hashes.items())):
            return None
        return cls(agreed[0], agreed[1], dict(hashes))


def is_digest(value: object) -> bool:
    return isinstance(value, str) and DIGEST.fullmatch(value) is not None


def confirmation_verdict(own: str, confirmations: Mapping[str, str], members: int) -> str:
    """APPLY, DISCARD or OUT_OF_STEP for a member whose reduction has digest `own`, given the digests the other
    `members − 1` members confirmed (missing ones count against)."""
    counts = collections.Counter(confirmations.values())
    same = 1 + counts.pop(own, 0)
    if 2 * same > members:
        return APPLY
    others_agree = max(counts.values(), default=0) >= 2  # two members that reduced alike may have applied it
    return OUT_OF_STEP if same >= 2 or others_agree else DISCARD


def outvoted(previous: Reduction, reports: Mapping[str, Reduction],
             voters: Collection[str] | None = None) -> tuple[int, int]:
    """(members that reduced what we did in `previous.round`, ourselves included; the most that reduced one other
    set): out of step when the second is larger. `reports`: this round's members' reports of that round; only
    those of `voters` count (None: all). Where groups are drawn anew each round (Factored's Mix2), this round's
    members were mostly in other groups last round: they reduced other inputs by design, and only the members of
    our own last reduction have a say on whether we hold what they hold."""
    votes = collections.Counter(r.digest for peer, r in reports.items()
                                if r.round == previous.round and (voters is None or peer in voters))
    same = votes.pop(previous.digest, 0) + 1
    return same, max(votes.values(), default=0)


def equivocators(previous: Reduction, reports: Mapping[str, Reduction], own_id: str) -> list[tuple[str, str]]:
    """(member, why) for each member of `previous` whose reporters disagree on what it sent, where what we got has
    no strict majority among at least MIN_REPORTERS of them (a member's report on itself does not count)."""
    found = []
    for sender, ours in previous.hashes.items():
        if sender == own_id:
            continue
        seen = [ours] + [r.hashes[sender] for peer, r in reports.items()
                         if peer != sender and r.round == previous.round and sender in r.hashes]
        counts = collections.Counter(seen)
        if len(seen) >= MIN_REPORTERS and len(counts) > 1 and 2 * counts[ours] <= len(seen):
            found.append((sender, f"round {previous.round}: {len(counts)} different values among {len(seen)} "
                                  f"members' reports"))
    return found
