"""Who mixes with whom in the live swarm: each peer draws its own random partners among the live peers.

The weights of a mix live in :mod:`p2ptrain.maths.mixing`; the exchange itself in :mod:`p2ptrain.net.exchange`
(topology → mixing weights → exchange, the split of stochastic gradient push).
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def draw_partners(candidates: Sequence[str], k: int, rng: random.Random, exclude: set[str]) -> list[str]:
    """Draw up to ``k`` distinct random partners among live ``candidates``, skipping busy or failed ones.

    Returns fewer than ``k`` peers (possibly none) when not enough candidates remain; mixing with an empty
    partner list is the identity, so the caller needs no special case for a lone peer.
    """
    if k < 0:
        raise ValueError(f"number of partners must be >= 0, got k={k}")
    eligible = sorted({peer for peer in candidates if peer not in exclude})
    return rng.sample(eligible, min(k, len(eligible)))
