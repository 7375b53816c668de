"""Discovery at scale: what a peer reads of the run's records a heartbeat, one key against shards, 64 to 4,096 peers.

Each simulated peer runs the real `RecordShards` and `SwarmWatcher` (net/record_shards.py, net/discovery.py) over an
in-memory DHT on a virtual clock: every heartbeat it stores its record in its shard and its watcher makes one
background read (`refresh_shards`, and its lineage when it found nobody). After a warm-up, per peer and heartbeat:
the records and bytes its reads returned, the keys it read, the peers its view holds, and whether every peer is in
some other peer's view (a gossip partner can be drawn for it). The one-key column is one peer's read of the single
key with every record in it, as every read was before the shards (protocol 2). Bytes per record are those of a real
signed record (a typical one, every field set: value, RSA subkey and signature, `record_wire_bytes`). The DHT's own
routing is modelled by its cost only: a key's KEY_BEAM (5) nearest nodes are its holders; a read for the latest
records asks every holder, each answering with its whole copy, and a background read asks one holder at random
(net/holder_read.py). Per peer and heartbeat: what its reads download and what the busiest peer uploads as a
holder (each copy it served), with every background read from every holder, as before 2026-11-30, and from one.

    python benchmarks/discovery_scale.py [--peers 64,256,1024,4096] [--target 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
import heapq
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from p2ptrain.net import discovery
from p2ptrain.net.dht_keys import KEY_BEAM, shard_key
from p2ptrain.net.discovery import PeerRecord, SwarmWatcher
from p2ptrain.net.identity import peer_id_of_signer
from p2ptrain.net.record_shards import SHARD_TARGET, RecordShards

RUN = "scale"
HEARTBEAT_S, TTL_S = 1.0, 8.0  # network defaults (net/dht.py)


class VirtualClock:
    def __init__(self) -> None:
        self.now = 1e9

    def __call__(self) -> float:
        return self.now


class MemoryDHT:
    """A DHT that is one dictionary: key → subkey → (value, expiry), answered at once; counts what reads return,
    and the records each of `nodes` served as one of a key's KEY_BEAM nearest nodes (its holders)."""

    def __init__(self, clock: VirtualClock, nodes: list[str] | None = None, seed: int = 0):
        self.clock, self.rng = clock, random.Random(seed)
        self.keys: dict[str, dict[str, tuple[dict[str, Any], float]]] = {}
        self.gets = self.records_returned = self.copies_returned = 0
        self.node_ids = [(DHTID.generate(source=node), node) for node in nodes or []]
        self.holders: dict[str, list[str]] = {}
        self.served: collections.Counter[str] = collections.Counter()

    def holders_of(self, key: str) -> list[str]:
        if key not in self.holders:
            target = DHTID.generate(source=key)
            nearest = heapq.nsmallest(KEY_BEAM, self.node_ids, key=lambda node: node[0].xor_distance(target))
            self.holders[key] = [node for _, node in nearest]
        return self.holders[key]

    def store(self, key: str, subkey: str, value: dict[str, Any], expiration_time: float) -> None:
        self.keys.setdefault(key, {})[subkey] = (value, expiration_time)

    def get(self, key: str, latest: bool, return_future: bool, beam_size: int = 0) -> concurrent.futures.Future[object]:
        """A latest-value read: a copy from every holder."""
        return self._read(key, self.holders_of(key))

    def run_coroutine(self, coro: functools.partial[Any], return_future: bool) -> concurrent.futures.Future[object]:
        """A background read (net/holder_read.py's, the only coroutine the watcher runs): one holder's copy."""
        key = coro.keywords["key"]
        return self._read(key, [self.rng.choice(self.holders_of(key))] if self.node_ids else [])

    def _read(self, key: str, holders: list[str]) -> concurrent.futures.Future[object]:
        now = self.clock()
        entries = {s: SimpleNamespace(value=v, expiration_time=e) for s, (v, e) in self.keys.get(key, {}).items()
                   if e >= now}
        self.gets += 1
        self.records_returned += len(entries)
        self.copies_returned += len(entries) * max(1, len(holders))
        for holder in holders:
            self.served[holder] += len(entries)
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        future.set_result(SimpleNamespace(value=entries) if entries else None)
        return future


