"""Peer records: parsed through the schema, malformed and stale ones dropped, the freshest kept per peer."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import random
import time
from types import SimpleNamespace

import pytest
from hivemind.utils import get_dht_time

from p2ptrain.join_rules import choose_donors
from p2ptrain.net import discovery
from p2ptrain.net.dht_keys import KEY_BEAM, MAX_SHARD_LEVEL, peers_key, shard_index, shard_key
from p2ptrain.net.discovery import (
    PROTOCOL_VERSION,
    PeerRecord,
    SwarmView,
    SwarmWatcher,
    fetch_peers,
    other_protocol_note,
    parse_records,
    present,
)
from p2ptrain.net.record_shards import LINEAGE_EVERY, RecordShards
from p2ptrain.peer import TrainingPeer
from p2ptrain.status import status_document
from p2ptrain.status_view import format_status_table

NOW = 1000.0


def entry(**fields: object) -> SimpleNamespace:
    record = dict(peer_id="12D3KooA", round=3, inner_step=2, phase="inner", round_eta=NOW + 5, updated=NOW - 1)
    record.update(fields)
    return SimpleNamespace(value=record)


def dht_result(*entries: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(value={f"subkey{i}".encode(): e for i, e in enumerate(entries)})


def test_malformed_and_stale_records_are_ignored_and_the_freshest_is_kept() -> None:
    raw = dht_result(
        entry(),
        entry(peer_id="12D3KooB", round="three"),  # wrong type
        entry(peer_id="12D3KooC", phase="hacking"),  # not a phase
        entry(peer_id="12D3KooD", round=-1),  # out of range
        SimpleNamespace(value=b"not a dict"),
        entry(peer_id="12D3KooE", updated=NOW - 60),  # stale: older than the TTL
        entry(peer_id="12D3KooA", round=4, updated=NOW - 0.5),  # a fresher record of A
    )
    records = parse_records(raw, ttl_s=8.0, now=NOW)
    assert [(r.peer_id, r.round) for r in records] == [("12D3KooA", 4)]
    assert parse_records(None, ttl_s=8.0, now=NOW) == []


def test_swarm_view_questions_and_the_status_table() -> None:
    records = [PeerRecord(peer_id=p, round=r, inner_step=0, phase=ph, round_eta=0.0, updated=NOW, train_loss=2.5)
               for p, r, ph in (("me", 3, "inner"), ("a", 3, "sync"), ("b", 4, "inner"), ("c", 9, "joining"))]
    view = SwarmView("me", records)
    assert [r.peer_id for r in view.others] == ["a", "b", "c"]
    assert [r.peer_id for r in view.at_round(3)] == ["a"]
    assert [r.peer_id for r in view.ahead_of(3)] == ["b"]  # a joining peer is not "ahead"
    table = format_status_table(status_document("run", False, records, NOW + 2))
    assert "4 live peer(s)" in table and "2.500" in table and "2.0s" in table
    reached = [records[0].copy(update=dict(reach="direct", relay=True)),
               records[1].copy(update=dict(reach="relay", relay_via="QmRelayAbcdef")),
               records[2].copy(update=dict(reach="outbound"))]
    lines = format_status_table(status_document("run", False, reached, NOW)).splitlines()
    assert "direct+relay" in lines[2] and "relay:Abcdef" in lines[3] and "outbound" in lines[4]
    assert " ? " in format_status_table(status_document("run", False, records[3:], NOW)).splitlines()[2]  # untested


def test_the_status_document_holds_every_field_but_the_ticket_and_round_trips_through_json() -> None:
    records = [PeerRecord(peer_id=p, round=3, inner_step=1, phase="inner", round_eta=0.0, updated=NOW - age,
                          val_loss=2.25, ticket="c2lnbmVk") for p, age in (("a", 1.5), ("b", 0.25))]
    document = json.loads(json.dumps(status_document("myrun", True, records, NOW)))
    assert (document["run_id"], document["signed"], document["live_peers"]) == ("myrun", True, 2)
    assert [(p["peer_id"], p["round"], p["val_loss"], p["seen_s"]) for p in document["peers"]] == [
        ("a", 3, 2.25, 1.5), ("b", 3, 2.25, 0.25)]
    assert all("ticket" not in p and {"phase", "reach", "banned", "tokens_per_s"} <= p.keys()
               for p in document["peers"])


def test_the_status_shows_each_peers_claimed_tokens_and_the_median_its_partners_verified() -> None:
    """A peer's vouches name partners by their ids' last 8 characters; a peer's own vouch for itself, and a vouch
    for nobody live, count for nothing; the lower median of the others' is shown."""
    ids = ["12D3KooWhonestAA", "12D3KooWhonestBB", "12D3KooWriderCCC", "12D3KooWxDDDDDDD"]
    vouched = [{"honestBB": 900, "riderCCC": 100, "honestAA": 5_000},  # A's vouch for itself is not counted
               {"honestAA": 1_000, "riderCCC": 100},
               {"honestAA": 1_000, "honestBB": 1_000},
               {"riderCCC": 10**12, "honestAA": 0, "goneEEEE": 7}]  # a liar of four
    records = [PeerRecord(peer_id=p, round=3, inner_step=0, phase="inner", round_eta=0.0, updated=NOW, tokens=t,
                          vouched=v) for p, t, v in zip(ids, (1_000, 1_000, 4_000, 0), vouched, strict=True)]
    document = status_document("run", False, records, NOW)
    assert [p["verified_tokens"] for p in document["peers"]] == [1_000, 900, 100, None]
    lines = format_status_table(document).splitlines()
    assert lines[0].split()[6:8] == ["tokens", "verified"]
    assert [line.split()[6:8] for line in lines[2:6]] == [["1k", "1k"], ["1k", "900"], ["4k", "100"], ["0", "-"]]
    big = format_status_table({"peers": [{"tokens": 12_345_678, "verified_tokens": 2.5e12}]}).splitlines()[2]
    assert "12.35M" in big and "2.5e+12" in big


