"""Whether to ask again an all-reduce member whose relay route just failed: only in the first round it fails."""

from __future__ import annotations

FORGET_RELAY_FAILURE_ROUNDS = 10  # a member's failing relay route is forgotten (asked again once more) after this


class RelayRetries:
    """Members whose relay route failed, and since which round: asked again (on `round_retry`'s schedule) only in
    the first round it fails.

    Its relay may have died: the member moves to another within a second and we read its new record next round,
    and meanwhile it waits for our offer until its patience runs out. Giving up at once, we would leave the round
    seconds before it and reach the next all-reduce a round ahead (the swarm's rounds then stay split for several
    rounds), so we ask until our patience runs out too. A record naming a relay that never passes
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