def record_wire_bytes() -> int:
    """A typical signed record's bytes: its value with every field set, its RSA subkey and the signature."""
    signer = RSASignatureValidator()
    peer_id = peer_id_of_signer(signer.local_public_key) or ""
    record = PeerRecord(peer_id=peer_id, round=1234, inner_step=17, phase="inner", round_eta=1e9, train_loss=3.2,
                        val_loss=3.3, tokens_per_s=12345.6, bandwidth_bps=2.2e7, fingerprint="a" * 64, updated=1e9,
                        bytes_sent=10**8, bytes_received=10**8, reach="direct", seen_as="203.0.113.7", protocol=3,
                        version="0.1.0", tokens=10**9, vouched={f"{i}" * 8: 10**6 for i in range(1, 9)})
    subkey = MSGPackSerializer.dumps(signer.local_public_key)
    signed = signer.sign_value(DHTRecord(b"k" * 20, subkey, MSGPackSerializer.dumps(record.dict()), 1e9))
    return len(subkey) + len(signed)


@contextmanager
def virtual_time(clock: VirtualClock) -> Iterator[None]:
    with mock.patch.object(discovery, "get_dht_time", clock):
        yield


class SimulatedPeer:
    def __init__(self, dht: MemoryDHT, peer_id: str, target: int, rng: random.Random):
        self.peer_id = peer_id
        self.shards = RecordShards(RUN, peer_id, target, rng)
        self.watcher = SwarmWatcher(dht, RUN, TTL_S, HEARTBEAT_S, shards=self.shards)  # type: ignore[arg-type]

    def publish(self, dht: MemoryDHT, now: float) -> None:
        record = PeerRecord(peer_id=self.peer_id, round=1, inner_step=0, phase="inner", round_eta=now, updated=now)
        dht.store(shard_key(RUN, *self.shards.publish_shard()), self.peer_id, record.dict(), now + TTL_S)

    def view(self) -> set[str]:
        return {r.peer_id for r in self.watcher.records()} - {self.peer_id}


def simulate(peers: int, target: int = SHARD_TARGET, heartbeats: int = 28, warmup: int = 16, joiners: int = 4,
             seed: int = 0, one_holder: bool = True) -> dict[str, Any]:
    """`peers` peers for `heartbeats` heartbeats (measured after `warmup`), then `joiners` fresh peers that join
    and are followed for two reads: per-peer figures, medians and worst cases. Background reads from one holder at
    random (the watcher's), or from every holder."""
    clock, rng = VirtualClock(), random.Random(seed)
    dht = MemoryDHT(clock, [f"peer-{i}" for i in range(peers)], seed)
    swarm = [SimulatedPeer(dht, f"peer-{i}", target, rng) for i in range(peers)]
    reads: list[int] = []
    copies: list[int] = []  # records a read downloaded, a copy from each holder it asked
    keys: list[int] = []
    cpu = time.process_time()
    with virtual_time(clock):
        for beat in range(heartbeats):
            clock.now += HEARTBEAT_S
            if beat == warmup:
                dht.served.clear()
            for peer in swarm:
                peer.publish(dht, clock.now)
            for peer in swarm:
                gets, returned, copies_before = dht.gets, dht.records_returned, dht.copies_returned
                peer.watcher.read_(peer.shards.refresh_shards(), one_holder=one_holder)
                if beat >= warmup:
                    reads.append(dht.records_returned - returned)
                    copies.append(dht.copies_returned - copies_before)
                    keys.append(dht.gets - gets)
        # records a heartbeat each peer served as a holder of the keys read, over the measured heartbeats
        served = sorted(dht.served[peer.peer_id] / (heartbeats - warmup) for peer in swarm)
        views = [peer.view() for peer in swarm]
        seen = set().union(*views)
        whole_view = len(swarm[0].watcher.records(current=True))
        newcomers = [SimulatedPeer(dht, f"joiner-{i}", target, rng) for i in range(joiners)]
        joined = []
        for newcomer in newcomers:
            newcomer.watcher.read_(newcomer.shards.refresh_shards(), one_holder=one_holder)
            first = len(newcomer.view())
            newcomer.watcher.read_(newcomer.shards.refresh_shards(), one_holder=one_holder)
            joined.append((first, newcomer.shards.level))
    levels = [peer.shards.level for peer in swarm]
    return {
        "one_holder": one_holder, "records_read_total": sum(reads), "copies_read_total": sum(copies),
        "copies_per_read_median": statistics.median(copies), "holder_records_served_total": sum(served),
        "holder_records_served_median": statistics.median(served), "holder_records_served_max": served[-1],
        "peers": peers, "target": target,
        "levels": sorted(set(levels)), "level_median": statistics.median(levels),
        "records_per_read_median": statistics.median(reads), "records_per_read_max": max(reads),
        "keys_per_read_median": statistics.median(keys), "keys_per_read_max": max(keys),
        "view_median": statistics.median(len(v) for v in views), "view_min": min(len(v) for v in views),
        "peers_in_no_view": peers - len(seen),
        "current_read_peers": whole_view,
        "joiner_first_read_peers_min": min(first for first, _ in joined) if joined else None,
        "joiner_levels": sorted({level for _, level in joined}),
        "simulation_cpu_s_per_peer_heartbeat": (time.process_time() - cpu) / (peers * heartbeats),
    }


