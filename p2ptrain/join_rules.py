"""The pure rules of joining and catching up (joining.py runs them against the network): which round to trust,
whom to ask for a state, and how to judge the state and the witnesses' answers about it."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import random
import statistics
from collections.abc import Callable, Sequence

from p2ptrain.net.discovery import PeerRecord
from p2ptrain.net.state_sharing import MalformedSketch, Sketch, StateSnapshot

LOSS_SLACK = 0.05  # absolute slack on the validation-loss check: a few held-out batches are a noisy measure
# a peer that ran ahead alone took more steps than the swarm it rejoins: the swarm's state may be this much worse
# than its own (by about a fifth; 1.5 leaves a margin). A liar majority can cost it no more than this
RAN_AHEAD_LOSS_FACTOR = 1.5
# a state refused for its loss alone costs its donor a ban at once only beyond this many times our loss (−5·θ_0 of
# the tiny model scores 2.0 to 2.3×); short of it, it is what an honest peer that averaged alone a few rounds serves
# (3.32 against 2.79 on the netns testnet: both fast peers banned an honest donor), and pays "worse_state"
FAR_WORSE_LOSS_FACTOR = 1.5
# an honest outer momentum grows by at most one round's Δ a round, and peers' differ by their own Δs in gossip modes
OUTER_NORM_FACTOR = 4.0


@dataclasses.dataclass(frozen=True)
class DonorChoice:
    """Who may be a donor this round, by quorum: `trusted` (live, not banned, not joining, within the lead),
    `suspects` (further ahead), the `donors` to try, best first, and whether we `ran_ahead` of the swarm."""

    quorum: int | None
    trusted: list[PeerRecord]
    suspects: list[PeerRecord]
    donors: list[PeerRecord]
    ran_ahead: bool = False
    split: list[str] = dataclasses.field(default_factory=list)  # a split's out-of-step peers, the first by rank first


@dataclasses.dataclass(frozen=True)
class JoinDecision:
    """What a catch-up decided, for the round loop to apply: adopt `snapshot` (served by `donor`, checked as
    `detail` says), or stay with our own state (None). `member`: whether the peer counts as one of the swarm's from
    now on (it took a state, found that it holds the swarm's, or saw other peers)."""

    snapshot: StateSnapshot | None = None
    member: bool = False
    donor: str = ""
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Witnessed:
    """One peer's sketch of its own state, with what its record says of it."""

    peer_id: str
    synced: bool
    sketch: Sketch


@dataclasses.dataclass(frozen=True)
class Verdict:
    accepted: bool
    detail: str  # for the log line: why refused, or what confirmed it
    confirmed_by: int = 0
    offence: str | None = "wrong_state"  # what a refusal costs its donor (net/reputation.py); None: no fault of its
    held_by_round: bool = False  # most (and at least two) of the synced peers of its round hold this state


def nobody(_peer: str) -> bool:
    """No peer: the `vouched` of a peer that has verified no partner's work yet (a joiner, a GASLoC peer)."""
    return False


def quorum_round(records: Sequence[PeerRecord]) -> int | None:
    """The lower median of the rounds the records announce (None without records): liars announcing a later
    round move it only if they are more than half the peers, and two peers' rounds resolve to the lower one."""
    rounds = sorted(r.round for r in records)
    return rounds[(len(rounds) - 1) // 2] if rounds else None


def voters(records: Sequence[PeerRecord], vouched: Callable[[str], bool]) -> list[PeerRecord]:
    """Whose rounds count: the records of partners whose work we verified, or all of them if none is."""
    return [r for r in records if vouched(r.peer_id)] or list(records)


def split_by_quorum(others: Sequence[PeerRecord], max_lead: int, is_banned: Callable[[str], bool],
                    vouched: Callable[[str], bool] = nobody
                    ) -> tuple[int | None, list[PeerRecord], list[PeerRecord]]:
    """(quorum round, trusted, suspects) among other live peers that are not joining and not banned.

    Identities are free, verified work is not: when any of those peers is a partner whose work we verified
    (`vouched`: sync/contribution.py), the quorum is their lower median alone. Twenty identities of one process
    announcing a stale round made it every honest peer's quorum, so each took the others for suspects and tried the
    identities' states every round (issue 31). A peer that verified nobody yet counts every identity."""
    live = [r for r in others if r.phase != "joining" and not is_banned(r.peer_id)]
    quorum = quorum_round(voters(live, vouched))
    if quorum is None:
        return None, [], []
    return (quorum, [r for r in live if r.round <= quorum + max_lead],
            [r for r in live if r.round > quorum + max_lead])


def peers_to_outnumber(others: Sequence[PeerRecord], own_round: int, max_lead: int,
                       is_banned: Callable[[str], bool], vouched: Callable[[str], bool] = nobody) -> int:
    """The other peers an all-reduce group must hold a majority of for us to be in step: trusted ones
    (`split_by_quorum`: live, not joining, not banned, not a liar ahead) in our round or beyond. A banned member
    still announcing our round once counted, so with 3 honest peers and one banned, the two that averaged together
    while the third came late held 2 of 4 and took themselves for out of step: both downloaded the latecomer's
    state and the three fell out of step by turns for the rest of the run (a CI run under load)."""
    _, trusted, _ = split_by_quorum(others, max_lead, is_banned, vouched)
    return sum(r.round >= own_round for r in trusted)


def choose_donors(others: Sequence[PeerRecord], own_round: int, in_step: bool, fresh: bool, aligned: bool,
                  max_lead: int, is_banned: Callable[[str], bool], last_round_syncing_s: float = 0.0,
                  now: float = 0.0, own_id: str = "", vouched: Callable[[str], bool] = nobody) -> DonorChoice:
    """Peers to download state from, best first; none when we are in step with the swarm.

    Aligned rounds (DiLoCo): catch up when a trusted peer is ahead, or when our last group was not the swarm's
    (`in_step` false: a synced peer of our round is a donor), or when we `ran_ahead`: more than half the swarm,
    counting us, is more than the lead behind us. A peer that averaged alone (it started before the others could
    see it) races ahead; to the others it is a suspect, never a donor, and to itself in step, since no peer is
    in its round: it would train alone for the whole run. It takes the majority's state. Every
    mode: a `fresh` process (round 0, never joined) takes a trusted peer's state. The quorum and the majority are
    those of the partners whose work we verified, where there are any (`vouched`, `split_by_quorum`), and they come
    first among donors of one round.

    `last_round_syncing_s` (DiLoCo without overlap; 0: none): a synced peer of the last round that is syncing, for
    at most that long since the end of its inner phase as it announced it (`now`, DHT time), is a donor too.
    Peers in lockstep each read the swarm before announcing their new round, so each finds the others there, and
    no donor of its own round ever (without this rule, peers set apart never catch up: tests/test_swarm.py). Longer
    in sync, it is stuck or done (a peer that finished its rounds); with overlap, the first round averages nobody
    by design, and every peer would take another's state after it.

    Out of step with no synced peer in our round (a split: say two peers that each averaged round 0 alone), each
    would wait for a synced donor that never comes, and average Δs over different anchors for the rest of the run.
    Then the round's out-of-step peers, us (`own_id`) included, rank by `split_rank`: all but the first take the
    first's state, which makes them synced; the first takes theirs once they are.
    """
    quorum, trusted, suspects = split_by_quorum(others, max_lead, is_banned, vouched)
    ahead = [r for r in trusted if r.round > own_round] if aligned else []
    counted = voters(trusted + suspects, vouched)
    behind = [r for r in counted if r.round < own_round - max_lead]
    ran_ahead = aligned and not fresh and 2 * len(behind) > len(counted) + 1
    if ahead or (fresh and trusted):
        candidates = [r for r in trusted if r.round >= own_round]
    elif ran_ahead:
        candidates = [r for r in trusted if quorum is not None and r.round >= quorum]
    elif not in_step and aligned:  # a synced peer of our round (or of the last, syncing: a moment from ours)
        candidates = [r for r in trusted if r.synced and (r.round == own_round or (
            r.round == own_round - 1 and r.phase == "sync" and _syncing_since(r, now, last_round_syncing_s)))]
        split = [r for r in trusted if r.round == own_round and not r.synced]
        if not candidates and split and own_id:
            ranked = sorted([own_id, *(r.peer_id for r in split)], key=lambda p: split_rank(own_round, p))
            candidates = [r for r in split if r.peer_id == ranked[0]]
            return DonorChoice(quorum, trusted, suspects, candidates, False, ranked)
    else:
        candidates = []
    # the most advanced first; among equals, the fastest announced link (a download from a slow home uplink can
    # take much of a joiner's first minute)
    donors = sorted(candidates, key=lambda r: (-r.round, not vouched(r.peer_id), not r.synced, -r.bandwidth_bps,
                                               r.peer_id))
    return DonorChoice(quorum, trusted, suspects, donors, ran_ahead and bool(donors))


def split_rank(round_: int, peer_id: str) -> bytes:
    """The order in which the out-of-step peers of a round hold the state the others take: a hash salted with the
    round, so that no identity, however chosen, comes first round after round."""
    return hashlib.blake2b(f"{round_}:{peer_id}".encode(), digest_size=16).digest()


def _syncing_since(record: PeerRecord, now: float, at_most_s: float) -> bool:
    """Whether `record`'s inner phase ended (as it announced it) at most `at_most_s` before `now` (0: never)."""
    return at_most_s > 0 and record.round_eta > 0 and now - record.round_eta <= at_most_s


def snapshot_rounds(donor_round: int, quorum: int, max_lead: int) -> tuple[int, int]:
    """The rounds a donor's snapshot may be of: the one it announced or any later one within the lead. A donor moves
    on while we read, download and check others first (fast gossip rounds: two or more); the lead is what bounds a
    liar, and the witnesses judge the state whatever round it claims."""
    return donor_round, max(donor_round, quorum + max_lead)


def choose_witnesses(trusted: Sequence[PeerRecord], donor: str, round_: int, count: int,
                     rng: random.Random, vouched: Callable[[str], bool] = nobody) -> list[PeerRecord]:
    """Up to `count` trusted peers other than the donor: partners whose work we verified first (`vouched`), then
    those of `round_`, then synced, then the nearest rounds; random among equals (a fixed order would let a set of
    colluders pick ids that always come first)."""
    pool = [r for r in trusted if r.peer_id != donor]
    rng.shuffle(pool)
    pool.sort(key=lambda r: (not vouched(r.peer_id), r.round != round_, not r.synced, abs(r.round - round_)))
    return pool[:count]


def judge_sketches(candidate: Sketch, answers: Sequence[Witnessed], tight: bool, tight_max: float,
                   loose_max: float) -> Verdict:
    """Refuse when more answers lie far from the candidate than near it, the donor counting as one voice for its
    own state: two honest answers outvote a lying donor, one lying witness cannot outvote an honest donor, and
    an even vote (or none) passes on to the loss check. Which answers, and how far is far: with `tight` (aligned
    rounds, a synced donor) the synced answers of the candidate's round, beyond `tight_max`, when there are any;
    otherwise all the answers, beyond `loose_max`. The parameters only: `judge_outer_state` judges the rest."""
    same_round = [a for a in answers if tight and a.sketch.round == candidate.round and a.synced]
    group, bound = (same_round, tight_max) if same_round else (list(answers), loose_max)
    where = f" of round {candidate.round}" if same_round else ""
    if not group:
        return Verdict(True, "no other peer answered")
    distances = sorted(candidate.distance(a.sketch) for a in group)
    close = sum(d <= bound for d in distances)
    far = len(group) - close
    if far > close + 1:
        return Verdict(False, f"its parameters are {distances[len(distances) // 2]:.3g} (relative) from "
                              f"{far} of {_peers(len(group))}{where}")
    # the donor's round holds it: two answers agree, or every one that answered (with 3 peers, the donor and the one
    # other synced peer are the swarm: with two required, a peer that had averaged alone refused their state for its
    # own lower loss and trained apart to the end, a CI run)
    held = bool(same_round) and close > far and (close >= 2 or not far)
    if far:
        return Verdict(True, f"{close} of {_peers(len(group))}{where} agree, {far} disagree: an even vote", close,
                       held_by_round=held)
    return Verdict(True, f"confirmed by {_peers(close)}{where} within {distances[-1]:.2g}", close, held_by_round=held)


def judge_outer_state(candidate: Sketch, answers: Sequence[Witnessed], tight: bool, tight_max: float,
                      own_outer_norm: float) -> Verdict:
    """The candidate's outer state (its outer momentum; GASLoC's previous iterate), once its parameters passed.
    Synced DiLoCo peers of one round hold one momentum: with `tight`, most of those that answered must hold the
    candidate's, within `tight_max` (the donor's voice breaks a tie, as in `judge_sketches`). Everywhere, it may be
    at most OUTER_NORM_FACTOR × longer than the longer of ours and the median witness's (momenta grow from zero over
    the first rounds and differ from peer to peer in gossip modes: only their scale compares). A refusal is a lie:
    an honest donor's outer state goes with its parameters."""
    same_round = [a for a in answers if tight and a.sketch.round == candidate.round and a.synced]
    far = sum(candidate.outer_distance(a.sketch) > tight_max for a in same_round)
    if far > len(same_round) - far + 1:
        return Verdict(False, f"its outer state is not that of {far} of {_peers(len(same_round))} of round "
                              f"{candidate.round}, whose parameters it holds")
    witnessed = [a.sketch.outer_norm for a in answers]
    reference = max(own_outer_norm, statistics.median(witnessed) if witnessed else 0.0)
    if reference > 0 and not candidate.outer_norm <= OUTER_NORM_FACTOR * reference:  # NaN fails too
        return Verdict(False, f"its outer state's norm {candidate.outer_norm:.3g} is over {OUTER_NORM_FACTOR:g} × "
                              f"{reference:.3g} (the longer of ours and the median witness's)")
    return Verdict(True, "outer state within scale")


def outvoted_state(sketches: Verdict, loss: Verdict) -> Verdict:
    """A state the sketch vote refused, and what it costs its donor by its validation loss (`loss`, against our own
    state's): a worse one is a lie ("wrong_state"); one as good as ours is what an honest donor serves that does not
    know yet that its all-reduce split from its round's majority ("unsynced_state", a little over half a ban, so
    that one such refusal does not ban an honest donor)."""
    offence = "unsynced_state" if loss.accepted else "wrong_state"
    return dataclasses.replace(sketches, detail=f"{sketches.detail}; {loss.detail}", offence=offence)


def _peers(count: int) -> str:
    return f"{count} peer" if count == 1 else f"{count} peers"


def median_claim(announced: Sequence[float | None]) -> float | None:
    """The median of the validation losses peers announce (None when none is known)."""
    values = [v for v in announced if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def own_loss_bound(own: float, ours_is_the_odd_one: bool) -> float:
    """The loss our own state sets as the bound on a candidate's: ours, or RAN_AHEAD_LOSS_FACTOR times ours when
    ours is the odd state out: we ran ahead of the swarm, or the synced peers of the candidate's round hold it
    (`Verdict.held_by_round`). Our lone state's loss is then no fair bar for the swarm's: early in a DiLoCo run the
    outer momentum's overshoot can leave the swarm's state at a higher loss than a peer that averaged alone, which
    would otherwise refuse it, ban its honest donors and train alone to the end."""
    return own * RAN_AHEAD_LOSS_FACTOR if ours_is_the_odd_one else own


def judge_loss(loss: float, own: float, claimed: float | None, tolerance: float) -> Verdict:
    """Refuse a state whose validation loss is worse than our own state's, or than the median other peers claim,
    by more than `tolerance` (relative) + LOSS_SLACK. Only the first is blamed on the donor: it is our own
    measurement, while in a small swarm one liar's low claim could otherwise get an honest donor banned. Blamed
    as a lie ("wrong_state") beyond FAR_WORSE_LOSS_FACTOR × ours, as a lone state ("worse_state") short of it."""
    for reference, whose, blamed in ((own, "ours", True), (claimed, "the swarm's", False)):
        limit = math.inf if reference is None else reference * (1 + tolerance) + LOSS_SLACK
        if not loss <= limit:  # NaN fails too
            far = not loss <= FAR_WORSE_LOSS_FACTOR * own
            offence = None if not blamed else "wrong_state" if far else "worse_state"
            return Verdict(False, f"its validation loss {loss:.3f} is above {limit:.3f} ({whose} {reference:.3f})",
                           offence=offence)
    swarm = "" if claimed is None else f", the swarm's {claimed:.3f}"
    return Verdict(True, f"validation loss {loss:.3f}, ours {own:.3f}{swarm}")


def witness_offence(error: BaseException) -> str | None:
    """What a witness's failed sketch answer costs it: a garbled one is "malformed", a stalled one a "timeout", a
    refusal (a rate limit, or a ban on us) or a lost connection nothing."""
    if isinstance(error, MalformedSketch):
        return "malformed"
    return "timeout" if isinstance(error, (TimeoutError, asyncio.TimeoutError)) else None
