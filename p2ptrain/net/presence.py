"""How this peer can be reached, found out once it has joined and kept up to date: the dial-back self-test
(net/reachability.py), then, if nobody can connect to it, a slot on a relay (net/relay.py), renewed, and another
relay's when that one goes. The answer goes into the peer's record (others' `Routes` read it), its own `Routes`,
and one log line whenever it changes.

It runs on the peer's event loop and never blocks it: helpers and relays are asked with bounded timeouts, in turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from hivemind.p2p import P2P

from p2ptrain.net.reachability import MAX_PORTS, Reachability, ask_dial_back
from p2ptrain.net.relay import RelayEntry, take_slot
from p2ptrain.net.routes import DIRECT, OUTBOUND, RELAYED, UNKNOWN, Presence, Routes
from p2ptrain.timing import DIAL_S, POLL_S

logger = logging.getLogger(__name__)


class PresenceAgent:
    """Finds and keeps this peer's reachability. `helpers()` lists peers to ask for a dial-back (initial peers
    first), `relays()` relays to try, best first (the swarm's, then initial peers); `publish(**fields)` puts the
    answer into our record. A slot taken on a relay the swarm does not announce (an initial peer, the bootstrap:
    the only relay a peer knows before it has read the swarm's records) is given up for one of the swarm's once
    there is one: in a 32-peer netns swarm all 8 NATed peers held the bootstrap's, which answers every joiner."""

    def __init__(self, p2p: P2P, routes: Routes, entry: RelayEntry, dial_back_namespace: str,
                 helpers: Callable[[], list[str]], relays: Callable[[], list[str]],
                 publish: Callable[..., None], use_relays: bool, retry_s: float):
        self.p2p, self.routes, self.entry, self.namespace = p2p, routes, entry, dial_back_namespace
        self.helpers, self.relays, self.publish, self.use_relays = helpers, relays, publish, use_relays
        self.retry_s = retry_s  # how often an unknown answer is asked again, and an outbound peer looks for a relay
        # one helper's dial-back (its dials of our ports, one after another, and our question) or one relay's answer
        self.ask_timeout_s = (MAX_PORTS + 1) * DIAL_S
        self.state = Reachability(Presence())
        self.told = ""  # the last line logged
        self.looks = 0  # how often it has looked for a relay (or would have, without `use_relays`)
        # the relay we hold is none the swarm announced when we took it (an initial peer's): left for one that is.
        # A relay taken from the swarm's is kept while it answers (a record missing from one read moves nobody)
        self.on_fallback = False
        self.stopped = asyncio.Event()

    async def run(self) -> None:
        """Test, then keep the answer until `stop()`: renew the relay slot, replace a lost relay."""
        ports = await self._ports()
        seen_as, reached = await self._test(ports)
        if reached:
            self._settle(Reachability(Presence(DIRECT, "", seen_as), reached, ports))
            return
        while not self.stopped.is_set():
            self.looks += 1
            relay, lease_s = await self._take_any_slot() if self.use_relays else ("", 0.0)
            self._settle(Reachability(Presence(RELAYED if relay else OUTBOUND, relay, seen_as), "", ports))
            await self._hold(relay, lease_s)

    def stop(self) -> None:
        self.stopped.set()

    async def _ports(self) -> tuple[int, ...]:
        maddrs = [str(m) for m in await self.p2p.get_visible_maddrs(latest=True)]
        ports = [int(m.split("/tcp/")[1].split("/")[0]) for m in maddrs if "/tcp/" in m and "p2p-circuit" not in m]
        return tuple(dict.fromkeys(ports))

    async def _test(self, ports: Sequence[int]) -> tuple[str, str]:
        """(the IP helpers see us at, the address one reached us at or ""), asking helpers in turn; asks again
        every `retry_s` until one answers."""
        while not self.stopped.is_set():
            for helper in self.helpers():
                try:
                    return await ask_dial_back(self.p2p, helper, self.namespace, ports, self.ask_timeout_s)
                except Exception as e:  # refused, malformed, P2P errors, timeouts: the next helper
                    logger.debug(f"dial-back by {helper} failed: {e!r}")
            self._settle(Reachability(Presence(UNKNOWN), "", tuple(ports)))
            await self._pause(self.retry_s)
        return "", ""

    async def _take_any_slot(self) -> tuple[str, float]:
        for relay in self.relays():
            try:
                lease_s = await take_slot(self.p2p, relay, self.routes.relay_namespace, self.ask_timeout_s,
                                          self.routes.ticket)
            except Exception as e:  # refused, P2P errors, timeouts: the next relay
                logger.debug(f"relay {relay} gave no slot: {e!r}")
                continue
            self.entry.relays = {relay}
            self.on_fallback = relay not in self.routes.relays()
            return relay, lease_s
        self.entry.relays = set()
        return "", 0.0

    async def _hold(self, relay: str, lease_s: float) -> None:
        """Renew the slot every third of its lease while the relay answers; without a relay, wait `retry_s`. Between
        renewals it watches the connection to the relay (every POLL_S): streams reach us through that
        connection only, so once it is gone (the relay died, or the link dropped) it renews at once, which dials
        the relay again or finds it gone, rather than staying unreachable for the rest of a third of the lease."""
        if not relay:
            await self._pause(self.retry_s)
            return
        renew_at = time.monotonic() + lease_s / 3
        while not self.stopped.is_set():
            await self._pause(max(0.0, min(POLL_S, renew_at - time.monotonic())))
            if self.stopped.is_set() or (time.monotonic() < renew_at and await self._connected(relay)):
                continue
            if self.on_fallback and self._swarm_relays_besides(relay):  # `run` takes a slot on one of those
                logger.debug(f"relay {relay} is no relay the swarm announces, and the swarm has some: moving")
                return
            try:
                lease_s = await take_slot(self.p2p, relay, self.routes.relay_namespace,
                                          min(self.ask_timeout_s, lease_s), self.routes.ticket)
            except Exception as e:
                if not self.stopped.is_set():  # (a renewal cut short by our own shutdown is no news)
                    logger.info(f"relay {relay} is gone ({type(e).__name__}); looking for another")
                self.entry.relays = set()
                return
            renew_at = time.monotonic() + lease_s / 3

    def _swarm_relays_besides(self, relay: str) -> bool:
        """Whether the swarm announces relays (`Routes.relays`) other than `relay`."""
        return any(p not in (relay, self.routes.own_id) for p in self.routes.relays())

    async def _connected(self, relay: str) -> bool:
        """Whether the daemon holds a connection to `relay` (a local question; when it cannot answer: yes, and the
        next renewal tells)."""
        try:
            return any(info.peer_id.to_base58() == relay for info in await self.p2p.list_peers())
        except Exception as e:
            logger.debug(f"could not list connections: {e!r}")
            return True

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stopped.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def _settle(self, state: Reachability) -> None:
        """Adopt a (new) answer: our routes, our record, and the line, when it changed."""
        self.state, presence = state, state.presence
        if presence != self.routes.own:
            self.routes.set_own_(presence)
            self.publish(reach=presence.reach, relay_via=presence.relay_via, seen_as=presence.seen_as)
        line = state.line()
        if line != self.told:
            self.told = line
            (logger.warning if presence.reach == OUTBOUND else logger.info)(line)
