"""Joining with untrusted peers (issue 9): quorum round, donor choice, sketches, metadata checks, and real swarms
on loopback where a liar announces a far-ahead round or serves −5·θ_0 as its state."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import re
import threading
import time
import types
import uuid
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from swarm_utils import PeerThread, replace_section, start_peer, stop_and_shut_down, tiny_config, wait_until

from p2ptrain.config import PeerConfig, RunConfig
from p2ptrain.errors import ConfigError
from p2ptrain.join_rules import (
    DonorChoice,
    Verdict,
    Witnessed,
    choose_donors,
    choose_witnesses,
    judge_loss,
    judge_outer_state,
    judge_sketches,
    median_claim,
    nobody,
    own_loss_bound,
    peers_to_outnumber,
    quorum_round,
    snapshot_rounds,
    split_by_quorum,
    split_rank,
)
from p2ptrain.joining import (
    JOIN_RETRIES,
    RAN_AHEAD_ROUNDS,
    Joiner,
    answers_with_patience,
    parameters_set_to,
)
from p2ptrain.metrics import RoundMetrics
from p2ptrain.net.dht import start_dht
from p2ptrain.net.discovery import PeerRecord, SwarmView
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.net.remote_hosts import RemoteHosts
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.routes import Routes
from p2ptrain.net.state_sharing import (
    DOWNLOAD_BURST,
    DOWNLOADS_AT_ONCE,
    DOWNLOADS_PER_HOST,
    SKETCH_BLOCK,
    SKETCH_BURST,
    SKETCH_SIZE,
    SKETCHES_QUEUED,
    MalformedSketch,
    Sketch,
    SnapshotExpectation,
    SnapshotRefused,
    StateServer,
    StateSnapshot,
    check_snapshot_metadata,
    download_deadline_s,
    download_state,
    parameter_norm,
    parameter_sketch,
    request_sketch,
)
from p2ptrain.net.wire import WireError, WireTimeout
from p2ptrain.peer import TrainingPeer
from p2ptrain.peer_state import PeerState
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.contribution import Contributions
from p2ptrain.sync.gasloc import GaslocSync
from p2ptrain.sync.refusals import Refusal
from p2ptrain.sync.state_evidence import ALIGNED_MAX_DISTANCE
from p2ptrain.testnet.sybils import StallingIdentities, SybilRecords
from p2ptrain.timing import BRIEF_S, SETUP_FLOOR_S

LIAR_ROUND = 100_000


def record(peer: str, round_: int, phase: str = "inner", synced: bool = True, val_loss: float | None = None,
           bandwidth_bps: float = 0.0) -> PeerRecord:
    return PeerRecord(peer_id=peer, round=round_, inner_step=0, phase=phase, round_eta=0.0, synced=synced,
                      val_loss=val_loss, bandwidth_bps=bandwidth_bps)


def nobody_banned(_peer: str) -> bool:
    return False


def donors_of(others: list[PeerRecord], own_round: int, in_step: bool = True, fresh: bool = False,
              aligned: bool = True, banned: tuple[str, ...] = ()) -> list[str]:
    choice = choose_donors(others, own_round, in_step, fresh, aligned, 2, lambda p: p in banned)
    return [r.peer_id for r in choice.donors]


# ---- the round by quorum, and donors ------------------------------------------------------------------------------
def test_the_quorum_round_is_the_lower_median_so_one_liar_cannot_move_it():
    assert quorum_round([record("a", 7), record("b", 7), record("liar", LIAR_ROUND)]) == 7
    assert quorum_round([record("a", 7), record("liar", LIAR_ROUND)]) == 7
    assert quorum_round([record("a", 5), record("b", 6), record("c", 6)]) == 6
    assert quorum_round([record("a", 3)]) == 3
    assert quorum_round([]) is None


def test_a_peer_far_ahead_of_the_quorum_is_a_suspect_and_never_a_donor():
    others = [record("a", 7), record("b", 7), record("liar", LIAR_ROUND)]
    choice = choose_donors(others, 6, True, False, True, 2, nobody_banned)
    assert choice.quorum == 7
    assert [r.peer_id for r in choice.suspects] == ["liar"]
    assert sorted(r.peer_id for r in choice.donors) == ["a", "b"]
    assert donors_of(others, 0, fresh=True, aligned=False) == ["a", "b"]  # a fresh gossip peer too
    assert donors_of([record("a", 7), record("liar", 10)], 0, fresh=True) == ["a"]  # 10 > 7 + 2
    assert donors_of([record("a", 7), record("near", 9)], 0, fresh=True) == ["near", "a"]  # within the lead


def test_the_usual_catching_up_cases_still_find_their_donor():
    assert donors_of([record("a", 7)], 0, fresh=True) == ["a"]  # a fresh joiner, one honest peer
    assert donors_of([record("a", 6), record("b", 6)], 5) == ["a", "b"]  # one round behind a majority
    assert donors_of([record("b", 6)], 5) == ["b"]  # two peers one round apart: the one behind catches up
    assert donors_of([record("a", 5)], 6) == []  # ... and the one ahead stays
    assert donors_of([record("b", 5), record("c", 6)], 5)[0] == "c"  # a split of 2 + 1 converges on the later round
    assert donors_of([record("a", 5, synced=False), record("b", 5)], 5, in_step=False) == ["b"]  # fell out of a group
    assert donors_of([record("a", 5), record("b", 5)], 5) == []  # in step: nothing to do
    assert donors_of([record("a", 9)], 5, aligned=False) == []  # gossip peers never catch up after joining


def test_identities_whose_work_we_never_verified_do_not_vote_beside_partners_whose_work_we_did():
    """Issue 31: 20 identities of one process announcing a stale round were the quorum of every honest peer, which
    then took the others for suspects and tried the identities' states every round, and one knocked out of step
    could not resync. Partners whose values did work (sync/contribution.py) decide the round once there are any."""
    honest = [record("h1", 40), record("h2", 40, synced=False), record("h3", 41)]
    sybils = [record(f"sybil{i}", 3) for i in range(20)]
    partners = {"h1", "h2", "h3"}
    worked = partners.__contains__
    for own_round, in_step in ((40, True), (40, False)):
        blind = choose_donors(honest + sybils, own_round, in_step, False, True, 2, nobody_banned)
        assert blind.quorum == 3 and blind.ran_ahead and {r.peer_id for r in blind.suspects} == partners
        choice = choose_donors(honest + sybils, own_round, in_step, False, True, 2, nobody_banned, vouched=worked)
        assert choice.quorum == 40 and not choice.ran_ahead and choice.suspects == []
        # a partner one round ahead: it first, then those of our round, the synced one first; no identity
        assert [r.peer_id for r in choice.donors] == ["h3", "h1", "h2"]
    assert split_by_quorum(honest + sybils, 2, nobody_banned, vouched=worked)[0] == 40
    # a joiner has verified nobody: every identity counts (the item 5 for joiners is not met by this)
    assert choose_donors(honest + sybils, 0, True, True, True, 2, nobody_banned, vouched=nobody).quorum == 3
    # among donors of one round, a verified partner comes first; among witnesses too
    assert donors_of_vouched([record("new", 7), record("known", 7)], {"known"}) == ["known", "new"]
    pool = [record("known", 5), record("new", 7), record("newer", 7)]
    assert choose_witnesses(pool, "", 7, 1, random.Random(0), vouched={"known"}.__contains__)[0].peer_id == "known"


def donors_of_vouched(others: list[PeerRecord], vouched: set[str]) -> list[str]:
    return [r.peer_id for r in choose_donors(others, 0, True, True, True, 2, nobody_banned,
                                             vouched=vouched.__contains__).donors]


def test_a_peer_that_ran_ahead_of_most_of_the_swarm_takes_the_majoritys_state():
    """A peer that averaged alone raced ahead: the others count it a suspect and never take its state, so it must
    take theirs, or it trains alone for the rest of the run (CI, Docker backend: 121 rounds alone)."""
    swarm = [record("p0", 10), record("p1", 25), record("p3", 25)]
    choice = choose_donors(swarm, 60, True, False, True, 2, nobody_banned)
    assert choice.ran_ahead and choice.quorum == 25
    assert sorted(r.peer_id for r in choice.donors) == ["p1", "p3"]  # the majority's round, not the straggler's
    # and the others, for their part, keep away from it
    assert donors_of([record("p0", 10), record("p2", 60), record("p3", 25)], 25) == []
    assert not choose_donors(swarm, 27, True, False, True, 2, nobody_banned).ran_ahead  # within the lead


def test_running_ahead_needs_a_majority_of_the_swarm_behind_not_one_peer_or_half():
    # two peers: each is half the swarm; the one behind catches up, the one ahead keeps its state
    assert donors_of([record("restarted", 5)], 19) == []
    assert donors_of([record("a", 19)], 5) == ["a"]
    # half of four behind (two restarted peers), the other ahead with us: no
    assert donors_of([record("r1", 10), record("r2", 20), record("b", 40)], 40) == []
    # three of four behind (liars announcing an old round need a majority of the live swarm, banned ones not counted)
    old = [record("l1", 3), record("l2", 3), record("l3", 3), record("b", 40)]
    assert sorted(donors_of(old, 40)) == ["l1", "l2", "l3"]
    assert donors_of(old, 40, banned=("l1",)) == []
    assert donors_of(old, 40, aligned=False) == []  # gossip rounds count a peer's own steps: never
    assert donors_of(old, 0, fresh=True) == ["l1", "l2", "l3"]  # a fresh peer (round 0) joins the quorum too


def test_a_peer_that_ran_ahead_accepts_a_worse_swarm_state_but_only_so_much_worse():
    """Its lone state took more steps than the swarm's: a state 18 % worse is the swarm's (CI), one twice as bad is
    refused, so a liar majority cannot hand it anything at all."""
    swarm_state, lone_state = 2.0, 1.69
    assert not judge_loss(swarm_state, own_loss_bound(lone_state, False), None, 0.1).accepted  # the usual bar
    assert judge_loss(swarm_state, own_loss_bound(lone_state, True), None, 0.1).accepted
    assert not judge_loss(2 * lone_state, own_loss_bound(lone_state, True), None, 0.1).accepted
    assert not judge_loss(float("nan"), own_loss_bound(lone_state, True), None, 0.1).accepted


def joiner_seeing(views: list[list[PeerRecord]], timeout_s: float = 30.0) -> tuple[Joiner, list[int]]:
    """A Joiner whose peer's swarm reads `views` in turn (the last one from then on); also the count of reads."""
    reads = [0]

    def swarm() -> SwarmView:
        reads[0] += 1
        return SwarmView("me", views[min(reads[0] - 1, len(views) - 1)])

    config = SyncConfig(mode="diloco", allreduce_timeout_s=timeout_s)
    peer = types.SimpleNamespace(peer_id="12D3KooWme", config=types.SimpleNamespace(sync=config),
                                 stop_event=threading.Event(),
                                 swarm=swarm, state=types.SimpleNamespace(round=0, synced=True, joined_ever=False),
                                 sync=types.SimpleNamespace(aligned_rounds=config.mode == "diloco"),
                                 routes=Routes("me"),
                                 reputation=types.SimpleNamespace(is_banned=nobody_banned),
                                 contributions=Contributions(), announced=[])
    peer.announce = lambda **fields: peer.announced.append(fields)
    return Joiner(peer), reads  # type: ignore[arg-type]


@pytest.mark.parametrize(("aligned", "level"), [(True, logging.WARNING), (False, logging.INFO)])
def test_a_peer_far_ahead_is_no_donor_and_a_warning_only_where_rounds_are_aligned(aligned, level, caplog):
    """In DiLoCo a round far ahead of the quorum is a lie or a split; in the gossip modes (GASLoC, the default) a
    fast peer counts its own rounds faster, which a mixed swarm does all the time: said once, at INFO."""
    joiner, _ = joiner_seeing([])
    joiner.peer.sync.aligned_rounds = aligned
    others = [record("a", 7), record("b", 7), record("fast", 30)]
    with caplog.at_level(logging.INFO, logger="p2ptrain.joining"):
        for _ in range(2):  # once per peer, not every read
            choice = joiner.choose(SwarmView("me", others))
    assert "fast" not in {r.peer_id for r in choice.donors}
    said = [r for r in caplog.records if "announces round 30" in r.getMessage()]
    assert [r.levelno for r in said] == [level], [r.getMessage() for r in said]


