"""Joining and catching up with untrusted peers: which round, whose state, and checking that state before use
(the rules are pure functions in join_rules.py; the Joiner runs them against the network).

Any peer can announce any round and serve any finite, well-shaped state (a peer announcing round 100000 with −5·θ_0
would be adopted by every honest peer within seconds). So a peer that joins or falls behind:
1. reads the round by quorum: the lower median of the rounds live peers announce. A peer more than
   `sync.join_max_round_lead` rounds ahead of it is suspect and never a donor; within that window the most
   advanced round is joined (honest peers a round apart must converge). A peer that finds more than
   half the swarm more than the lead behind it ran ahead alone and takes the majority's state;
2. downloads a donor's snapshot, its metadata checked before anything else (state_sharing);
3. corroborates it: draws a secret seed *after* the download and asks up to WITNESSES other peers for the
   sketch of their own state under it (so the donor cannot shape its lie to pass), then compares distances:
   DiLoCo peers of one round hold the same state up to float rounding, so the synced peers of the snapshot's
   round must lie within ALIGNED_MAX_DISTANCE; otherwise (gossip modes, other rounds) within
   `sync.join_gossip_max_distance`; refused when most answers are far (the donor's own voice breaks a tie).
   The candidate's validation loss on our held-out batches must not be worse than our own state's, nor than
   the median other peers announce (not the donor), by more than `sync.join_loss_tolerance` (our own bar is
   looser when ours is the odd state out: join_rules.own_loss_bound);
4. applies the first state that passes; a donor whose state fails is penalised ("wrong_state": banned; a state
   outvoted by the sketches but as good as ours on our batches costs a little over half a ban, "unsynced_state").

With aligned rounds, a joiner that would arrive after its round's peers have read who is in the round waits for
their next round first (`Joiner.round_to_join`): they would leave it out of the round's all-reduce and it would
average alone, out of step (the exchange all-reduce fixes its group when its sync starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Protocol, TypeVar

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from p2ptrain.config import PeerConfig
from p2ptrain.join_rules import (
    DonorChoice,
    JoinDecision,
    Verdict,
    Witnessed,
    choose_donors,
    choose_witnesses,
    judge_loss,
    judge_outer_state,
    judge_sketches,
    median_claim,
    outvoted_state,
    own_loss_bound,
    snapshot_rounds,
    witness_offence,
)
from p2ptrain.maths.inner import InnerTrainer
from p2ptrain.net.discovery import Announcer, PeerRecord, SwarmView
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.net.remote_hosts import READ_TIMEOUT_S, RemoteHosts
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.routes import Routes
from p2ptrain.net.state_sharing import (
    OUTER_PREFIX,
    Sketch,
    SnapshotExpectation,
    SnapshotRefused,
    StateSnapshot,
    download_deadline_s,
    download_state,
    parameter_norm,
    parameter_sketch,
    request_sketch,
)
from p2ptrain.net.wire import WireTimeout
from p2ptrain.peer_state import PeerState
from p2ptrain.sync.contribution import Contributions
from p2ptrain.sync.interface import OuterSync
from p2ptrain.sync.state_evidence import ALIGNED_MAX_DISTANCE
from p2ptrain.timing import BRIEF_S, SETUP_FLOOR_S, TICK_S, matchmaking_bound_s

logger = logging.getLogger(__name__)
T = TypeVar("T")

WITNESSES = 3  # peers asked to corroborate a downloaded state
AHEAD_MAX_LOSS = 0.9  # of our own loss: a state from peers ahead of our quorum must show that much training
# a fresh gossip peer whose every donor failed (refused, or the download failed) tries again, at most JOIN_RETRIES
# times, the first JOIN_RETRY_ROUNDS rounds later, then twice as long after each failure (rounds 1, 3, 7, 15); then
# it trains on from its own state. DiLoCo needs none: a peer behind the swarm's round looks for a donor every round
JOIN_RETRIES = 4
JOIN_RETRY_ROUNDS = 1
# a witness's sketch may come LATE_WITNESS_FACTOR × as late as the first witness's (at least timing.BRIEF_S later:
# every witness sketches the same layout, so an honest one is not much slower than the first)
LATE_WITNESS_FACTOR = 4.0
RAN_AHEAD_ROUNDS = 3  # a peer takes the majority's state once it found it far behind this many rounds in a row
# a donor list read longer ago than timing.SETUP_FLOOR_S is read again before the next donor: a slow link's
# download outlasts rounds, and the rounds a snapshot may be of move on meanwhile


@contextlib.contextmanager
def parameters_set_to(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """Write `values` into `params` for the duration of the block, then put the originals back."""
    backup = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p, v in zip(params, values, strict=True):
                p.copy_(v.to(device=p.device, dtype=p.dtype))
        yield
    finally:
        with torch.no_grad():
            for p, b in zip(params, backup, strict=True):
                p.copy_(b)


class JoiningPeer(Protocol):
    """What the Joiner reads of the peer it catches up (peer.TrainingPeer), and the two things it asks of it:
    a read of the swarm, and an announcement."""

    @property
    def peer_id(self) -> str: ...

    @property
    def config(self) -> PeerConfig: ...

    @property
    def state(self) -> PeerState: ...

    @property
    def sync(self) -> OuterSync: ...

    @property
    def params(self) -> Sequence[torch.Tensor]: ...

    @property
    def inner(self) -> InnerTrainer: ...

    @property
    def val_batches(self) -> list[torch.Tensor]: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def p2p(self) -> P2P: ...

    @property
    def loop(self) -> BackgroundLoop: ...

    @property
    def routes(self) -> Routes: ...

    @property
    def reputation(self) -> Reputation: ...

    @property
    def contributions(self) -> Contributions: ...

    @property
    def announcer(self) -> Announcer: ...

    @property
    def stop_event(self) -> threading.Event: ...

    def swarm(self) -> SwarmView: ...

    def announce(self, wait: bool = False, **fields: object) -> None: ...


class Joiner:
    """The catching-up step of a peer's round loop: choose donors, download, corroborate, then decide whose state
    the peer adopts (the round loop applies the decision) and penalise the donors whose state failed."""

    def __init__(self, peer: JoiningPeer):
        self.peer = peer
        self.config = peer.config.sync
        self.rng = random.Random(secrets.randbits(64))
        self._suspects_logged: set[str] = set()
        self.join_s = BRIEF_S  # how long our latest successful join took (download and checks); a guess before one
        self.failed_joins = 0  # fresh joins (first or retried) whose every donor failed
        self.retry_round: int | None = None  # gossip modes: the round a fresh peer that could not join tries again
        self.ran_ahead_rounds = 0  # rounds in a row we found most of the swarm far behind us (join_rules.ran_ahead)
        # gossip modes: a process resumed from a checkpoint (its round, never joined) holds parameters its partners
        # may have moved far from since: gossiped as they are, they are hard-clipped by honest partners (offences
        # towards a ban) and it clips theirs (tests/test_joining.py). It takes a corroborated state first (one
        # the loss check finds no worse than its own); DiLoCo's round catches it up anyway
        self.resumed = not peer.sync.aligned_rounds and peer.state.round > 0 and not peer.state.joined_ever

    def fresh(self) -> bool:
        """Whether we hold no state of the swarm's yet and should take one: a new process (round 0, never joined),
        in gossip modes one resumed from a checkpoint, or one whose join failed and is due to try again (any
        trusted round will do then)."""
        state = self.peer.state
        return ((state.round == 0 or self.resumed) and not state.joined_ever) or (
            self.retry_round is not None and state.round >= self.retry_round)

    def choose(self, view: SwarmView) -> DonorChoice:
        peer = self.peer
        fresh = self.fresh()
        own_round = 0 if fresh else peer.state.round  # a retrying peer's round counts its own rounds alone
        choice = choose_donors(view.others, own_round, peer.state.synced, fresh, peer.sync.aligned_rounds,
                               self.config.join_max_round_lead, peer.reputation.is_banned,
                               self._last_round_syncing_s(), get_dht_time(), peer.peer_id,
                               peer.contributions.vouches_for)
        for suspect in choice.suspects:
            if suspect.peer_id not in self._suspects_logged:
                self._suspects_logged.add(suspect.peer_id)
                # gossip rounds are each peer's own count, which a fast peer runs up honestly: not a donor, but no
                # warning for what a mixed swarm does all the time
                level, why = ((logging.WARNING, "suspect") if peer.sync.aligned_rounds
                              else (logging.INFO, "gossip rounds are each peer's own"))
                logger.log(level, f"peer {suspect.peer_id} announces round {suspect.round}, more than "
                                  f"{self.config.join_max_round_lead} ahead of the swarm's {choice.quorum} "
                                  f"({why}): not a donor")
        return dataclasses.replace(choice, donors=peer.routes.best_first(choice.donors))  # reachable, direct first

    def _choose_again(self) -> DonorChoice:
        """The choice from a fresh read of the swarm, without donors while our lead is too recent to act on."""
        return self._unless_too_soon(self.choose(self.peer.swarm()))

    def _last_round_syncing_s(self) -> float:
        """How long a peer of the last round may have been syncing to count as a moment from ours (DiLoCo without
        overlap): its all-reduce's two stages, each waiting at most `sync.matchmaking_s`, and a margin."""
        return matchmaking_bound_s(self.config.matchmaking_s) if self.config.overlap == "none" else 0.0

    def catch_up_(self, view: SwarmView) -> JoinDecision:
        """Whose state to adopt: the first donor's that passes the checks, or none (stay with ours)."""
        peer, state = self.peer, self.peer.state
        choice = self.choose(view)
        self.ran_ahead_rounds = self.ran_ahead_rounds + 1 if choice.ran_ahead else 0
        choice = self._unless_too_soon(choice)
        if choice.split:
            role = f"we take the state of {choice.split[0]}" if choice.donors else "we hold the state the others take"
            logger.info(f"out of step, and none of the {len(choice.split)} peers of round {state.round} is in "
                        f"step: {role}")
        if choice.donors and peer.sync.aligned_rounds and not self._counted_in_round_0(choice):
            choice = self.round_to_join(choice)
        if self._starts_alike(choice):
            logger.info("the swarm is in round 0 and holds our initial state: nothing to download")
            return JoinDecision(member=True)
        own_loss = None if state.round == 0 and not state.joined_ever else peer.announcer.record.val_loss
        if choice.ran_ahead:
            logger.warning(f"round {state.round} is more than {self.config.join_max_round_lead} ahead of most of "
                           f"the swarm (its round {choice.quorum}): we averaged alone; taking the swarm's state")
        fresh, started = self.fresh(), time.monotonic()
        decision = self._first_state_taken(self._donors(choice, self._choose_again), fresh, own_loss, started)
        if decision is None and self._may_look_ahead(view, choice, fresh):
            decision = self._state_from_ahead(choice, fresh, started)
        if decision is not None:
            return decision
        if choice.donors or (fresh and choice.suspects):
            logger.warning(f"no peer could share a state that passed the checks; training on from ours"
                           f"{self._retry_later() if fresh and not peer.sync.aligned_rounds else ''}")
        return JoinDecision(member=bool(view.others))

    def _first_state_taken(self, donors: Iterator[tuple[PeerRecord, DonorChoice]], fresh: bool,
                           own_loss: float | None, started: float, must_beat: float | None = None
                           ) -> JoinDecision | None:
        """The first donor's state that passes the checks (`_corroborate`), or None; a donor whose state failed
        them pays what the verdict says."""
        peer, state = self.peer, self.peer.state
        for donor, drawn_from in donors:
            snapshot = self._download(donor, drawn_from)
            if snapshot is None:
                continue
            # a donor that did not move on (done, or stuck); when we ran ahead, the swarm's round is behind ours
            if not fresh and not drawn_from.ran_ahead and snapshot.round < state.round:
                logger.info(f"the state of {donor.peer_id} is of round {snapshot.round}, before ours: not taken")
                continue
            verdict = self._corroborate(snapshot, donor, drawn_from, own_loss, must_beat)
            if not verdict.accepted:
                logger.warning(f"refused the state of {donor.peer_id}: {verdict.detail}")
                if verdict.offence is not None:
                    peer.reputation.penalise(donor.peer_id, verdict.offence, verdict.detail)
                continue
            self.join_s, self.retry_round = time.monotonic() - started, None
            return JoinDecision(snapshot, member=True, donor=donor.peer_id, detail=verdict.detail)
        return None

    def _may_look_ahead(self, view: SwarmView, choice: DonorChoice, fresh: bool) -> bool:
        """Whether to try the peers ahead of our quorum (`_state_from_ahead`) when no donor of it gave a state:
        while that quorum counts every identity, because we verified nobody's work, and some peer is ahead of us.
        A fresh peer, in any mode; in DiLoCo, one that averages with nobody it verified (gossip peers mix with
        partners of any round, and verify them so)."""
        if not any(r.round > self.peer.state.round for r in choice.suspects):
            return False
        vouched = self.peer.contributions.vouches_for
        return fresh or (self.peer.sync.aligned_rounds and not any(vouched(r.peer_id) for r in view.others))

    def _state_from_ahead(self, choice: DonorChoice, fresh: bool, started: float) -> JoinDecision | None:
        """Try the peers ahead of our quorum, nearest first. We verified nobody's work, so every identity counts in
        our quorum: 20 identities of one process announcing a stale round made that round a fresh joiner's, every
        honest peer a suspect, and it trained alone until they left (issue 31). A fresh peer's state from ahead must
        show training: its loss on our batches at most AHEAD_MAX_LOSS of our own (θ_0's); a trained peer's faces
        the usual check against ours. In DiLoCo, a round about to sync is joined at its next (`round_to_join`)."""
        own_loss = self.peer.inner.evaluate(self.peer.val_batches)
        first = self._ahead_of(choice)
        logger.info(f"no donor of the swarm's round {choice.quorum} gave a state, and we verified nobody's work: "
                    f"trying the {len(first.donors)} peer(s) ahead of it (our loss {own_loss:.3f})")
        if self.peer.sync.aligned_rounds:
            # with no round left to join in time (the peers ahead waiting to rejoin each other, or missing from a
            # read under load), their state now, a round late, still beats ours: read again, as the first read's
            # range refuses a snapshot of the rounds they ran while we waited. Our next round catches up as any
            # out-of-step peer's does
            timed = self.round_to_join(first, self._choose_ahead)
            first = timed if timed.donors else self._read_ahead_again(choice) or first
        return self._first_state_taken(self._donors(first, self._choose_ahead), fresh, own_loss, started,
                                       must_beat=AHEAD_MAX_LOSS * own_loss if fresh else None)

    def _choose_ahead(self) -> DonorChoice:
        """The peers ahead of our quorum, from a fresh read of the swarm (`_ahead_of`)."""
        return self._ahead_of(self.choose(self.peer.swarm()))

    def _read_ahead_again(self, stale: DonorChoice) -> DonorChoice | None:
        """From a fresh read, the peers ahead of our quorum, or, where none is, the read's donors beyond `stale`'s
        reach (the identities that outvoted us left, or their records lapsed: the peers ahead are the quorum now);
        None without either."""
        choice = self.choose(self.peer.swarm())
        ahead = self._ahead_of(choice)
        if ahead.donors:
            return ahead
        reach = -1 if stale.quorum is None else stale.quorum + self.config.join_max_round_lead
        beyond = [r for r in choice.donors if r.round > reach]
        return dataclasses.replace(choice, donors=beyond) if beyond else None

    @staticmethod
    def _ahead_of(choice: DonorChoice) -> DonorChoice:
        """The peers ahead of `choice`'s quorum as donors, nearest it first (a liar far ahead comes last), each
        witnessed by all; the quorum raised to the furthest, so that a donor's snapshot may be of a round within
        the lead beyond it (a gossip donor moves on while we download)."""
        donors = sorted(choice.suspects, key=lambda r: (r.round, -r.bandwidth_bps, r.peer_id))
        return DonorChoice(max((r.round for r in donors), default=choice.quorum), choice.trusted + choice.suspects,
                           [], donors)

    def _donors(self, choice: DonorChoice,
                read_again: Callable[[], DonorChoice]) -> Iterator[tuple[PeerRecord, DonorChoice]]:
        """Each donor once, best first, with its choice: after a try over SETUP_FLOOR_S, from `read_again`. Each
        donor we get back failed: the others of its host (the address our connection to it came from) go after
        every other donor. Identities are free and addresses are not: a host's identities that each claim the
        swarm's latest round and a fast link, then hold the download silent, would otherwise cost a joiner a
        chunk deadline each before its first honest donor."""
        tried: set[str] = set()
        failed_hosts: set[str] = set()
        read_at = time.monotonic()
        while True:
            left = [d for d in choice.donors if d.peer_id not in tried]
            if not left:
                return
            hosts = self._hosts_of([d.peer_id for d in left]) if failed_hosts else {}
            donor = next((d for d in left if hosts.get(d.peer_id) not in failed_hosts), left[0])
            tried.add(donor.peer_id)
            yield donor, choice
            host = self._hosts_of([donor.peer_id]).get(donor.peer_id)
            if host is not None:
                failed_hosts.add(host)
            if time.monotonic() - read_at > SETUP_FLOOR_S:
                choice, read_at = read_again(), time.monotonic()

    def _hosts_of(self, peers: list[str]) -> dict[str, str | None]:
        """The host each of `peers` connects from, where we hold a connection to it (net/remote_hosts.py)."""
        try:
            return self.peer.loop.run(RemoteHosts.of(self.peer.p2p).hosts_of(peers), timeout=2 * READ_TIMEOUT_S)
        except Exception as e:  # a daemon going away: no host known, the plain order stands
            logger.debug(f"cannot read the hosts of donors: {e!r}")
            return {}

    def _retry_later(self) -> str:
        """Schedule a fresh peer's next try (JOIN_RETRIES, backing off); what the log line says of it."""
        self.failed_joins += 1
        if self.failed_joins > JOIN_RETRIES:
            self.retry_round = None
            return f" (gave up after {self.failed_joins} tries)"
        self.retry_round = self.peer.state.round + JOIN_RETRY_ROUNDS * 2 ** (self.failed_joins - 1)
        return f" until round {self.retry_round}, then tries again"

    def round_to_join(self, choice: DonorChoice, read_again: Callable[[], DonorChoice] | None = None
                      ) -> DonorChoice:
        """`choice`, or when its round's peers will have read who is in their round before we could be there, the
        choice once they started their next round (waiting at most `sync.allreduce_timeout_s`; once, as rounds
        shorter than a join would never leave room)."""
        if not self._too_late_for(choice):
            return choice
        read_again = read_again or self._choose_again
        round_ = choice.donors[0].round
        logger.info(f"round {round_} is about to sync: joining at its next round")
        # Waiting, we are no donor and no member of anyone's round: a peer waiting on us would wait in vain (two
        # peers each waiting for the other's next round would stall until stopped)
        self.peer.announce(wait=True, phase="joining")
        give_up_at = time.monotonic() + self.config.allreduce_timeout_s
        while time.monotonic() < give_up_at and not self.peer.stop_event.wait(0.2):
            later = read_again()
            if not later.donors:  # the donors left, or are waiting themselves: train on from ours
                logger.info(f"no donor of round {round_} or later is left to join: training on")
                return later
            if later.donors[0].round > round_ and all(r.phase == "inner" for r in later.donors
                                                      if r.round == later.donors[0].round):
                return later
        return read_again()

    def _counted_in_round_0(self, choice: DonorChoice) -> bool:
        """Whether a fresh peer already said it is in round 0, the round of its donors (it waited for the peers it
        was launched with: swarm_start.py): their round-0 groups count it, and wait for it."""
        peer = self.peer
        return (peer.state.round == 0 and not peer.state.joined_ever and choice.donors[0].round == 0
                and peer.announcer.record.phase == "inner")

    def _unless_too_soon(self, choice: DonorChoice) -> DonorChoice:
        """`choice`, without donors when we ran ahead for fewer than RAN_AHEAD_ROUNDS rounds in a row: a lead that
        a round or two undoes (a member that averaged alone twice while the other waited, records of a peer just
        killed) must not send us back to a state of rounds ago."""
        if choice.ran_ahead and self.ran_ahead_rounds < RAN_AHEAD_ROUNDS:
            return dataclasses.replace(choice, donors=[], ran_ahead=False)
        return choice

    def _starts_alike(self, choice: DonorChoice) -> bool:
        """Whether a fresh peer whose donors are all in round 0 already holds their state: every peer of a run
        builds θ_0 from the same seed, so peers that start together need no download (which costs a home link
        minutes). Told from the sketches of up to WITNESSES round-0 peers under a seed of ours, most of which must
        match our own (a misconfigured seed, or a liar, only costs the download that would have happened)."""
        peer = self.peer
        if peer.state.round != 0 or peer.state.joined_ever or not choice.donors or choice.donors[0].round != 0:
            return False
        seed = secrets.randbits(64)
        answers = self._ask(choose_witnesses(peer.routes.best_first(choice.trusted), "", 0, WITNESSES, self.rng,
                                             peer.contributions.vouches_for), seed)
        own = Sketch(0, parameter_sketch(peer.params, seed), parameter_norm(peer.params))
        alike = [a for a in answers if a.sketch.round == 0 and own.distance(a.sketch) <= ALIGNED_MAX_DISTANCE]
        return bool(answers) and 2 * len(alike) > len(answers)

    def _too_late_for(self, choice: DonorChoice) -> bool:
        """Whether the trusted peers of the first donor's round sync before our record could reach them."""
        round_ = choice.donors[0].round
        peers = [r for r in choice.trusted if r.round == round_]
        if any(r.phase == "sync" for r in peers):
            return True
        etas = [r.round_eta for r in peers if r.round_eta > 0]
        # beyond the join itself, a tick for our record to reach their read of who is in the round
        return bool(etas) and min(etas) - get_dht_time() < self.join_s + TICK_S

    def _download(self, donor: PeerRecord, choice: DonorChoice) -> StateSnapshot | None:
        peer, timeout_s = self.peer, self.config.state_download_timeout_s
        assert choice.quorum is not None  # there are donors
        low, high = snapshot_rounds(donor.round, choice.quorum, self.config.join_max_round_lead)
        nbytes = peer.state.nbytes()
        deadline_s = download_deadline_s(nbytes, timeout_s)
        try:
            return peer.loop.run(download_state(
                peer.p2p, PeerID.from_base58(donor.peer_id), peer.config.run.run_id, peer.state.layout(),
                max_bytes=2 * nbytes + 2**20, chunk_timeout_s=timeout_s,
                expected_metadata=SnapshotExpectation(peer.config.run.run_id, peer.fingerprint, low, high),
                route=peer.routes.route_to(donor.peer_id), ticket=peer.routes.ticket), timeout=deadline_s)
        except SnapshotRefused as e:
            logger.warning(f"refused the state of {donor.peer_id}: {e}")
            if e.offence is not None:
                peer.reputation.penalise(donor.peer_id, e.offence, str(e))
        except (TimeoutError, asyncio.TimeoutError, WireTimeout) as e:  # a slow donor holds our training: it pays
            logger.warning(f"the state download from {donor.peer_id} took too long ({e}); trying the next peer")
            peer.reputation.penalise(donor.peer_id, "slow_send", f"state download: {e}")
        except Exception as e:  # WireError, StateMismatchError, timeouts, P2P errors: all mean "next donor"
            logger.warning(f"state download from {donor.peer_id} failed: {e!r}; trying the next peer")
        return None

    def _corroborate(self, snapshot: StateSnapshot, donor: PeerRecord, choice: DonorChoice,
                     own_loss: float | None, must_beat: float | None = None) -> Verdict:
        """The sketch check against other peers, then the validation-loss check (the costlier one) on our batches;
        with `must_beat`, a loss above it is refused whatever the witnesses say (no offence)."""
        seed = secrets.randbits(64)  # drawn after the download: the donor could not know it
        others = [r for r in choice.trusted if r.peer_id != donor.peer_id
                  and not self.peer.reputation.is_banned(r.peer_id)]  # a donor refused just before is banned now
        witnesses = choose_witnesses(self.peer.routes.best_first(others), donor.peer_id, snapshot.round, WITNESSES,
                                     self.rng, self.peer.contributions.vouches_for)
        tight = self.peer.sync.aligned_rounds and not self.config.own_delta_first and donor.synced
        candidate, answers = snapshot.sketch(seed), self._ask(witnesses, seed)
        sketches = judge_sketches(candidate, answers, tight, ALIGNED_MAX_DISTANCE, self.config.join_gossip_max_distance)
        if sketches.accepted:
            outer = self._judge_outer_state(snapshot, candidate, answers, tight)
            if not outer.accepted:
                return outer
        with parameters_set_to(self.peer.params, snapshot.tensors[:len(self.peer.params)]):
            loss = self.peer.inner.evaluate(self.peer.val_batches)
        if must_beat is not None and not loss <= must_beat:
            return Verdict(False, f"its validation loss {loss:.3f} is above {must_beat:.3f}: no sign of training")
        if own_loss is None:  # a fresh peer's is θ_0's: no state may be worse than where training starts
            own_loss = self.peer.inner.evaluate(self.peer.val_batches)
        if not sketches.accepted:
            return outvoted_state(sketches, judge_loss(loss, own_loss, None, self.config.join_loss_tolerance))
        claimed = median_claim([r.val_loss for r in others])  # what the donor claims of itself proves nothing
        held = sketches.held_by_round  # the donor's round holds this state: a refusal is no fault of the donor's
        judged = judge_loss(loss, own_loss_bound(own_loss, choice.ran_ahead or held), claimed,
                            self.config.join_loss_tolerance)
        if not judged.accepted:
            return dataclasses.replace(judged, offence=None if held else judged.offence)
        return dataclasses.replace(judged, detail=f"{sketches.detail}; {judged.detail}")

    def _judge_outer_state(self, snapshot: StateSnapshot, candidate: Sketch, answers: Sequence[Witnessed],
                           tight: bool) -> Verdict:
        """The snapshot's outer state: against the witnesses' (join_rules.judge_outer_state), then beside its own
        parameters (the strategy's `outer_state_problem`)."""
        ours = [t for n, t in self.peer.state.named_tensors() if n.startswith(OUTER_PREFIX)]
        verdict = judge_outer_state(candidate, answers, tight, ALIGNED_MAX_DISTANCE, parameter_norm(ours))
        count = len(self.peer.params)
        problem = self.peer.sync.outer_state_problem(snapshot.tensors[:count], snapshot.tensors[count:])
        return verdict if problem is None or not verdict.accepted else Verdict(False, problem)

    def _ask(self, witnesses: Sequence[PeerRecord], seed: int) -> list[Witnessed]:
        """The witnesses' sketches under `seed`, asked at once; those that fail or refuse are left out."""
        peer, timeout_s = self.peer, self.config.state_download_timeout_s

        async def ask(record: PeerRecord) -> Sketch:
            return await request_sketch(peer.p2p, PeerID.from_base58(record.peer_id), peer.config.run.run_id,
                                        seed, timeout_s, peer.routes.route_to(record.peer_id), peer.routes.ticket)

        async def ask_all() -> list[Sketch | BaseException]:
            return await answers_with_patience([ask(w) for w in witnesses], timeout_s)

        try:  # each request has its own deadline; this one only guards against a stuck event loop
            results = peer.loop.run(ask_all(), timeout=timeout_s + 5) if witnesses else []
        except TimeoutError:
            logger.warning(f"no peer answered a sketch request within {timeout_s + 5:g} s")
            return []
        answers = []
        for record, result in zip(witnesses, results, strict=True):
            if isinstance(result, BaseException):
                logger.debug(f"no sketch from {record.peer_id}: {result!r}")
                offence = witness_offence(result)
                if offence is not None:  # a witness that stalls or garbles its answer pays, as a partner would
                    peer.reputation.penalise(record.peer_id, offence, f"sketch request: {result!r}")
            else:
                answers.append(Witnessed(record.peer_id, record.synced, result))
        return answers


