"""Mixing weights and the arithmetic of one gossip mix, on lists of tensors (one tensor per model parameter).

Weights are Metropolis–Hastings: ``w_ij = 1 / (1 + max(d_i, d_j))`` for each edge and ``w_ii = 1 − Σ_j w_ij``.
They are symmetric and doubly stochastic for any symmetric graph, so a round preserves the swarm mean; on a
d-regular graph they reduce to the uniform ``1 / (d + 1)`` (1/2 for a matching, 1/3 for a cycle). Each peer can
compute its own row from its degree and its partners' degrees, without knowing the whole graph. The live path
takes its weights from here (`uniform_weight`); whole graphs for simulated rounds are in benchmarks/sim/graphs.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from p2ptrain.tensor_layout import check_alike, distance, norm


def metropolis_weight(own_degree: int, partner_degree: int) -> float:
    """Weight of one edge under Metropolis–Hastings; both ends compute the same value."""
    if own_degree < 1 or partner_degree < 1:
        raise ValueError(f"both ends of an edge have degree >= 1, got {own_degree} and {partner_degree}")
    return 1.0 / (1 + max(own_degree, partner_degree))


def uniform_weight(degree: int) -> float:
    """The weight of every edge when each peer mixes with at most `degree` partners: 1/(degree + 1), i.e. 1/2 for
    pair averaging and 1/3 with two partners. A peer that found fewer partners keeps the rest on its own value, so
    the mix stays doubly stochastic whoever completed how many exchanges."""
    return metropolis_weight(degree, degree)


@torch.no_grad()
def pull_toward_(target: Sequence[torch.Tensor], partner: Sequence[torch.Tensor], own: Sequence[torch.Tensor],
                 weight: float) -> None:
    """In place: ``target += w · (partner − own)``, one edge of a mix seen from one end.

    The other end adds ``w · (own − partner)``, so the pair's sum is preserved whoever started the exchange.
    """
    check_alike(own, partner, "partner")
    for t, theirs, mine in zip(target, partner, own, strict=True):
        t.add_(theirs - mine, alpha=weight)


def exact_average(tensor_lists: Sequence[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The elementwise mean of several lists of tensors (what an all-reduce returns)."""
    if not tensor_lists:
        raise ValueError("cannot average an empty set of peers")
    for position, other in enumerate(tensor_lists[1:], start=1):
        check_alike(tensor_lists[0], other, f"peer {position}")
    return [torch.stack(list(group)).mean(dim=0) for group in zip(*tensor_lists, strict=True)]


def consensus_distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """``‖a − b‖ / ‖a‖`` over all tensors taken together (0 when both are zero, inf when only ``a`` is)."""
    gap, scale = distance(a, b), norm(a)
    if scale == 0.0:
        return 0.0 if gap == 0.0 else math.inf
    return gap / scale