class SilentDHT:
    """A DHT whose reads never come back (a reply lost inside hivemind's DHT process)."""

    def get(self, key: str, latest: bool, return_future: bool, beam_size: int = 0) -> concurrent.futures.Future[object]:
        assert return_future, "a blocking get would hang the training loop"
        return concurrent.futures.Future()


def test_a_dht_that_never_answers_yields_no_peers_instead_of_a_hang() -> None:
    started = time.monotonic()
    assert fetch_peers(SilentDHT(), "run", ttl_s=5.0, timeout_s=0.2) == []  # type: ignore[arg-type]
    assert time.monotonic() - started < 5


class ScriptedDHT:
    """A DHT whose reads of the run's peers key return these results in turn (the last one from then on); its
    shards are empty."""

    def __init__(self, *results: SimpleNamespace | None) -> None:
        self.results, self.reads = list(results), 0

    def get(self, key: str, latest: bool, return_future: bool, beam_size: int = 0) -> concurrent.futures.Future[object]:
        assert beam_size == KEY_BEAM, "a read asks the key's nearest nodes, not hivemind's default 20"
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        if key != peers_key("run"):
            future.set_result(None)
            return future
        future.set_result(self.results[min(self.reads, len(self.results) - 1)])
        self.reads += 1
        return future


def test_the_swarm_watcher_keeps_records_until_they_expire_not_until_a_read_misses_them() -> None:
    """A DHT read that reaches only some nodes (or none) must not make a peer believe itself alone."""
    now = get_dht_time()
    both = dht_result(entry(peer_id="A", updated=now), entry(peer_id="B", updated=now - 3.0))
    dht = ScriptedDHT(both, None, dht_result(entry(peer_id="A", round=4, updated=now + 0.1)))
    watcher = SwarmWatcher(dht, "run", ttl_s=5.0, refresh_s=0.5)  # type: ignore[arg-type]
    assert [r.peer_id for r in watcher.records()] == ["A", "B"]  # first call: waits for a read
    assert watcher.records() == watcher.records() and dht.reads == 1  # then answers from what it knows
    assert [r.peer_id for r in watcher.records(current=True)] == ["A", "B"]  # an empty read forgets nobody
    assert [(r.peer_id, r.round) for r in watcher.records(current=True)] == [("A", 4), ("B", 3)]  # fresher wins
    watcher.merge_([PeerRecord(peer_id="B", round=2, inner_step=0, phase="inner", round_eta=0.0,
                               updated=now - 4.0)])  # an older record of B does not replace the newer one
    assert [r.round for r in watcher.records()] == [4, 3]
    watcher.ttl_s = 2.0  # B's record (3 s old) has now expired
    assert [r.peer_id for r in watcher.records()] == ["A"]


