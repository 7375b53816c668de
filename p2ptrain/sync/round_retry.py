"""When to ask again a partner that refused our offer because it has not reached our round yet.

A refusal "not in this round" is no failure: the partner is still in its inner phase (or an all-reduce member in an
earlier stage) and will be there in a moment. All-reduce members end their inner phases within moments of each
other, so the opener's offer often comes first: asked again a quarter second later, both waited that long (loopback
DiLoCo, 2 peers: 0.25 s of a 0.8 s round). The schedule starts at FIRST_RETRY_S and doubles up to ROUND_RETRY_S;
quick asks fit a responder's offer token bucket (param_gossip.OFFER_BURST). GASLoC's parameter gossip (Mix1)
keeps the fixed ROUND_RETRY_S: gossip peers do not end their rounds together, so quick asks buy them nothing.

An all-reduce member we cannot reach through its relay is asked again on the same schedule, once (relay_retries.py).
"""

from __future__ import annotations

ROUND_RETRY_S = 0.25  # the longest wait before asking again (a partner far behind is asked this often)
# DiLoCo's loopback rounds 0.8 -> 0.55 s (2 peers). Off for a while: the testnet stall checks counted rounds, and
# the shorter rounds failed them on stalls of the same seconds; they count seconds now (checks.max_stall_s)
FIRST_RETRY_S = 0.02


def retry_delay_s(attempt: int) -> float:
    """The wait before asking a partner not yet in our round again, after `attempt` asks (0: the first)."""
    return min(ROUND_RETRY_S, FIRST_RETRY_S * 2 ** min(attempt, 16))