async def answers_with_patience(requests: Sequence[Awaitable[T]], timeout_s: float) -> list[T | BaseException]:
    """Each request's answer or exception, in order. Once the first answer is in (not a refusal: that comes at
    once), the others get LATE_WITNESS_FACTOR times as long again (at least BRIEF_S); those still out
    then, or at `timeout_s`, are TimeoutErrors: waiting for every witness, one that never answers would hold each
    corroboration for the whole `timeout_s`."""
    started, tasks = time.monotonic(), [asyncio.ensure_future(r) for r in requests]
    deadline, pending, answered_s = started + timeout_s, set(tasks), None
    while pending and answered_s is None:
        done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                           return_when=asyncio.FIRST_COMPLETED)
        if not done:
            break
        if any(task.exception() is None for task in done):
            answered_s = time.monotonic() - started
    if pending and answered_s is not None:
        patience_s = max(BRIEF_S, LATE_WITNESS_FACTOR * answered_s)
        await asyncio.wait(pending, timeout=min(patience_s, max(0.0, deadline - time.monotonic())))
    answers: list[T | BaseException] = []
    for task in tasks:
        if not task.done():
            task.cancel()
            answers.append(TimeoutError(f"no answer within {time.monotonic() - started:.1f} s"))
        else:
            error = task.exception()
            answers.append(error if error is not None else task.result())
    return answers