def test_expired_records_stay_recently_seen_for_a_few_lifetimes_and_a_peer_that_left_never_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Gossip's fallback while no record stands (`TrainingPeer._context`): peers live within RECENT_LIFETIMES
    lifetimes, not those that said they left; older ones are forgotten, so the table stays the swarm's size."""
    now = get_dht_time()
    ours = {"protocol": PROTOCOL_VERSION}
    dht = ScriptedDHT(dht_result(entry(peer_id="A", updated=now - 1.0, **ours),
                                 entry(peer_id="B", updated=now - 4.0, **ours),
                                 entry(peer_id="C", updated=now - 1.0, phase="left", **ours)))
    watcher = SwarmWatcher(dht, "run", ttl_s=5.0, refresh_s=0.5)  # type: ignore[arg-type]
    assert [r.peer_id for r in watcher.records()] == ["A", "B"]
    monkeypatch.setattr(discovery, "get_dht_time", lambda: now + 12.0)  # no read since: A 13 s old, B 16 s
    assert watcher.records() == [] and discovery.RECENT_LIFETIMES * 5.0 == 15.0
    assert [r.peer_id for r in watcher.recently_seen()] == ["A"]  # B is beyond 3 lifetimes, C left
    watcher.merge_([])
    assert set(watcher._known) == {"A", "C"}  # B is forgotten; C's tombstone (it left) is kept, never drawn

    def context(needs_current_swarm: bool) -> list[str]:
        me = SimpleNamespace(sync=SimpleNamespace(needs_current_swarm=needs_current_swarm), watcher=watcher,
                             peer_id="me", fingerprint="",
                             step_time_s=math.nan, state=SimpleNamespace(round=3),
                             config=SimpleNamespace(sync=SimpleNamespace(overlap="none")), _inner_steps=lambda: 5)
        me._view_of = lambda records: TrainingPeer._view_of(me, records)  # type: ignore[arg-type]
        return TrainingPeer._context(me, SwarmView("me", []), 5).live_peers  # type: ignore[arg-type]

    assert context(needs_current_swarm=False) == ["A"]  # gossip draws from those seen lately
    assert context(needs_current_swarm=True) == []  # an all-reduce's members are those of the records that stand


