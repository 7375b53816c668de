"""Relays for peers behind NAT: a public node passes streams between peers that cannot connect to each other.

A peer nobody can connect to takes a *slot* on a relay (`rpc_register`, renewed before its lease runs out): it
opens the connection, so the relay can open streams back over it. A peer that wants a stream to it opens one to
the relay (`rpc_forward`) naming the target and the service; the relay opens a stream to the target's
`RelayEntry` (`rpc_relayed`) and passes messages both ways until either end closes. The target serves it as if the
initiator had called it directly (the exchange, the state download, a sketch), under the initiator's peer id as
the relay vouches for it.

libp2p's own circuit relay cannot do this here: p2pd's relays are "limited" (128 KiB and 2 minutes per relayed
connection, whatever its -relayDataLimit says), a size for hole punching, not for a model's payload.

What a relay grants (`RelayLimits`): a bounded number of slots (in all and per host), of circuits at once (in all,
per peer and per host), a rate for all relayed bytes together (a circuit beyond it waits: one relay is never
saturated, and its own traffic keeps a share), and an idle bound per circuit. A host is the address a peer's
connection comes from (`net/remote_hosts.py`): identities are free, so one machine's identities share its caps.
In a signed run, slots and circuits go only to peers whose request carries their ticket (the organiser's signature
of their peer id, which libp2p authenticates): 65 unticketed identities from one host took all 64 slots of a
bootstrap, and 4 of them all 16 circuits.

A relay is trusted by the peers that take its slots: it could claim any sender toward them (the offences of a
relayed exchange are charged as if the sender had sent it), as any peer can send them what it likes; the bootstrap,
run by the organiser, is every swarm's first relay.
"""

# No `from __future__ import annotations`: hivemind's ServicerBase reads the rpc_* annotations at runtime.
import asyncio
import collections
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Callable
from typing import AsyncIterator  # noqa: UP035  (ServicerBase recognises typing.AsyncIterator only)

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto.averaging_pb2 import DownloadData

from p2ptrain.net.admission import AdmissionPolicy
from p2ptrain.net.dht import NetworkConfig
from p2ptrain.net.remote_hosts import RemoteHosts
from p2ptrain.net.routes import Route
from p2ptrain.net.wire import WireError, decode_metadata, drain, encode_metadata, refusal
from p2ptrain.timing import PATIENCE_S, SETUP_FLOOR_S, TICK_S, relay_lease_s

logger = logging.getLogger(__name__)

Service = Callable[[AsyncIterator[DownloadData], P2PContext], AsyncIterator[DownloadData]]
PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,64}")
SERVICE = re.compile(r"[a-z]{1,16}:[A-Za-z0-9_.:-]{1,200}")


NAMESPACE = "p2ptrain.relay"  # one for every run: a bootstrap relays for any run's peers (within its limits)


@dataclasses.dataclass(frozen=True)
class RelayLimits:
    """What a relay grants the peers of its run."""

    max_clients: int = 64  # peers holding a slot at once
    max_circuits: int = 16  # relayed streams open at once, in all; beyond, refused as busy
    per_peer: int = 4  # relayed streams one peer opens at once
    # one host's share of the slots and of the circuits: the peers of one home or campus behind one NAT address
    # use a relay at once, a flood of identities from one machine takes no more
    per_host_clients: int = 8
    per_host_circuits: int = 8
    bytes_per_s: float = NetworkConfig.relay_mbit * 1e6 / 8  # every relayed byte, both directions together
    lease_s: float = relay_lease_s(TICK_S)  # a slot lapses this long after its last renewal
    idle_s: float = PATIENCE_S  # a circuit in which nobody sent a message for this long is closed

    @classmethod
    def of(cls, config: NetworkConfig) -> "RelayLimits":
        """The limits a relay with this network config grants."""
        return cls(config.relay_max_clients, config.relay_max_circuits, bytes_per_s=config.relay_mbit * 1e6 / 8,
                   lease_s=relay_lease_s(config.heartbeat_s))

    def __post_init__(self) -> None:
        if min(self.max_clients, self.max_circuits, self.per_peer, self.per_host_clients,
               self.per_host_circuits) < 1 or min(
                self.bytes_per_s, self.lease_s, self.idle_s) <= 0:
            raise ValueError("relay limits: counts must be >= 1 and bytes_per_s, lease_s, idle_s > 0")


class ByteBudget:
    """Paces bytes to `bytes_per_s` on average, in bursts of a quarter second's worth: `spend` waits its turn."""

    def __init__(self, bytes_per_s: float):
        self.rate, self.burst = bytes_per_s, bytes_per_s / 4
        self.tokens, self.at = self.burst, time.monotonic()

    async def spend(self, nbytes: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate) - nbytes
        self.at = now
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


