"""The event loop: each peer alternates inner phases (compute) with exchanges over its link; a heap of timed events
decides who waits for whom. Timing of each algorithm (docs/algorithms.md §1-3; transfer times from model.py):
  diloco     blocking all-reduce of outer gradients: a round ends for all when the slowest inner phase is done plus
             model.allreduce_s (a butterfly, or an all-gather of sparse payloads).
  gossip-1   asynchronous pairs: a peer whose inner phase is done draws a random peer whose link is free and
             exchanges with it (model.exchange_s: its payload out, the partner's back). The initiator waits; the
             partner keeps computing, unless it was itself waiting to mix, in which case the exchange is its mix too.
  gossip-2   the same with two partners at once, the initiator's upload and download split between the two flows.
  factored   Mix1: a pair exchange started with the round, behind the inner phase; the peer waits only for what is
             left of it when the inner phase ends. Mix2: a blocking 2-partner exchange after every K-th inner phase.
  gradgossip gossip of outer gradients (no parameters): as gossip-k with the outer-gradient payload; with overlap
             (sync.overlap delayed) the exchange of round r starts as round r + 1 does and runs behind its inner
             phase, as Mix1 does.
Gossip and Mix1 exchanges carry parameters, Mix2, gradient gossip and DiLoCo's all-reduce outer gradients
(model.Swarm's two payloads).
A link serves one exchange at a time; initiators draw among free peers only (the DHT is assumed to record who is
free, so refusals cost nothing); a peer that finds too few free partners waits until a link frees.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass

import numpy as np

from benchmarks.scale.model import Swarm, allreduce_s, exchange_s
from p2ptrain.errors import ConfigError

HORIZON_LIMIT_S = 3.2e9  # a century: rounds slower than this mean the inputs make no sense
KINDS = ("allreduce", "gossip", "factored", "gradgossip")


@dataclass(frozen=True)
class Algorithm:
    """How a round synchronises: kind 'allreduce' (DiLoCo), 'gossip', 'factored' or 'gradgossip'."""

    kind: str
    partners: int = 1  # gossip, gradgossip: partners per exchange; factored: Mix2's partners (Mix1 always has one)
    mix2_every: int = 1  # factored: Mix2 after every mix2_every-th inner phase
    overlap: bool = False  # gradgossip: the exchange runs behind the next inner phase

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"algorithm kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if self.partners < 1 or self.mix2_every < 1:
            raise ConfigError("partners and mix2_every must be >= 1")
        if self.overlap and (self.kind != "gradgossip" or self.partners != 1):
            raise ConfigError("overlap applies to gradgossip with one partner")

    @property
    def name(self) -> str:
        if self.kind == "allreduce":
            return "diloco"
        if self.kind == "factored":
            return f"factored-K{self.mix2_every}"
        return f"{self.kind}-{self.partners}" + ("-overlap" if self.overlap else "")

    @property
    def behind_inner_phase(self) -> bool:
        """Whether the round's exchange starts with the round and runs behind the inner phase (Mix1's timing)."""
        return self.kind == "factored" or self.overlap


@dataclass(eq=False)
class SimResult:
    """Per-peer outcome of one run; every peer's compute_s + wait_s equals end_s."""

    algorithm: Algorithm
    budget_s: float
    end_s: float
    compute_s: np.ndarray
    wait_s: np.ndarray
    rounds_in_budget: np.ndarray
    round_s: list[list[float]]  # per peer, the duration of each completed round
    partners: list[set[int]]  # per peer, everyone it exchanged with (all-reduce: not recorded)

    @property
    def utilisation(self) -> np.ndarray:
        return self.compute_s / self.end_s

    def summary(self) -> dict[str, float]:
        """Medians over peers; round time is each peer's mean over its completed rounds (fast peers, who complete
        more rounds, would otherwise outweigh slow ones)."""
        mean_round_s = [sum(per_peer) / len(per_peer) for per_peer in self.round_s if per_peer]
        return {
            "utilisation_median": float(np.median(self.utilisation)),
            "utilisation_p10": float(np.percentile(self.utilisation, 10)),
            "round_s_median": float(np.median(mean_round_s)) if mean_round_s else math.nan,
            "rounds_in_budget_median": float(np.median(self.rounds_in_budget)),
            "rounds_in_budget_p10": float(np.percentile(self.rounds_in_budget, 10)),
            "simulated_s": self.end_s,
        }