class SlowDHT:
    """A DHT whose reads answer nothing, each key `delay_s` after it was asked on a clock of its own (the watcher's,
    patched in), and that counts the keys it was asked for."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.now, self.keys = delay_s, 0.0, []

    def monotonic(self) -> float:
        return self.now

    def get(self, key: str, latest: bool, return_future: bool, beam_size: int = 0) -> concurrent.futures.Future[object]:
        self.keys.append(key)
        self.now += self.delay_s
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        future.set_result(None)
        return future


def test_a_lineage_read_waits_for_a_read_with_time_left_instead_of_timing_out(monkeypatch, caplog) -> None:
    """A read whose first keys took most of its wait puts off its lineage keys to the next read; issued with what
    was left, they timed out and the read warned that the DHT did not answer, though it had."""
    dht = SlowDHT(delay_s=0.08)
    monkeypatch.setattr(discovery, "time", SimpleNamespace(monotonic=dht.monotonic))
    watcher = SwarmWatcher(dht, "run", ttl_s=5.0, refresh_s=0.5)  # type: ignore[arg-type]
    own = watcher.shards.refresh_shards()
    with caplog.at_level(logging.WARNING):
        watcher.read_(own, timeout_s=0.2)  # found nobody, so a lineage read is due; 0.04 s of 0.2 left: too little
        assert dht.keys == [shard_key("run", *shard) for shard in own] and watcher._lineage_due
        watcher.read_(own, timeout_s=1.0)  # 0.84 s left: the lineage keys come with it
    lineage = [shard_key("run", *shard) for shard in watcher.shards.lineage() if shard not in own]
    assert dht.keys[2 * len(own):2 * len(own) + len(lineage)] == lineage and not watcher._lineage_due
    drawn = dht.keys[2 * len(own) + len(lineage):]  # it found nobody: another shard of every level 1-8 as well
    assert len(drawn) == MAX_SHARD_LEVEL and not set(drawn) & set(dht.keys[:2 * len(own) + len(lineage)])
    assert "did not answer" not in caplog.text


class ShardedDHT:
    """A DHT holding fresh records of these peers, each in its shard of `level`."""

    def __init__(self, peer_ids: list[str], level: int) -> None:
        self.results: dict[str, list[SimpleNamespace]] = {}
        for peer_id in peer_ids:
            key = shard_key("run", level, shard_index(peer_id, level))
            self.results.setdefault(key, []).append(entry(peer_id=peer_id, updated=get_dht_time()))
        self.keys_read: list[str] = []

    def get(self, key: str, latest: bool, return_future: bool, beam_size: int = 0) -> concurrent.futures.Future[object]:
        self.keys_read.append(key)
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        future.set_result(dht_result(*self.results[key]) if key in self.results else None)
        return future


def test_a_newcomer_whose_own_shards_are_empty_finds_the_swarm_in_others_of_its_level() -> None:
    """24 peers at level 3 (3 a shard), none in the newcomer's shard of any level: reading only its own shards, it
    stayed alone (a CI run: 12 identities over the 4 shards of level 2, none in the reader's)."""
    newcomer = "newcomer"
    others = [f"peer{i}" for i in range(200) if shard_index(f"peer{i}", 3) != shard_index(newcomer, 3)][:24]
    watcher = SwarmWatcher(ShardedDHT(others, level=3), "run", ttl_s=5.0, refresh_s=0.5,  # type: ignore[arg-type]
                           shards=RecordShards("run", newcomer, target=3, rng=random.Random(0)))
    assert all(shard_key("run", *shard) not in watcher.dht.results for shard in watcher.shards.lineage())
    watcher.read_(watcher.shards.refresh_shards())
    assert watcher.records() and watcher.shards.level == 3  # another shard of level 3, drawn at random
    for _ in range(LINEAGE_EVERY):  # then it reads its own shard of level 3 and one drawn: it stays with them
        watcher.read_(watcher.shards.refresh_shards())
    assert watcher.shards.level == 3 and len(watcher.records()) > 3


def test_a_peer_that_left_is_gone_at_once_and_only_a_newer_record_brings_it_back() -> None:
    now = get_dht_time()
    dht = ScriptedDHT(dht_result(entry(peer_id="A", updated=now - 1), entry(peer_id="B", updated=now - 1)),
                      dht_result(entry(peer_id="A", phase="left", updated=now)),  # A shut down
                      dht_result(entry(peer_id="A", updated=now - 1)),  # a slower replica's older record of A
                      dht_result(entry(peer_id="A", round=0, updated=now + 0.1)))  # A restarted
    watcher = SwarmWatcher(dht, "run", ttl_s=5.0, refresh_s=0.5)  # type: ignore[arg-type]
    assert [r.peer_id for r in watcher.records()] == ["A", "B"]
    assert [r.peer_id for r in watcher.records(current=True)] == ["B"]  # not after its TTL: now
    assert [r.peer_id for r in watcher.records(current=True)] == ["B"]  # the older record does not revive it
    assert [(r.peer_id, r.round) for r in watcher.records(current=True)] == [("A", 0), ("B", 3)]
    assert "1 live peer(s)" in format_status_table(status_document("run", False, present(parse_records(
        dht_result(entry(peer_id="A", phase="left"), entry(peer_id="B")), ttl_s=5.0, now=NOW)), NOW))


def peer_at(round_: int, phase: str, eta: float) -> PeerRecord:
    return PeerRecord(peer_id=f"{phase}-{eta}", round=round_, inner_step=0, phase=phase, round_eta=eta, updated=NOW)


def test_a_late_diloco_peer_ends_its_inner_phase_to_join_a_group_of_its_round_already_syncing() -> None:
    """Else a group a matchmaking window behind averages alone, round after round (the swarm splits in two). A
    banned peer's record does not count (a CI run: two honest peers cut round 1 to one step at a banned member's
    ETA; the third, which had not seen it, ran all five and came too late)."""
    reputation = SimpleNamespace(is_banned=lambda peer: False)
    contributions = SimpleNamespace(vouches_for=lambda peer: False)
    me = SimpleNamespace(state=SimpleNamespace(round=7), sync=SimpleNamespace(aligned_rounds=True),
                         reputation=reputation, contributions=contributions)
    now_dht, now = get_dht_time(), time.monotonic()
    syncing = SwarmView("me", [peer_at(7, "sync", now_dht - 1.0)])
    assert TrainingPeer._inner_deadline(me, syncing) <= now + 0.1  # type: ignore[arg-type]  # at once (min steps)
    still_training = SwarmView("me", [peer_at(7, "inner", now_dht + 3.0), peer_at(7, "sync", now_dht - 1.0)])
    assert TrainingPeer._inner_deadline(me, still_training) == pytest.approx(now + 3.0, abs=0.5)
    other_round = SwarmView("me", [peer_at(6, "sync", now_dht - 1.0), peer_at(8, "inner", now_dht + 3.0)])
    assert TrainingPeer._inner_deadline(me, other_round) == math.inf
    gossip = SimpleNamespace(state=SimpleNamespace(round=7), sync=SimpleNamespace(aligned_rounds=False))
    assert TrainingPeer._inner_deadline(gossip, syncing) == math.inf  # type: ignore[arg-type]
    reputation.is_banned = lambda peer: peer == syncing.others[0].peer_id
    assert TrainingPeer._inner_deadline(me, syncing) == math.inf  # type: ignore[arg-type]
    assert TrainingPeer._inner_deadline(me, still_training) == pytest.approx(now + 3.0, abs=0.5)  # type: ignore


def test_once_a_diloco_peer_verified_partners_only_their_etas_end_its_inner_phase() -> None:
    """An ETA is a free claim: an identity alone in our round with one in the past would cut each honest peer's
    phase to the fewest steps, round after round, while the honest records still show the last round."""
    now_dht, now = get_dht_time(), time.monotonic()
    partner = PeerRecord(peer_id="partner", round=6, inner_step=0, phase="sync", round_eta=now_dht - 5.0, updated=NOW)
    stranger = peer_at(7, "sync", now_dht - 1.0)
    verified = {"partner"}
    me = SimpleNamespace(state=SimpleNamespace(round=7), sync=SimpleNamespace(aligned_rounds=True),
                         reputation=SimpleNamespace(is_banned=lambda peer: False),
                         contributions=SimpleNamespace(vouches_for=lambda peer: peer in verified))
    view = SwarmView("me", [partner, stranger])
    assert TrainingPeer._inner_deadline(me, view) == math.inf  # type: ignore[arg-type]  # all our steps
    partner_in_round = PeerRecord(peer_id="partner", round=7, inner_step=0, phase="inner", round_eta=now_dht + 3.0,
                                  updated=NOW)
    view = SwarmView("me", [partner_in_round, stranger])
    assert TrainingPeer._inner_deadline(me, view) == pytest.approx(now + 3.0, abs=0.5)  # type: ignore[arg-type]
    verified.clear()  # no verified partner yet (a fresh peer): every ETA counts, the stranger's too
    assert TrainingPeer._inner_deadline(me, SwarmView("me", [stranger])) <= now + 0.1  # type: ignore[arg-type]


def test_a_newcomer_downloads_state_from_the_most_advanced_peer_with_the_fastest_link() -> None:
    """State is the whole model and optimizer: among peers of the latest round, the fastest link serves it."""
    records = [PeerRecord(peer_id=name, round=round_, inner_step=0, phase="inner", round_eta=0.0, updated=NOW,
                          bandwidth_bps=bps) for name, round_, bps in
               (("a-slow", 5, 1e6), ("b-fast", 5, 50e6), ("c-behind", 4, 100e6), ("d-unknown", 5, 0.0))]
    choice = choose_donors(records, own_round=0, in_step=True, fresh=True, aligned=False, max_lead=2,
                           is_banned=lambda _peer: False)
    assert [r.peer_id for r in choice.donors] == ["b-fast", "a-slow", "d-unknown", "c-behind"]


def test_peers_of_another_protocol_are_left_out_and_told_apart_once_each(caplog: pytest.LogCaptureFixture) -> None:
    """A record without `protocol` is of a peer from before records carried it (0); a peer reads only peers of its
    own protocol into its view, and says once per peer, in one line, which release the other runs."""
    old = parse_records(dht_result(entry(peer_id="12D3KooOld")), ttl_s=8.0, now=NOW)[0]
    assert (old.protocol, old.version) == (0, "")
    same = old.copy(update=dict(peer_id="12D3KooSame", protocol=PROTOCOL_VERSION, version="0.1.0"))
    newer = old.copy(update=dict(peer_id="12D3KooNew", protocol=PROTOCOL_VERSION + 1, version="0.3.0"))
    records = [old, same, newer]
    me = SimpleNamespace(peer_id="12D3KooMe", fingerprint="", told_apart=set(), routes=SimpleNamespace(
        update_=lambda _records: None), config=SimpleNamespace(sync=SimpleNamespace(matchmaking_s=1.0)),
        sync=SimpleNamespace(needs_current_swarm=False),
        watcher=SimpleNamespace(records=lambda current, timeout_s: records))
    me._note_left_out = lambda rs: TrainingPeer._note_left_out(me, rs)  # type: ignore[arg-type]
    me._view_of = lambda rs: TrainingPeer._view_of(me, rs)  # type: ignore[arg-type]
    caplog.set_level("WARNING", logger="p2ptrain")
    for _ in range(3):
        view = TrainingPeer.swarm(me)  # type: ignore[arg-type]
        assert [r.peer_id for r in view.others] == ["12D3KooSame"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # once each, however often the swarm is read
    assert "12D3KooOld runs p2ptrain before 0.1.0 (protocol 0), older than ours" in lines[0]
    assert "12D3KooNew runs p2ptrain 0.3.0" in lines[1] and "pip install -U 'p2ptrain==0.3.0'" in lines[1]
    assert other_protocol_note(newer.copy(update=dict(version="")), "0.1.0").endswith(
        "pip install -U 'p2ptrain' to train with it")
    # a peer of our protocol that trains another model is left out too, and named once
    records.append(same.copy(update=dict(peer_id="12D3KooGpt", fingerprint="f" * 64)))
    for _ in range(2):
        assert [r.peer_id for r in TrainingPeer.swarm(me).others] == ["12D3KooSame"]  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "12D3KooGpt trains another model (fingerprint ffffffffffff, ours )" in lines[2]
    assert "same model settings" in lines[2]



def test_status_lists_a_level_whose_first_shard_is_empty() -> None:
    """`fetch_peers` read the first shard of each level only: 12 records over level 2's 4 shards left it empty one
    time in 30, and `status` listed nobody. Records in every shard of level 2 but the first, and in 3 of level 5's
    32 shards, one among the 4 probed: a level is read whole once a shard it probes holds a record."""
    ids = [f"12D3Koo{i}" for i in range(400)]
    level2 = [p for p in ids if shard_index(p, 2) != 0][:12]
    level5 = [p for p in ids if shard_index(p, 5) in (2, 9, 30)][:6]
    assert len(level2) == 12 and len(level5) == 6 and {shard_index(p, 5) for p in level5} & {2}
    dht = ShardedDHT(level2, 2)
    assert [r.peer_id for r in fetch_peers(dht, "run", ttl_s=5.0)] == sorted(level2)  # type: ignore[arg-type]
    dht = ShardedDHT(level5, 5)
    assert [r.peer_id for r in fetch_peers(dht, "run", ttl_s=5.0)] == sorted(level5)  # type: ignore[arg-type]
    assert len(dht.keys_read) == len(set(dht.keys_read)) == 1 + 2 + 4 * (MAX_SHARD_LEVEL - 1) + 32 - 4
