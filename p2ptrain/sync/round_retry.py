"""When to ask again a partner that refused our offer because it has not reached our round yet.

A refusal "not in this round" is no failure: the partner is still in its inner phase (or an all-reduce member in an
earlier stage) and will be there in a moment. All-reduce members end their inner phases within moments of each
other, so the opener's offer often comes first: asked again a quarter second later, both waited that long (loopback
DiLoCo, 2 peers: 0.25 s of a 0.8 s round). The schedule starts at FIRST_RETRY_S and doubles up to ROUND_RETRY_S;
quick asks fit a responder's offer token bucket (param_gossip.OFFER_BURST). GASLoC's parameter gossip (Mix1)
keeps the fixed ROUND_RETRY_S: gossip peers do not end their rounds together, so quick asks buy them nothing.

An all-reduce member we cannot reach through its relay is asked again on the same schedule, once (`RelayRetries`).
"""

from __future__ import annotations

ROUND_RETRY_S = 0.25  # the longest wait before asking again (a partner far behind is asked this often)
# DiLoCo's loopback rounds 0.8 -> 0.55 s (2 peers). Off for a while: the testnet stall checks counted rounds, and
# the shorter rounds failed them on stalls of the same seconds; they count seconds now (checks.max_stall_s)
FIRST_RETRY_S = 0.02


def retry_delay_s(attempt: int) -> float:
    """The wait before asking a partner not yet in our round again, after `attempt` asks (0: the first)."""
    return min(ROUND_RETRY_S, FIRST_RETRY_S * 2 ** min(attempt, 16))


FORGET_RELAY_FAILURE_ROUNDS = 10  # a member's failing relay route is forgotten (asked again once more) after this


class RelayRetries:
    """Whether to ask again an all-reduce member whose relay route just failed: only in the first round it fails.

    Its relay may have died: the member moves to another within a second and we read its new record next round,
    and meanwhile it waits for our offer until its patience runs out. Giving up at once, we would leave the round
    seconds before it and reach the next all-reduce a round ahead (netns testnet, a relay killed mid-run: rounds
    split for up to 7 rounds), so we ask until our patience runs out too. A record naming a relay that never passes
    streams (a dead one that lingers, a hostile one) would then hold every round that long: from its second round
    on, such a member is given up at once again, until FORGET_RELAY_FAILURE_ROUNDS have passed."""

    def __init__(self) -> None:
        self.failing_since: dict[str, int] = {}  # member → the round its relay route started failing

    def ask_again_(self, member: str, round_: int) -> bool:
        for stale in [m for m, since in self.failing_since.items() if since < round_ - FORGET_RELAY_FAILURE_ROUNDS]:
            del self.failing_since[stale]
        return self.failing_since.setdefault(member, round_) == round_

    def reached_(self, member: str) -> None:
        self.failing_since.pop(member, None)