def syncing_in(seconds: float, round_: int, phase: str = "inner") -> list[PeerRecord]:
    return [record(p, round_, phase=phase).copy(update={"round_eta": get_dht_time() + seconds}) for p in "ab"]


def test_after_a_donor_fails_the_others_of_its_host_are_tried_after_every_other_donor():
    """Identities are free and addresses are not: a host's identities that each claim the latest round and a fast
    link (first among donors), then hold a download silent, cost a joiner a chunk deadline each before its first
    honest donor. Once one fails, its host's others go last; a donor with no host known (no connection yet, or this
    machine's own loopback) is a host of its own."""
    joiner, _ = joiner_seeing([])
    hosts = {**{f"sybil{i}": "10.0.0.9" for i in range(4)}, "honest1": "10.0.0.1", "honest2": None}
    joiner._hosts_of = lambda peers: {p: hosts.get(p) for p in peers}  # type: ignore[method-assign]
    donors = [record(f"sybil{i}", 9) for i in range(4)] + [record("honest1", 8), record("honest2", 8)]
    choice = DonorChoice(8, donors, [], donors)
    order = [donor.peer_id for donor, _ in joiner._donors(choice, lambda: choice)]  # each one fails
    assert order == ["sybil0", "honest1", "honest2", "sybil1", "sybil2", "sybil3"]
    tried = []
    for donor, _ in joiner._donors(choice, lambda: choice):
        tried.append(donor.peer_id)
        if donor.peer_id == "honest1":
            break  # its state passed the checks: nobody else is asked
    assert tried == ["sybil0", "honest1"]


def test_a_joiner_takes_a_round_with_time_left_at_once():
    joiner, reads = joiner_seeing([])
    choice = joiner.round_to_join(joiner.choose(SwarmView("me", syncing_in(60, 5))))
    assert [r.round for r in choice.donors] == [5, 5] and reads[0] == 0


@pytest.mark.parametrize("first", [syncing_in(0.5, 5), syncing_in(-1, 5, phase="sync")],
                         ids=["about-to-sync", "syncing"])
def test_a_joiner_too_late_for_its_round_waits_for_the_next(first):
    """The round's peers would read who is in the round before our record reached them: we would average alone."""
    joiner, reads = joiner_seeing([first, first, syncing_in(60, 6)])
    choice = joiner.round_to_join(joiner.choose(SwarmView("me", first)))
    assert [r.round for r in choice.donors] == [6, 6] and reads[0] == 3


def test_a_fresh_peer_that_waited_in_round_0_for_the_peers_launched_with_it_runs_round_0_with_them():
    """While it waited (swarm_start.py) it said it was in round 0: the others' round-0 groups count it and wait for
    it, so it must not sit round 0 out as a late joiner would, however soon they sync."""
    joiner, reads = joiner_seeing([])
    joiner.peer.announcer = types.SimpleNamespace(record=types.SimpleNamespace(phase="inner"))
    round_0 = joiner.choose(SwarmView("me", syncing_in(-1, 0, phase="sync")))
    assert joiner._counted_in_round_0(round_0)
    assert not joiner._counted_in_round_0(joiner.choose(SwarmView("me", syncing_in(-1, 1, phase="sync"))))
    joiner.peer.announcer.record.phase = "joining"  # it did not wait: its record was not in their groups
    assert not joiner._counted_in_round_0(round_0) and reads[0] == 0


def test_a_joiner_waits_for_the_next_round_at_most_the_all_reduce_timeout():
    joiner, _ = joiner_seeing([syncing_in(-1, 5, phase="sync")], timeout_s=0.5)
    started = time.monotonic()
    choice = joiner.round_to_join(joiner.choose(SwarmView("me", syncing_in(-1, 5, phase="sync"))))
    assert [r.round for r in choice.donors] == [5, 5] and time.monotonic() - started < 5


def test_a_joiner_waiting_says_so_and_stops_when_its_donors_wait_themselves():
    """Two peers, each waiting for the other's next round, stalled 52 s (CI, churn scenario): a waiting peer
    announces itself joining, so the other sees no donor and trains on, and so do we."""
    syncing = syncing_in(-1, 5, phase="sync")
    waiting = [r.copy(update={"phase": "joining"}) for r in syncing]
    joiner, reads = joiner_seeing([syncing, waiting])
    started = time.monotonic()
    choice = joiner.round_to_join(joiner.choose(SwarmView("me", syncing)))
    assert choice.donors == [] and time.monotonic() - started < 5 and reads[0] == 2
    assert joiner.peer.announced == [{"wait": True, "phase": "joining"}]  # stored and waited for


def test_a_fresh_joiner_whose_peers_ahead_leave_no_round_to_join_takes_their_state_a_round_late():
    """Outvoted by identities of a stale round, a fresh DiLoCo joiner tries the peers ahead of it. Their round was
    about to sync, and by the next read they were waiting to rejoin each other (or gone from a read under load): it
    gave up on them and trained alone from θ_0, two rounds in a CI run. Their state a round late beats ours."""
    sybils = [record(f"sybil{i}", 0) for i in range(5)]
    syncing = syncing_in(-1, 12, phase="sync")
    waiting = [r.copy(update={"phase": "joining"}) for r in syncing]
    joiner, reads = joiner_seeing([sybils + waiting])
    joiner.peer.inner = types.SimpleNamespace(evaluate=lambda _batches: 5.5)
    joiner.peer.val_batches = []
    tried: list[str] = []

    def first_state_taken(donors, _fresh, _own_loss, _started, must_beat=None):
        tried.extend(donor.peer_id for donor, _ in donors)
        assert must_beat is not None  # a fresh peer's state from ahead must show training
        return None

    joiner._first_state_taken = first_state_taken  # type: ignore[method-assign]
    choice = joiner.choose(SwarmView("me", sybils + syncing))
    assert choice.quorum == 0 and {r.peer_id for r in choice.suspects} == {"a", "b"}
    assert joiner._state_from_ahead(choice, fresh=True, started=time.monotonic()) is None
    assert sorted(tried) == ["a", "b"] and reads[0] >= 1


@pytest.mark.parametrize("identities_seen", [True, False], ids=["identities-still-there", "their-records-lapsed"])
def test_a_fresh_joiner_that_gave_up_waiting_for_the_peers_ahead_reads_again_for_the_rounds_they_ran(
        identities_seen):
    """Given up on the round it waited for, the joiner downloaded by its first read, whose range (rounds 12 to 14)
    refused the snapshots of round 15 the peers ahead had reached meanwhile, and trained alone from θ_0 (a run with 3
    CPU hogs beside it). It reads again; where the identities' records lapsed, the peers ahead are the quorum now,
    and that read's donors."""
    sybils = [record(f"sybil{i}", 0) for i in range(5)]
    syncing = syncing_in(-1, 12, phase="sync")
    waiting = [r.copy(update={"phase": "joining"}) for r in syncing]
    moved_on = syncing_in(60, 15)
    joiner, reads = joiner_seeing([sybils + waiting, (sybils if identities_seen else []) + moved_on])
    joiner.peer.inner = types.SimpleNamespace(evaluate=lambda _batches: 5.5)
    joiner.peer.val_batches = []
    drawn: list[tuple[str, int]] = []

    def first_state_taken(donors, _fresh, _own_loss, _started, must_beat=None):
        drawn.extend((donor.peer_id, choice.quorum) for donor, choice in donors)
        return None

    joiner._first_state_taken = first_state_taken  # type: ignore[method-assign]
    choice = joiner.choose(SwarmView("me", sybils + syncing))
    assert joiner._state_from_ahead(choice, fresh=True, started=time.monotonic()) is None
    assert sorted(drawn) == [("a", 15), ("b", 15)] and reads[0] == 2


def test_a_lead_taken_in_a_round_or_two_does_not_send_a_peer_back():
    """The majority must be far behind RAN_AHEAD_ROUNDS rounds in a row: a member that averaged alone twice while
    the other waited, or the records of a peer just killed, make a lead that the next round undoes."""
    joiner, _ = joiner_seeing([])
    joiner.peer.state.round = 26
    choice = joiner.choose(SwarmView("me", [record("p1", 23), record("p2", 23)]))
    assert choice.ran_ahead and choice.donors
    for rounds_in_a_row, held_back in ((1, True), (RAN_AHEAD_ROUNDS - 1, True), (RAN_AHEAD_ROUNDS, False)):
        joiner.ran_ahead_rounds = rounds_in_a_row
        assert (joiner._unless_too_soon(choice).donors == []) == held_back
    assert joiner._unless_too_soon(joiner.choose(SwarmView("me", [record("p1", 27)]))).donors  # catching up: at once


def test_a_diloco_peer_that_ran_ahead_takes_the_swarms_state_of_an_earlier_round():
    """Seen on the netns testnet: a peer that averaged alone from round 0 ran 9 rounds ahead, found it had, and
    refused each donor's state as 'of round 0, before ours', round after round: it averaged alone all run."""
    joiner, _ = joiner_seeing([])
    state = PeerState([], types.SimpleNamespace(set_params_=lambda _tensors: None),  # type: ignore[arg-type]
                      types.SimpleNamespace(rounds_count_own_steps=False, load_state_tensors_=lambda _tensors: None))
    state.round, state.joined_ever = 26, True
    joiner.peer.state = state
    joiner.peer.announcer = types.SimpleNamespace(record=types.SimpleNamespace(val_loss=3.0))
    joiner.ran_ahead_rounds = RAN_AHEAD_ROUNDS - 1  # this read is the RAN_AHEAD_ROUNDS-th in a row
    joiner._download = lambda donor, choice: StateSnapshot({"round": 23}, (), ())  # type: ignore[method-assign]
    joiner._corroborate = lambda *_args: Verdict(True, "by hand")  # type: ignore[method-assign]
    decision = joiner.catch_up_(SwarmView("me", [record("p1", 23), record("p2", 23)]))
    assert decision.snapshot is not None and decision.donor in {"p1", "p2"}
    state.take_(decision)
    assert state.round == 23 and state.synced


def gossip_joiner_refusing(refusals: int) -> tuple[Joiner, types.SimpleNamespace, list[int]]:
    """A fresh GASLoC peer's Joiner whose every candidate state is refused `refusals` times, then accepted (to
    round 40); also the rounds at which it tried."""
    tries: list[int] = []
    config = SyncConfig(mode="gasloc")
    sync = types.SimpleNamespace(aligned_rounds=config.mode == "diloco",
                                 rounds_count_own_steps=config.mode == "gasloc",
                                 load_state_tensors_=lambda _tensors: None)
    state = PeerState([], types.SimpleNamespace(set_params_=lambda _tensors: None), sync)  # type: ignore[arg-type]
    peer = types.SimpleNamespace(peer_id="12D3KooWme", config=types.SimpleNamespace(sync=config), state=state,
                                 sync=sync,
                                 reputation=types.SimpleNamespace(is_banned=nobody_banned),
                                 contributions=Contributions(),
                                 announcer=types.SimpleNamespace(record=types.SimpleNamespace(val_loss=3.0)),
                                 routes=Routes("me"))
    joiner = Joiner(peer)  # type: ignore[arg-type]

    def corroborate(*_args: object) -> Verdict:
        tries.append(peer.state.round)
        return Verdict(len(tries) > refusals, "by hand", offence=None)

    joiner._download = lambda donor, choice: StateSnapshot({"round": 40}, (), ())  # type: ignore[method-assign]
    joiner._corroborate = corroborate  # type: ignore[method-assign]
    return joiner, peer, tries


