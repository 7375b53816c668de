"""Offers that arrive a moment early are held until this peer reaches their round, not refused.

All-reduce members end their inner phases within moments of each other, so the opener's offer often arrives while
the other member is still computing. Refused ("not in this round"), it would be made again and again
(`round_retry.py`), each time with its whole payload (benchmarks/wire_bytes.py counts them). Held, an offer's payload
crosses once, and is read the moment the round begins.

The initiator says how long it will wait (`hold_s` in its offer: what is left of its stage's patience). The
responder holds an offer at most that long and at most its own patience, and only an offer at most
MAX_STAGES_AHEAD ahead of its current stage; anything else is judged at once. What holding costs the
responder is one of its exchange slots (net/responder_limits.py) for that long, as a slow sender's offer does.

A peer that shuts down closes its gate (`close`): the offers it holds for a round it will not reach are refused
(`Refusal.LEAVING`) at once. Left held, they would end with its process and no answer, and each initiator would wait
its exchange's deadline, out of step with the members that ended the round.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

# how far ahead an offer may be and still be held: the exchange all-reduce numbers a round's stages 2r (Δ) and
# 2r + 1 (digests), so a member still in the previous round's confirmation stage is one behind the data stage, and
# a member computing with overlap (its all-reduce one round behind) up to two; the reduce-scatter, with 6 stages a
# round (sync/scatter_allreduce.py), holds offers up to its round's stages ahead (`RoundGate.max_stages_ahead`)
MAX_STAGES_AHEAD = 2


def offered_hold_s(header: dict[str, Any], own_cap_s: float) -> float:
    """How long the offer in `header` may be held: its `hold_s` (the initiator's word), at most `own_cap_s`; 0 for
    anything but a finite positive number of seconds (a peer that sends none is judged at once)."""
    hold_s = header.get("hold_s")
    if isinstance(hold_s, bool) or not isinstance(hold_s, (int, float)) or not 0 < hold_s < math.inf:
        return 0.0
    return min(float(hold_s), own_cap_s)


class RoundGate:
    """The stage this peer has reached, and the offers waiting for a later one."""

    def __init__(self) -> None:
        self.round: int | None = None  # None until the first stage begins
        self.max_stages_ahead = MAX_STAGES_AHEAD  # the reduce-scatter holds its round's stages (ScatterAllReduce)
        self._advanced = asyncio.Event()  # set (and replaced) each time `round` changes
        self.closed = False  # shutting down: nothing is held any more

    def advance_(self, round_: int) -> None:
        """This peer's current stage is now `round_`: wake the offers held for it."""
        self.round = round_
        advanced, self._advanced = self._advanced, asyncio.Event()
        advanced.set()

    def may_hold(self, round_: int) -> bool:
        """Whether an offer for `round_` is worth holding: a stage not reached yet, and not far ahead."""
        return not self.closed and (self.round is None or self.round < round_ <= self.round + self.max_stages_ahead)

    async def close(self) -> None:
        """Hold nothing from now on, and let the held offers be judged (refused) now (on the gate's event loop)."""
        self.closed = True
        self._advanced.set()

    async def wait_for(self, round_: int, hold_s: float) -> float:
        """Wait until stage `round_` begins, at most `hold_s`, while the offer is worth holding; the seconds
        waited."""
        started = time.monotonic()
        give_up_at = started + hold_s
        while self.may_hold(round_) and time.monotonic() < give_up_at:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._advanced.wait(), give_up_at - time.monotonic())
        return time.monotonic() - started
