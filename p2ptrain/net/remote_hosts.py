"""Which machine a connected peer reaches us from. Identities are free and addresses are not, so what one machine
may hold (relay slots, relayed streams, state downloads, exchanges) is capped per host as well as per identity.

hivemind's `P2PContext` names the remote peer id only; p2pd's list of connections (`P2P.list_peers`) gives each
connected peer the remote address of its connection: the address its packets come from, not one it claims. The
list is read again when older than `refresh_s`, and (at most every `MIN_READ_S`) for a peer that was not in the
last read: a stream comes over a connection, so a new peer's is already there. A read that takes longer than
`READ_TIMEOUT_S` (a daemon under load) is given up, and what the last one said stands.

A peer has no host here when it is reached only through a circuit, or from this machine's loopback address (a
testnet of many peers on one machine is one operator's). Only its per-identity caps apply to it then.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
import weakref
from collections.abc import Callable, Sequence

from hivemind.p2p import P2P

logger = logging.getLogger(__name__)

REFRESH_S = 5.0  # a host seen for a peer is trusted this long (a peer id keeps its connection's address)
MIN_READ_S = 0.1  # the list is read at most this often, however many unknown peers open streams
READ_TIMEOUT_S = 1.0  # a stream waits this long at most for the list before it is admitted on what we knew
OWN_MACHINE = ("127.0.0.1", "::1")  # this machine's own loopback addresses: no host cap
IP_ADDRESS = re.compile(r"^/ip[46]/([^/]+)/")


def host_of_address(maddr: str) -> str | None:
    """The IP address a connection's remote multiaddr comes from; None for a circuit, this machine's loopback, or
    anything that is not an IP address."""
    match = IP_ADDRESS.match(maddr)
    if match is None or "/p2p-circuit" in maddr:
        return None
    try:
        host = str(ipaddress.ip_address(match.group(1)))
    except ValueError:
        return None
    return None if host in OWN_MACHINE else host


class RemoteHosts:
    """Connected peer ids → the host each connects from, as p2pd's connection list says."""

    _of_p2p: weakref.WeakKeyDictionary[P2P, RemoteHosts] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, p2p: P2P) -> RemoteHosts:
        """The one reader of `p2p`'s connections that its services share."""
        hosts = cls._of_p2p.get(p2p)
        if hosts is None:
            hosts = cls._of_p2p[p2p] = cls(p2p)
        return hosts

    def __init__(self, p2p: P2P, refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic):
        self.p2p = weakref.ref(p2p)  # not a strong one: `of` keys its readers by their P2P, weakly
        self.refresh_s, self.clock = refresh_s, clock
        self._hosts: dict[str, str | None] = {}  # every peer of the last read: its host, or None (no host cap)
        self._read_at = -float("inf")
        self._reading = asyncio.Lock()

    async def host_of(self, peer: str) -> str | None:
        """The host `peer` (base58) connects from, or None (see the module's doc)."""
        age = self.clock() - self._read_at
        if age > self.refresh_s or (peer not in self._hosts and age > MIN_READ_S):
            await self._read()
        return self._hosts.get(peer)

    async def hosts_of(self, peers: Sequence[str]) -> dict[str, str | None]:
        """The host each of `peers` connects from (None: see the module's doc), from one read of the list at most."""
        age = self.clock() - self._read_at
        if age > self.refresh_s or (any(p not in self._hosts for p in peers) and age > MIN_READ_S):
            await self._read()
        return {peer: self._hosts.get(peer) for peer in peers}

    async def _read(self) -> None:
        async with self._reading:
            if self.clock() - self._read_at <= MIN_READ_S:  # another caller read it while we waited
                return
            p2p = self.p2p()
            if p2p is None:  # its P2P is gone: so are its connections
                self._hosts = {}
                return
            try:
                peers = await asyncio.wait_for(p2p.list_peers(), READ_TIMEOUT_S)
            except Exception as e:  # a busy daemon, or one going away: keep what we knew
                logger.debug(f"cannot list connections: {e!r}")
                self._read_at = max(self._read_at, self.clock() - self.refresh_s + MIN_READ_S)  # not again at once
                return
            self._hosts = {info.peer_id.to_base58(): next(
                (h for h in (host_of_address(str(a)) for a in info.addrs) if h is not None), None) for info in peers}
            self._read_at = self.clock()