def run_rounds(joiner: Joiner, peer: types.SimpleNamespace, rounds: int) -> None:
    """The peer's round loop, as far as joining goes: try to catch up (the state takes what the joiner decides),
    then count the round (gossip peers' rounds are their own)."""
    view = SwarmView("me", [record("a", 30), record("b", 31)])
    for _ in range(rounds):
        peer.state.take_(joiner.catch_up_(view))
        peer.state.round += 1


def test_a_fresh_gossip_peer_that_refused_every_donor_tries_again_later_and_joins():
    joiner, peer, tries = gossip_joiner_refusing(refusals=4)  # two donors, both refused at each of two tries
    run_rounds(joiner, peer, 6)
    assert tries[:2] == [0, 0] and tries[2:4] == [1, 1] and tries[4] == 3  # backing off: rounds 0, 1, 3
    assert len(tries) == 5 and peer.state.round > 40 and joiner.retry_round is None


def test_a_fresh_gossip_peer_gives_up_after_its_retries():
    joiner, peer, tries = gossip_joiner_refusing(refusals=10_000)
    run_rounds(joiner, peer, 40)
    assert sorted(set(tries)) == [0, 1, 3, 7, 15] and len(tries) == 2 * (JOIN_RETRIES + 1)
    assert joiner.retry_round is None and peer.state.round == 40


def test_banned_and_joining_peers_are_neither_donors_nor_counted_in_the_quorum():
    others = [record("a", 7), record("liar", 8), record("new", 0, phase="joining")]
    choice = choose_donors(others, 6, True, False, True, 2, lambda p: p == "liar")
    assert choice.quorum == 7 and [r.peer_id for r in choice.donors] == ["a"]
    assert [r.peer_id for r in choice.trusted] == ["a"]


def test_a_pair_of_three_honest_peers_outnumbers_the_others_whatever_a_banned_peer_announces() -> None:
    """Two honest peers that averaged together while the third came late hold a majority of the round's peers; a
    banned member still announcing the round once made it 2 of 4, and both took the latecomer's state (a CI run)."""
    others = [record("partner", 2), record("late", 2), record("banned", 2), record("new", 2, phase="joining"),
              record("behind", 1), record("ahead", 3), record("liar", LIAR_ROUND)]
    assert peers_to_outnumber(others, 2, 2, lambda p: p == "banned") == 3  # partner, late, ahead
    in_step = PeerState([], None, None)  # type: ignore[arg-type]
    in_step.record_step_(group_size=2, others_here=peers_to_outnumber(others[:3], 2, 2, lambda p: p == "banned"),
                         shown=None)
    assert in_step.synced
    in_step.record_step_(group_size=2, others_here=peers_to_outnumber(others[:3], 2, 2, lambda p: False), shown=None)
    assert not in_step.synced  # the same pair among three others is not a majority


def test_a_split_with_no_synced_peer_heals_all_take_the_state_of_the_first_by_rank() -> None:
    """Two (or more) peers that each averaged a round alone are all out of step, and none is synced: without a rule
    each would wait for a synced donor forever. All but the first by `split_rank` take the first's state."""
    ids = ["12D3KooWa", "12D3KooWb", "12D3KooWc"]
    for round_ in (1, 7):
        first = min(ids, key=lambda p: split_rank(round_, p))
        for me in ids:
            others = [record(p, round_, synced=False) for p in ids if p != me] + [record("behind", round_ - 1)]
            choice = choose_donors(others, round_, False, False, True, 2, nobody_banned, own_id=me)
            assert [r.peer_id for r in choice.donors] == ([] if me == first else [first]), (round_, me)
    firsts = {min(ids, key=lambda p: split_rank(r, p)) for r in range(40)}
    assert firsts == set(ids)  # salted by the round: no identity comes first in every round
    # a synced peer of the round is still the donor; in step, no one is
    others = [record("12D3KooWa", 3, synced=False), record("12D3KooWs", 3, synced=True)]
    assert [r.peer_id for r in choose_donors(others, 3, False, False, True, 2, nobody_banned,
                                             own_id="12D3KooWb").donors] == ["12D3KooWs"]
    assert choose_donors(others[:1], 3, True, False, True, 2, nobody_banned, own_id="12D3KooWb").donors == []


def test_the_most_advanced_donor_comes_first_then_synced_then_the_fastest_link():
    others = [record("slow", 7, bandwidth_bps=1e6), record("fast", 7, bandwidth_bps=1e9),
              record("unsynced", 7, synced=False, bandwidth_bps=1e10), record("later", 8)]
    assert donors_of(others, 6) == ["later", "fast", "slow", "unsynced"]


def test_a_snapshot_may_be_of_the_donors_round_or_any_later_one_within_the_lead():
    # seen in CI: two honest GASLoC donors were two rounds past their records by the time a joiner that first
    # checked a liar's state reached them, and a window of one round refused both
    assert snapshot_rounds(7, 7, 2) == (7, 9)
    assert snapshot_rounds(8, 7, 6) == (8, 13)
    assert snapshot_rounds(9, 7, 2) == (9, 9)


def test_witnesses_exclude_the_donor_and_prefer_peers_of_the_snapshots_round():
    trusted = [record("donor", 7), record("a", 6), record("b", 7, synced=False), record("c", 7), record("d", 5)]
    chosen = choose_witnesses(trusted, "donor", 7, 3, random.Random(0))
    assert [r.peer_id for r in chosen] == ["c", "b", "a"]
    assert choose_witnesses([record("donor", 7)], "donor", 7, 3, random.Random(0)) == []


# ---- sketches -------------------------------------------------------------------------------------------------------
def test_the_sketch_is_rademacher_projections_drawn_from_the_seeds_pcg64_bits():
    """By hand: a single element 1.0 gets, in projection k, the sign of bit k of the stream's first word."""
    word = int(np.random.PCG64(1234).random_raw(1)[0])
    expected = [2.0 * ((word >> k) & 1) - 1 for k in range(SKETCH_SIZE)]
    assert parameter_sketch([torch.ones(1)], seed=1234) == expected
    assert parameter_sketch([torch.full((1,), 3.0)], seed=1234) == [3 * e for e in expected]