class _FreeSet:
    """Peers whose link is free: O(1) add, remove and uniform draw."""

    def __init__(self, n: int) -> None:
        self.items, self.position = list(range(n)), list(range(n))

    def remove(self, peer: int) -> None:
        index, last = self.position[peer], self.items.pop()
        if last != peer:
            self.items[index], self.position[last] = last, index
        self.position[peer] = -1

    def add(self, peer: int) -> None:
        self.position[peer] = len(self.items)
        self.items.append(peer)

    def draw(self, rng: random.Random, k: int, exclude: int) -> list[int] | None:
        """k distinct free peers other than ``exclude``, or None if there are fewer."""
        if len(self.items) - (self.position[exclude] >= 0) < k:
            return None
        chosen: list[int] = []
        while len(chosen) < k:
            peer = self.items[rng.randrange(len(self.items))]
            if peer != exclude and peer not in chosen:
                chosen.append(peer)
        return chosen


class _Simulation:
    """One run. Heap entries are (time_s, priority, seq, event, peer or exchange id); "try" events have priority 1
    so they run after every state change at the same instant, and peers ready together can pair with each other."""

    def __init__(self, algorithm: Algorithm, swarm: Swarm, budget_s: float, min_rounds: int, seed: int) -> None:
        n = swarm.n
        self.alg, self.swarm, self.budget_s, self.min_rounds = algorithm, swarm, budget_s, min_rounds
        self.rng, self.seq = random.Random(seed), itertools.count()
        self.heap: list[tuple[float, int, int, str, int]] = []
        self.compute_s, self.wait_s, self.since_s, self.computing = [0.0] * n, [0.0] * n, [0.0] * n, [True] * n
        self.round_start_s, self.rounds_in_budget = [0.0] * n, [0] * n
        self.round_s: list[list[float]] = [[] for _ in range(n)]
        self.partners: list[set[int]] = [set() for _ in range(n)]
        self.need: list[str | None] = [None] * n  # pending exchange: "gossip", "mix1" or "mix2"
        self.inner_done = [False] * n
        self.free = _FreeSet(n)
        self.waiting: set[int] = set()  # peers with a need and a free link that found too few free partners
        self.exchanges: dict[int, tuple[str, list[int], list[int]]] = {}
        self.exchange_ids = itertools.count()
        self.arrived, self.peers_at_min_rounds, self.done_at_s = 0, 0, math.inf

    def run(self) -> SimResult:
        for peer in range(self.swarm.n):
            self._start_round(peer, 0.0)
        while self.heap and self.heap[0][0] <= max(self.budget_s, self.done_at_s):
            time_s, _, _, event, who = heapq.heappop(self.heap)
            if time_s > HORIZON_LIMIT_S:
                raise ConfigError("rounds take over a century: raise bandwidth or compression, or lower --min-rounds")
            getattr(self, f"_on_{event}")(who, time_s)
        end_s = max(self.budget_s, self.done_at_s)
        for peer in range(self.swarm.n):
            self._switch(peer, end_s, self.computing[peer])
        return SimResult(
            self.alg, self.budget_s, end_s, np.array(self.compute_s), np.array(self.wait_s),
            np.array(self.rounds_in_budget), self.round_s, self.partners,
        )

    def _push(self, time_s: float, priority: int, event: str, who: int) -> None:
        heapq.heappush(self.heap, (time_s, priority, next(self.seq), event, who))

    def _switch(self, peer: int, now_s: float, computing: bool) -> None:
        """Book the time since the peer's last switch as compute or wait, then enter the new state."""
        elapsed_s = now_s - self.since_s[peer]
        if self.computing[peer]:
            self.compute_s[peer] += elapsed_s
        else:
            self.wait_s[peer] += elapsed_s
        self.since_s[peer], self.computing[peer] = now_s, computing

    def _start_round(self, peer: int, now_s: float) -> None:
        self.inner_done[peer] = False
        if self.swarm.round_cost_s:  # the client's own work first: no compute
            self._switch(peer, now_s, computing=False)
            self._push(now_s + self.swarm.round_cost_s, 0, "compute", peer)
        else:
            self._on_compute(peer, now_s)
        if self.alg.behind_inner_phase:
            self.need[peer] = "mix1"
            self._push(now_s, 1, "try", peer)

    def _on_compute(self, peer: int, now_s: float) -> None:
        self._switch(peer, now_s, computing=True)
        self._push(now_s + float(self.swarm.inner_phase_s[peer]), 0, "inner_done", peer)

    def _end_round(self, peer: int, now_s: float) -> None:
        self.round_s[peer].append(now_s - self.round_start_s[peer])
        self.rounds_in_budget[peer] += now_s <= self.budget_s
        if len(self.round_s[peer]) == self.min_rounds:
            self.peers_at_min_rounds += 1
            if self.peers_at_min_rounds == self.swarm.n:
                self.done_at_s = now_s
        self.round_start_s[peer] = now_s
        self._start_round(peer, now_s)

    def _on_inner_done(self, peer: int, now_s: float) -> None:
        self._switch(peer, now_s, computing=False)
        self.inner_done[peer] = True
        if self.alg.kind == "allreduce":
            self.arrived += 1
            if self.arrived == self.swarm.n:
                self.arrived = 0
                self._push(now_s + allreduce_s(self.swarm), 0, "allreduce_done", -1)
        elif not self.alg.behind_inner_phase:
            self.need[peer] = "gossip"
            self._push(now_s, 1, "try", peer)
        elif self.need[peer] != "mix1":  # the exchange behind the inner phase is done: otherwise wait for it
            self._after_mix1(peer, now_s)

    def _after_mix1(self, peer: int, now_s: float) -> None:
        if self.alg.kind == "factored" and (len(self.round_s[peer]) + 1) % self.alg.mix2_every == 0:
            self.need[peer] = "mix2"
            self._push(now_s, 1, "try", peer)
        else:
            self._end_round(peer, now_s)

    def _on_allreduce_done(self, _: int, now_s: float) -> None:
        for peer in range(self.swarm.n):
            self._end_round(peer, now_s)

    def _on_try(self, peer: int, now_s: float) -> None:
        kind = self.need[peer]
        if kind is None or self.free.position[peer] < 0:
            return  # nothing to do, or its link is busy: the exchange that frees it tries again
        chosen = self.free.draw(self.rng, 1 if kind == "mix1" else self.alg.partners, exclude=peer)
        if chosen is None:
            self.waiting.add(peer)
            return
        group = [peer, *chosen]
        satisfied = [peer] + [p for p in chosen if self.need[p] == kind]  # a partner waiting to mix is mixed too
        for p in group:
            self.free.remove(p)
            self.waiting.discard(p)
        self.partners[peer].update(chosen)
        for p in chosen:
            self.partners[p].add(peer)
        exchange_id = next(self.exchange_ids)
        self.exchanges[exchange_id] = (kind, group, satisfied)
        deltas = self.alg.kind == "gradgossip" or kind == "mix2"  # outer gradients; else parameters
        self._push(now_s + exchange_s(self.swarm, peer, chosen, deltas), 0, "exchange_done", exchange_id)

    def _on_exchange_done(self, exchange_id: int, now_s: float) -> None:
        kind, group, satisfied = self.exchanges.pop(exchange_id)
        for peer in group:
            self.free.add(peer)
        for peer in satisfied:
            self.need[peer] = None
            if kind != "mix1":
                self._end_round(peer, now_s)
            elif self.inner_done[peer]:
                self._after_mix1(peer, now_s)
        for peer in [p for p in group if p not in satisfied and self.need[p] is not None] + list(self.waiting):
            self._push(now_s, 1, "try", peer)


def simulate(algorithm: Algorithm, swarm: Swarm, budget_s: float, min_rounds: int = 10, seed: int = 0) -> SimResult:
    """Run until budget_s and until every peer has completed min_rounds rounds, whichever is later."""
    if budget_s <= 0 or min_rounds < 1:
        raise ConfigError("budget_s must be > 0 and min_rounds >= 1")
    return _Simulation(algorithm, swarm, budget_s, min_rounds, seed).run()