def one_key_rows(peers: int) -> int:
    """Records a read of the single key returns with `peers` records in it (every read before the shards)."""
    clock = VirtualClock()
    dht = MemoryDHT(clock)
    for i in range(peers):
        dht.store(shard_key(RUN, 0, 0), f"peer-{i}", {}, clock.now + TTL_S)
    dht.get(shard_key(RUN, 0, 0), latest=True, return_future=True)
    return dht.records_returned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="64,256,1024,4096", help="swarm sizes, comma-separated")
    parser.add_argument("--target", type=int, default=SHARD_TARGET, help="records a shard is kept near")
    parser.add_argument("--heartbeats", type=int, default=28)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "discovery_scale.json")
    args = parser.parse_args(argv)
    record_bytes = record_wire_bytes()
    rows = []
    lines = [f"`python benchmarks/discovery_scale.py --peers {args.peers} --target {args.target} --heartbeats "
             f"{args.heartbeats}`: a signed record is {record_bytes} bytes; heartbeat {HEARTBEAT_S:g} s, TTL "
             f"{TTL_S:g} s; per peer and heartbeat, after {args.heartbeats // 2 + 2} heartbeats of warm-up", "",
             "| peers | levels | one key: records a read | shards: records a read (median, max) | kB a heartbeat "
             "(one key, shards) | kB downloaded: every holder, one holder | busiest holder's upload kB: every holder, "
             "one holder | keys read | view (median, min) | peers in no view | joiner's first read |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for peers in (int(p) for p in args.peers.split(",")):
        every, row = (simulate(peers, args.target, args.heartbeats, warmup=args.heartbeats // 2 + 2,
                               one_holder=one_holder) for one_holder in (False, True))
        row["one_key_records_per_read"] = one_key_rows(peers)
        row["record_bytes"] = record_bytes
        row["every_holder"] = {k: every[k] for k in ("copies_per_read_median", "holder_records_served_median",
                                                     "holder_records_served_max")}
        rows.append(row)
        kb = record_bytes / 1e3
        lines.append(f"| {peers} | {row['levels']} | {row['one_key_records_per_read']} | "
                     f"{row['records_per_read_median']:g}, {row['records_per_read_max']} | "
                     f"{row['one_key_records_per_read'] * kb:.0f}, {row['records_per_read_median'] * kb:.0f} | "
                     f"{every['copies_per_read_median'] * kb:.0f}, {row['copies_per_read_median'] * kb:.0f} | "
                     f"{every['holder_records_served_max'] * kb:,.0f}, {row['holder_records_served_max'] * kb:,.0f} | "
                     f"{row['keys_per_read_median']:g} | {row['view_median']:g}, {row['view_min']} | "
                     f"{row['peers_in_no_view']} | {row['joiner_first_read_peers_min']} peers |")
        print(lines[-1], flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"record_bytes": record_bytes, "rows": rows}, indent=1))
    args.json.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