def test_the_sketch_is_the_same_blockwise_as_a_dense_projection():
    torch.manual_seed(0)
    tensors = [torch.randn(SKETCH_BLOCK + 5), torch.randn(3, 7)]
    bits = np.random.PCG64(99)
    dense = []
    for count in (SKETCH_BLOCK, 5, 21):  # the blocks: a full one, the first tensor's tail, the second tensor
        words = bits.random_raw(-(-SKETCH_SIZE * count // 64)).astype("<u8")
        signs = np.unpackbits(words.view(np.uint8), bitorder="little")[: SKETCH_SIZE * count]
        dense.append(signs.reshape(SKETCH_SIZE, count).astype(np.float64) * 2 - 1)
    flat = [tensors[0][:SKETCH_BLOCK], tensors[0][SKETCH_BLOCK:], tensors[1].reshape(-1)]
    expected = sum(d @ f.double().numpy() for d, f in zip(dense, flat, strict=True))
    np.testing.assert_allclose(parameter_sketch(tensors, seed=99), expected, rtol=1e-12)
    assert parameter_sketch(tensors, seed=99) != parameter_sketch(tensors, seed=100)


SEED = 7
torch.manual_seed(1)
THETA = [torch.randn(50, 40) * 0.02, torch.ones(40)]


def sketch_of(tensors: list[torch.Tensor], round_: int = 7, seed: int = SEED) -> Sketch:
    return Sketch(round_, parameter_sketch(tensors, seed), parameter_norm(tensors))


def scaled(factor: float) -> list[torch.Tensor]:
    return [factor * t for t in THETA]


def test_a_scaled_lie_is_far_in_the_sketch_and_float_rounding_is_not():
    honest = sketch_of(THETA)
    rounded = sketch_of([t + 1e-7 * torch.randn_like(t) for t in THETA])
    assert honest.distance(rounded) < 1e-5
    for lie, true in ((-5, 6.0), (10, 9.0), (1.3, 0.3)):  # ‖λθ − θ‖ / min(‖λθ‖, ‖θ‖)
        assert 0.47 * true < sketch_of(scaled(lie)).distance(honest) < 1.61 * true


def test_the_sketch_estimates_the_relative_distance_of_unrelated_states():
    torch.manual_seed(2)
    a, b = [torch.randn(10_000)], [torch.randn(10_000)]
    true = float((a[0] - b[0]).norm() / min(a[0].norm(), b[0].norm()))
    estimates = [sketch_of(a, seed=s).distance(sketch_of(b, seed=s)) for s in range(20)]
    assert all(0.47 * true < e < 1.61 * true for e in estimates)  # the 99.9 % band of a χ with 16 degrees
    assert 0.85 * true < float(np.median(estimates)) < 1.15 * true


def witnessed(sketch: Sketch, synced: bool = True) -> Witnessed:
    return Witnessed("w", synced, sketch)


def judge(candidate: Sketch, answers: list[Witnessed], tight: bool = True):
    return judge_sketches(candidate, answers, tight, ALIGNED_MAX_DISTANCE, 0.5)


def test_a_state_far_from_the_peers_of_its_round_is_refused_with_the_distance():
    honest, lie = sketch_of(THETA), sketch_of(scaled(-5))
    verdict = judge(lie, [witnessed(honest), witnessed(honest)])
    assert not verdict.accepted
    assert re.fullmatch(r"its parameters are [3-9]\.\d+ \(relative\) from 2 of 2 peers of round 7", verdict.detail)
    accepted = judge(honest, [witnessed(honest), witnessed(honest)])
    assert accepted.accepted and accepted.confirmed_by == 2
    assert accepted.detail == "confirmed by 2 peers of round 7 within 0"


def test_aligned_peers_must_agree_tightly_gossip_peers_loosely():
    honest, nearby = sketch_of(THETA), sketch_of(scaled(1.01))  # 1 % away: a gossip partner, or a round apart
    answers = [witnessed(nearby), witnessed(nearby)]
    assert not judge(honest, answers).accepted
    assert judge(honest, answers, tight=False).accepted
    other_round = [witnessed(sketch_of(scaled(1.01), round_=6)), witnessed(nearby, synced=False)]
    verdict = judge(honest, other_round)  # no synced peer of round 7 answered: the loose bound
    assert verdict.accepted and verdict.detail.startswith("confirmed by 2 peers within 0.0")


def test_most_answers_decide_and_the_donors_own_voice_breaks_a_tie():
    honest, lie = sketch_of(THETA), sketch_of(scaled(-5))
    two_to_one = [witnessed(honest), witnessed(honest), witnessed(lie)]
    assert judge(honest, two_to_one).accepted
    assert not judge(lie, [witnessed(honest), witnessed(honest)]).accepted  # 2 honest peers outvote the donor
    assert not judge(lie, [witnessed(honest)] * 3).accepted
    assert judge(lie, two_to_one).accepted  # 2 against 2 (a colluding witness): the loss check decides
    # one lying witness cannot get an honest donor refused: an even vote (the donor's own voice counted) or
    # no answer at all leaves the decision to the loss check
    assert judge(honest, [witnessed(lie)]).accepted and judge(lie, [witnessed(honest)]).accepted
    assert judge(lie, [witnessed(honest)]).detail == "0 of 1 peer of round 7 agree, 1 disagree: an even vote"
    assert judge(honest, [witnessed(honest), witnessed(lie)]).accepted
    assert judge(lie, []).detail == "no other peer answered"


def test_a_state_every_synced_peer_of_its_round_holds_is_the_rounds_even_with_one_answer():
    """`held_by_round` loosens the loss bar for a peer whose own state is the odd one out: the donor's round holds
    the candidate when two answers agree with it, or every answer (the donor and one other synced peer are a
    3-peer swarm's majority); not when the vote is even, nor on answers of other rounds or unsynced peers."""
    honest, lie = sketch_of(THETA), sketch_of(scaled(-5))
    assert judge(honest, [witnessed(honest)]).held_by_round
    assert judge(honest, [witnessed(honest), witnessed(honest), witnessed(lie)]).held_by_round
    assert not judge(honest, [witnessed(honest), witnessed(lie)]).held_by_round  # even: the loss check decides
    assert not judge(honest, [witnessed(sketch_of(THETA, round_=6))]).held_by_round
    assert not judge(honest, [witnessed(honest, synced=False)]).held_by_round
    assert not judge(honest, [witnessed(honest)], tight=False).held_by_round
    assert not judge(honest, []).held_by_round


def snapshot_with_momentum(momentum: list[torch.Tensor], round_: int = 7) -> StateSnapshot:
    """THETA as the parameters, `momentum` as the outer state."""
    return StateSnapshot.capture({"round": round_}, [*((f"param:{i}", t) for i, t in enumerate(THETA)),
                                                     *((f"sync:momentum:{i}", m) for i, m in enumerate(momentum))])


def test_honest_parameters_with_a_poisoned_outer_momentum_are_refused():
    """A donor's outer momentum (GASLoC: its previous iterate) was taken unchecked: honest parameters passed the
    sketch vote and the loss check, and the poisoned momentum threw the joiner's next outer step anywhere. Synced
    DiLoCo peers of one round hold one momentum: most of them must hold the candidate's. Elsewhere momenta differ
    from peer to peer, and only the candidate's scale is bounded: OUTER_NORM_FACTOR × the longer of ours and the
    median witness's."""
    momentum = [0.1 * t for t in THETA]
    honest = snapshot_with_momentum(momentum).sketch(SEED)

    def judge_outer(candidate: Sketch, answers: list[Witnessed], tight: bool = True, own: float = 0.0) -> Verdict:
        return judge_outer_state(candidate, answers, tight, ALIGNED_MAX_DISTANCE, own)

    for poison in ([-m for m in momentum], [10 * m for m in momentum]):  # as long as the honest one, or longer
        lie = snapshot_with_momentum(poison).sketch(SEED)
        assert judge(lie, [witnessed(honest), witnessed(honest)]).accepted  # the parameters are the swarm's
        verdict = judge_outer(lie, [witnessed(honest), witnessed(honest)])
        assert not verdict.accepted and "not that of 2 of 2 peers of round 7" in verdict.detail, verdict
        assert judge_outer(lie, [witnessed(honest), witnessed(lie)]).accepted  # an even vote (a colluding witness)
    assert judge_outer(honest, [witnessed(honest), witnessed(honest)]).accepted
    answers = [witnessed(honest), witnessed(honest), witnessed(snapshot_with_momentum([m * 2 for m in momentum])
                                                              .sketch(SEED))]
    scale = honest.outer_norm
    far = snapshot_with_momentum([10 * m for m in momentum]).sketch(SEED)
    verdict = judge_outer(far, answers, tight=False)  # gossip, a fresh joiner: the witnesses' median is the bar
    assert not verdict.accepted and f"over 4 × {scale:.3g}" in verdict.detail, verdict
    assert judge_outer(snapshot_with_momentum([3 * m for m in momentum]).sketch(SEED), answers, tight=False).accepted
    assert judge_outer(far, answers, tight=False, own=3 * scale).accepted  # ours is longer: the bar is ours
    assert judge_outer(far, [], tight=False).accepted  # nothing to compare with yet (round 0)
    assert not judge_outer(dataclasses.replace(far, outer_norm=math.nan), answers, tight=False).accepted


def test_a_joiner_refuses_a_donors_state_whose_outer_momentum_is_out_of_scale():
    """The same, through a Factored joiner's corroboration: honest parameters, a momentum 10 × the witnesses'."""
    momentum = [0.1 * t for t in THETA]
    params = [t.clone() for t in THETA]
    config = SyncConfig(mode="factored")
    state = types.SimpleNamespace(round=6, synced=True, joined_ever=True,
                                  named_tensors=lambda: [("sync:momentum:0", torch.zeros(3))])
    peer = types.SimpleNamespace(config=types.SimpleNamespace(sync=config), state=state,
                                 params=params, val_batches=[], routes=Routes("me"),
                                 reputation=types.SimpleNamespace(is_banned=nobody_banned),
                                 contributions=Contributions(),
                                 inner=types.SimpleNamespace(evaluate=lambda _batches: 3.0),
                                 sync=types.SimpleNamespace(outer_state_problem=lambda _params, _tensors: None,
                                                            aligned_rounds=config.mode == "diloco"))
    joiner = Joiner(peer)  # type: ignore[arg-type]
    joiner._ask = lambda asked, seed: [Witnessed(r.peer_id, True, snapshot_with_momentum(momentum).sketch(seed))
                                       for r in asked]  # type: ignore[method-assign]
    choice = DonorChoice(7, [record("donor", 7), *(record(f"w{i}", 7) for i in range(3))], [], [record("donor", 7)])
    for factor, accepted in ((10.0, False), (2.0, True)):
        candidate = snapshot_with_momentum([factor * m for m in momentum])
        verdict = joiner._corroborate(candidate, record("donor", 7), choice, 3.0)
        assert verdict.accepted == accepted, verdict
    assert verdict.accepted and "confirmed by 3 peers" in verdict.detail
    candidate = snapshot_with_momentum([10 * m for m in momentum])
    verdict = joiner._corroborate(candidate, record("donor", 7), choice, 3.0)
    assert verdict.offence == "wrong_state" and "outer state's norm" in verdict.detail
    peer.sync = types.SimpleNamespace(outer_state_problem=lambda _params, tensors: f"{len(tensors)} tensors, all wrong",
                                      aligned_rounds=config.mode == "diloco")
    verdict = joiner._corroborate(snapshot_with_momentum(momentum), record("donor", 7), choice, 3.0)
    assert not verdict.accepted and verdict.detail == "2 tensors, all wrong"  # what the strategy sees beside θ


def test_a_gasloc_state_whose_previous_iterate_lies_far_from_its_parameters_is_refused():
    """GASLoC's outer state is its previous iterate x_prev, one outer step behind the parameters: θ_next = x_new +
    γ (x_new − x_prev). A donor's x_prev far from its honest parameters would throw the joiner's next step γ × as
    far; beyond `sync.join_gossip_max_distance` (relative) the state is refused."""
    sync = types.SimpleNamespace(config=SyncConfig(mode="gasloc"))  # all the check reads of the strategy
    one_step_behind = [0.98 * t for t in THETA]
    assert GaslocSync.outer_state_problem(sync, THETA, one_step_behind) is None  # type: ignore[arg-type]
    problem = GaslocSync.outer_state_problem(sync, THETA, [-t for t in THETA])  # type: ignore[arg-type]
    assert problem == "its previous iterate is 2 (relative) from its parameters"
    assert GaslocSync.outer_state_problem(sync, THETA, [t * math.nan for t in THETA]) is not None  # type: ignore


def test_the_loss_check_refuses_the_poison_and_keeps_honest_noise():
    claimed = median_claim([2.70, 2.69, 50.0, None])  # a liar announcing 50 does not move the median
    assert claimed == pytest.approx(2.70)
    refused = judge_loss(5.549, own=2.8, claimed=claimed, tolerance=0.1)  # −5·θ_0 as issue 9 measured it
    assert not refused.accepted and refused.offence == "wrong_state" and refused.detail.endswith("(ours 2.800)")
    assert judge_loss(2.9, own=2.8, claimed=claimed, tolerance=0.1).accepted  # below 2.70 × 1.1 + 0.05 = 3.02
    assert not judge_loss(math.nan, own=2.8, claimed=None, tolerance=0.1).accepted
    assert judge_loss(2.7, own=5.27, claimed=None, tolerance=0.1).accepted  # a fresh peer: θ_0's loss is the bar
    assert judge_loss(12.3, own=5.27, claimed=None, tolerance=0.1).offence == "wrong_state"  # the tiny model's −5·θ_0
    # a lone honest state scored worse than ours (the netns testnet, 4 peers, one on 64 kbit/s: both fast peers
    # banned an honest donor for this at once): refused, and it costs its donor a third of a ban
    lone = judge_loss(3.322, own=2.785, claimed=None, tolerance=0.1)
    assert not lone.accepted and lone.offence == "worse_state"
    assert judge_loss(3.322, own=2.785, claimed=2.0, tolerance=0.1).offence == "worse_state"  # ours is the bar
    assert judge_loss(2.9, own=2.8, claimed=2.0, tolerance=0.1).offence is None  # the swarm's claim blames no one
    assert median_claim([None]) is None


def corroborating_joiner(own: list[torch.Tensor], swarm: list[torch.Tensor], witnesses_holding: int,
                         losses: dict[str, float]) -> tuple[Joiner, Callable[[StateSnapshot], Verdict]]:
    """A DiLoCo Joiner whose three synced witnesses of round 7 hold `swarm` (`witnesses_holding` of them; the others
    our own state), and whose loss on our batches is losses["own"] for our parameters, losses["swarm"] for others."""
    params = [t.clone() for t in own]
    evaluate = lambda _batches: losses["own"] if torch.equal(params[0], own[0]) else losses["swarm"]  # noqa: E731
    config = SyncConfig(mode="diloco")
    peer = types.SimpleNamespace(config=types.SimpleNamespace(sync=config),
                                 state=types.SimpleNamespace(round=6, synced=False, joined_ever=True,
                                                             named_tensors=lambda: []),
                                 params=params, val_batches=[], routes=Routes("me"),
                                 reputation=types.SimpleNamespace(is_banned=nobody_banned),
                                 contributions=Contributions(),
                                 inner=types.SimpleNamespace(evaluate=evaluate),
                                 sync=types.SimpleNamespace(outer_state_problem=lambda _params, _tensors: None,
                                                            aligned_rounds=config.mode == "diloco"))
    joiner = Joiner(peer)  # type: ignore[arg-type]
    witnesses = [record(f"w{i}", 7) for i in range(3)]

    def ask(asked: list[PeerRecord], seed: int) -> list[Witnessed]:
        held = {f"w{i}" for i in range(witnesses_holding)}
        return [Witnessed(r.peer_id, True, sketch_of(swarm if r.peer_id in held else own, seed=seed)) for r in asked]

    joiner._ask = ask  # type: ignore[method-assign]
    choice = DonorChoice(7, [record("donor", 7), *witnesses], [], [record("donor", 7)])
    return joiner, lambda snapshot: joiner._corroborate(snapshot, record("donor", 7), choice, losses["own"])


def test_a_state_the_synced_peers_of_its_round_hold_is_the_swarms_even_when_our_lone_one_scores_better():
    """Early in a DiLoCo run the outer momentum overshoots: the swarm's state scored 4.48 on a peer's batches against
    3.98 for its own lone state (netns testnet, a member out of step at round 2). It refused the state and banned
    its three honest donors for wrong_state, then trained alone to the end. Held by the round's synced peers, the
    state is judged against a looser bar and a refusal is not blamed on the donor; a state only the donor holds
    faces the usual bar, and one far worse than ours is refused whoever holds it."""
    swarm = [THETA[0] + 0.01, THETA[1]]
    snapshot = StateSnapshot({"round": 7}, ("param:0", "param:1"), tuple(swarm))
    _, judge_swarm_state = corroborating_joiner(THETA, swarm, 3, {"own": 3.976, "swarm": 4.476})
    verdict = judge_swarm_state(snapshot)
    assert verdict.accepted and verdict.detail.startswith("confirmed by 3 peers of round 7"), verdict
    _, judge_donors_state = corroborating_joiner(THETA, swarm, 0, {"own": 3.976, "swarm": 4.476})
    verdict = judge_donors_state(snapshot)  # 3 of 3 witnesses far: refused on the sketches, and blamed
    assert not verdict.accepted and verdict.offence == "wrong_state" and "from 3 of 3 peers of round 7" in \
        verdict.detail
    _, judge_even_vote = corroborating_joiner(THETA, swarm, 1, {"own": 3.976, "swarm": 4.476})
    verdict = judge_even_vote(snapshot)  # 1 of 3 holds it (with the donor, 2 against 2): the usual bar
    assert not verdict.accepted and verdict.offence == "worse_state" and verdict.detail.endswith("(ours 3.976)")
    _, judge_poison = corroborating_joiner(THETA, swarm, 3, {"own": 3.976, "swarm": 12.3})
    verdict = judge_poison(snapshot)
    assert not verdict.accepted and verdict.offence is None


def test_a_state_only_its_donor_holds_but_as_good_as_ours_costs_over_half_a_ban():
    """An honest donor whose all-reduce split from its round's majority serves its state in good faith until its
    next round shows it out of step (CI: a NAT testnet peer refused such a state, 0.176 from 2 of 2 synced peers of
    its round, banned the donor for 60 s and ran its rounds without it). The state is refused all the same; it
    costs its donor a little over half a ban, so a donor that keeps serving one is banned at the second."""
    swarm = [THETA[0] + 0.01, THETA[1]]
    snapshot = StateSnapshot({"round": 7}, ("param:0", "param:1"), tuple(swarm))
    _, judge_donors_state = corroborating_joiner(THETA, swarm, 0, {"own": 3.976, "swarm": 3.95})
    verdict = judge_donors_state(snapshot)
    assert not verdict.accepted and verdict.offence == "unsynced_state", verdict
    assert "from 3 of 3 peers of round 7" in verdict.detail and "validation loss 3.950" in verdict.detail
    reputation = Reputation()
    assert not reputation.penalise("donor", verdict.offence, verdict.detail)
    assert reputation.penalise("donor", verdict.offence, verdict.detail)


@pytest.mark.parametrize("stall", ["trickles past the deadline", "goes silent for a chunk's deadline"])
def test_a_donor_too_slow_with_its_state_is_left_within_the_deadline_and_pays(monkeypatch, stall):
    """A donor that trickles its state just inside each chunk's deadline held a joiner's training for
    4 × sync.state_download_timeout_s and ranked first again at the next catch-up (it announces its own speed): the
    download has a deadline from the state's size and SLOWEST_LINK_BYTES_PER_S, and a donor that misses it (or stalls
    a chunk) is penalised like a stalled stream."""
    assert download_deadline_s(1_400_000, 60.0) == pytest.approx(60 + 1_400_000 / 65536)  # the tiny model's state
    assert download_deadline_s(10**10, 60.0) == 240.0

    async def slow_download(*_args: object, **_kwargs: object) -> None:
        if stall.startswith("goes silent"):
            raise WireTimeout("peer sent nothing for 0.2 s")
        await asyncio.sleep(30)

    monkeypatch.setattr("p2ptrain.joining.download_state", slow_download)
    loop, reputation = BackgroundLoop(name="p2ptrain-test-download"), Reputation()
    donor = record("QmaezLg9QXM5U9wez1eovYFDJxnrueeqTQhesffHWi4Jhe", 7)
    peer = types.SimpleNamespace(config=types.SimpleNamespace(sync=SyncConfig(state_download_timeout_s=0.2),
                                                              run=RunConfig()),
                                 p2p=None, loop=loop, reputation=reputation, routes=Routes("me"), fingerprint="f",
                                 state=types.SimpleNamespace(nbytes=lambda: 16 * 1024, layout=lambda: []),
                                 sync=types.SimpleNamespace(aligned_rounds=True))
    try:
        started = time.monotonic()
        assert Joiner(peer)._download(donor, DonorChoice(7, [], [], [])) is None  # type: ignore[arg-type]
        assert time.monotonic() - started < 2.0  # 0.2 s + 16 KiB at 64 KiB/s: 0.45 s
        assert reputation.offences() == {donor.peer_id: {"slow_send": 1}}
    finally:
        loop.stop()


def test_a_witness_that_garbles_or_stalls_its_sketch_pays_and_one_that_refuses_does_not(monkeypatch):
    """A joiner waited for every witness's sketch (sync.state_download_timeout_s, 60 s): one that never answered
    held every corroboration that long, unpunished. Now the others get LATE_WITNESS_FACTOR × the first answer's time
    (at least BRIEF_S); a garbled answer is an offence, a late one a timeout, a refusal (a rate limit, or
    we are banned there) none."""
    honest = Sketch(7, [0.0] * SKETCH_SIZE, 1.0)

    async def answer(_p2p: object, peer_id: object, *_args: object) -> Sketch:
        kind = str(peer_id)
        if kind.endswith("garbled"):
            raise MalformedSketch("peer sent a sketch with non-numbers or a negative norm")
        if kind.endswith("stalled"):
            await asyncio.sleep(60)  # past the request's deadline (state_download_timeout_s)
        if kind.endswith("refused"):
            raise WireError("peer refused a sketch: too many requests")
        return honest

    monkeypatch.setattr("p2ptrain.joining.request_sketch", answer)
    monkeypatch.setattr("p2ptrain.joining.PeerID.from_base58", lambda text: text)
    loop, reputation = BackgroundLoop(name="p2ptrain-test-witnesses"), Reputation()
    peer = types.SimpleNamespace(config=types.SimpleNamespace(sync=SyncConfig(), run=RunConfig()), p2p=None,
                                 loop=loop, reputation=reputation, routes=Routes("me"),
                                 sync=types.SimpleNamespace(aligned_rounds=True))
    try:
        witnesses = [record(f"w-{kind}", 7) for kind in ("honest", "garbled", "stalled", "refused")]
        started = time.monotonic()
        answers = Joiner(peer)._ask(witnesses, seed=1)  # type: ignore[arg-type]
        assert time.monotonic() - started < BRIEF_S + 2.0
    finally:
        loop.stop()
    assert [(a.peer_id, a.sketch) for a in answers] == [("w-honest", honest)]
    assert reputation.offences() == {"w-garbled": {"malformed": 1}, "w-stalled": {"timeout": 1}}


def test_witnesses_slower_than_the_first_are_waited_for_within_the_patience():
    async def answer(value: int, after_s: float) -> int:
        await asyncio.sleep(after_s)
        return value

    async def refuse() -> int:
        raise WireError("peer refused a sketch: busy")

    async def scenario(*requests: Awaitable[int]) -> list[object]:
        return await answers_with_patience(list(requests), timeout_s=60.0)

    started = time.monotonic()
    first, second, third = asyncio.run(scenario(answer(1, 0.1), answer(2, 1.5), answer(3, 10.0)))
    assert (first, second) == (1, 2) and isinstance(third, TimeoutError)  # 1.5 s is within max(2 s, 4 × 0.1 s)
    assert time.monotonic() - started < 4.0
    # a refusal comes at once: the clock starts with the first answer (a big model's sketch takes seconds)
    refused, slow, slower = asyncio.run(scenario(refuse(), answer(2, 1.0), answer(3, 3.5)))
    assert isinstance(refused, WireError) and (slow, slower) == (2, 3)
    nobody = asyncio.run(answers_with_patience([answer(1, 5.0)], timeout_s=0.2))
    assert isinstance(nobody[0], TimeoutError)


def test_a_state_refused_only_on_what_other_peers_claim_is_not_blamed_on_its_donor():
    """One liar announcing a loss of 0.01 must not get an honest donor banned in a small swarm."""
    verdict = judge_loss(2.7, own=5.27, claimed=median_claim([0.01]), tolerance=0.1)
    assert not verdict.accepted and verdict.offence is None


def test_a_candidate_is_evaluated_without_being_kept():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with parameters_set_to(params, [torch.ones(3)]):
        assert params[0].sum().item() == 3
    assert params[0].sum().item() == 0


# ---- snapshot metadata ----------------------------------------------------------------------------------------------
EXPECTED = SnapshotExpectation(run_id="run", fingerprint="fp", min_round=7, max_round=8)


@pytest.mark.parametrize("round_", ["x", "1", 1.5, 7.0, True, None, [7], -1, 10**30, LIAR_ROUND, 6, 9])
def test_snapshot_metadata_with_a_wrong_round_is_refused(round_):
    with pytest.raises(SnapshotRefused) as refused:
        check_snapshot_metadata({"round": round_, "run_id": "run", "fingerprint": "fp"}, EXPECTED)
    is_int = isinstance(round_, int) and not isinstance(round_, bool)
    assert refused.value.offence == (None if is_int else "malformed")


@pytest.mark.parametrize("metadata", [{"run_id": "other", "fingerprint": "fp"}, {"run_id": "run"},
                                      {"run_id": "run", "fingerprint": 5}, {"run_id": ["run"], "fingerprint": "fp"}])
def test_snapshot_metadata_of_another_run_or_model_is_refused(metadata):
    with pytest.raises(SnapshotRefused):
        check_snapshot_metadata(dict(metadata, round=7), EXPECTED)


def test_snapshot_metadata_of_the_expected_round_passes():
    for round_ in (7, 8):
        check_snapshot_metadata({"round": round_, "run_id": "run", "fingerprint": "fp"}, EXPECTED)
    snapshot = StateSnapshot.capture({"round": 7}, [("param:w", torch.ones(2)), ("sync:m", torch.ones(2))])
    # the parameters' sketch leaves the outer state out; the outer state is sketched apart, under the next seed
    assert snapshot.sketch(3) == Sketch(7, parameter_sketch([torch.ones(2)], 3), math.sqrt(2),
                                        parameter_sketch([torch.ones(2)], 4), math.sqrt(2))


@pytest.mark.parametrize("knob", [{"join_max_round_lead": -1}, {"join_loss_tolerance": -0.1},
                                  {"join_gossip_max_distance": 0.0}])
def test_join_knobs_are_validated(knob):
    with pytest.raises(ConfigError):
        SyncConfig(**knob)


# ---- the state server over real P2P ---------------------------------------------------------------------------------
async def start_pair() -> tuple[P2P, P2P]:
    options = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False)
    a = await P2P.create(**options)
    b = await P2P.create(initial_peers=await a.get_visible_maddrs(), **options)
    return a, b


def served(round_: object) -> StateSnapshot:
    torch.manual_seed(3)
    named = [("param:w", torch.randn(5, 4)), ("sync:m", torch.zeros(5, 4))]
    return StateSnapshot.capture({"round": round_, "run_id": "run", "fingerprint": "fp"}, named)


async def serve_and_fetch(snapshot: StateSnapshot, banned: bool, seed: int,
                          wanted: StateSnapshot | None = None) -> tuple[object, object]:
    """Serve `snapshot` from one peer (banning the other when `banned`); the other downloads it, expecting the
    layout of `wanted` (by default the snapshot's), and asks for its sketch under `seed`. Returns both results, or
    the exceptions they raised."""
    a, b = await start_pair()
    wanted = wanted or snapshot
    try:
        server = StateServer(lambda: snapshot, refuses=lambda peer, _ticket: banned and peer == b.peer_id.to_base58())
        await server.add_p2p_handlers(a, namespace="run")
        layout = [(n, tuple(t.shape), str(t.dtype)) for n, t in zip(wanted.names, wanted.tensors, strict=True)]
        results = []
        for call in (download_state(b, a.peer_id, "run", layout, 2**20, 5.0, EXPECTED),
                     request_sketch(b, a.peer_id, "run", seed, 5.0)):
            try:
                results.append(await call)
            except Exception as e:  # the outcome under test
                results.append(e)
        return results[0], results[1]
    finally:
        await a.shutdown()
        await b.shutdown()


@pytest.mark.network
def test_a_peer_downloads_a_snapshot_and_its_sketch_under_a_seed_of_its_choosing():
    snapshot = served(7)
    downloaded, answer = asyncio.run(asyncio.wait_for(serve_and_fetch(snapshot, banned=False, seed=2**63 + 5), 60))
    assert isinstance(downloaded, StateSnapshot) and downloaded.round == 7
    assert all(torch.equal(x, y) for x, y in zip(downloaded.tensors, snapshot.tensors, strict=True))
    assert isinstance(answer, Sketch) and answer.round == 7
    assert answer == snapshot.sketch(2**63 + 5) == downloaded.sketch(2**63 + 5)


@pytest.mark.network
def test_a_download_cut_short_says_so_rather_than_blaming_the_layout():
    """The donor's stream ends early (it shut down mid-transfer): a WireError saying how far it got, not a state
    mismatch ("has 1 tensors, expected 2" read as a wrong model)."""
    whole = served(7)
    cut = StateSnapshot(whole.metadata, whole.names[:1], whole.tensors[:1])  # the layout promises 2, one comes
    downloaded, _ = asyncio.run(asyncio.wait_for(serve_and_fetch(cut, banned=False, seed=1, wanted=whole), 60))
    assert isinstance(downloaded, WireError) and "ended after 1 of 2 tensors" in str(downloaded), downloaded


@pytest.mark.network
def test_a_download_cut_inside_its_last_tensor_says_so_rather_than_blaming_the_donor_for_corrupt_data():
    """A donor cuts a download at its deadline (a reader too slow under load, a CI run): the stream ends inside the
    last tensor, whose parts combine to fewer bytes than its shape needs. That is a cut, not an undecodable tensor."""
    whole = served(7)
    short = whole.tensors[-1].flatten()[: whole.tensors[-1].numel() * 3 // 4].clone()
    cut = StateSnapshot(whole.metadata, whole.names, (*whole.tensors[:-1], short))
    downloaded, _ = asyncio.run(asyncio.wait_for(serve_and_fetch(cut, banned=False, seed=1, wanted=whole), 60))
    assert isinstance(downloaded, WireError) and "ended inside tensor 2 of 2: cut off" in str(downloaded), downloaded


@pytest.mark.network
def test_metadata_with_round_x_is_refused_in_the_download_before_anything_is_applied():
    downloaded, _ = asyncio.run(asyncio.wait_for(serve_and_fetch(served("x"), banned=False, seed=1), 60))
    assert isinstance(downloaded, SnapshotRefused) and downloaded.offence == "malformed"


@pytest.mark.network
def test_a_banned_peer_gets_neither_the_state_nor_a_sketch():
    downloaded, answer = asyncio.run(asyncio.wait_for(serve_and_fetch(served(7), banned=True, seed=1), 60))
    assert isinstance(downloaded, SnapshotRefused) and "not served here" in str(downloaded), downloaded
    assert downloaded.offence is None  # a refusal says why; it is no offence of the donor's
    assert isinstance(answer, WireError) and "refused" in str(answer)


@pytest.mark.network
def test_sketch_requests_beyond_the_rate_are_refused_and_a_flood_gets_its_sender_banned():
    async def scenario() -> tuple[list[object], bool, list[object]]:
        a, b = await start_pair()
        try:
            reputation = Reputation()
            server = StateServer(lambda: served(7), reputation.refuses, reputation.penalise)
            await server.add_p2p_handlers(a, namespace="run")
            answers = []
            for wave in range(2 * SKETCH_BURST // SKETCHES_QUEUED):  # as many at once as may wait (see below)
                answers += await asyncio.gather(*(request_sketch(b, a.peer_id, "run", wave * 10 + i, 5.0)
                                                  for i in range(SKETCHES_QUEUED)), return_exceptions=True)
            banned = reputation.is_banned(b.peer_id.to_base58())
            c = await P2P.create(initial_peers=await a.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            try:  # another peer is served as usual
                others = [await request_sketch(c, a.peer_id, "run", 1, 5.0)]
            finally:
                await c.shutdown()
            return answers, banned, others
        finally:
            await a.shutdown()
            await b.shutdown()

    answers, banned, others = asyncio.run(asyncio.wait_for(scenario(), 60))
    served_count = sum(isinstance(x, Sketch) for x in answers)
    refused = [x for x in answers if not isinstance(x, Sketch)]
    # a burst the size of a few joins is served (one more token may come back while the requests arrive)
    assert SKETCH_BURST <= served_count <= SKETCH_BURST + 2, answers
    assert all(isinstance(x, WireError) and "refused a sketch" in str(x) for x in refused)
    assert banned  # 6 or more refused requests: offences of weight 1, past the default ban score of 4
    assert isinstance(others[0], Sketch)


@pytest.mark.network
def test_a_donor_serves_few_snapshots_at_once_cuts_off_a_stalled_reader_and_rate_limits_each_peer():
    """Served without bound, concurrent downloads (from any number of identities) each held a copy of the whole
    state, and a reader that never read held its stream for good; then one identity held both slots of a donor for
    85 s at no cost. Now: DOWNLOADS_AT_ONCE at a time (a request beyond is refused, the joiner tries another donor),
    one per peer (a second at once is an offence), each cut off when its reader stops reading (an offence), and each
    peer at most DOWNLOAD_BURST in a burst (beyond: refused, an offence)."""
    big = StateSnapshot.capture({"round": 7, "run_id": "run", "fingerprint": "fp"},
                                [("param:w", torch.randn(1024, 1024)), ("sync:m", torch.zeros(1024, 1024))])
    layout = [(n, tuple(t.shape), str(t.dtype)) for n, t in zip(big.names, big.tensors, strict=True)]

    async def scenario() -> tuple[object, object, float, dict[str, dict[str, int]], int]:
        a, b = await start_pair()
        c, d = [await P2P.create(initial_peers=await a.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                 nat_port_map=False, auto_nat=False, use_relay=False) for _ in range(2)]
        reputation = Reputation()
        # downloads are capped at 4 × 2 s = 8 s here (download_deadline_s); at 0.5 s (2 s) the donor cut c's honest
        # 8 MiB download itself in a CI run, its reads slowed by the loaded machine
        server = StateServer(lambda: big, reputation.refuses, reputation.penalise, chunk_timeout_s=2.0)
        await server.add_p2p_handlers(a, namespace="run")
        try:
            assert DOWNLOADS_AT_ONCE == 2  # one stalled stream from each of b and d
            stalled = [await StateServer.get_stub(p2p, a.peer_id, namespace="run").rpc_download_state(
                averaging_pb2.DownloadData()) for p2p in (b, d)]
            for stream in stalled:
                await stream.__anext__()  # one message read, then nothing: the donor's writes back up
            second = await asyncio.gather(download_state(d, a.peer_id, "run", layout, 2**24, 5.0, EXPECTED),
                                          return_exceptions=True)  # d's second while its first is held: an offence
            busy = await asyncio.gather(download_state(c, a.peer_id, "run", layout, 2**24, 5.0, EXPECTED),
                                        return_exceptions=True)
            assert isinstance(second[0], SnapshotRefused) and "while its first is served" in str(second[0]), second
            started = time.monotonic()
            # each stalled stream is cut at its deadline: its next message at 64 KiB/s, at most 4 × 2 = 8 s
            downloaded = await download_state(c, a.peer_id, "run", layout, 2**24, 5.0, EXPECTED) \
                if await wait_until_async(lambda: not any(not t.done() for t in server._serving), 30) else None
            waited = time.monotonic() - started
            small = StateServer(lambda: served(7), reputation.refuses, reputation.penalise)
            await small.add_p2p_handlers(c, namespace="small")
            small_layout = [(n, tuple(t.shape), str(t.dtype)) for n, t in zip(served(7).names, served(7).tensors,
                                                                                 strict=True)]
            answers = []
            for _ in range(DOWNLOAD_BURST + 2):  # one after another: a token comes back every 2 s
                answers += await asyncio.gather(download_state(b, c.peer_id, "small", small_layout, 2**20, 5.0,
                                                               EXPECTED), return_exceptions=True)
            return busy[0], downloaded, waited, reputation.offences(), sum(isinstance(x, StateSnapshot)
                                                                           for x in answers), b.peer_id, d.peer_id
        finally:
            for p2p in (a, b, c, d):
                await p2p.shutdown()

    busy, downloaded, waited, offences, served_count, b_id, d_id = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert isinstance(busy, SnapshotRefused) and "busy" in str(busy), busy  # both slots taken: refused, saying so
    # the stalled streams were cut at their deadline (not held for good, as for 85 s before), then c got the state
    assert isinstance(downloaded, StateSnapshot) and downloaded.round == 7, (downloaded, waited)
    assert DOWNLOAD_BURST <= served_count <= DOWNLOAD_BURST + 1  # a token may come back meanwhile
    assert offences == {b_id.to_base58(): {"slow_send": 1, "too_many_requests": DOWNLOAD_BURST + 2 - served_count},
                        d_id.to_base58(): {"slow_send": 1, "too_many_opens": 1}}, offences


@pytest.mark.network
def test_a_donor_serves_one_state_download_at_a_time_to_each_host_and_charges_no_offence_for_it():
    """Two identities of one machine held both download slots of a donor before (one each). Now a host gets
    DOWNLOADS_PER_HOST at a time: its second identity is refused as busy (no offence: the peers of one home share
    their address), while a peer of another host takes the other slot. 127.0.0.2 and .3 are other hosts here."""
    big = StateSnapshot.capture({"round": 7, "run_id": "run", "fingerprint": "fp"},
                                [("param:w", torch.randn(1024, 1024))])
    layout = [(n, tuple(t.shape), str(t.dtype)) for n, t in zip(big.names, big.tensors, strict=True)]

    async def scenario() -> tuple[object, object, object, dict[str, dict[str, int]]]:
        options = dict(nat_port_map=False, auto_nat=False, use_relay=False)
        a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], **options)
        one_host = [await P2P.create(initial_peers=await a.get_visible_maddrs(),
                                     host_maddrs=["/ip4/127.0.0.2/tcp/0"], **options) for _ in range(2)]
        other_host = await P2P.create(initial_peers=await a.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.3/tcp/0"],
                                      **options)
        reputation = Reputation()
        server = StateServer(lambda: big, reputation.refuses, reputation.penalise, chunk_timeout_s=2.0,
                             host_of=RemoteHosts(a).host_of)
        await server.add_p2p_handlers(a, namespace="run")
        try:
            assert DOWNLOADS_PER_HOST == 1 < DOWNLOADS_AT_ONCE
            stalled = await StateServer.get_stub(one_host[0], a.peer_id, namespace="run").rpc_download_state(
                averaging_pb2.DownloadData())
            await stalled.__anext__()  # one message read, then nothing: its slot stays held until its deadline
            refused, other = await asyncio.gather(
                download_state(one_host[1], a.peer_id, "run", layout, 2**24, 5.0, EXPECTED),
                download_state(other_host, a.peer_id, "run", layout, 2**24, 5.0, EXPECTED), return_exceptions=True)
            # once the stalled stream is cut (at its deadline), the host's second identity is served
            later = await download_state(one_host[1], a.peer_id, "run", layout, 2**24, 5.0, EXPECTED) \
                if await wait_until_async(lambda: not any(not t.done() for t in server._serving), 30) else None
            return refused, other, later, reputation.offences()
        finally:
            for p2p in (*one_host, other_host, a):
                await p2p.shutdown()

    refused, other, later, offences = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert isinstance(refused, SnapshotRefused) and "state download to its host" in str(refused), refused
    assert refused.offence is None
    assert isinstance(other, StateSnapshot) and other.round == 7, other
    assert isinstance(later, StateSnapshot) and later.round == 7, later
    assert [counts for counts in offences.values()] == [{"slow_send": 1}], offences  # the stalled reader's alone


async def wait_until_async(condition: Callable[[], bool], timeout_s: float) -> bool:
    give_up_at = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > give_up_at:
            return False
        await asyncio.sleep(0.05)
    return True


@pytest.mark.network
def test_sketch_requests_beyond_those_that_may_wait_are_refused_as_busy_at_no_cost(monkeypatch):
    """Sketches are computed one at a time: a flood from many identities, each within its rate, made an honest
    joiner's request wait behind it, late enough to count as a stalled witness. Beyond SKETCHES_QUEUED waiting,
    a request is refused as busy (a refusal costs the witness nothing at the joiner, and the asker nothing here)."""
    slow, sketch = served(7), StateSnapshot.sketch
    monkeypatch.setattr(StateSnapshot, "sketch", lambda self, seed: (time.sleep(0.5), sketch(self, seed))[1])

    async def scenario() -> tuple[list[object], dict[str, dict[str, int]]]:
        a, b = await start_pair()
        try:
            reputation = Reputation()
            server = StateServer(lambda: slow, reputation.refuses, reputation.penalise)
            await server.add_p2p_handlers(a, namespace="run")
            answers = await asyncio.gather(*(request_sketch(b, a.peer_id, "run", seed, 10.0)
                                             for seed in range(SKETCHES_QUEUED + 2)), return_exceptions=True)
            return answers, reputation.offences()
        finally:
            await a.shutdown()
            await b.shutdown()

    answers, offences = asyncio.run(asyncio.wait_for(scenario(), 60))
    busy = [x for x in answers if not isinstance(x, Sketch)]
    assert len(busy) == 2 and all("busy" in str(x) for x in busy), answers
    assert offences == {}


# ---- real peers on loopback with a liar ---------------------------------------------------------------------------
class Liar:
    """A real peer of the run (its own DHT node, signed record and state server) that trains nothing: it announces
    the round `lie` picks from the honest rounds it sees, serves −5·θ_0 as that round's state, announces a
    validation loss of 50 (to drag the swarm's median up) and a terabit link (to be the first donor among peers of
    its round), and answers sketch requests honestly for its lie. It refuses gossip offers: answering them, it
    replayed θ_0 to GASLoC partners (the replay class, tests/test_robust_gossip.py), and a CI run saw an honest
    peer's loss rise past θ_0's for one round, which is not what these tests are about."""

    def __init__(self, config: PeerConfig, initial_peers: list[str], lie: Callable[[list[int]], int]):
        self.peer = TrainingPeer(config, initial_peers)
        mixer = getattr(self.peer.sync, "mixer", None)  # GASLoC's parameter gossip; DiLoCo's all-reduce needs none
        if mixer is not None:
            mixer.driver.open = lambda _header: Refusal.NO_VALUE
        self.lie = lie
        self.poison = [(name, -5 * tensor) for name, tensor in self.peer.state.named_tensors()]
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Liar:
        self.thread.start()
        return self

    def _run(self) -> None:
        served = None
        while not self.stop_event.wait(0.3):
            round_ = self.lie([r.round for r in self.peer.swarm().others if r.phase != "joining"])
            if round_ != served:
                self.peer._snapshot = StateSnapshot.capture(
                    dict(round=round_, fingerprint=self.peer.fingerprint, run_id=self.peer.config.run.run_id),
                    self.poison)
                served = round_
            self.peer.announcer.update(publish=True, round=round_, phase="inner", inner_step=0, round_eta=0.0,
                                       val_loss=50.0, bandwidth_bps=1e12)  # the fastest link: tried first

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=30)
        self.peer.shutdown()


def far_ahead(_rounds: list[int]) -> int:
    return LIAR_ROUND


def ahead_within_the_lead(rounds: list[int]) -> int:
    """Two rounds ahead of the most advanced honest peer it sees: inside the lead, so a donor to every honest peer
    (which must then refuse its state); one round would not do: honest DiLoCo peers move to the next round
    together and would find it at their own round, never ahead."""
    return max(rounds, default=0) + 2


def relative_distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True))) / math.sqrt(
        sum(float(y.pow(2).sum()) for y in b))


