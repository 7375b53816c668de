"""Holding an offer for a round a moment away (sync/round_gate.py): how long the initiator's word may make us hold
it, and which offers are held at all."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from p2ptrain.sync.round_gate import MAX_STAGES_AHEAD, RoundGate, offered_hold_s


@pytest.mark.parametrize("hold_s, expected", [
    (1.5, 1.5), (2, 2.0), (1e9, 3.0),  # at most our own cap
    (None, 0.0), (0, 0.0), (-1.0, 0.0), (float("nan"), 0.0), (float("inf"), 0.0), (True, 0.0), ("2", 0.0),
    ([1], 0.0),
])
def test_the_offered_hold_is_bounded_by_our_cap_and_anything_else_holds_nothing(hold_s: Any, expected: float):
    assert offered_hold_s({"hold_s": hold_s}, own_cap_s=3.0) == expected
    assert offered_hold_s({}, own_cap_s=3.0) == 0.0


def test_a_held_offer_is_released_when_its_round_begins_and_not_before():
    async def scenario() -> None:
        gate = RoundGate()
        gate.advance_(3)
        waiter = asyncio.create_task(gate.wait_for(4, hold_s=5.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        gate.advance_(4)
        assert await asyncio.wait_for(waiter, 1.0) < 1.0

    asyncio.run(scenario())


def test_a_hold_ends_at_its_bound_and_offers_not_ahead_or_far_ahead_are_not_held():
    async def scenario() -> None:
        gate = RoundGate()
        assert gate.may_hold(7)  # no round yet (the first one, or a joiner): any offer may be a moment early
        gate.advance_(3)
        assert 0.2 <= await gate.wait_for(4, hold_s=0.2) < 1.0  # the round never came
        assert await gate.wait_for(3, hold_s=5.0) < 0.1  # our round: judged at once
        assert await gate.wait_for(2, hold_s=5.0) < 0.1  # a past round: judged (refused) at once
        assert await gate.wait_for(3 + MAX_STAGES_AHEAD + 1, hold_s=5.0) < 0.1  # too far ahead to be a moment
        assert gate.may_hold(3 + MAX_STAGES_AHEAD)

    asyncio.run(scenario())
