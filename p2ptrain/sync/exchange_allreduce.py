"""DiLoCo's all-reduce (and Factored's Mix2 by all-reduce) over our own exchange protocol: every member of the
round's group swaps its outer gradient with every other member, then each computes the group's CenteredClip mean.

Why not hivemind's averager (net/allreduce.py says it in full): there, each member claims its own weight and reduces
a span of the vector for everyone, unseen, so one member can put the mean wherever it likes inside any check an
honest peer can make (benchmarks/robustness.py: an aimed member diverged honest DiLoCo peers). Here
- every input is attributable: it arrives over a stream libp2p authenticated, from the member that sent it, and is
  checked alike by every member (decodes to our shapes, finite, within ±MAX_ABS_VALUE: no bound relative to one's
  own Δ, which would let a value near one member's bound split the group's inputs);
- the receiver fixes the weights (1/n each) and reduces robustly (maths/centered_clip.py): k hostile members among
  n move the mean by about k·τ/(n − k) at most, and an input far beyond τ is an offence (`clipped`); a minority of
  inputs too short to hold any training (free riders') is left out by every member alike;
- members that hold the same inputs, sorted by peer id, compute the same mean (CenteredClip is deterministic), and
  sync/allreduce_agreement.py makes sure they do before anyone applies it: members confirm their inputs' digest to
  each other, apply the mean only with a majority, and otherwise all keep the round's anchor.

The group of a round is its live peers per the DHT records (the peer passes their ids), split into about
n / `group_size` groups by a hash of each member's id and the round, which every peer draws alike (DiLoCo: one
group). There is no matchmaking window: each stage ends as soon as every expected member is done, and waits for
late ones at most `patience_s` (`sync.matchmaking_s`). One member of a pair opens the exchange (one stream per
pair), the other waits for it: the lower peer id, unless only the other can reach it (a member behind NAT opens
its own streams; net/routes.py); members that no path joins (two outbound-only peers without a relay) are not in
one group. Both stages run as rounds of the exchange protocol, numbered 2r (Δ) and 2r + 1 (digests).

Cost: each member sends its Δ to each other member: (n − 1)·S bytes against 2·S·(n − 1)/n for a butterfly
all-reduce, the same for a pair, n/2 times more for larger groups: the price of seeing every input. Compression
(`sync.grad_codec`) shrinks S: with topk or sparse, a member sends s = codec(β·e + Δ), the same bytes to every
member, and keeps what the codec left out in its error-feedback residual e ← β·e + Δ − s, committed only when the
round's mean is applied (alone, discarded or refused: e stays as it was, and our own Δ, or nothing, is applied).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from hivemind.p2p import P2P

from p2ptrain.maths.centered_clip import RobustMean, centered_clip_rows_, stack
from p2ptrain.maths.codecs import ErrorFeedback, compress_all, decode_all
from p2ptrain.maths.pacing import LinkSpeeds
from p2ptrain.net.allreduce import AveragingResult
from p2ptrain.net.exchange import Payload
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.routes import Routes
from p2ptrain.net.wire import payload_bytes
from p2ptrain.sync.allreduce_agreement import (
    APPLY,
    DISCARD,
    MAX_MEMBERS,
    Reduction,
    confirmation_verdict,
    equivocators,
    is_digest,
    largest_group,
    outvoted,
)
from p2ptrain.sync.config import GRAD_CODECS, SyncConfig
from p2ptrain.sync.contribution import IDLE_FRACTION, Contributions, OwnWork
from p2ptrain.sync.exchange_driver import ExchangeDriver, Outcome, RoundClosed, RoundSlots, same_round
from p2ptrain.sync.interface import HONEST, Conduct, RoundSync
from p2ptrain.sync.outer_gradient_payload import outer_gradient_codec, prepare_payload
from p2ptrain.sync.refusals import ASK_AGAIN, Refusal
from p2ptrain.sync.state_evidence import parse_sample, state_in_step
from p2ptrain.tensor_layout import norm

logger = logging.getLogger(__name__)

MAX_ABS_VALUE = 1e15  # a member's values beyond this are refused by every member alike (fp32 arithmetic stays finite)
GATHER_WEIGHT = 1.0  # offers carry a weight field; an all-reduce's weights are the receiver's (1/n), not offered


def round_groups(members: Sequence[str], round_: int, group_size: int | None, seed: str) -> list[list[str]]:
    """The round's members split into about len / `group_size` groups (None: one group), each member's drawn from a
    hash of the run, the round and its id, so that every peer that sees the same members draws the same groups,
    and one that sees a member more or less still draws the same group for every other member (as long as the
    count of groups is the same). A shuffle cut into runs of `group_size` shifted every member after the one that
    views disagreed on: on the netns testnet, half of Factored's Mix2 rounds averaged alone. A group holds at most
    `largest_group(group_size)` members (larger draws are cut in runs, in order of id)."""
    ordered = sorted(set(members))
    count = max(1, round(len(ordered) / group_size)) if group_size else 1
    buckets: dict[int, list[str]] = {}
    for member in ordered:
        digest = hashlib.sha256(f"{seed}/{round_}/{member}".encode()).digest()
        buckets.setdefault(int.from_bytes(digest[:8], "big") % count, []).append(member)
    cap = largest_group(group_size)
    return [bucket[i:i + cap] for _, bucket in sorted(buckets.items()) for i in range(0, len(bucket), cap)]


def robust_reduction(inputs: Sequence[tuple[str, Sequence[torch.Tensor]]], round_: int,
                     multiplier: float) -> tuple[RobustMean, Reduction]:
    """What every member computes from a round's inputs (sorted by peer id): their CenteredClip mean, and what was
    reduced (each input's hash, their digest). The inputs are copied once, into the rows of one matrix, which is
    hashed row by row and then reduced in place."""
    stacked = stack([x for _, x in inputs])
    reduction = Reduction.of(round_, [(peer, [row]) for (peer, _), row in zip(inputs, stacked, strict=True)])
    return centered_clip_of_working_rows_(stacked, inputs[0][1], multiplier), reduction


def centered_clip_of_working_rows_(stacked: torch.Tensor, like: Sequence[torch.Tensor],
                                   multiplier: float) -> RobustMean:
    """CenteredClip of the rows that show training; each input's length, distance from the mean and direction in
    the order of the rows, all of them. A row shorter than IDLE_FRACTION × the rows' lower median length carries
    none (a free rider's Δ: sync/contribution.py) and, in the mean at 1/n, would shrink the others' step by its
    share until the rider's ban (docs/threat-model.md). Every member holds the same rows, so leaves out the same
    ones; a majority decides, as the lower median asks: with half the rows or more that short, none is left out."""
    lengths = [float(x) for x in stacked.norm(dim=1)]
    reference = sorted(lengths)[(len(lengths) - 1) // 2]
    idle = [j for j, length in enumerate(lengths) if length < IDLE_FRACTION * reference]
    if not idle:
        return centered_clip_rows_(stacked, like, multiplier)
    order = [j for j in range(len(lengths)) if j not in idle] + idle  # row p of the reordered rows: input order[p]
    _reorder_rows_(stacked, order)
    working = len(order) - len(idle)
    result = centered_clip_rows_(stacked[:working], like, multiplier)  # a view: no copy of a model's worth of rows
    mean = torch.cat([t.reshape(-1) for t in result.mean])
    distances = result.distances + [float((stacked[p] - mean).norm()) for p in range(working, len(order))]
    row_lengths = result.lengths + [lengths[j] for j in idle]
    against = result.against + [False] * len(idle) if result.against else []  # an idle row points nowhere
    unordered = sorted(range(len(order)), key=order.__getitem__)  # input j sits at row unordered[j]
    return dataclasses.replace(result, distances=[distances[p] for p in unordered],
                               lengths=[row_lengths[p] for p in unordered],
                               against=[against[p] for p in unordered] if against else [])


def _reorder_rows_(stacked: torch.Tensor, order: list[int]) -> None:
    """Row p of `stacked` becomes its row order[p], in place, one row of scratch (a permutation's cycles)."""
    scratch, placed = torch.empty_like(stacked[0]), [False] * len(order)
    for start in range(len(order)):
        if placed[start] or order[start] == start:
            placed[start] = True
            continue
        scratch.copy_(stacked[start])
        p = start
        while order[p] != start:
            stacked[p].copy_(stacked[order[p]])
            placed[p], p = True, order[p]
        stacked[p].copy_(scratch)
        placed[p] = True


class StageClaims(Protocol):
    """What a stage's headers carry in place of the all-to-all's fields (the reduce-scatter's means and sketches),
    and what it keeps of the members' headers."""

    def header(self) -> dict[str, Any]: ...

    def note_(self, partner: str, header: dict[str, Any]) -> None: ...


class GatherRound:
    """One stage of one peer's all-to-all: it keeps what each expected member sent (its Δ, or its digest) and the
    report in its header; `inputs()` gives the values, ours included, sorted by peer id. A member's value whose ack
    was lost is kept: the members confirm what they reduced before anyone applies it (`ExchangeAllReduce._confirm`),
    and the member most likely holds ours (its ack was lost, not its commit).

    A reduce-scatter's stages are gather rounds too: `payloads` sends each member its own chunk, `claims` says what
    headers carry (sync/scatter_allreduce.py)."""
    keeps_unconfirmed_mix = True
    extra_offers_offend = True  # one exchange per pair and stage

    def __init__(self, stage_round: int, own_id: str, sent: list[torch.Tensor], payload: list, codec: str,
                 expected: set[str], digest: str | None = None, payloads: dict[str, Payload] | None = None,
                 claims: StageClaims | None = None):
        self.round, self.own_id, self.sent, self.payload, self.codec = stage_round, own_id, sent, payload, codec
        self.payloads = payloads or {}  # member → what we send it, if not `payload`
        self.claims = claims
        self.slots = RoundSlots(stage_round, own_id, MAX_MEMBERS - 1)
        self.weight, self.digest = GATHER_WEIGHT, digest  # digest: ours, in the confirmation stage
        self.answered_us: set[str] = set()  # members that answered an offer of ours, if only to refuse it
        self.measures_link = digest is None  # a confirmation is a few bytes
        self.expected = expected - {own_id}
        self.received: dict[str, list[torch.Tensor]] = {}
        self.reports: dict[str, Reduction] = {}  # member → what its previous all-reduce reduced, as it says
        self.confirmed: dict[str, str] = {}  # member → the digest it confirmed (confirmation stage)
        self.state: list[float] | None = None  # our anchor's sample, shown in the data stage (DiLoCo only)
        # our Δ's length and claimed tokens, where members' values are judged for their work (the all-to-all's data
        # stage: sync/contribution.py); None elsewhere (digests, a reduce-scatter's chunks)
        self.own_work: OwnWork | None = None
        self.states: dict[str, list[float]] = {}  # member → the sample of its anchor it showed
        self.complete = asyncio.Event()  # set once every expected member is done
        self._check_complete()

    @property
    def done(self) -> list[str]:  # members whose value we hold, in the order it came
        return self.slots.done

    def payload_for(self, partner: str) -> Payload:
        return self.payloads.get(partner, self.payload)

    def alive(self) -> set[str]:
        """Members that took part in this stage in any way: a reduce-scatter's fallback group. A member whose view of
        the group differs cuts other chunks (a peer that left, seen by some only): its chunks are refused, but it is
        there."""
        return set(self.done) | self.slots.opened | self.answered_us

    def value_for(self, partner: str, codec: str | None) -> tuple[str, Payload]:
        return self.codec, self.payload_for(partner)

    def agree_weight(self, claimed: object) -> float | None:
        """Offers carry GATHER_WEIGHT, a marker: the reduction weighs the inputs, not the exchange."""
        return GATHER_WEIGHT if claimed == GATHER_WEIGHT else None

    def accept_(self, sender: str, round_: int, gives_up_at: float) -> str | None:
        if round_ == self.round and sender not in self.expected and not self.slots.closing:
            return Refusal.NOT_IN_GROUP  # another group of the round, or a peer our records do not show yet
        return self.slots.accept_(sender, round_, gives_up_at)

    def apply_(self, partner: str, theirs: Sequence[torch.Tensor], outgoing: bool, weight: float) -> None:
        if not self.slots.may_apply(partner):
            raise RoundClosed(f"stage {self.round} of the all-reduce closed (or has {partner}'s value) before this "
                              f"commit")
        self.received[partner] = list(theirs)
        self.slots.applied_(partner, outgoing, payload_bytes(self.payload_for(partner)))
        self.release_(partner, outgoing)
        self._check_complete()

    def release_(self, partner: str, outgoing: bool) -> None:
        """An exchange ended; a member whose offer to us ended unapplied is not waited for (one offer per round)."""
        self.slots.release_(partner, outgoing)
        if not outgoing and partner not in self.done:
            self.give_up_on_(partner)

    def close_(self) -> list[torch.Tensor] | None:
        """Close for good; None: the stage mixes nothing (the all-reduce reduces `inputs()`)."""
        self.slots.close_()
        return None

    def ended_(self, partner: str, outcome: str) -> None:
        """An exchange we opened ended: a member that refused for good (not its group, round over) or failed is
        no longer waited for."""
        if outcome != Outcome.OK and outcome not in ASK_AGAIN and outcome != Outcome.RELAY_FAILED:
            self.give_up_on_(partner)
        if outcome not in (Outcome.FAILED, Outcome.RELAY_FAILED):  # it answered, if only to refuse
            self.answered_us.add(partner)

    def give_up_on_(self, partner: str) -> None:
        """Stop waiting for `partner` (it refused or failed for good)."""
        self.expected.discard(partner)
        self._check_complete()

    def _check_complete(self) -> None:
        if self.expected <= set(self.done):
            self.complete.set()

    def inputs(self) -> list[tuple[str, list[torch.Tensor]]]:
        return sorted([(self.own_id, self.sent), *self.received.items()])


Audit = Callable[[list[tuple[str, list[torch.Tensor]]]], None]  # sees a round's inputs once they are reduced


class ExchangeAllReduce:
    """The all-to-all exchange of outer gradients for one peer (one kind: DiLoCo's, or Mix2's): `gather` runs a
    round; its `driver` answers offers (`serve_exchanges(p2p, exchange.driver)`) and makes ours. It is the driver's
    policy for the all-reduce's values: what headers carry, how a member's value is decoded (never clipped:
    CenteredClip over all inputs replaces per-partner clipping).

    A round's stages are numbered `stages` × round + k, the all-to-all's from k = `all_to_all_stage`: the verified
    reduce-scatter (sync/scatter_allreduce.py) runs its own stages first through this one's driver, and this
    all-to-all as its fallback, with the public steps below (`prepare`, `our_group`, `run_stage`, ...)."""

    def __init__(self, p2p: P2P, run_id: str, fingerprint: str, like: Sequence[torch.Tensor], config: SyncConfig,
                 kind: str, group_size: int | None, links: LinkSpeeds | None = None,
                 reputation: Reputation | None = None, routes: Routes | None = None, conduct: Conduct = HONEST,
                 stages: int = 2, all_to_all_stage: int = 0, contributions: Contributions | None = None):
        self.p2p, self.run_id, self.config, self.kind = p2p, run_id, config, kind
        self.stages, self.all_to_all_stage = stages, all_to_all_stage
        self.own_id, self.conduct = p2p.peer_id.to_base58(), conduct  # the conduct forms the s we send
        self.feedback = ErrorFeedback(outer_gradient_codec(config), like, config.error_feedback_decay)
        self.reputation = reputation if reputation is not None else Reputation()  # the peer's one record of offences
        self.routes = routes if routes is not None else Routes("")  # who we can open streams to, and how
        self.driver = ExchangeDriver(p2p, run_id, fingerprint, kind, config, self, GRAD_CODECS,
                                     sum(t.numel() * 4 for t in like) + 2**20, links, self.reputation, self.routes,
                                     contributions=contributions)
        self.links = self.driver.links  # the peer's one table of measured links
        self.group_size = group_size
        self.own_tokens = 0  # what the round in flight's inner phase trained, claimed to the members
        self.previous: Reduction | None = None  # what our latest all-reduce reduced (None: alone, out of step)
        self._residual_before: list[torch.Tensor] | None = None  # error feedback before the latest round's commit
        self._token = [torch.zeros(1)]  # the confirmation stage's payload: the digest travels in the header
        self._token_payload = compress_all(self.feedback.codec, self._token)

    async def gather(self, delta: Sequence[torch.Tensor], round_peers: Sequence[str], round_: int,
                     patience_s: float, state: list[float] | None = None, tokens: int = 0) -> AveragingResult:
        """Blocking all-reduce of round `round_`: the group's robust mean (our own Δ when alone), and its cost.
        `delta` must not change meanwhile (`ExchangeAverager.launch` hands over a copy). `state`: our anchor's
        sample (sync/state_evidence.py), shown to the members and judged against theirs (DiLoCo's peers only);
        `tokens`: what our inner phase trained, claimed to the members."""
        started, own, self.own_tokens = time.monotonic(), [d.detach().float().cpu() for d in delta], tokens
        prepared, group = await self.prepare(own, round_), self.our_group(round_peers, round_)
        if prepared is None or group is None:
            return AveragingResult(own, group_size=1)
        return await self.all_to_all(own, *prepared, group, round_, patience_s, state, started, RoundSync())

    async def prepare(self, own: list[torch.Tensor], round_: int) -> tuple[list, list[torch.Tensor]] | None:
        """(our payload, our s), or None for a non-finite Δ (nothing can be sent)."""
        self._residual_before = None  # a refusal from now on concerns this round's mean
        try:
            payload, sent, _ = await asyncio.get_running_loop().run_in_executor(None, prepare_payload, self.feedback,
                                                                                own, self.outgoing)
        except ValueError as e:
            logger.warning(f"round {round_}: not averaging this outer gradient ({e})")
            return None
        return payload, sent

    def our_group(self, round_peers: Sequence[str], round_: int) -> list[str] | None:
        """Our group of the round (sorted; ourselves included), or None when NAT leaves us out of it."""
        members = [p for p in round_peers if not self.reputation.refuses(p)] + [self.own_id]
        group = next(g for g in round_groups(members, round_, self.group_size, self.run_id) if self.own_id in g)
        group = self.routes.connected_group(group, f"{self.run_id}/{round_}")  # every pair can meet (NAT)
        if self.own_id not in group:  # behind NAT with another outbound-only member: left out of this round
            self.previous = None
            return None
        return sorted(group)

    async def all_to_all(self, own: list[torch.Tensor], payload: list, sent: list[torch.Tensor], group: list[str],
                         round_: int, patience_s: float, state: list[float] | None, started: float,
                         stats: RoundSync, judge: bool = True, audit: Audit | None = None) -> AveragingResult:
        """Swap s with every member of `group`, reduce, confirm (`judge`: by the previous round's reports too;
        `audit`: called with the inputs, off the event loop, once they are reduced)."""
        rnd = GatherRound(self.stages * round_ + self.all_to_all_stage, self.own_id, sent, payload,
                          self.feedback.codec.name, set(group))
        rnd.state = state
        if self.config.robust:  # the members' values are judged for their work against ours
            rnd.own_work = OwnWork(norm(sent), self.own_tokens)
        rnd = await self.run_stage(rnd, patience_s, stats)
        out_of_step = self.judge_previous_(rnd)[0] if judge else False
        inputs = rnd.inputs()
        result = functools.partial(self.round_result, stats=stats, started=started, state=state,
                                   shown={peer: rnd.states[peer] for peer, _ in inputs if peer in rnd.states})

        def kept() -> AveragingResult:  # the anchor stays: nothing to apply (made only then: a Δ's worth of zeros)
            return result([torch.zeros_like(o) for o in own], len(inputs), discarded=True)

        if out_of_step or len(inputs) == 1:
            self.previous = None
            return kept() if out_of_step else result(own, 1)
        mean, lengths, distances, reduction = await asyncio.get_running_loop().run_in_executor(
            None, self._reduce_and_audit, inputs, round_, audit)
        verdict = await self._confirm(reduction, {peer for peer, _ in inputs} - {self.own_id}, rnd.round + 1,
                                      patience_s, stats)
        logger.debug(f"round {round_}: {len(inputs)} inputs (expected {len(rnd.expected) + 1}), {verdict}, "
                     f"{time.monotonic() - started:.2f} s")
        self.previous = reduction if verdict == APPLY else reduction.discarded() if verdict == DISCARD else None
        if verdict == APPLY:
            self.commit_(sent)
            ours = [peer for peer, _ in inputs].index(self.own_id)  # what the check of the mean needs, measured
            return result(mean, len(inputs), claimed_norms=lengths, own_norm=lengths[ours],
                          own_deviation=distances[ours] if distances else None)
        # DISCARD: nobody applies this round, every member keeps the anchor it shares with the others. Out of step:
        # others may have applied a mean we lack; we keep the anchor too (applying our own Δ set every member of a
        # round split two and two apart from all the others, netns testnet), and the next round's states show
        # whether we are behind (sync/state_evidence.py)
        return kept()

    def commit_(self, sent: list[torch.Tensor]) -> None:
        """The round's mean is applied: what the codec left out of our s is sent in later rounds (none with
        grad_codec none); `undo_commit_` puts the residual back."""
        self._residual_before = self.feedback.residual
        self.feedback.commit_(sent)

    def round_result(self, delta: list[torch.Tensor], size: int, *, stats: RoundSync, started: float,
                     state: list[float] | None, shown: dict[str, list[float]], **extra: Any) -> AveragingResult:
        """A round's outcome: what to apply, the group's size, its cost, and whether our anchor is in step with the
        members' anchors they showed (`shown`; DiLoCo's peers only)."""
        return AveragingResult(delta, size, stats.bytes_sent, stats.bytes_received, time.monotonic() - started,
                               in_step=None if state is None else state_in_step(self.own_id, state, shown), **extra)

    def judge_previous_(self, rnd: GatherRound) -> tuple[bool, list[str]]:
        """Judge our previous all-reduce by this stage's reports (`_previous_verdict`: out of step, and who cheated),
        and leave the cheats' inputs out: every member sees the same honest reports, so leaves the same ones out."""
        out_of_step, cheats = self._previous_verdict(rnd)
        for peer in cheats:
            rnd.received.pop(peer, None)
        return out_of_step, cheats

    def undo_commit_(self) -> None:
        """Put the error-feedback residual back as it was before the latest round's commit (if that round has one)."""
        if self._residual_before is not None:
            self.feedback.residual, self._residual_before = self._residual_before, None

    async def run_stage(self, rnd: GatherRound, patience_s: float, stats: RoundSync) -> GatherRound:
        """Run one stage: open exchanges with the higher ids of the group, wait for the lower ones, close."""
        self.driver.current = rnd
        give_up_at = time.monotonic() + patience_s
        ours = [p for p in rnd.expected if self.routes.opener(self.own_id, p) == self.own_id]
        await self.driver.open_all(rnd, ours, patience_s, stats, rnd.round // self.stages)
        with contextlib.suppress(asyncio.TimeoutError):  # the others of the group open their exchanges with us
            await asyncio.wait_for(rnd.complete.wait(), max(0.0, give_up_at - time.monotonic()))
        await self.driver.close_round(rnd, stats)
        return rnd

    async def _confirm(self, reduction: Reduction, members: set[str], stage: int, patience_s: float,
                       stats: RoundSync) -> str:
        """Swap digests with the members whose Δ we reduced, but those we refuse now (the reduction may have just
        banned one); APPLY, DISCARD or OUT_OF_STEP by a majority of the others. A refused member can only count
        against: waited for, it held every member's round for the whole patience, and counted, one confirmation
        lost among three honest members of four set one apart (a CI run: out of step, alone for 5 rounds)."""
        heard = {p for p in members if not self.reputation.refuses(p)}
        rnd = await self.run_stage(self.digest_round(stage, heard, reduction.digest), patience_s, stats)
        counted = heard or members  # nobody left to hear (a pair, the other just banned): discarded, as before
        verdict = confirmation_verdict(reduction.digest, rnd.confirmed, len(counted) + 1)
        if verdict != APPLY:
            same = sum(d == reduction.digest for d in rnd.confirmed.values())
            logger.info(f"round {stage // self.stages}: {same} of {len(counted)} members confirmed this peer's "
                        f"inputs: {verdict}")
        return verdict

    def digest_round(self, stage_round: int, members: set[str], digest: str,
                     claims: StageClaims | None = None) -> GatherRound:
        """A stage that swaps digests with `members` (in headers; the payload is a one-value token)."""
        return GatherRound(stage_round, self.own_id, self._token, self._token_payload, self.feedback.codec.name,
                           members, digest, claims=claims)

    def _reduce_and_audit(self, inputs: list[tuple[str, list[torch.Tensor]]], round_: int,
                          audit: Audit | None) -> tuple[list[torch.Tensor], list[float], list[float], Reduction]:
        reduced = self._reduce(inputs, round_)
        if audit is not None:
            audit(inputs)
        return reduced

    def _reduce(self, inputs: list[tuple[str, list[torch.Tensor]]],
                round_: int) -> tuple[list[torch.Tensor], list[float], list[float], Reduction]:
        """(the mean, each input's length, each input's distance from the mean, what was reduced): the work of a
        round, off the event loop. The mean is CenteredClip's (without `sync.robust`: the plain mean, distances not
        measured); members far beyond τ are penalised."""
        if not self.config.robust:
            values = [x for _, x in inputs]
            return ([torch.stack(parts).mean(dim=0) for parts in zip(*values, strict=True)], [norm(x) for x in values],
                    [], Reduction.of(round_, inputs))
        result, reduction = robust_reduction(inputs, round_, self.config.clip_multiplier)
        for j in result.far_inputs():
            peer = inputs[j][0]
            if peer != self.own_id:
                self.reputation.penalise(peer, result.offence_of(j),
                                         f"round {round_}: outer gradient {result.distances[j]:.3g} from the group's "
                                         f"robust mean (τ {result.radius:.3g})")
        return result.mean, result.lengths, result.distances, reduction

    # ---- what headers carry: our previous reduction (data stage), our digest (confirmation stage) ----------------
    def header_extra(self) -> dict[str, Any]:
        rnd = self.driver.current
        if isinstance(rnd, GatherRound) and rnd.claims is not None:
            return rnd.claims.header()
        if isinstance(rnd, GatherRound) and rnd.digest is not None:
            return {"digest": rnd.digest}
        shown: dict[str, Any] = {"state": rnd.state} if isinstance(rnd, GatherRound) and rnd.state is not None else {}
        if isinstance(rnd, GatherRound) and rnd.own_work is not None:
            shown["tokens"] = rnd.own_work.tokens
        return (self.previous.header() if self.previous is not None else {}) | shown

    def note_partner(self, rnd: GatherRound, partner: str, header: dict[str, Any]) -> None:
        if rnd.claims is not None:
            rnd.claims.note_(partner, header)
        if rnd.digest is not None:
            if is_digest(header.get("digest")):
                rnd.confirmed[partner] = header["digest"]
            return
        if rnd.claims is not None:
            return
        report, sample = Reduction.parse(header), parse_sample(header.get("state"))
        if report is not None:
            rnd.reports[partner] = report
        if sample is not None:
            rnd.states[partner] = sample

    def _previous_verdict(self, rnd: GatherRound) -> tuple[bool, list[str]]:
        """Judge our previous all-reduce by what this round's members report (sync/allreduce_agreement.py): whether
        we are out of step, and the members that sent different members different values (penalised)."""
        if self.previous is None:
            return False, []
        reports = {peer: r for peer, r in rnd.reports.items() if peer in rnd.done}
        cheats = []
        for peer, why in equivocators(self.previous, reports, self.own_id):
            self.reputation.penalise(peer, "equivocated", why)
            cheats.append(peer)
        voters = None if self.group_size is None else self.previous.hashes  # one group: every member has a say
        same, other = outvoted(self.previous, reports, voters)
        if other > same:
            logger.warning(f"round {rnd.round // self.stages}: {other} member(s) reduced other inputs than this "
                           f"peer's {same} in round {self.previous.round}: out of step; keeping the anchor this round")
        return other > same, cheats

    # ---- what a member's value must be ------------------------------------------------------------------------
    def decode_partner(self, rnd: GatherRound, header: dict[str, Any], payload: Payload) -> list[torch.Tensor]:
        """The member's value: of this stage, it decodes to our shapes, finite, every entry within ±MAX_ABS_VALUE."""
        same_round(rnd, header)
        theirs = [t.float() for t in decode_all(str(header.get("codec")), payload, like=rnd.sent)]
        if any(bool((t.abs() > MAX_ABS_VALUE).any()) for t in theirs):
            raise ValueError(f"outer gradient holds values beyond ±{MAX_ABS_VALUE:g}")
        return theirs

    def clip_partner(self, rnd: GatherRound, partner: str, theirs: list[torch.Tensor],
                     header: dict[str, Any]) -> list[torch.Tensor]:
        """A member's value as it came: CenteredClip over all inputs bounds it (`_reduce`)."""
        return theirs

    def stand_in(self, rnd: GatherRound, partner: str, theirs: list[torch.Tensor]) -> list[torch.Tensor]:
        """A member's value as it came, work or none: every member must reduce the same inputs, and the reduce
        leaves an idle one out of the mean (`_reduce`)."""
        return theirs

    def outgoing(self, sent: list[torch.Tensor]) -> list[torch.Tensor]:
        """What we send for our s, as the peer's conduct forms it: the s every member receives (once a round)."""
        return self.conduct.sent_outer_gradient(sent)