def run_with_liar(config: PeerConfig, lie: Callable[[list[int]], int], rounds_before_joiner: int = 4):
    """Two honest peers and a liar; once the honest peers have done `rounds_before_joiner` rounds, a fresh peer
    joins for one round. Returns (honest peers' metrics, the joiner's first round, honest params of that round
    (None if no honest peer finished it), the liar's peer id, the peers' banned lists)."""
    a = start_peer(config)
    b = start_peer(config, a.maddrs)
    liar = Liar(config, a.maddrs, lie).start()
    threads = [PeerThread(a), PeerThread(b)]
    metrics: list[list[RoundMetrics]] = [[], []]
    for peer, log in zip((a, b), metrics, strict=True):
        peer.round_callbacks.append(lambda _peer, m, log=log: log.append(m))
    joiner = None
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.wait_for_round(rounds_before_joiner, timeout_s=180)
        joiner = start_peer(replace_section(config, "run", rounds=1), a.maddrs)
        # these tests are about a joiner that sees the liar; one DHT read can miss records (then it would join an
        # honest peer without ever trying the liar): wait until the joiner's view holds it
        new = joiner
        wait_until(lambda: liar.peer.peer_id in {r.peer_id for r in new.watcher.records(current=True)},
                   timeout_s=30, what="the joiner to see the liar's record")
        (first,) = PeerThread(joiner).start().join(timeout_s=120)
        try:
            threads[0].wait_for_round(first.round, timeout_s=60)
            honest_params = threads[0].params_after_round[first.round]
        except AssertionError:
            honest_params = None
        joiner_params = [p.detach().clone() for p in joiner.params]
        banned = [sorted(p.reputation.banned()) for p in (a, b, joiner)]
    finally:
        stop_and_shut_down(threads, [joiner])
        liar_id = liar.peer.peer_id
        liar.close()
    return metrics, first, joiner_params, honest_params, liar_id, banned


