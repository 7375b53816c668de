"""Where the run's peer records live in the DHT, and which of them a peer reads: a directory that splits as the
swarm grows, so that what a peer reads a heartbeat stays flat in the swarm's size.

One key holding every record costs each read the whole swarm: n signed records of 1.3 kB, every heartbeat, at every
peer (n² across the swarm; at 1,000 peers a peer would read 1.3 MB a second). The records are spread instead over
the 2^L shard keys of a level L; a peer's shard is the low L bits of a hash of its id, so the shards of level L + 1
split those of L in two. Each peer estimates the swarm's size from the shards it reads and keeps its level where a
shard holds about `target` records: it moves up when a shard would hold over twice the target, to the level where
it holds at most the target, and down when one holds under a quarter (a swarm of up to 2 × `target` peers stays at
level 0, the single key every record was in before). It publishes at its level and, each refresh, reads its own
shard at its level and the two next to it (peers whose levels differ by one still meet there) and one shard of its
level drawn at random, keeping each record until its TTL: a view of its own shard and a sample of the rest, which
gossip needs (random partners, the quorum round's median). Every few reads, and when it finds nobody, a peer reads
its shard at every level as well (after finding nobody, another shard of every level drawn at random too: its own
may be empty) and moves to the level that holds most peers (a joiner of a swarm that has split, peers split over
levels that do not meet). An all-reduce (DiLoCo) reads every shard of its level and of the two next
to it: its exchange is O(n) anyway. docs/design.md ("Records at scale") gives the measured costs
(benchmarks/discovery_scale.py).
"""

from __future__ import annotations

import collections
import math
import random
import statistics
import threading

from p2ptrain.net.dht_keys import MAX_SHARD_LEVEL, shard_index

# records a shard is kept near: a shard of the level holds a quarter to twice this many. A key's holder serves
# about the square of it a heartbeat (each of ~2 × target readers takes ~2 × target records): at 16 the busiest
# holder of a 32-peer swarm uploaded 2.7 Mbit/s, more than a p10 home link has (docs/design.md)
SHARD_TARGET = 8
# the level follows the median of the latest estimates of the swarm's size, not one read's: up on the median of the
# latest ESTIMATES_TO_MOVE reads at a level (within the records' TTL: peers that see the first movers' records
# follow them), down on a whole window of ESTIMATES_KEPT
ESTIMATES_KEPT, ESTIMATES_TO_MOVE = 8, 3
# reads: every peer reads its lineage this often (and after any read that found nobody), and a lineage read does
# not move a peer in this many reads after a move
LINEAGE_EVERY = 8
# a record refreshed longer ago than this is of a peer that moved (or is slow): not where it is now
FRESH_HEARTBEATS = 3


Shard = tuple[int, int]  # (level, index)


