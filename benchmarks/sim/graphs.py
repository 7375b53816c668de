"""Whole gossip graphs for simulated rounds: who mixes with whom, the mixing matrix, and the in-place mix.

The live swarm never sees a whole graph: each peer draws its own partners (``p2ptrain.maths.topology``) and takes
its weights from ``p2ptrain.maths.mixing``. The simulator and the tests build the graph of a round here, with the
same Metropolis–Hastings weights, to check what the live rule does in aggregate (sum preserved, consensus).

A graph is returned as neighbour lists: ``neighbours[i]`` holds the peers that peer ``i`` mixes with this round,
never ``i`` itself, and the relation is symmetric (``j in neighbours[i]`` iff ``i in neighbours[j]``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from p2ptrain.maths.mixing import metropolis_weight
from p2ptrain.tensor_layout import check_alike

Neighbours = list[list[int]]
Graphs = tuple[list[Neighbours], list[Neighbours]]  # per round: (GASLoC's graph or Mix1's matching, Mix2's cycle)


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


def ring_graph(n: int) -> Neighbours:
    """A fixed overlay: peer i's neighbours are i − 1 and i + 1 (mod n), every round (CHOCO's public estimates
    need fixed neighbours); n = 2 is one edge, n = 1 none."""
    _check_peer_count(n)
    if n <= 2:
        return [[1], [0]] if n == 2 else [[]]
    return [[(i - 1) % n, (i + 1) % n] for i in range(n)]


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


def mixing_weights(neighbours: Neighbours, peer: int) -> list[float]:
    """Peer ``peer``'s weights for its neighbours, in the order of ``neighbours[peer]``."""
    own_degree = len(neighbours[peer])
    return [metropolis_weight(own_degree, len(neighbours[j])) for j in neighbours[peer]]


def mixing_matrix(neighbours: Neighbours, n: int) -> torch.Tensor:
    """The n×n float64 mixing matrix W of a symmetric graph: symmetric, doubly stochastic, non-negative."""
    if len(neighbours) != n:
        raise ValueError(f"expected neighbour lists for {n} peers, got {len(neighbours)}")
    check_symmetric(neighbours)
    matrix = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j, weight in zip(neighbours[i], mixing_weights(neighbours, i), strict=True):
            matrix[i, j] = weight
        matrix[i, i] = 1.0 - matrix[i].sum()
    return matrix


def mix_(own: list[torch.Tensor], neighbours: Sequence[list[torch.Tensor]], weights: Sequence[float]) -> None:
    """In place: ``own ← own − Σ_j w_j (own − neighbour_j)`` = ``(1 − Σ_j w_j)·own + Σ_j w_j·neighbour_j``.

    Every input is validated before the first write, so a bad neighbour leaves ``own`` untouched.
    Mixing with an empty list is the identity. The convex form makes a pair average bit-identical on both ends.
    """
    if len(neighbours) != len(weights):
        raise ValueError(f"got {len(neighbours)} neighbours but {len(weights)} weights")
    for position, neighbour in enumerate(neighbours):
        check_alike(own, neighbour, f"neighbour {position}")
    own_weight = 1.0 - math.fsum(weights)
    if not all(w >= 0.0 for w in weights) or own_weight < -1e-12:
        raise ValueError(f"mixing weights must be non-negative and sum to <= 1, got {list(weights)}")
    if not neighbours:
        return
    with torch.no_grad():
        for index, tensor in enumerate(own):
            tensor.mul_(own_weight)
            for neighbour, weight in zip(neighbours, weights, strict=True):
                tensor.add_(neighbour[index].to(tensor.dtype), alpha=weight)


def pair_average_(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Both lists become their elementwise average (1-peer gossip between two local copies)."""
    check_alike(a, b, "pair partner")
    with torch.no_grad():
        for x, y in zip(a, b, strict=True):
            average = x.mul(0.5).add_(y.to(x.dtype), alpha=0.5)
            x.copy_(average)
            y.copy_(average)
