"""Gossip partners whose exchange we opened failed (a time-out, a dial or stream error), left out of our draws for
a few rounds.

A partner that stopped answering (it crashed, or a cut split the swarm) keeps its record in our view until the
record's lifetime ends, and each exchange we open with it costs our round a whole deadline (at least the set-up
floor, 5 s) while we train nothing. Drawn again every round, it would cost one every round. So a partner whose
exchange failed is not drawn for the next round, after a second failure in a row for two, then four, up to
MAX_SKIPPED_ROUNDS: what a dead partner costs us falls geometrically, and a live one is asked again within that
many rounds. Its own offers to us are answered as ever, and an exchange that ends well either way forgets its
failures. Not an offence (`Reputation`): an honest peer behind a cut looks the same.

Nor is one time-out taken for a slow link (`ExchangeDriver.exchange_with`'s `slow_if_timed_out`): it bounded the
link's speed, and so grew the next deadline by the safety factor (5 s, then 20 s), which two peers whose connection
went stale at a cut then both waited out after the heal. A second time-out in a row is.
"""

from __future__ import annotations

MAX_SKIPPED_ROUNDS = 4  # rounds a partner is left out of our draws at most: a partition healed is mixed across soon


class FailedPartners:
    """Per partner: its failures in a row, and the first round it may be drawn again."""

    def __init__(self) -> None:
        self.failed: dict[str, tuple[int, int]] = {}  # partner → (failed exchanges we opened in a row, next round)

    def failed_(self, partner: str, round_: int) -> None:
        """An exchange we opened with `partner` in round `round_` failed: skip it for 1, 2, 4 ... rounds."""
        failures = self.failed.get(partner, (0, 0))[0] + 1
        self.failed[partner] = failures, round_ + 1 + min(MAX_SKIPPED_ROUNDS, 2 ** (failures - 1))

    def reached_(self, partner: str) -> None:
        """An exchange with `partner` (opened by either side) ended well: its failures are forgotten."""
        self.failed.pop(partner, None)

    def failed_before(self, partner: str) -> bool:
        """Whether the last exchange we opened with `partner` failed."""
        return partner in self.failed

    def drawable(self, partners: list[str], round_: int) -> list[str]:
        """The `partners` that may be drawn in round `round_`. A partner that left the swarm for good is forgotten
        once its rounds are over, so the table holds the partners that failed within the last few rounds only."""
        for gone in [p for p, (_, first) in self.failed.items() if first <= round_ and p not in partners]:
            self.reached_(gone)
        return [p for p in partners if self.failed.get(p, (0, round_))[1] <= round_]
