"""DiLoCo's all-reduce (and Factored's Mix2) as a verified reduce-scatter: each member sends each other member one
chunk of its outer gradient, not all of it, and checks the means it gets back (`sync.allreduce_transport: scatter`).

Why: the all-to-all exchange (sync/exchange_allreduce.py) shows every member every input, at (n − 1)·S bytes each,
n/2 times an ideal all-reduce's 2·S·(n − 1)/n; a butterfly all-reduce (hivemind's) costs the ideal but lets any
member put the mean of its span wherever it likes. Here, after BTARD (Gorbunov et al. 2022), each round runs

1. chunks: s (decode(codec(Δ)), flattened, zero-padded) is cut into one chunk per member, sorted by peer id; each
   member gets its chunk from every member (S/n each way per pair) and reduces it with CenteredClip, run until it
   stops moving (maths/centered_clip.py, maths/chunk_check.py);
2. means: each owner sends every member its chunk's mean, with what it says of it (`ChunkMean`: the radius τ, whose
   inputs it reduced, their lengths and hashes). Each member checks what concerns itself: its input is among them
   if their exchange committed, with its own length and hash; and τ is one CenteredClip could have had;
3. sketches: each member sketches its residual clip(x − v, τ) for every chunk (buckets drawn from a digest of every
   mean: no owner knows them before it has sent its mean) and swaps the sketches and that digest; an owner compares
   each member's sketch with the one of the input it holds (a lie is exact: `false_sketch`);
4. confirmations: a member whose every chunk's sketches sum to zero (the fixed point of CenteredClip) confirms the
   digest; the mean is applied by every member that sees a strict majority of the group confirm the digest of the
   means it holds (a majority holds at least one honest member whose check passed).

A lie about a mean costs its author about k·τ/m at most (maths/chunk_check.py: k colluders among m members), the
order of what k hostile inputs move CenteredClip by anyway. Whatever fails (a check, a dead owner, a view that
differs) sends the round to the all-to-all exchange, in the same round, among the members heard from: never worse
than that transport, at the price of the round's bytes twice. After such a fallback each member holds every input,
recomputes the means and sketches it was sent and bans those that lied (`false_mean`, `false_sketch`): a member
cannot make the group fall back for nothing more than once. The reports of the previous round (`Reduction`,
sync/allreduce_agreement.py) hash each owner's mean, so an owner that sends members different means is an
equivocator. Bytes: 2·S·(n − 1)/n per member plus headers (each sketch SKETCH_BUCKETS floats per chunk).
Codecs: none and fp16 (a chunk's values travel as the codec made them; a sparse s's mean is dense: use exchange).
A pair runs the all-to-all (`MIN_MEMBERS`): the same bytes, and each computes the mean itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import blake3
import torch
from hivemind.p2p import P2P

from p2ptrain.maths import chunk_check
from p2ptrain.maths.centered_clip import RobustMean, centered_clip_rows_, stack
from p2ptrain.maths.codecs import compress_all
from p2ptrain.maths.pacing import LinkSpeeds
from p2ptrain.net.allreduce import AveragingResult
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.routes import Routes
from p2ptrain.sync.allreduce_agreement import MAX_MEMBERS, MAX_PEER_ID, Reduction, is_digest, value_hash
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.contribution import Contributions
from p2ptrain.sync.exchange_allreduce import ExchangeAllReduce, GatherRound
from p2ptrain.sync.interface import HONEST, Conduct, RoundSync
from p2ptrain.tensor_layout import norm

logger = logging.getLogger(__name__)

CHUNKS, MEANS, SKETCHES, CONFIRMATIONS, FALLBACK = range(5)  # stages of a round; the fallback's digests: FALLBACK + 1
FAILED = "f" * 64  # the digest a member confirms when its check of the means failed
# groups smaller than this run the all-to-all: for a pair it sends the same bytes (S each) and each member computes
# the mean itself, where a scatter lets the other member move its chunk's mean by what one claim can cancel (1.5 τ)
MIN_MEMBERS = 3
AUDIT_TOLERANCE = 0.01  # × a chunk's scale: a recomputed mean farther from the owner's is a lie (fp32 noise: 1e-6)


@dataclasses.dataclass(frozen=True)
class ChunkMean:
    """What an owner says of its chunk's mean (unverified: each member checks its own entry)."""

    radius: float
    members: tuple[str, ...]  # sorted: whose inputs it reduced
    lengths: tuple[float, ...]  # ‖input‖, per member
    hashes: tuple[str, ...]  # value_hash of each input

    def header(self) -> dict[str, Any]:
        return {"radius": self.radius, "members": list(self.members), "lengths": list(self.lengths),
                "hashes": list(self.hashes)}

    @classmethod
    def parse(cls, value: object) -> ChunkMean | None:
        """A member's claim from its header; None when malformed (the chunk then fails the check)."""
        if not isinstance(value, dict):
            return None
        radius, members, lengths, hashes = (value.get(k) for k in ("radius", "members", "lengths", "hashes"))
        if not (isinstance(members, list) and isinstance(lengths, list) and isinstance(hashes, list)
                and 0 < len(members) == len(lengths) == len(hashes) <= MAX_MEMBERS):
            return None
        ids_ok = all(isinstance(m, str) and 0 < len(m) <= MAX_PEER_ID for m in members)
        if not (ids_ok and members == sorted(set(members))
                and all(_is_number(x) and x >= 0 for x in [radius, *lengths]) and all(map(is_digest, hashes))):
            return None
        return cls(float(radius), tuple(members), tuple(float(x) for x in lengths), tuple(hashes))  # type: ignore


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class MeansClaims:
    """Stage 2's headers: our chunk's `ChunkMean` with its mean, and what each member says of its own."""

    def __init__(self, own_id: str, summary: ChunkMean):
        self.summary, self.summaries = summary, {own_id: summary}

    def header(self) -> dict[str, Any]:
        return {"chunk": self.summary.header()}

    def note_(self, partner: str, header: dict[str, Any]) -> None:
        summary = ChunkMean.parse(header.get("chunk"))
        if summary is not None:
            self.summaries[partner] = summary