async def _paced(messages: AsyncIterator[DownloadData], idle_s: float, budget: ByteBudget,
                 counted: Callable[[int], None]) -> AsyncIterator[DownloadData]:
    """Messages as they come, each within `idle_s` of the last, paced by `budget`, their bytes `counted`."""
    while True:
        try:
            message = await asyncio.wait_for(messages.__anext__(), idle_s)
        except (StopAsyncIteration, asyncio.TimeoutError):
            return
        size = message.ByteSize()
        await budget.spend(size)
        counted(size)
        yield message


class RelayServer(ServicerBase):
    """A relay: slots for peers behind NAT, and the streams it passes between peers (see the module's doc)."""

    def __init__(self, p2p: P2P, namespace: str, limits: RelayLimits = RelayLimits(),
                 policy: AdmissionPolicy | None = None):
        self.p2p, self.namespace, self.limits = p2p, namespace, limits
        self.policy = policy  # a signed run's: who may take a slot or open a circuit (None or open: anyone)
        self.hosts = RemoteHosts.of(p2p)
        self.clients: dict[str, float] = {}  # slot holder → when its lease ends (monotonic)
        self.client_hosts: dict[str, str] = {}  # slot holder → the host it connects from (when it has one)
        self.circuits = collections.Counter[str]()  # open circuits per initiator
        self.host_circuits = collections.Counter[str]()  # open circuits per initiator's host
        self.budget = ByteBudget(limits.bytes_per_s)
        self.relayed_bytes = 0  # every byte passed, both directions
        self.served = self.refused = 0  # circuits opened, refused

    async def rpc_register(self, request: DownloadData, context: P2PContext) -> DownloadData:
        """Take or renew a slot for the caller: {"status": "ok", "lease_s": s} or a refusal."""
        peer = context.remote_id.to_base58()
        not_admitted = self._not_admitted(peer, request)
        if not_admitted is not None:
            return refusal(not_admitted)
        host, now = await self.hosts.host_of(peer), time.monotonic()
        self.clients = {p: end for p, end in self.clients.items() if end > now}
        self.client_hosts = {p: h for p, h in self.client_hosts.items() if p in self.clients}
        if peer not in self.clients:
            if len(self.clients) >= self.limits.max_clients:
                return refusal(f"all {self.limits.max_clients} relay slots are taken")
            if host is not None and list(self.client_hosts.values()).count(host) >= self.limits.per_host_clients:
                return refusal(f"all {self.limits.per_host_clients} relay slots one host may hold are taken")
        self.clients[peer] = now + self.limits.lease_s
        if host is not None:
            self.client_hosts[peer] = host
        return DownloadData(metadata=encode_metadata({"status": "ok", "lease_s": self.limits.lease_s}))

    async def rpc_forward(self, requests: AsyncIterator[DownloadData],
                          context: P2PContext) -> AsyncIterator[DownloadData]:
        source = context.remote_id.to_base58()
        try:
            first = await asyncio.wait_for(requests.__anext__(), self.limits.idle_s)
            routing = decode_metadata(first.metadata)
        except (StopAsyncIteration, asyncio.TimeoutError, WireError):
            return
        target, service = routing.get("to"), routing.get("service")
        host = await self.hosts.host_of(source)
        why_not = self._not_admitted(source, first) or self._admit(source, host, target, service)
        if why_not is not None:
            self.refused += 1
            yield refusal(why_not)
            # a refusal's stream stays open for what the initiator still sends (here and below): closed at once,
            # p2pd resets it and the refusal is lost (wire.drain)
            await drain(requests, SETUP_FLOOR_S)
            return
        held = [(self.circuits, source)] + ([(self.host_circuits, host)] if host is not None else [])
        for counter, key in held:
            counter[key] += 1
        self.served += 1
        try:
            async for message in self._pass(source, str(target), str(service), requests):
                yield message
        finally:
            for counter, key in held:
                counter[key] -= 1
                if not counter[key]:
                    del counter[key]

    def _not_admitted(self, peer: str, request: DownloadData) -> str | None:
        """Why the run refuses `peer` (a signed run: its request carries no valid ticket), or None."""
        if self.policy is None or not self.policy.signed:
            return None
        try:
            ticket = decode_metadata(request.metadata).get("ticket", "")
        except WireError:
            return "malformed relay request"
        problem = self.policy.ticket_problem(peer, ticket if isinstance(ticket, str) else "")
        return None if problem is None else f"not admitted to this run: {problem}"

    def _admit(self, source: str, host: str | None, target: object, service: object) -> str | None:
        if not isinstance(target, str) or not isinstance(service, str) or not SERVICE.fullmatch(service):
            return "malformed relay request"
        if self.clients.get(target, 0.0) <= time.monotonic():
            return f"{target} holds no slot on this relay"
        if self.circuits.total() >= self.limits.max_circuits:
            return "relay busy"
        if self.circuits[source] >= self.limits.per_peer:
            return f"more than {self.limits.per_peer} relayed streams at once"
        if host is not None and self.host_circuits[host] >= self.limits.per_host_circuits:
            return f"more than {self.limits.per_host_circuits} relayed streams at once from one host"
        return None

    def _count(self, nbytes: int) -> None:
        self.relayed_bytes += nbytes

    async def _pass(self, source: str, target: str, service: str,
                    requests: AsyncIterator[DownloadData]) -> AsyncIterator[DownloadData]:
        """The circuit: the initiator's messages to the target's entry, and its answers back, paced."""
        async def upstream() -> AsyncIterator[DownloadData]:
            yield DownloadData(metadata=encode_metadata({"from": source, "service": service}))
            async for message in _paced(requests, self.limits.idle_s, self.budget, self._count):
                yield message

        stub = RelayEntry.get_stub(self.p2p, PeerID.from_base58(target), namespace=self.namespace)
        try:
            responses = await asyncio.wait_for(stub.rpc_relayed(upstream()), self.limits.idle_s)
        except Exception as e:  # the target's slot outlived its connection: P2P errors, timeouts
            logger.debug(f"relay: cannot reach {target}: {e!r}")
            yield refusal(f"the relay cannot reach {target}")
            await drain(requests, SETUP_FLOOR_S)
            return
        async with contextlib.aclosing(responses):
            async for message in _paced(responses, self.limits.idle_s, self.budget, self._count):
                yield message


