"""Who mixes with whom: gossip graphs for simulated rounds, and partner draws for the asynchronous swarm.

A graph is returned as neighbour lists: ``neighbours[i]`` holds the peers that peer ``i`` mixes with this round,
never ``i`` itself, and the relation is symmetric (``j in neighbours[i]`` iff ``i in neighbours[j]``).
Weights for these graphs live in :mod:`p2ptrain.maths.mixing`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

Neighbours = list[list[int]]


def _check_peer_count(n: int) -> None:
    if n < 1:
        raise ValueError(f"a gossip graph needs at least one peer, got n={n}")


def complete_graph(n: int) -> Neighbours:
    """Every peer mixes with every other peer (exact averaging with uniform weights 1/n)."""
    _check_peer_count(n)
    return [[j for j in range(n) if j != i] for i in range(n)]


def random_matching(n: int, rng: random.Random) -> Neighbours:
    """1-peer topology: a uniformly random perfect matching; with odd ``n`` one random peer stays alone."""
    _check_peer_count(n)
    order = list(range(n))
    rng.shuffle(order)
    neighbours: Neighbours = [[] for _ in range(n)]
    for a, b in zip(order[0::2], order[1::2], strict=False):
        neighbours[a].append(b)
        neighbours[b].append(a)
    return neighbours


def random_cycle_graph(n: int, rng: random.Random) -> Neighbours:
    """2-peer topology: a random Hamiltonian cycle, so each peer mixes with two random peers.

    The cycle is 2-regular, hence uniform weights 1/3 are doubly stochastic. Small swarms degenerate:
    n=1 has no edge, n=2 a single edge (each peer has one partner), n=3 the triangle (= complete graph).
    """
    _check_peer_count(n)
    order = list(range(n))
    rng.shuffle(order)
    neighbours: Neighbours = [[] for _ in range(n)]
    if n == 1:
        return neighbours
    if n == 2:
        return [[1], [0]]
    for position, peer in enumerate(order):
        neighbours[peer] = [order[position - 1], order[(position + 1) % n]]
    return neighbours


def edges(neighbours: Neighbours) -> list[tuple[int, int]]:
    """The undirected edges ``(i, j)`` with ``i < j`` of a neighbour-list graph."""
    return sorted({(min(i, j), max(i, j)) for i, peers in enumerate(neighbours) for j in peers})


def check_symmetric(neighbours: Neighbours) -> None:
    """Raise ValueError unless the graph has no self-loops, no duplicates, no out-of-range peers, and is symmetric."""
    n = len(neighbours)
    for i, peers in enumerate(neighbours):
        if len(set(peers)) != len(peers):
            raise ValueError(f"peer {i} lists a neighbour twice: {peers}")
        for j in peers:
            if not 0 <= j < n or j == i:
                raise ValueError(f"peer {i} has an invalid neighbour {j} (n={n})")
            if i not in neighbours[j]:
                raise ValueError(f"graph is not symmetric: {j} is a neighbour of {i} but not the reverse")


def draw_partners(candidates: Sequence[str], k: int, rng: random.Random, exclude: set[str]) -> list[str]:
    """Draw up to ``k`` distinct random partners among live ``candidates``, skipping busy or failed ones.

    Returns fewer than ``k`` peers (possibly none) when not enough candidates remain; mixing with an empty
    partner list is the identity, so the caller needs no special case for a lone peer.
    """
    if k < 0:
        raise ValueError(f"number of partners must be >= 0, got k={k}")
    eligible = sorted({peer for peer in candidates if peer not in exclude})
    return rng.sample(eligible, min(k, len(eligible)))