class RecordShards:
    """A peer's place in the directory: the level it publishes at, and the shards each read covers.

    `observe_` takes how many records of others each shard read held, and moves the level as it says. Shared by
    the peer's announcer (which publishes at `level`) and its swarm watcher (which reads and observes)."""

    def __init__(self, run_id: str, peer_id: str, target: int = SHARD_TARGET, rng: random.Random | None = None):
        if target < 1:
            raise ValueError(f"a shard's target must be >= 1 record, got {target}")
        self.run_id, self.peer_id, self.target = run_id, peer_id, target
        self.rng = rng or random.Random()
        self._level = 0
        self._estimates: collections.deque[float] = collections.deque(maxlen=ESTIMATES_KEPT)
        self._reads_since_move = LINEAGE_EVERY + 1  # a newcomer may move at its first lineage read
        self._lock = threading.Lock()

    @property
    def level(self) -> int:
        with self._lock:
            return self._level

    def own(self, level: int) -> Shard:
        return level, shard_index(self.peer_id, level)

    def publish_shard(self) -> Shard:
        return self.own(self.level)

    def refresh_shards(self) -> list[Shard]:
        """What a background read covers: our shard at our level and the two next to it, and one shard of our level
        drawn at random."""
        level = self.level
        shards = [self.own(lvl) for lvl in range(max(0, level - 1), min(MAX_SHARD_LEVEL, level + 1) + 1)]
        roaming = (level, self.rng.randrange(2**level))
        return shards + ([roaming] if roaming not in shards else [])

    def every_shard(self) -> list[Shard]:
        """What a read of the whole swarm covers: every shard of our level and of the two next to it (peers whose
        estimate differs from ours by a level)."""
        level = self.level
        return [(lvl, index) for lvl in (level, level - 1, level + 1) if 0 <= lvl <= MAX_SHARD_LEVEL
                for index in range(2**lvl)]

    def lineage(self, roaming: bool = False) -> list[Shard]:
        """Our shard at every level: where a peer looks for a swarm that has split. With `roaming` (a read that
        found nobody), another shard of every level drawn at random as well: our own shard at the swarm's level
        can be empty (a shard holds a quarter to twice the target: at a quarter of 8, about one in 7 holds nobody),
        and a newcomer reading only its own stayed alone."""
        own = [self.own(level) for level in range(MAX_SHARD_LEVEL + 1)]
        if not roaming:
            return own
        return own + [(level, (index + self.rng.randrange(1, 2**level)) % 2**level) for level, index in own if level]

    def observe_(self, counts: dict[Shard, int], lineage: bool = False,
                 fresh: dict[Shard, int] | None = None) -> None:
        """Update the estimate of the swarm's size from one read's live records of other peers per shard (read
        shards that held none count as 0), and our level with it: up when the latest ESTIMATES_TO_MOVE estimates
        put over twice the target in a shard, to the level where one holds at most the target; down one level
        when a full window puts under a quarter of it in one. A `lineage` read (our shard at every level) moves us
        to the level that holds most peers, counting only `fresh` records (refreshed within FRESH_HEARTBEATS: a
        peer that moved leaves its old record behind), when that is not ours: peers split over levels that do not
        meet (some moved up while the others' reads said stay) gather where most of them are; not in the first
        LINEAGE_EVERY reads after a move, while our old level still holds our fresh records."""
        if not counts:
            return
        peers, densest = _crowds(counts)
        estimate = 1 + sum(n for level, n in peers.items() if abs(level - densest) <= 1)
        now_at, crowded = _crowds(counts if fresh is None else fresh)
        with self._lock:
            self._reads_since_move += 1
            # a peer that just moved leaves fresh records at its old level for a few heartbeats, which a lineage
            # read would take for a crowd there: the first LINEAGE_EVERY reads after a move do not move back
            settled = self._reads_since_move > LINEAGE_EVERY
            if lineage and settled and crowded != self._level and now_at[crowded] > now_at.get(self._level, 0):
                self._move_(crowded)
                return
            self._estimates.append(estimate)
            recent = statistics.median(list(self._estimates)[-ESTIMATES_TO_MOVE:])
            if len(self._estimates) >= ESTIMATES_TO_MOVE and recent / 2**self._level > 2 * self.target:
                # the level where a shard holds at most the target: twice the margin to the next move either way
                self._move_(min(MAX_SHARD_LEVEL, math.ceil(math.log2(recent / self.target))))
            elif (len(self._estimates) == ESTIMATES_KEPT and self._level > 0
                  and statistics.median(self._estimates) / 2**self._level < self.target / 4):
                self._move_(self._level - 1)

    def _move_(self, level: int) -> None:
        self._level = level
        self._estimates.clear()  # the next reads are of the new level's shards
        self._reads_since_move = 0


def _crowds(counts: dict[Shard, int]) -> tuple[dict[int, float], int]:
    """How many peers each level read stands for (`_peers_at`), and the level that stands for most (the lower of
    equals)."""
    by_level: dict[int, list[int]] = {}
    for (level, _), count in counts.items():
        by_level.setdefault(level, []).append(count)
    peers = {level: _peers_at(level, found) for level, found in by_level.items()}
    return peers, max(peers, key=lambda level: (peers[level], -level))


def _peers_at(level: int, found: list[int]) -> float:
    """How many peers a level's shards stand for: a shard of level l holding c stands for c × 2^l of them, where
    the shards read held two or more; a lone record read at level 8 (a straggler) stands for itself, not 256."""
    return statistics.fmean(found) * 2**level if sum(found) >= 2 else float(sum(found))
