"""Mixing weights and the in-place gossip mixing of lists of tensors (one tensor per model parameter).

Weights are Metropolis–Hastings: ``w_ij = 1 / (1 + max(d_i, d_j))`` for each edge and ``w_ii = 1 − Σ_j w_ij``.
They are symmetric and doubly stochastic for any symmetric graph, so a round preserves the swarm mean; on a
d-regular graph they reduce to the uniform ``1 / (d + 1)`` (1/2 for a matching, 1/3 for a cycle). Each peer can
compute its own row from its degree and its partners' degrees, without knowing the whole graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from p2ptrain.maths.topology import Neighbours, check_symmetric
from p2ptrain.tensor_layout import check_alike


def metropolis_weight(own_degree: int, partner_degree: int) -> float:
    """Weight of one edge under Metropolis–Hastings; both ends compute the same value."""
    if own_degree < 1 or partner_degree < 1:
        raise ValueError(f"both ends of an edge have degree >= 1, got {own_degree} and {partner_degree}")
    return 1.0 / (1 + max(own_degree, partner_degree))


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


def exact_average(tensor_lists: Sequence[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The elementwise mean of several lists of tensors (what an all-reduce returns)."""
    if not tensor_lists:
        raise ValueError("cannot average an empty set of peers")
    for position, other in enumerate(tensor_lists[1:], start=1):
        check_alike(tensor_lists[0], other, f"peer {position}")
    return [torch.stack(list(group)).mean(dim=0) for group in zip(*tensor_lists, strict=True)]


def consensus_distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """``‖a − b‖ / ‖a‖`` over all tensors taken together (0 when both are zero, inf when only ``a`` is)."""
    check_alike(a, b, "compared state")
    diff_sq = math.fsum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b, strict=True))
    norm_sq = math.fsum(float(x.double().pow(2).sum()) for x in a)
    if norm_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else math.inf
    return math.sqrt(diff_sq / norm_sq)
