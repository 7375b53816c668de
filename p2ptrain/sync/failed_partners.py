"""Gossip partners whose exchange we opened failed (a time-out, a dial or stream error), left out of our draws for
a few rounds.

A partner that stopped answering (it crashed, or a cut split the swarm) keeps its record in our view until the
record's lifetime ends, and each exchange we open with it costs our round a whole deadline (at least the set-up
floor, 5 s) while we train nothing. Drawn again every round, it would cost one every round. So a partner whose
exchange failed is not drawn for the next round, after a second failure in a row for two, then four, up to
MAX_SKIPPED_ROUNDS: what a dead partner costs us falls geometrically, and a live one is asked again within that
many rounds. Its own offers to us are answered as ever, and an exchange that ends well either way forgets its
failures. Not an offence (`Reputation`): an honest peer behind a cut looks the same.

A partner that never completed an exchange with us (either side opening it) has no such claim on our rounds: its
skips keep doubling up to MAX_STRANGER_SKIPPED_ROUNDS, and its time-outs never grow its deadline (below). An
identity that takes every offer and never answers, announcing a fast link, cost each honest GASLoC peer a deadline
every fifth round for as long as it stayed, each longer than the one before (5 s, 20 s, then the cap); identities
cost nothing. Now such an identity costs a set-up floor about log2 of the rounds it stays. An honest partner we
mixed with before a cut is asked again within MAX_SKIPPED_ROUNDS after the heal, as before, and an honest
stranger mixes with us, and becomes known, the moment an exchange it opens with us completes.

Nor is one time-out taken for a slow link (`ExchangeDriver.exchange_with`'s `slow_if_timed_out`): it bounded the
link's speed, and so grew the next deadline by the safety factor (5 s, then 20 s), which two peers whose connection
went stale at a cut then both waited out after the heal. A second time-out in a row is, with a partner that
completed an exchange with us before (`slow_if_timed_out`).
"""

from __future__ import annotations

from collections import OrderedDict

MAX_SKIPPED_ROUNDS = 4  # rounds a partner is left out of our draws at most: a partition healed is mixed across soon
MAX_STRANGER_SKIPPED_ROUNDS = 64  # the same for a partner that never completed an exchange with us
MAX_KNOWN = 4096  # partners remembered as having completed an exchange with us, the latest kept


class FailedPartners:
    """Per partner: its failures in a row, and the first round it may be drawn again; and the partners that
    completed an exchange with us."""

    def __init__(self, max_known: int = MAX_KNOWN) -> None:
        self.failed: dict[str, tuple[int, int]] = {}  # partner → (failed exchanges we opened in a row, next round)
        self.known: OrderedDict[str, None] = OrderedDict()
        self.max_known = max_known

    def failed_(self, partner: str, round_: int) -> None:
        """An exchange we opened with `partner` in round `round_` failed: skip it for 1, 2, 4 ... rounds."""
        failures = self.failed.get(partner, (0, 0))[0] + 1
        cap = MAX_SKIPPED_ROUNDS if partner in self.known else MAX_STRANGER_SKIPPED_ROUNDS
        self.failed[partner] = failures, round_ + 1 + min(cap, 2 ** (failures - 1))

    def reached_(self, partner: str) -> None:
        """An exchange with `partner` (opened by either side) ended well: its failures are forgotten."""
        self.failed.pop(partner, None)
        self.known.pop(partner, None)
        self.known[partner] = None
        while len(self.known) > self.max_known:
            self.known.popitem(last=False)

    def slow_if_timed_out(self, partner: str) -> bool:
        """Whether a time-out of an exchange we open with `partner` now bounds its link (`ExchangeDriver`): the
        second in a row, with a partner that completed an exchange with us before."""
        return partner in self.failed and partner in self.known

    def drawable(self, partners: list[str], round_: int) -> list[str]:
        """The `partners` that may be drawn in round `round_`. A partner that left the swarm for good is forgotten
        once its rounds are over, so the table holds the partners that failed within the last few rounds only."""
        for gone in [p for p, (_, first) in self.failed.items() if first <= round_ and p not in partners]:
            self.failed.pop(gone)
        return [p for p in partners if self.failed.get(p, (0, round_))[1] <= round_]