def assert_honest_training(metrics: list[list[RoundMetrics]]) -> None:
    print("honest rounds and validation losses:", [[(m.round, round(m.val_loss, 3)) for m in log] for log in metrics])
    for log in metrics:
        assert log and all(m.round < 100 for m in log), [m.round for m in log]
        losses = [m.val_loss for m in log]
        assert max(losses) < THETA_0_LOSS and losses[-1] < min(losses[0], HONEST_LOSS), losses


# validation losses of the tiny model: θ_0 5.27, −5·θ_0 12.3; honest peers below 4 after a few rounds
THETA_0_LOSS, HONEST_LOSS = 5.27, 4.0


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_diloco_peers_ignore_a_far_ahead_liar_and_a_late_joiner_takes_the_honest_state():
    config = tiny_config(f"liar-far-{uuid.uuid4().hex[:6]}", run={"rounds": 0})
    metrics, first, joiner_params, honest_params, liar_id, _ = run_with_liar(config, far_ahead)
    assert_honest_training(metrics)
    assert first.joined and first.round < 100 and first.val_loss < HONEST_LOSS
    if honest_params is not None:
        assert relative_distance(joiner_params, honest_params) < 0.5  # the poison is 6 away


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_diloco_peers_refuse_and_ban_a_liar_ahead_within_the_lead():
    config = tiny_config(f"liar-near-{uuid.uuid4().hex[:6]}", run={"rounds": 0})
    metrics, first, joiner_params, honest_params, liar_id, banned = run_with_liar(config, ahead_within_the_lead)
    assert_honest_training(metrics)
    assert all(liar_id in peers for peers in banned), banned  # both honest peers and the joiner
    assert not any(peer in peers for peers in banned for peer in (m[0].peer_id for m in metrics)), banned
    assert first.joined and first.val_loss < HONEST_LOSS
    if honest_params is not None:
        assert relative_distance(joiner_params, honest_params) < 0.5


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_gasloc_joiner_refuses_a_liars_state_and_takes_an_honest_one():
    # GASLoC rounds of the tiny model take a fraction of the liar's refresh of what it sees: two rounds ahead of what
    # it saw last would often be behind the honest peers by the time the joiner looks; a lead of 6 keeps it ahead
    config = tiny_config(f"liar-gasloc-{uuid.uuid4().hex[:6]}", run={"rounds": 0},
                         sync={"mode": "gasloc", "join_max_round_lead": 6})
    metrics, first, joiner_params, honest_params, liar_id, banned = run_with_liar(
        config, lambda rounds: max(rounds, default=0) + 5)
    assert_honest_training(metrics)
    # whether the joiner tries the liar first depends on which round the liar's snapshot and record show when the
    # joiner looks (GASLoC rounds are fast; seen in CI: it went to an honest donor at once), so what is asserted is
    # the outcome: an honest state taken (below), and no honest peer blamed for the liar
    assert not any(peer in peers for peers in banned for peer in (m[0].peer_id for m in metrics)), banned
    assert first.joined and first.val_loss < HONEST_LOSS
    if honest_params is not None:
        assert relative_distance(joiner_params, honest_params) < 0.5


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_gasloc_peer_resumed_from_an_old_checkpoint_joins_before_it_gossips(tmp_path):
    """A volunteer that comes back from a checkpoint many rounds old holds parameters its partners have long moved
    away from: gossiping them as they are got it hard-clipped (and would get it banned) by honest neighbours, and had
    it clip theirs. It takes a corroborated state of the swarm's instead, when its own is worse."""
    config = tiny_config(f"resume-gasloc-{uuid.uuid4().hex[:6]}", run={"rounds": 0}, sync={"mode": "gasloc"})
    a = start_peer(config)
    b = start_peer(config, a.maddrs)
    away = replace_section(config, "run", rounds=2, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    threads = [PeerThread(a), PeerThread(b)]
    resumed = None
    try:
        for thread in threads:
            thread.start()
        first = start_peer(away, a.maddrs)
        try:
            (_, left) = PeerThread(first).start().join(timeout_s=120)  # a checkpoint at the end of its 2 rounds
        finally:
            first.shutdown()  # gone from the swarm (its record expires) until it comes back
        threads[0].wait_for_round(left.round + 16, timeout_s=300)
        resumed = TrainingPeer(replace_section(away, "run", rounds=6), a.maddrs, resume=True)
        back = PeerThread(resumed).start().join(timeout_s=180)
        threads[0].wait_for_round(max(threads[0].params_after_round) + 1, timeout_s=60)  # exchanges with it ran
        offences = [p.reputation.offences() for p in (a, b, resumed)]
        resumed_id, banned = resumed.peer_id, [p.reputation.banned() for p in (a, b)]
    finally:
        stop_and_shut_down(threads, [resumed])
    print("resumed peer's rounds:", [(m.round, m.joined, round(m.val_loss, 3)) for m in back], "offences:", offences)
    for thread in threads:  # round, inner steps, seconds of the round and of its sync, failed exchanges
        print("honest peer", thread.peer.peer_id, [(m.round, m.inner_steps, round(m.round_s, 1),
                                                   round(m.comm_blocked_s, 1), m.failed_exchanges)
                                                  for m in thread.history])
    # Two honest GASLoC peers of the tiny model a few rounds apart under load hard-clip each other now and then (a
    # CI run: one clip each way, once in ~15 runs), so one clip either way is allowed; without the join its
    # partners clipped the resumed peer 1 + 1 and 3 + 1 times in two runs, and it clipped both of them.
    clipped_it = sum(found.get(resumed_id, {}).get("clipped", 0) for found in offences[:2])
    it_clipped = sum(found.get("clipped", 0) for found in offences[2].values())
    assert clipped_it <= 1 and it_clipped <= 1, offences
    # no honest peer banned: in CI one of the two stalled 5 s while the other trained 25 rounds alone, and they
    # banned each other for the hard clips of closing in again (maths/drift_excuse.py)
    assert banned == [{}, {}], banned
    assert back[0].joined and back[-1].val_loss < left.val_loss  # it took the swarm's state and trained on


def rounds_run_by(first_round: int, lost: set[int], rounds: int = 10) -> list[int]:
    """The rounds `TrainingPeer.run` runs with `run.rounds` set, starting at `first_round` (a joiner's donor's round),
    when each round in `lost` is waited out to join the next one."""
    ran: list[int] = []
    peer = types.SimpleNamespace(config=PeerConfig(run=RunConfig(rounds=rounds, progress=False)),
                                 state=types.SimpleNamespace(round=first_round, joined_ever=True),
                                 end_round=None, rounds_run=0, round_callbacks=[],
                                 stop_event=threading.Event(), node=types.SimpleNamespace(command=lambda _: None),
                                 _save_at_the_end=lambda _ended, _saved_round: None)

    def run_round(_bar: object) -> types.SimpleNamespace:
        while peer.state.round in lost:
            peer.state.round += 1
        TrainingPeer._count_from(peer, peer.state.round)  # type: ignore[arg-type]
        ran.append(peer.state.round)
        peer.state.round += 1
        return types.SimpleNamespace(round=ran[-1], val_loss=3.0, tokens_per_s=1.0, peers_averaged=3, joined=False,
                                     train_loss=3.0, round_s=1.0)

    peer.run_round = run_round
    TrainingPeer.run(peer)  # type: ignore[arg-type]
    return ran


def test_run_rounds_count_from_the_first_round_so_a_round_lost_to_a_catch_up_is_not_run_alone_at_the_end():
    """A DiLoCo member that waited out round 6 to join round 7 ran rounds up to 14 with rounds=14 and ran the
    last one alone, as the others had stopped: the swarm's final states differed (netns testnet, partition
    scenario: 0.17 apart)."""
    assert rounds_run_by(0, lost=set()) == list(range(10))
    assert rounds_run_by(0, lost={6}) == [0, 1, 2, 3, 4, 5, 7, 8, 9]  # it stops with the others, after round 9
    assert rounds_run_by(20, lost=set()) == list(range(20, 30))  # a joiner (or a resumed peer) runs its 10 rounds


@pytest.mark.parametrize(("mode", "expected"), [("gasloc", 14), ("factored", 7), ("diloco", 7)])
def test_a_gasloc_peer_that_takes_a_slower_peers_state_keeps_its_own_round_count(mode, expected):
    """GASLoC rounds count a peer's own outer steps (a slow link's peer counts fewer): a peer resumed at round 14
    that took the state of a slower peer at round 7 went on from 7 (seen in the docker swarm). DiLoCo's all-reduce
    and Factored's same-round Mix1 take the donor's round."""
    applied: list[list[torch.Tensor]] = []
    sync = types.SimpleNamespace(load_state_tensors_=applied.append,
                                 rounds_count_own_steps=mode == "gasloc")
    state = PeerState(["p"], types.SimpleNamespace(set_params_=applied.append), sync, round_=14)  # type: ignore[arg-type]
    snapshot = StateSnapshot({"round": 7}, ("p", "m"), (torch.ones(3), torch.full((3,), 2.0)))
    state.adopt_(snapshot)
    assert state.round == expected
    assert [t.tolist() for group in applied for t in group] == [[1.0] * 3, [2.0] * 3]


def test_a_slow_download_reads_the_swarm_again_before_the_next_donor(monkeypatch):
    """A download over a slow link outlasts rounds: after a try older than SETUP_FLOOR_S, the next donor and
    the rounds its snapshot may be of come from a fresh read of the swarm, not from the list read before the first
    try (whose donors have moved on); a donor tried once is not tried again."""
    joiner, peer, _tries = gossip_joiner_refusing(refusals=10_000)
    clock = [100.0]
    monkeypatch.setattr("p2ptrain.joining.time.monotonic", lambda: clock[0])
    reads: list[int] = []
    peer.swarm = lambda: reads.append(1) or SwarmView("me", [record("a", 34), record("b", 35), record("c", 33)])
    asked: list[tuple[str, int]] = []

    def download(donor: PeerRecord, choice: DonorChoice) -> object:
        asked.append((donor.peer_id, donor.round))
        clock[0] += SETUP_FLOOR_S + 1  # the download took longer than a donor list stays fresh
        return object()

    joiner._download = download  # type: ignore[method-assign]
    joiner.catch_up_(SwarmView("me", [record("a", 30), record("b", 31)]))
    assert asked[0] == ("b", 31)  # the most advanced first
    assert asked[1:] == [("a", 34), ("c", 33)]  # read again: a's new round, and c, which had joined meanwhile
    assert len(reads) == 3  # once after each try


SYBIL_ROUNDS = 8


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.alone  # the all-reduce's groups are decided by deadlines
def test_twenty_identities_announcing_a_stale_round_do_not_move_the_round_of_peers_that_trained_together():
    """Issue 31: 20 identities from one process announcing a stale round made it the quorum of every honest DiLoCo
    peer, which took the others for suspects and tried the identities' states every round. Here 3 honest peers
    train 8 rounds with 20 such identities live from round 1 on: they keep averaging all together, download no state,
    and end with one state. The same views, counted by identity, give the stale round (the rule this replaces)."""
    config = tiny_config(f"sybil-{uuid.uuid4().hex[:6]}", run={"rounds": SYBIL_ROUNDS, "min_peers": 3})
    first = start_peer(config)
    peers = [first] + [start_peer(config, first.maddrs) for _ in range(2)]
    threads = [PeerThread(p) for p in peers]
    sybil_dht = start_dht(config.network, first.maddrs)
    sybils = None
    views = []
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.wait_for_round(0, timeout_s=120)
        sybils = SybilRecords(sybil_dht, config.run.run_id, 20, 0, first.fingerprint, config.network.record_ttl_s,
                              config.network.heartbeat_s).start()
        threads[0].wait_for_round(3, timeout_s=120)
        views = [p.swarm() for p in peers]  # what each honest peer reads, the identities included
        histories = [thread.join(timeout_s=300) for thread in threads]
    finally:
        if sybils is not None:
            sybils.stop()
        for peer in peers:
            peer.shutdown()
        sybil_dht.shutdown()
    lead = config.sync.join_max_round_lead
    for peer, view in zip(peers, views, strict=True):
        assert sum(r.peer_id in sybils.peer_ids for r in view.others) == 20, "the identities were not read"
        blind_quorum = split_by_quorum(view.others, lead, nobody_banned)[0]
        quorum = split_by_quorum(view.others, lead, nobody_banned, peer.contributions.vouches_for)[0]
        assert blind_quorum == 0 and quorum >= 3, (blind_quorum, quorum)
    for history in histories:
        print(f"rounds {[m.round for m in history]}, group {[m.peers_averaged for m in history]}, "
              f"joined {[m.joined for m in history]}")
        assert [m.round for m in history] == list(range(SYBIL_ROUNDS)) and not any(m.joined for m in history)
        assert sum(m.peers_averaged == 3 for m in history) >= SYBIL_ROUNDS - 1  # a deadline may cost one round
    last = [t.params_after_round[SYBIL_ROUNDS - 1] for t in threads]
    assert all(relative_distance(p, last[0]) < 1e-5 for p in last[1:])


SILENT_DONORS, SILENT_ROUND = 4, 10_000


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
# its 4 s chunk deadlines and the 1 s read of the joiner's connections (a donor's host) are what load beside it
# breaks: in 2 of 6 CI runs it tried two silent identities, or none of its tries ended in a state (alone: 6 of 6)
@pytest.mark.alone
def test_a_joiner_tries_one_silent_donor_of_a_host_then_an_honest_one():
    """Issue 31: identities are free and addresses are not. 4 identities on one address (127.0.0.2) announce a round
    far ahead and a 1 Gbit/s link, which puts them first among a fresh joiner's donors (and, their round the quorum,
    lets the honest peers' snapshots be of any round up to it: tiny GASLoC rounds outrun the records), then take its
    download and send nothing. Tried one by one, each cost the joiner a chunk deadline before its first honest
    donor; once one failed, its host's others go after every other donor: one deadline, then the honest state."""
    config = tiny_config(f"silent-donors-{uuid.uuid4().hex[:6]}", run={"rounds": 0, "min_peers": 2},
                         sync={"mode": "gasloc", "state_download_timeout_s": 4.0})
    honest = [start_peer(config)]
    honest.append(start_peer(config, honest[0].maddrs))
    threads = [PeerThread(p).start() for p in honest]
    identities, joiner = None, None
    try:
        threads[0].wait_for_round(2, timeout_s=120)
        one_host = dataclasses.replace(config.network, host_maddrs=("/ip4/127.0.0.2/tcp/0",))
        identities = StallingIdentities(one_host, honest[0].maddrs, config.run.run_id, SILENT_DONORS,
                                        honest[0].fingerprint, config.network.record_ttl_s,
                                        config.network.heartbeat_s, kinds=(), claims={"bandwidth_bps": 1e9},
                                        round_=SILENT_ROUND, serves_state=True)
        wait_until(lambda: sum(r.peer_id in identities.peer_ids for r in honest[0].swarm().others) == SILENT_DONORS,
                   timeout_s=60, what="the identities' records")
        joiner = start_peer(replace_section(config, "run", rounds=2, min_peers=1), honest[0].maddrs)
        history = PeerThread(joiner).start().join(timeout_s=300)
    finally:
        stop_and_shut_down(threads, [joiner])
        if identities is not None:
            identities.stop()
    # an honest state: the identities serve none
    assert history[0].joined and history[0].round < SILENT_ROUND, history[0]
    tried = {p for p, offences in joiner.reputation.offences().items() if "slow_send" in offences}
    assert tried <= set(identities.peer_ids) and len(tried) == 1, tried


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("mode", ["gasloc", "diloco"])
def test_a_fresh_joiner_outvoted_by_identities_of_a_stale_round_takes_a_trained_state_from_ahead(mode):
    """Issue 31: a fresh joiner verified nobody's work, so 20 identities announcing round 0 are its quorum and the
    honest peers, rounds ahead, its suspects: it tried only the identities (no endpoint behind them) and trained
    alone until they left (DiLoCo: and, having verified nobody, stayed out of the honest peers' rounds). Now when
    no donor of its quorum gives a state it tries the peers ahead of it, takes a state whose loss shows training,
    and averages with the honest peers from then on."""
    config = tiny_config(f"stale-sybils-{uuid.uuid4().hex[:6]}", run={"rounds": 0, "min_peers": 2},
                         # a lead of 6: GASLoC rounds of the tiny model outrun the records (test_a_gasloc_joiner_...)
                         sync={"mode": mode, "join_max_round_lead": 6 if mode == "gasloc" else 2})
    lead = config.sync.join_max_round_lead
    honest = [start_peer(config)]
    honest.append(start_peer(config, honest[0].maddrs))
    threads = [PeerThread(p).start() for p in honest]

    def outvoted(view: SwarmView) -> bool:
        quorum, _, suspects = split_by_quorum(view.others, lead, nobody_banned)
        return quorum == 0 and {r.peer_id for r in suspects} >= {p.peer_id for p in honest}

    sybil_dht = start_dht(config.network, honest[0].maddrs)
    sybils, joiner = None, None
    try:
        threads[0].wait_for_round(4, timeout_s=120)
        sybils = SybilRecords(sybil_dht, config.run.run_id, 20, 0, honest[0].fingerprint,
                              config.network.record_ttl_s, config.network.heartbeat_s).start()
        wait_until(lambda: sum(r.peer_id in sybils.peer_ids for r in honest[0].swarm().others) == 20,
                   timeout_s=60, what="the identities' records")
        joiner = start_peer(replace_section(config, "run", rounds=5, min_peers=1), honest[0].maddrs)
        # the joiner's own read shows the premise before it starts: under load (CI runs) a read held fewer of the
        # identities' records, or missed an honest peer, and the premise, not the joiner, failed
        views = [joiner.swarm()]
        wait_until(lambda: outvoted(views[-1]) or bool(views.append(joiner.swarm())), timeout_s=60,
                   what="the joiner's read to show the identities' round and the honest peers ahead")
        view = views[-1]
        history = PeerThread(joiner).start().join(timeout_s=300)
    finally:
        stop_and_shut_down(threads, [joiner])
        if sybils is not None:
            sybils.stop()
        sybil_dht.shutdown()
    assert outvoted(view)  # as it was
    rows = [(m.round, m.peers_averaged, m.joined) for m in history]
    # its first round; in DiLoCo maybe its second: under load (a CI run) the first look ahead found no honest
    # peer it could join in time, and a DiLoCo peer that verified nobody looks ahead again each round
    first = next((i for i, m in enumerate(history) if m.joined), len(history))
    assert first <= (0 if mode == "gasloc" else 1), rows
    assert history[first].round > 4 and history[first].val_loss < HONEST_LOSS, rows
    # from then on it trains with the honest peers: each round averaged with them, or (DiLoCo, a round behind them
    # under load: a CI run's rows (16, 3, False), (17, 1, True), (19, 1, True)) took their state again; one round may
    # miss them, none trains on alone
    after = history[first + 1:]
    assert any(m.peers_averaged > 1 for m in after), rows
    assert sum(m.peers_averaged == 1 and not m.joined for m in after) <= 1, rows
