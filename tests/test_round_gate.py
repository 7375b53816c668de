"""Holding an offer for a round a moment away (sync/round_gate.py): how long the initiator's word may make us hold
it, and which offers are held at all."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from swarm_utils import shutdown, start_p2ps

from p2ptrain.maths.codecs import compress_all, get_codec
from p2ptrain.net import exchange
from p2ptrain.net.exchange import serve_exchanges
from p2ptrain.net.reputation import Reputation
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


# ---- the exchange protocol's side: a held offer is announced, a silent partner is not waited for -------------------

NAMESPACE = "round-gate-test.allreduce"


class LateResponder:
    """A handler that holds every offer `hold_s` (None: judges at once), then accepts it with a 4-value answer."""

    namespace, max_payload_bytes, chunk_timeout_s = NAMESPACE, 2**20, 5.0

    def __init__(self, hold_s: float | None):
        self.hold_s, self.reputation, self.applied = hold_s, Reputation(), 0

    def hold(self, header: dict[str, Any]) -> Any:
        return None if self.hold_s is None else asyncio.sleep(self.hold_s)

    def open(self, header: dict[str, Any]) -> Any:
        responder = self

        class Answer:
            header, payload = {"round": 0}, compress_all(get_codec("none"), [torch.ones(4)])

            def validate(self, partner_header: dict[str, Any], partner_payload: Any) -> Any:
                return lambda: setattr(responder, "applied", responder.applied + 1)

            def close(self) -> None:
                pass

        return Answer()


class GossipServicer(exchange.GossipServicer):  # same class name: hivemind routes calls by it
    """A partner that vanished: it takes the stream and never says a word."""

    def __init__(self) -> None:
        super().__init__(handler=LateResponder(None), max_payload_bytes=2**20, chunk_timeout_s=5.0)

    async def rpc_exchange(self, requests: Any, _context: Any) -> AsyncIterator[Any]:
        await asyncio.sleep(60)
        yield None


def offer_to(a: Any, b: Any, deadline_s: float, hold_s: float) -> Any:
    payload = compress_all(get_codec("none"), [torch.zeros(4)])
    return exchange.push_pull(a, b.peer_id, NAMESPACE, {"round": 0}, payload, lambda h, p: lambda: None, 2**20,
                              deadline_s=deadline_s, hold_s=hold_s)


@pytest.mark.network
def test_a_held_offer_is_answered_after_its_deadline_and_a_silent_partner_is_dropped_at_it():
    """Held 1.5 s with a 1 s deadline: the responder said 'held' at once, so the initiator waits for the answer (up
    to deadline + hold). A partner that says nothing at all is dropped at the deadline, however long the hold
    offered: a member that vanished costs what it cost before offers could be held."""
    async def scenario() -> None:
        a, b, c = await start_p2ps(3)
        try:
            responder = LateResponder(1.5)
            await serve_exchanges(b, responder)
            outcome = await offer_to(a, b, deadline_s=1.0, hold_s=3.0)
            outcome.apply()
            assert responder.applied == 1 and 1.5 <= outcome.seconds < 3.0
            assert 1.4 <= outcome.partner_header["held_s"] <= outcome.seconds
            await GossipServicer().add_p2p_handlers(c, namespace=NAMESPACE)
            started = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await offer_to(a, c, deadline_s=1.0, hold_s=30.0)
            assert time.monotonic() - started < 3.0
        finally:
            await shutdown([a, b, c])

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


@pytest.mark.network
def test_a_partner_that_says_it_holds_an_offer_granted_no_hold_is_dropped_at_once_for_an_offence():
    """Gossip grants no hold (an honest responder then judges an offer at once). An identity that said 'held' anyway,
    then nothing, cost each initiator the whole deadline; it breaks a rule no honest peer does, and is dropped the
    moment it says it. With a hold granted, the same answer is waited for, as before."""
    async def scenario() -> None:
        a, b = await start_p2ps(2)
        try:
            await serve_exchanges(b, LateResponder(30.0))  # holds whatever it was granted
            started = time.monotonic()
            with pytest.raises(exchange.UngrantedHold):
                await offer_to(a, b, deadline_s=20.0, hold_s=0.0)
            assert time.monotonic() - started < 10.0  # not the 20 s deadline
            with pytest.raises(asyncio.TimeoutError):  # granted 0.5 s: waited for up to the deadline and the hold
                await offer_to(a, b, deadline_s=1.0, hold_s=0.5)
        finally:
            await shutdown([a, b])

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))
