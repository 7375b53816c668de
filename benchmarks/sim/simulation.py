"""Training a row: simulated peers run their inner phases, then the row's exchange (benchmarks/sim/exchanges.py,
benchmarks/sim/compressed_gossip.py) on the round's gossip graphs; peers and the workbench are in peers.py."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from benchmarks.sim.compressed_gossip import exchange_choco, exchange_gradgossip
from benchmarks.sim.exchanges import (
    exchange_delayed,
    exchange_diloco,
    exchange_factored,
    exchange_gasloc,
    mix1_pull,
    send_parameters,
)
from benchmarks.sim.graphs import Graphs, Neighbours, complete_graph, random_cycle_graph, random_matching, ring_graph
from benchmarks.sim.peers import (
    Bench,
    SimPeer,
    Tensors,
    build_bench,
    clone,
    inner_phase_,
    make_peers,
    outer_step_,
    validation_loss,
)
from benchmarks.sim.rows import Algorithm

# the workbench's names as benchmarks/robustness.py and tests/test_outer_rules.py import them, from here
__all__ = ["Bench", "SimPeer", "Tensors", "build_bench", "inner_phase_", "make_graphs", "make_peers", "mix1_pull",
           "outer_step_", "send_parameters", "train_row", "validation_loss"]

EXCHANGES: dict[str, Callable[..., dict]] = {"diloco": exchange_diloco, "gasloc": exchange_gasloc,
                                             "factored": exchange_factored, "delayed": exchange_delayed,
                                             "gradgossip": exchange_gradgossip, "choco": exchange_choco}


def make_graphs(row: Algorithm, n: int, rounds: int, seed: int) -> Graphs:
    """Per round: (GASLoC's graph, Factored's Mix1 matching, or the gossip rows' graph; Factored's Mix2 cycle).
    Drawn from ``seed``: the same in every row of a seed."""
    first, second = random.Random(seed), random.Random(seed + 1)
    draw: dict[str, Callable[[], Neighbours]] = {
        "complete": lambda: complete_graph(n), "matching": lambda: random_matching(n, first),
        "cycle": lambda: random_cycle_graph(n, first), "ring": lambda: ring_graph(n)}
    primary = "matching" if row.kind == "factored" else row.graph
    return [draw[primary]() for _ in range(rounds)], [random_cycle_graph(n, second) for _ in range(rounds)]


def _needed_partners(row: Algorithm, graphs: Graphs, r: int, i: int, n: int) -> set[int]:
    if row.kind in ("gasloc", "gradgossip", "choco"):
        return set(graphs[0][r][i])
    if row.kind == "factored":
        return (set(graphs[0][r][i]) if r % row.mix1_every == 0 else set()) | \
            (set(graphs[1][r][i]) if (r + 1) % row.mix2_every == 0 else set())
    return set(range(n)) - {i}


def train_row(row: Algorithm, bench: Bench, steps: list[int], rounds_done: list[int]) -> list[SimPeer]:
    """Peer i runs ``steps[i]`` inner steps per round and completes ``rounds_done[i]`` rounds.

    A peer whose last round did not complete within the budget still runs that round's inner phase (a partner
    that completes may need its proposal) but keeps its previous state.
    """
    peers = make_peers(row, bench)
    graphs = make_graphs(row, len(peers), max(rounds_done), bench.settings.seed)
    carry: dict[str, Any] = {}
    for r in range(max(rounds_done)):
        present = [p for p in peers if rounds_done[p.index] >= r]
        finishing = {p.index for p in present if rounds_done[p.index] > r}
        for i in finishing:
            if not _needed_partners(row, graphs, r, i, len(peers)) <= {p.index for p in present}:
                raise RuntimeError(f"{row.name}: peer {i} completes round {r} without all of its partners")
        before = {p.index: clone(p.theta) for p in present if p.index not in finishing}
        deltas = {p.index: inner_phase_(p, steps[p.index]) for p in present}
        nbytes = EXCHANGES[row.kind](row, present, deltas, r, graphs, bench, carry)
        for peer in present:
            if peer.index in finishing:
                peer.bytes_sent += nbytes[peer.index]
            else:
                peer.theta = before[peer.index]
    return peers
