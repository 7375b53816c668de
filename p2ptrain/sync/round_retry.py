"""When to ask again a partner that refused our offer because it has not reached our round yet.

A refusal "not in this round" is no failure: the partner is still in its inner phase (or an all-reduce member in an
earlier stage) and will be there in a moment. All-reduce members end their inner phases within moments of each
other, so the opener's offer often comes first, and a fixed wait before asking again would idle both members.
The schedule starts at FIRST_RETRY_S and doubles up to timing.POLL_S (a partner far behind is asked that
often); quick asks fit a responder's offer token bucket (param_gossip.OFFER_BURST). Every exchange the driver
makes (sync/exchange_driver.py) asks again on this schedule, Mix1's parameter gossip included.

An all-reduce member we cannot reach through its relay is asked again on the same schedule, once (relay_retries.py).
"""

from __future__ import annotations

from p2ptrain.timing import POLL_S

FIRST_RETRY_S = 0.02  # s: the first wait before asking again; members of an all-reduce arrive moments apart


def retry_delay_s(attempt: int) -> float:
    """The wait before asking a partner not yet in our round again, after `attempt` asks (0: the first)."""
    return min(POLL_S, FIRST_RETRY_S * 2 ** min(attempt, 16))

