"""The peer records' directory splits as the swarm grows (net/record_shards.py): what a peer reads a heartbeat stays
flat in the swarm's size, every peer stays in someone's view, and a newcomer finds a swarm that split before it."""

from __future__ import annotations

import random
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from hivemind.utils.crypto import RSAPrivateKey
from swarm_utils import run_swarm, tiny_config

from benchmarks.discovery_scale import MemoryDHT, VirtualClock, one_key_rows, simulate, virtual_time
from p2ptrain.net.dht_keys import KEY_BEAM, MAX_SHARD_LEVEL, shard_index, shard_key
from p2ptrain.net.discovery import Announcer, PeerRecord
from p2ptrain.net.record_shards import ESTIMATES_KEPT, ESTIMATES_TO_MOVE, LINEAGE_EVERY, SHARD_TARGET, RecordShards


def test_shards_nest_from_level_to_level_and_spread_peers_evenly() -> None:
    peers = [f"peer-{i}" for i in range(4096)]
    for level in range(1, MAX_SHARD_LEVEL + 1):
        assert all(shard_index(p, level) % 2 ** (level - 1) == shard_index(p, level - 1) for p in peers[:200])
    counts = [0] * 16
    for peer in peers:
        counts[shard_index(peer, 4)] += 1
    assert min(counts) > 4096 / 16 * 0.75 and max(counts) < 4096 / 16 * 1.25
    assert shard_key("run", 0, 0) == "run_peers" and shard_key("run", 3, 5) == "run_peers.3.5"


def test_the_level_follows_the_latest_estimates_up_and_a_full_window_down_and_a_lineage_read_to_the_crowd() -> None:
    shards = RecordShards("run", "me", target=4, rng=random.Random(0))
    assert shards.refresh_shards() == [(0, 0), (1, shard_index("me", 1))]  # level 0's random shard is its own
    for _ in range(ESTIMATES_TO_MOVE - 1):
        shards.observe_({(0, 0): 40})
    assert shards.level == 0  # one read does not move it
    shards.observe_({(0, 0): 40})
    assert shards.level == 4  # 41 peers with us: 2.6 a shard at level 4, at most the target
    assert shards.publish_shard() == (4, shard_index("me", 4))
    assert sorted(shards.every_shard()) == [(level, i) for level in (3, 4, 5) for i in range(2**level)]
    refresh = shards.refresh_shards()
    assert refresh[:3] == [(3, shard_index("me", 3)), (4, shard_index("me", 4)), (5, shard_index("me", 5))]
    assert all(level == 4 for level, _ in refresh[3:])
    shards.observe_({(4, 0): 3, (4, 1): 2, (5, 0): 0, (3, 0): 0})  # 41 peers at level 4, none elsewhere
    assert shards.level == 4
    for _ in range(ESTIMATES_TO_MOVE):
        shards.observe_({(4, 0): 2, (4, 1): 3, (8, 0): 1}, lineage=True)  # a straggler at 8: 1 peer, not 256
    assert shards.level == 4
    shards = RecordShards("run", "me", target=4)
    for _ in range(ESTIMATES_KEPT - 1):
        shards.observe_({(0, 0): 40})
    assert shards.level == 4
    for _ in range(ESTIMATES_KEPT):
        shards.observe_({(4, 0): 0, (4, 1): 0, (3, 0): 0})  # us alone
    assert shards.level == 3  # down one level, after a full window of low estimates
    # a lineage read: 12 others at level 0 where we are, 5 in our shard of level 2 (20 peers): most are at level 2
    shards = RecordShards("run", "me", target=4)
    shards.observe_({(0, 0): 12, (1, 0): 0, (2, 1): 5, (3, 1): 0}, lineage=True)
    assert shards.level == 2
    shards.observe_({(0, 0): 12, (2, 1): 1}, lineage=True)  # just moved: level 0 still holds our fresh records
    assert shards.level == 2
    for _ in range(LINEAGE_EVERY):
        shards.observe_({(2, 1): 4, (2, 3): 5, (0, 0): 8}, lineage=True)  # 18 here against 8 at level 0: stay
    assert shards.level == 2
    shards.observe_({(0, 0): 12, (2, 1): 1}, lineage=True)  # settled: 12 at level 0 against 4 here
    assert shards.level == 0
    with pytest.raises(ValueError, match="target"):
        RecordShards("run", "me", target=0)