class RelayEntry(ServicerBase):
    """A peer's door for streams relays pass to it: only from relays it holds a slot on (`relays`), and only to
    the services it registered (`add_service`: the exchange kinds, the state download and sketches)."""

    def __init__(self) -> None:
        self.services: dict[str, Service] = {}
        self.relays: set[str] = set()

    def add_service(self, name: str, service: Service) -> None:
        self.services[name] = service

    async def rpc_relayed(self, requests: AsyncIterator[DownloadData],
                          context: P2PContext) -> AsyncIterator[DownloadData]:
        if context.remote_id.to_base58() not in self.relays:
            yield refusal("this peer holds no slot on that relay")
            await drain(requests, SETUP_FLOOR_S)
            return
        try:
            routing = decode_metadata((await asyncio.wait_for(requests.__anext__(), RelayLimits.idle_s)).metadata)
        except (StopAsyncIteration, asyncio.TimeoutError, WireError):
            return
        source, service = routing.get("from"), routing.get("service")
        handler = self.services.get(service) if isinstance(service, str) else None
        if handler is None or not isinstance(source, str) or not PEER_ID.fullmatch(source):
            yield refusal("unknown service or malformed sender")
            await drain(requests, SETUP_FLOOR_S)
            return
        inner = P2PContext(handle_name=str(service), local_id=context.local_id, remote_id=PeerID.from_base58(source))
        async for message in handler(requests, inner):
            yield message
        # a service that answers without reading its request's end (the state download, a sketch): returning at
        # once would reset the stream while the relay's last message is on its way, losing the answer in flight
        await drain(requests, SETUP_FLOOR_S)


async def open_relayed(p2p: P2P, route: Route, target: PeerID, service: str,
                       requests: AsyncIterator[DownloadData]) -> AsyncIterator[DownloadData]:
    """A stream to `service` of `target` through `route`'s relay: what a direct stub call would return."""
    async def routed() -> AsyncIterator[DownloadData]:
        yield DownloadData(metadata=encode_metadata({"to": target.to_base58(), "service": service,
                                                     "ticket": route.ticket}))
        async for message in requests:
            yield message

    stub = RelayServer.get_stub(p2p, PeerID.from_base58(route.relay), namespace=route.namespace)
    return await stub.rpc_forward(routed())


async def take_slot(p2p: P2P, relay: str, namespace: str, timeout_s: float, ticket: str = "") -> float:
    """Take or renew a slot on `relay` (with our `ticket` in a signed run); its lease in seconds. Raises WireError
    when refused, P2P errors or TimeoutError when the relay does not answer."""
    stub = RelayServer.get_stub(p2p, PeerID.from_base58(relay), namespace=namespace)
    request = DownloadData(metadata=encode_metadata({"ticket": ticket}))
    answer = decode_metadata((await stub.rpc_register(request, timeout=timeout_s)).metadata)
    lease_s = answer.get("lease_s")
    if answer.get("status") != "ok" or not isinstance(lease_s, (int, float)) or not 1 <= lease_s <= 3600:
        raise WireError(f"relay {relay} gave no slot: {str(answer.get('reason', 'malformed answer'))[:200]}")
    return float(lease_s)