class SketchClaims:
    """Stages 3 and 4's headers: the digest of the means a member holds (stage 3: with its residuals' sketches)."""

    def __init__(self, digest: str, ours: dict[str, list[float]] | None = None):
        self.digest = digest
        self.ours = ours or {}  # owner → our sketch
        self.theirs: dict[str, dict[str, list[float]]] = {}  # member → owner → its sketch

    def header(self) -> dict[str, Any]:
        return {"digest": self.digest} | ({"sketches": self.ours} if self.ours else {})

    def note_(self, partner: str, header: dict[str, Any]) -> None:
        if isinstance(sketches := header.get("sketches"), dict) and len(sketches) <= MAX_MEMBERS:
            self.theirs[partner] = {owner: [float(v) for v in values] for owner, values in sketches.items()
                                    if isinstance(owner, str) and chunk_check.is_sketch(values)}


@dataclasses.dataclass
class View:
    """The means of a round's chunks as one member holds them, and the buckets their sketches use."""

    owners: list[str]
    means: dict[str, torch.Tensor]
    summaries: dict[str, ChunkMean]
    digest: str
    layouts: dict[str, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, owners: list[str], means: dict[str, torch.Tensor], summaries: dict[str, ChunkMean]) -> View:
        parts = "".join(f"{o}:{value_hash([means[o]])}:{summaries[o].header()};" for o in owners)
        return cls(owners, means, summaries, blake3.blake3(parts.encode()).hexdigest())

    def sketch(self, owner: str, input_: torch.Tensor) -> list[float]:
        """The sketch of clip(input − owner's mean, τ), in buckets drawn from the digest of every mean."""
        if owner not in self.layouts:
            seed = bytes.fromhex(self.digest) + owner.encode()
            self.layouts[owner] = chunk_check.sketch_layout(seed, self.means[owner].numel())
        radius = self.summaries[owner].radius
        return chunk_check.sketch(chunk_check.residual(input_, self.means[owner], radius), self.layouts[owner])

    def entry(self, owner: str, member: str) -> tuple[float, str] | None:
        """(length, hash) of `member`'s input as `owner` says it reduced it; None: left out."""
        summary = self.summaries[owner]
        if member not in summary.members:
            return None
        i = summary.members.index(member)
        return summary.lengths[i], summary.hashes[i]

    def mean(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        flat = torch.cat([self.means[o] for o in self.owners])[:sum(t.numel() for t in like)]
        return [part.view_as(t).clone() for part, t in zip(flat.split([t.numel() for t in like]), like, strict=True)]

    def claimed_norms(self) -> list[float]:
        """Each member's ‖s‖ from the lengths the owners say its chunks had (members in every chunk)."""
        everywhere = set.intersection(*(set(s.members) for s in self.summaries.values()))
        return [math.sqrt(math.fsum(entry[0] ** 2 for o in self.owners if (entry := self.entry(o, m)) is not None))
                for m in sorted(everywhere)]


def chunks_of(sent: Sequence[torch.Tensor], owners: Sequence[str]) -> dict[str, torch.Tensor]:
    """s flattened, zero-padded to a multiple of the members, one equal chunk per owner (sorted)."""
    flat = torch.cat([t.detach().float().reshape(-1) for t in sent])
    length = -(-flat.numel() // len(owners))
    padded = torch.cat([flat, flat.new_zeros(length * len(owners) - flat.numel())])
    return {o: padded[i * length:(i + 1) * length].clone() for i, o in enumerate(owners)}


class ScatterAllReduce:
    """The verified reduce-scatter for one peer (one kind: DiLoCo's, or Mix2's). It holds the all-to-all
    (`fallback`), whose driver runs every stage of its rounds (`driver`: served as the all-to-all's is) and whose
    steps it shares: payload, group, stages, the previous round's reports, the commit of the error feedback."""
    STAGES = 6  # a round's stages are numbered STAGES × round + k (CHUNKS ... FALLBACK + 1)

    def __init__(self, p2p: P2P, run_id: str, fingerprint: str, like: Sequence[torch.Tensor], config: SyncConfig,
                 kind: str, group_size: int | None, links: LinkSpeeds | None = None,
                 reputation: Reputation | None = None, routes: Routes | None = None, conduct: Conduct = HONEST,
                 contributions: Contributions | None = None):
        self.fallback = ExchangeAllReduce(p2p, run_id, fingerprint, like, config, kind, group_size, links, reputation,
                                          routes, conduct, stages=self.STAGES, all_to_all_stage=FALLBACK,
                                          contributions=contributions)
        self.p2p, self.config, self.own_id, self.driver = p2p, config, self.fallback.own_id, self.fallback.driver
        self.reputation, self.feedback = self.fallback.reputation, self.fallback.feedback  # the all-to-all's own
        # a member in any stage of the round before still holds our offer
        self.driver.gate.max_stages_ahead = self.STAGES
        # a failed round's view, the digests and sketches its members sent, until the fallback's inputs
        self._audit: tuple[int, View, dict[str, str], SketchClaims] | None = None
        self._liars: set[str] = set()  # members found lying this round (penalised once)

    @property
    def previous(self) -> Reduction | None:
        """What our latest all-reduce reduced (None: alone, out of step): the all-to-all's record, which its reports
        and judgement use."""
        return self.fallback.previous

    @previous.setter
    def previous(self, reduction: Reduction | None) -> None:
        self.fallback.previous = reduction

    def undo_commit_(self) -> None:
        self.fallback.undo_commit_()

    async def gather(self, delta: Sequence[torch.Tensor], round_peers: Sequence[str], round_: int,
                     patience_s: float, state: list[float] | None = None, tokens: int = 0) -> AveragingResult:
        """Blocking all-reduce of round `round_`, as `ExchangeAllReduce.gather`: by reduce-scatter, or, when that
        does not hold, by the all-to-all in the same round (whose members alone judge our claimed `tokens`)."""
        started, own = time.monotonic(), [d.detach().float().cpu() for d in delta]
        fallback = self.fallback
        fallback.own_tokens = tokens
        prepared, group = await fallback.prepare(own, round_), fallback.our_group(round_peers, round_)
        if prepared is None or group is None:
            return AveragingResult(own, group_size=1)
        (payload, sent), stats, self._liars, self._audit = prepared, RoundSync(), set(), None
        if len(group) < MIN_MEMBERS:  # the all-to-all costs no more there, and nobody's word stands in for a mean
            return await fallback.all_to_all(own, payload, sent, group, round_, patience_s, state, started, stats)
        chunks = chunks_of(sent, group)
        payloads = {o: compress_all(self.feedback.codec, [c]) for o, c in chunks.items()}
        rnd = GatherRound(self.STAGES * round_ + CHUNKS, self.own_id, [chunks[self.own_id]], payloads[self.own_id],
                          self.feedback.codec.name, set(group), payloads=payloads)
        rnd.state = state
        rnd = await fallback.run_stage(rnd, patience_s, stats)
        out_of_step, cheats = fallback.judge_previous_(rnd)
        result = functools.partial(fallback.round_result, stats=stats, started=started, state=state,
                                   shown={peer: rnd.states[peer] for peer in rnd.done if peer in rnd.states})
        if out_of_step:
            self.previous = None
            return result([torch.zeros_like(o) for o in own], len(group), discarded=True)
        heard = set(rnd.done) - set(cheats)
        view, problem = await self._means(rnd, chunks, group, heard, patience_s, stats)
        problem = await self._checked(view, problem, rnd, chunks, heard, patience_s, stats)
        if view is not None and problem is None:
            self.previous = Reduction.of(round_, [(o, [view.means[o]]) for o in group])
            fallback.commit_(sent)
            return result(view.mean(own), len(group), claimed_norms=view.claimed_norms(), own_norm=norm(sent))
        members = sorted((rnd.alive() - set(cheats)) | {self.own_id})
        logger.info(f"round {round_}: the reduce-scatter did not hold ({problem}); falling back to the "
                    f"all-to-all among {len(members)} members")
        return await fallback.all_to_all(own, payload, sent, members, round_, patience_s, state, started, stats,
                                         judge=False, audit=functools.partial(self._audit_fallback, round_))

    async def _means(self, rnd: GatherRound, chunks: dict[str, torch.Tensor], group: list[str], heard: set[str],
                     patience_s: float, stats: RoundSync) -> tuple[View | None, str | None]:
        """Reduce our chunk, swap the means with the members we heard from: (our view, or None; what is wrong).
        `rnd`: the chunks stage; `chunks`: owner → our chunk of its span."""
        mean, summary = await asyncio.get_running_loop().run_in_executor(None, self._reduce_chunk, rnd.inputs())
        claims = MeansClaims(self.own_id, summary)
        means_rnd = await self.fallback.run_stage(GatherRound(rnd.round + MEANS, self.own_id, [mean],
                                                  compress_all(self.feedback.codec, [mean]), rnd.codec, heard,
                                                  claims=claims), patience_s, stats)
        means = {self.own_id: mean} | {o: x[0] for o, x in means_rnd.received.items()}
        missing = sorted(set(group) - (set(means) & set(claims.summaries)))
        if missing:
            return None, f"no mean from {', '.join(missing[:3])}{' and others' if len(missing) > 3 else ''}"
        view = View.of(group, means, claims.summaries)
        return view, self._view_problem(view, rnd, chunks)

    def _view_problem(self, view: View, rnd: GatherRound, chunks: dict[str, torch.Tensor]) -> str | None:
        """What in the owners' claims contradicts what we know: our own input, and whether τ can be CenteredClip's."""
        for owner in view.owners:
            summary = view.summaries[owner]
            why = chunk_check.radius_problem(summary.radius, summary.lengths, self.config.clip_multiplier)
            if why is not None or not set(summary.members) <= set(view.owners):
                return f"{owner}: {why or 'names inputs from outside the group'}"
            entry, chunk = view.entry(owner, self.own_id), chunks[owner]
            if entry is None and (owner in rnd.done or owner == self.own_id):
                return f"{owner} left this peer's input out"
            if entry is not None and (entry[1] != value_hash([chunk]) or not math.isclose(
                    entry[0], norm([chunk]), rel_tol=1e-4, abs_tol=1e-30)):  # both in fp64
                return f"{owner} misreports this peer's input"
        return None

    async def _checked(self, view: View | None, problem: str | None, rnd: GatherRound, chunks: dict[str, torch.Tensor],
                       heard: set[str], patience_s: float, stats: RoundSync) -> str | None:
        """Stages 3 and 4: swap sketches, check every chunk, confirm; None when a majority holds our view checked."""
        loop, fallback = asyncio.get_running_loop(), self.fallback
        ours: dict[str, list[float]] = {}
        if view is not None and problem is None:
            ours = await loop.run_in_executor(None, lambda: {
                o: view.sketch(o, chunks[o]) for o in view.owners if view.entry(o, self.own_id) is not None})
        digest = view.digest if view is not None and problem is None else FAILED
        claims = SketchClaims(digest, ours)
        sketches = await fallback.run_stage(fallback.digest_round(rnd.round + SKETCHES, heard, digest, claims),
                                            patience_s, stats)
        if view is not None and problem is None:
            problem = await loop.run_in_executor(None, self._judge_sketches, view, sketches.confirmed, claims)
        verdict = FAILED if problem is not None or view is None else view.digest
        confirmed = await fallback.run_stage(fallback.digest_round(rnd.round + CONFIRMATIONS, heard, verdict,
                                                                   SketchClaims(verdict)), patience_s, stats)
        if view is None:
            return problem
        votes = (problem is None) + sum(d == view.digest for d in confirmed.confirmed.values())
        if 2 * votes > len(view.owners):
            return None
        self._audit = (rnd.round // self.STAGES, view, sketches.confirmed, claims)
        return problem or f"{votes} of {len(view.owners)} members confirmed these means"

    def _judge_sketches(self, view: View, confirmed: dict[str, str], sketches: SketchClaims) -> str | None:
        """Every chunk's sketches must sum to zero (`confirmed`: the digest each member sent with its sketches). (An
        owner could tell a lying sketch of its chunk at once, but penalises it only in the audit, with every other
        member: a ban by one member alone splits the group.)"""
        agreeing = {m for m, d in confirmed.items() if d == view.digest}
        for owner in view.owners:
            summary, claims = view.summaries[owner], {}
            for member in summary.members:
                claim = sketches.ours.get(owner) if member == self.own_id else \
                    sketches.theirs.get(member, {}).get(owner) if member in agreeing else None
                if claim is None:
                    return f"no sketch of {owner}'s chunk from {member}"
                claims[member] = claim
            why = chunk_check.judge_sketches(claims, summary.radius, summary.lengths)
            if why is not None:
                return f"{owner}'s chunk: {why}"
        return None

    def _check_claim(self, view: View, owner: str, member: str, claim: list[float], input_: torch.Tensor) -> None:
        """Penalise `member` (once a round) if `claim` is not the sketch of the input it sent `owner`."""
        summary = view.summaries[owner]
        if member != self.own_id and member not in self._liars and not chunk_check.sketch_matches(
                claim, view.sketch(owner, input_), summary.radius, summary.lengths):
            self._liars.add(member)
            self.reputation.penalise(member, "false_sketch", f"its sketch of {owner}'s chunk does not match the "
                                                             f"input it sent")

    def _reduce_chunk(self, inputs: list[tuple[str, list[torch.Tensor]]]) -> tuple[torch.Tensor, ChunkMean]:
        """Our chunk's mean over the inputs we got (ours included), and what we say of it. An input far beyond τ is
        an offence (`clipped`), as in the all-to-all: a member whose whole Δ is far sends every owner a far chunk,
        so every honest member penalises it alike (one that aims at a few owners is banned by those only)."""
        members, rows = [p for p, _ in inputs], stack([x for _, x in inputs])
        hashes = [value_hash([row]) for row in rows]
        result = self._chunk_mean(rows)
        for j in result.far_inputs() if self.config.robust else []:
            if members[j] != self.own_id:
                self.reputation.penalise(members[j], result.offence_of(j),
                                         f"its chunk of our span is {result.distances[j]:.3g} from the chunk's robust "
                                         f"mean (τ {result.radius:.3g})")
        return result.mean[0], ChunkMean(result.radius, tuple(members), tuple(result.lengths), tuple(hashes))

    def _chunk_mean(self, rows: torch.Tensor) -> RobustMean:
        """The rows' CenteredClip, run until it stops moving; without `sync.robust` the plain mean, with τ the
        farthest input's distance (nothing clipped, the residuals still sum to zero)."""
        if not self.config.robust:
            mean = rows.sum(dim=0).div_(len(rows))
            distances = (rows - mean).norm(dim=1).tolist()
            return RobustMean([mean], max(distances), distances, [norm([row]) for row in rows])
        return centered_clip_rows_(rows.clone(), [rows[0]], self.config.clip_multiplier, chunk_check.MAX_ITERATIONS,
                                   chunk_check.CONVERGED)

    # ---- after a fallback: who lied ------------------------------------------------------------------------------
    def _audit_fallback(self, round_: int, inputs: list[tuple[str, list[torch.Tensor]]]) -> None:
        """The fallback's inputs are reduced (off the event loop): audit the failed round's view with them."""
        audit, self._audit = self._audit, None
        if audit is not None and audit[0] == round_:
            self._audit_round(audit[1], audit[2], audit[3], {peer: chunks_of(x, audit[1].owners) for peer, x in inputs})

    def _audit_round(self, view: View, confirmed: dict[str, str], sketches: SketchClaims,
                     chunks: dict[str, dict[str, torch.Tensor]]) -> None:
        """With every input in hand (the fallback's, as the owners hashed them), recompute each owner's mean and each
        member's sketch we were sent: a mean or a sketch that differs is a lie its author pays for."""
        agreeing = {m for m, d in confirmed.items() if d == view.digest}
        for owner in view.owners:
            summary = view.summaries[owner]
            held = [m for m in summary.members
                    if m in chunks and (entry := view.entry(owner, m)) is not None
                    and value_hash([chunks[m][owner]]) == entry[1]]
            for member in held:
                claim = sketches.theirs.get(member, {}).get(owner) if member in agreeing else None
                if claim is not None:
                    self._check_claim(view, owner, member, claim, chunks[member][owner])
            if owner == self.own_id or owner in self._liars or len(held) < len(summary.members):
                continue  # a member's input we cannot tell from the owner's word: no judgement of the owner
            mean = self._chunk_mean(torch.stack([chunks[m][owner] for m in held])).mean[0]
            gap = float((mean - view.means[owner]).norm())
            if gap > AUDIT_TOLERANCE * chunk_check.scale(summary.radius, summary.lengths):
                self._liars.add(owner)
                self.reputation.penalise(owner, "false_mean", f"its chunk's mean is {gap:.3g} from the "
                                                              f"CenteredClip of the inputs it reduced")