@pytest.mark.slow
@pytest.mark.background  # CPU work, nothing timed (tests/README.md)
def test_a_peer_reads_about_as_many_records_at_four_times_the_swarm_and_every_peer_is_in_a_view() -> None:
    """The simulation of benchmarks/discovery_scale.py: real watchers on an in-memory DHT, the default target."""
    small, large = (simulate(peers, heartbeats=22, warmup=14, joiners=2) for peers in (32, 128))
    assert one_key_rows(128) == 4 * one_key_rows(32) == 128  # one key: every record, every read
    assert large["records_per_read_median"] <= 1.5 * small["records_per_read_median"]
    # our shard and one at random, of at most twice the target each
    assert large["records_per_read_max"] <= 3 * 2 * SHARD_TARGET
    for row in (small, large):
        assert row["peers_in_no_view"] == 0 and row["view_min"] > 0  # each can be drawn as a gossip partner
        assert row["current_read_peers"] == row["peers"]  # an all-reduce's read lists the whole swarm
        assert row["joiner_first_read_peers_min"] > 0  # a newcomer finds the split swarm on its first read
        # levels one apart still meet (each peer reads its shard at the levels next to its own)
        assert max(row["levels"] + row["joiner_levels"]) - min(row["levels"] + row["joiner_levels"]) <= 1
    assert max(small["levels"]) < min(large["levels"])
    # a background read takes one holder's copy, at random; a read for the latest records, every holder's
    every = simulate(32, heartbeats=22, warmup=14, joiners=2, one_holder=False)
    assert small["copies_read_total"] == small["records_read_total"]
    assert every["copies_read_total"] == KEY_BEAM * every["records_read_total"]
    for row in (small, large, every):  # each copy a read took, one of the key's holders served
        assert row["holder_records_served_total"] == pytest.approx(row["copies_read_total"] / (22 - 14))
    # the busiest holder serves a share of the readers: its load falls by about the number of holders
    assert small["holder_records_served_max"] < 0.5 * every["holder_records_served_max"]
    # a holder serves about the square of the target: at twice the default, a 32-peer swarm's busiest holder uploaded
    # more than a p10 home link (docs/design.md)
    double = simulate(32, target=2 * SHARD_TARGET, heartbeats=22, warmup=14, joiners=2)
    assert small["holder_records_served_max"] < 0.5 * double["holder_records_served_max"]


class StoringDHT:
    """What an announcer stores, by key; no DHT behind it."""

    def __init__(self) -> None:
        self.signing_key = RSAPrivateKey()
        self.stores: list[tuple[str, dict[str, Any]]] = []

    def add_validators(self, validators: list[object]) -> None:
        pass

    def store(self, key: str, subkey: bytes, value: dict[str, Any], expiration_time: float,
              return_future: bool, beam_size: int = 0) -> SimpleNamespace:
        assert beam_size == KEY_BEAM, "a store asks the key's nearest nodes, not hivemind's default 20"
        self.stores.append((key, value))
        return SimpleNamespace(result=lambda timeout: True)


def test_the_announcer_stores_in_its_level_s_shard_and_says_it_left_in_every_shard_that_holds_it() -> None:
    dht = StoringDHT()
    shards = RecordShards("run", "me", target=4)
    announcer = Announcer(dht, "run", PeerRecord(peer_id="me", round=1, inner_step=0, phase="inner", round_eta=0.0),
                          heartbeat_s=1.0, ttl_s=8.0, shards=shards)  # type: ignore[arg-type]
    assert announcer.publish()
    for _ in range(ESTIMATES_TO_MOVE):
        shards.observe_({(0, 0): 20})
    assert announcer.publish()
    moved = shard_key("run", shards.level, shard_index("me", shards.level))
    assert [key for key, _ in dht.stores] == ["run_peers", moved]
    announcer.leave()
    assert sorted((key, value["phase"]) for key, value in dht.stores[2:]) == sorted(
        [("run_peers", "left"), (moved, "left")])


def test_the_virtual_clock_drives_the_records_expiry_in_the_simulation() -> None:
    clock = VirtualClock()
    dht = MemoryDHT(clock)
    dht.store("k", "a", {}, clock.now + 8.0)
    with virtual_time(clock):
        assert dht.get("k", latest=True, return_future=True).result() is not None
        clock.now += 9.0
        assert dht.get("k", latest=True, return_future=True).result() is None


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_gossip_swarm_whose_records_split_into_shards_mixes_beyond_its_shards() -> None:
    """Two records a shard: 5 GASLoC peers publish in the 4 shards of level 2 (one or two a shard: a read of a shard
    is a sample this small), yet find partners beyond their own shard. (That an all-reduce's read covers every
    shard: tests/test_records.py, on real DHT nodes.)"""
    rounds, peers = 5, 5
    config = tiny_config(f"shards-{uuid.uuid4().hex[:6]}", run={"rounds": rounds}, sync={"mode": "gasloc"},
                         network={"records_per_shard": 2})
    threads, histories = run_swarm(config, peers=peers)
    stored = [thread.peer.announcer.stored_shards for thread in threads]
    assert all(max(level for level, _ in shards) >= 1 for shards in stored), stored  # the records did split
    levels = [thread.peer.watcher.shards.level for thread in threads]
    assert max(levels) - min(levels) <= 1, levels  # peers one level apart read each other's shards
    partners: set[frozenset[str]] = set()
    for history in histories:
        assert history[-1].train_loss < history[0].train_loss
        partners |= {frozenset((m.peer_id, p)) for m in history for p in m.partners}
    assert len(partners) >= peers  # more pairs than the shards could hold alone
