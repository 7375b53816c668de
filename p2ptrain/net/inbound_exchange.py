"""The responder's side of one inbound exchange (net/exchange.py): the slot it holds, its deadline timer, and what
its end releases and costs its initiator."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from hivemind.proto import averaging_pb2

from p2ptrain.net.reputation import Reputation
from p2ptrain.net.responder_limits import Slots

logger = logging.getLogger(__name__)


class InboundExchange:
    """One inbound exchange holding a slot: who offers it, its messages, its deadline, and what to release.

    The deadline is a timer that cancels the task serving the exchange (hivemind serves each inbound stream in its
    own task, and ends the stream when that task ends). It is the one bound that also holds while we are suspended
    handing our payload to an initiator that stopped reading it: no timeout of ours runs then.
    """

    def __init__(self, peer: str, requests: AsyncIterator[averaging_pb2.DownloadData], slots: Slots,
                 reputation: Reputation, host: str | None = None):
        self.peer, self.requests, self.slots, self.reputation = peer, requests, slots, reputation
        self.host = host  # the host its slot counts against (None: no host cap)
        self.started = time.monotonic()  # when we were ready to read its payload (after a hold)
        self.held_s = 0.0  # how long the handler held the offer before judging it
        self.close_opened: Callable[[], None] | None = None  # releases the handler's exchange, once it opened one
        self._task = asyncio.current_task()
        self._timer: asyncio.TimerHandle | None = None
        self._released = False
        self.payload_sent = self.committed = self.penalised = False  # our value shown; it committed; it paid

    def arm(self, seconds: float, offence: str) -> None:
        """Drop the exchange `seconds` from now, and penalise its sender for `offence`."""
        self.disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire, offence)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def release(self) -> None:
        """Free our slot and the handler's exchange, once: when the task ends or at the deadline, whichever comes
        first (a task cancelled while suspended in our `yield` finalizes this generator only later)."""
        if not self._released:
            self._released = True
            self.disarm()
            if self.payload_sent and not self.committed:  # it saw our value and walked away (or the stream broke)
                self.penalise("uncommitted", "took our payload and ended without a commit")
            self.slots.give_back(self.peer, self.host)
            if self.close_opened is not None:
                self.close_opened()

    def penalise(self, offence: str, detail: str) -> None:
        """Record this exchange's one offence (a later one of the same exchange is not counted again)."""
        if not self.penalised:
            self.penalised = True
            self.reputation.penalise(self.peer, offence, detail)

    def _expire(self, offence: str) -> None:
        detail = f"exchange dropped after {time.monotonic() - self.started:.1f} s"
        logger.info(f"{detail}: {self.peer} ({offence})")
        self.penalise(offence, detail)
        self.release()
        if self._task is not None:
            self._task.cancel()
