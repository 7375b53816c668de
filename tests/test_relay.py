"""Relays for peers behind NAT (net/relay.py) on real hivemind P2P over loopback: a gossip exchange and a state
download pass through a relay, bit for bit as directly; what a relay refuses (no slot, busy, too many streams
from one peer, not its client); and its byte budget holds relayed traffic to its rate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import averaging_pb2

from p2ptrain.net.admission import (
    AdmissionPolicy,
    generate_organiser_key,
    load_organiser_key,
    load_signing_key,
    sign_ticket,
)
from p2ptrain.net.discovery import PeerRecord
from p2ptrain.net.exchange import ExchangeRefused, push_pull, serve_exchanges
from p2ptrain.net.presence import PresenceAgent
from p2ptrain.net.relay import NAMESPACE, ByteBudget, RelayEntry, RelayLimits, RelayServer, open_relayed, take_slot
from p2ptrain.net.routes import DIRECT, RELAYED, Presence, Route, Routes
from p2ptrain.net.state_sharing import SnapshotExpectation, StateServer, StateSnapshot, download_state
from p2ptrain.net.wire import WireError, decode_metadata, encode_metadata
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.param_gossip import ParamGossip
from p2ptrain.tensor_layout import layout_of

pytestmark = [pytest.mark.network]

RUN, FINGERPRINT = "relayed", "fp-1"
SHAPES = [(64, 32), (32,)]
OPTIONS: dict[str, Any] = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False,
                               use_relay=False)


def reference() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(s) for s in SHAPES]


def mixer(p2p: P2P, routes: Routes | None = None) -> ParamGossip:
    return ParamGossip(p2p, RUN, FINGERPRINT, "gasloc", reference(), SyncConfig(mode="gasloc", robust=False), seed=0,
                       routes=routes)


async def three_nodes(limits: RelayLimits = RelayLimits(), policy: AdmissionPolicy | None = None
                      ) -> tuple[P2P, P2P, P2P, RelayServer, RelayEntry]:
    """A relay, a target that holds a slot on it (its `RelayEntry` admits the relay), and an initiator."""
    relay = await P2P.create(**OPTIONS)
    target = await P2P.create(initial_peers=await relay.get_visible_maddrs(), **OPTIONS)
    initiator = await P2P.create(initial_peers=await relay.get_visible_maddrs(), **OPTIONS)
    server = RelayServer(relay, NAMESPACE, limits, policy)
    await server.add_p2p_handlers(relay, namespace=NAMESPACE)
    entry = RelayEntry()
    await entry.add_p2p_handlers(target, namespace=NAMESPACE)
    return relay, target, initiator, server, entry


def routes_via(initiator: P2P, target: P2P, relay: P2P) -> Routes:
    routes = Routes(initiator.peer_id.to_base58(), NAMESPACE)
    routes.known[target.peer_id.to_base58()] = Presence(RELAYED, relay.peer_id.to_base58(), "10.0.0.9")
    return routes


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Wait (on the event loop) until `condition` holds: a relay closes a circuit once both ends closed theirs."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.05)


async def shut(*nodes: P2P) -> None:
    for node in nodes:
        await node.shutdown()


def test_a_gossip_exchange_through_a_relay_mixes_as_a_direct_one_and_the_relay_counts_its_bytes() -> None:
    async def scenario() -> None:
        relay, target, initiator, server, entry = await three_nodes()
        try:
            lease_s = await take_slot(target, relay.peer_id.to_base58(), NAMESPACE, timeout_s=10)
            entry.relays = {relay.peer_id.to_base58()}
            responder = mixer(target)
            await serve_exchanges(target, responder.driver, entry)
            ours, theirs = [t + 0.01 for t in reference()], [t - 0.01 for t in reference()]
            for m, value in ((responder, theirs), (mixer(initiator), ours)):
                m.set_base_(reference())
                m.set_base_(value)
            starter = mixer(initiator, routes_via(initiator, target, relay))
            starter.set_base_(reference())
            starter.set_base_(ours)
            mixed, stats = await starter.mix(ours, [target.peer_id.to_base58()], round_=0)
            assert lease_s == RelayLimits().lease_s and stats.partners == [target.peer_id.to_base58()]
            correction = responder.take_correction_()
            for m, o, t, c in zip(mixed, ours, theirs, correction, strict=True):
                assert torch.allclose(m, (o + t) / 2, atol=1e-3) and torch.allclose(t + c, m, atol=2e-3)
            payload_bytes = sum(2 * t.numel() for t in ours)  # fp16 both ways
            assert 2 * payload_bytes <= server.relayed_bytes <= 2 * payload_bytes + 4096  # + protobuf envelopes
            assert server.served == 1
            await until(lambda: not server.circuits, "the circuit to close")  # once the responder drained it
        finally:
            await shut(initiator, target, relay)

    asyncio.run(asyncio.wait_for(scenario(), timeout=90))


def test_a_state_download_through_a_relay_is_the_donors_snapshot() -> None:
    async def scenario() -> None:
        relay, target, initiator, _server, entry = await three_nodes()
        try:
            await take_slot(target, relay.peer_id.to_base58(), NAMESPACE, timeout_s=10)
            entry.relays = {relay.peer_id.to_base58()}
            named = [(f"param:{i}", t) for i, t in enumerate(reference())]
            snapshot = StateSnapshot.capture({"round": 3, "run_id": RUN, "fingerprint": FINGERPRINT}, named)
            state_server = StateServer(lambda: snapshot)
            state_server.serve_relayed(entry, RUN)
            route = Route(relay.peer_id.to_base58(), NAMESPACE)
            expected = layout_of([n for n, _ in named], [t for _, t in named])
            got = await download_state(initiator, target.peer_id, RUN, expected, 10**7, 10.0,
                                       SnapshotExpectation(RUN, FINGERPRINT, 3, 4), route=route)
            assert got.round == 3 and all(torch.equal(a, b) for a, b in zip(got.tensors, snapshot.tensors,
                                                                                strict=True))
        finally:
            await shut(initiator, target, relay)

    asyncio.run(asyncio.wait_for(scenario(), timeout=90))


async def echo_service(requests: AsyncIterator[averaging_pb2.DownloadData],
                       context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
    """Answers with who the relay vouched for, then waits for the initiator to close."""
    yield averaging_pb2.DownloadData(metadata=encode_metadata({"from": context.remote_id.to_base58()}))
    async for _ in requests:
        pass


async def one_message(relay: P2P, initiator: P2P, target: P2P, kept: list[Any] | None = None,
                      ticket: str = "") -> dict[str, Any]:
    """The first answer to a relayed "echo:test" stream; the stream stays open while it is in `kept`."""
    hold = asyncio.Event()

    async def requests() -> AsyncIterator[averaging_pb2.DownloadData]:
        yield averaging_pb2.DownloadData()
        await hold.wait()

    stream = await open_relayed(initiator, Route(relay.peer_id.to_base58(), NAMESPACE, ticket), target.peer_id,
                                "echo:test", requests())
    first = await asyncio.wait_for(stream.__anext__(), 10)
    if kept is None:
        hold.set()
        await stream.aclose()  # type: ignore[attr-defined]
    else:
        kept.append((stream, hold))
    return decode_metadata(first.metadata)


def test_a_relay_refuses_targets_without_a_slot_and_entries_refuse_relays_they_did_not_choose() -> None:
    async def scenario() -> None:
        relay, target, initiator, _server, entry = await three_nodes()
        try:
            entry.add_service("echo:test", echo_service)
            assert "holds no slot" in (await one_message(relay, initiator, target))["reason"]
            await take_slot(target, relay.peer_id.to_base58(), NAMESPACE, timeout_s=10)
            assert "holds no slot on that relay" in (await one_message(relay, initiator, target))["reason"]
            entry.relays = {relay.peer_id.to_base58()}
            assert (await one_message(relay, initiator, target)) == {"from": initiator.peer_id.to_base58()}
        finally:
            await shut(initiator, target, relay)

    asyncio.run(asyncio.wait_for(scenario(), timeout=90))


def test_a_relay_refuses_streams_beyond_its_circuits_and_a_full_relay_gives_no_slot() -> None:
    async def scenario() -> None:
        relay, target, initiator, server, entry = await three_nodes(RelayLimits(max_clients=1, max_circuits=2,
                                                                                per_peer=2))
        other = await P2P.create(initial_peers=await relay.get_visible_maddrs(), **OPTIONS)
        kept: list[Any] = []
        try:
            entry.add_service("echo:test", echo_service)
            await take_slot(target, relay.peer_id.to_base58(), NAMESPACE, timeout_s=10)
            entry.relays = {relay.peer_id.to_base58()}
            with pytest.raises(WireError, match="relay slots are taken"):
                await take_slot(other, relay.peer_id.to_base58(), NAMESPACE, timeout_s=10)
            held = await asyncio.gather(*(one_message(relay, initiator, target, kept) for _ in range(2)))
            assert all(answer["from"] == initiator.peer_id.to_base58() for answer in held)
            assert "relay busy" in (await one_message(relay, other, target))["reason"]
            assert server.refused == 1
            for stream, hold in kept:
                hold.set()
                await stream.aclose()
            await until(lambda: not server.circuits, "the held circuits to close")
            assert (await one_message(relay, other, target))["from"] == other.peer_id.to_base58()
        finally:
            await shut(other, initiator, target, relay)

    asyncio.run(asyncio.wait_for(scenario(), timeout=90))


async def node_on(address: str, relay: P2P) -> P2P:
    """A node listening (and so dialling) on `address`: 127.0.0.2, 127.0.0.3, ... are other hosts to a relay, where
    127.0.0.1, this machine's own, has no host cap."""
    return await P2P.create(initial_peers=await relay.get_visible_maddrs(), host_maddrs=[f"/ip4/{address}/tcp/0"],
                            nat_port_map=False, auto_nat=False, use_relay=False)


def test_the_identities_of_one_host_share_its_relay_slots_and_circuits() -> None:
    """Measured before: 65 identities from one host took all 64 slots of a bootstrap, and 4 of them all its
    circuits. Now a host's identities share its share of both, and a peer of another host still gets in."""
    async def scenario() -> None:
        relay, target, _initiator, server, entry = await three_nodes(RelayLimits(per_host_clients=2,
                                                                                  per_host_circuits=1))
        crowd = [await node_on("127.0.0.2", relay) for _ in range(3)]
        neighbour = await node_on("127.0.0.3", relay)
        relay_id, kept = relay.peer_id.to_base58(), []
        try:
            for node in crowd[:2]:
                await take_slot(node, relay_id, NAMESPACE, timeout_s=10)
            with pytest.raises(WireError, match="relay slots one host may hold are taken"):
                await take_slot(crowd[2], relay_id, NAMESPACE, timeout_s=10)
            await take_slot(crowd[0], relay_id, NAMESPACE, timeout_s=10)  # a renewal takes no second slot
            await take_slot(neighbour, relay_id, NAMESPACE, timeout_s=10)
            await take_slot(target, relay_id, NAMESPACE, timeout_s=10)  # 127.0.0.1: this machine's own
            assert sorted(server.client_hosts.values()) == ["127.0.0.2", "127.0.0.2", "127.0.0.3"]
            entry.relays = {relay_id}
            entry.add_service("echo:test", echo_service)
            assert (await one_message(relay, crowd[0], target, kept))["from"] == crowd[0].peer_id.to_base58()
            refused = await one_message(relay, crowd[2], target)  # another identity of the same host
            assert "relayed streams at once from one host" in refused["reason"], refused
            assert (await one_message(relay, neighbour, target))["from"] == neighbour.peer_id.to_base58()
            for stream, hold in kept:
                hold.set()
                await stream.aclose()
            await until(lambda: not server.host_circuits, "the held circuit to close")
            assert (await one_message(relay, crowd[2], target))["from"] == crowd[2].peer_id.to_base58()
        finally:
            await shut(neighbour, *crowd, _initiator, target, relay)

    asyncio.run(asyncio.wait_for(scenario(), timeout=90))


def test_the_byte_budget_holds_traffic_to_its_rate() -> None:
    async def scenario() -> float:
        budget, started = ByteBudget(bytes_per_s=2e6), time.monotonic()
        for _ in range(40):
            await budget.spend(50_000)  # 2 MB in all, 0.5 MB of it in the first burst
        return time.monotonic() - started

    assert 0.7 <= asyncio.run(scenario()) <= 2.0  # (2 MB − a 0.5 MB burst) at 2 MB/s


def test_an_exchange_refused_by_the_relay_is_a_refusal() -> None:
    async def scenario() -> None:
        relay, target, initiator, _server, _entry = await three_nodes()
        try:
            with pytest.raises(ExchangeRefused, match="holds no slot"):
                await push_pull(initiator, target.peer_id, f"{RUN}.gasloc", {}, [], lambda h, p: lambda: None,
                                10**6, 10.0, Route(relay.peer_id.to_base58(), NAMESPACE))
        finally:
            await shut(initiator, target, relay)

    asyncio.run(asyncio.wait_for(scenario(), timeout=90))


def test_a_relayed_peer_moves_on_once_its_connection_to_the_relay_is_gone_not_at_its_next_renewal() -> None:
    """The relay dies: the peer's watch of its connection notices within a fraction of a second and its renewal
    finds the relay gone (before, it noticed at the next renewal, a third of a lease later: 10 s here), so it is
    unreachable through a dead relay for about a round at most. While the relay lives, it does not renew early."""
    async def scenario() -> None:
        relay, target, initiator, server, entry = await three_nodes(RelayLimits(lease_s=30.0))
        relay_id, target_id = relay.peer_id.to_base58(), target.peer_id.to_base58()
        try:
            lease_s = await take_slot(target, relay_id, NAMESPACE, timeout_s=10)
            entry.relays = {relay_id}
            agent = PresenceAgent(target, Routes(target_id, NAMESPACE), entry, "dial-back", helpers=list,
                                  relays=list, publish=lambda **_: None, use_relays=True, retry_s=1.0)
            lease_ends = server.clients[target_id]
            holding = asyncio.create_task(agent._hold(relay_id, lease_s))
            await asyncio.sleep(1.5)
            assert not holding.done() and server.clients[target_id] == lease_ends  # connected: no early renewal
            await relay.shutdown()
            gone_at = time.monotonic()
            await asyncio.wait_for(holding, timeout=lease_s / 3)
            assert time.monotonic() - gone_at < 5.0 and entry.relays == set()
        finally:
            await shut(initiator, target)

    asyncio.run(asyncio.wait_for(scenario(), timeout=90))


def test_a_peer_on_an_initial_peers_relay_moves_to_one_the_swarm_announces_at_its_next_renewal() -> None:
    """Before a peer has read the swarm's records, the only relay it knows is an initial peer's (the bootstrap): in
    a 32-peer netns swarm all 8 NATed peers held the bootstrap's for the whole run, beside every joiner's DHT. It
    keeps that slot while the swarm announces no relay, and gives it up at its next renewal once one does."""
    async def scenario() -> None:
        bootstrap, target, volunteer, _, entry = await three_nodes(RelayLimits(lease_s=3.0))
        volunteer_relay = RelayServer(volunteer, NAMESPACE, RelayLimits(lease_s=3.0))
        await volunteer_relay.add_p2p_handlers(volunteer, namespace=NAMESPACE)
        bootstrap_id, target_id, volunteer_id = (n.peer_id.to_base58() for n in (bootstrap, target, volunteer))
        routes = Routes(target_id, NAMESPACE)
        try:
            agent = PresenceAgent(target, routes, entry, "dial-back", helpers=list,
                                  relays=lambda: [*routes.relays(), bootstrap_id], publish=lambda **_: None,
                                  use_relays=True, retry_s=1.0)
            assert (await agent._take_any_slot())[0] == bootstrap_id  # the swarm announces none yet
            holding = asyncio.create_task(agent._hold(bootstrap_id, 3.0))
            await asyncio.sleep(2.5)  # one renewal (at 1 s) and more: still on the bootstrap
            assert not holding.done()
            routes.update_([PeerRecord(peer_id=volunteer_id, round=0, inner_step=0, phase="inner", round_eta=0.0,
                                       reach=DIRECT, relay=True)])
            await asyncio.wait_for(holding, timeout=3.0)  # the next renewal gives the fallback up
            assert (await agent._take_any_slot())[0] == volunteer_id and entry.relays == {volunteer_id}
            assert target_id in volunteer_relay.clients
            # a relay taken from the swarm's is kept while it answers, whatever one read of the records says (in a
            # 32-peer run NATed peers flipped between the two volunteer relays when one's record missed a read)
            routes.update_([PeerRecord(peer_id="QmOtherRelay", round=0, inner_step=0, phase="inner", round_eta=0.0,
                                       reach=DIRECT, relay=True)])
            holding = asyncio.create_task(agent._hold(volunteer_id, 3.0))
            await asyncio.sleep(2.5)
            assert not holding.done()
            holding.cancel()
        finally:
            await shut(volunteer, target, bootstrap)

    asyncio.run(asyncio.wait_for(scenario(), timeout=90))


def test_a_signed_runs_relay_gives_slots_and_circuits_only_to_peers_with_their_ticket(tmp_path: Path) -> None:
    """Measured before: 65 unticketed identities from one host took all 64 relay slots of a signed run's bootstrap,
    and 4 of them held all 16 circuits; no ticketed peer behind NAT could get a slot."""
    key_path, public_path = generate_organiser_key(tmp_path / "organiser.key")
    policy = AdmissionPolicy(RUN, load_organiser_key(public_path))

    def ticket(p2p: P2P, run: str = RUN) -> str:
        return sign_ticket(load_signing_key(key_path), run, p2p.peer_id.to_base58())

    async def scenario() -> None:
        relay, target, initiator, server, entry = await three_nodes(policy=policy)
        try:
            entry.add_service("echo:test", echo_service)
            relay_id = relay.peer_id.to_base58()
            for wrong in ("", ticket(initiator), ticket(target, run="another-run"), "not base64!"):
                with pytest.raises(WireError, match="not admitted to this run"):
                    await take_slot(target, relay_id, NAMESPACE, timeout_s=10, ticket=wrong)
            assert not server.clients
            await take_slot(target, relay_id, NAMESPACE, timeout_s=10, ticket=ticket(target))
            entry.relays = {relay_id}
            for wrong in ("", ticket(target)):  # none, or another peer's
                refused = await one_message(relay, initiator, target, ticket=wrong)
                assert "not admitted to this run" in refused["reason"]
            answer = await one_message(relay, initiator, target, ticket=ticket(initiator))
            assert answer["from"] == initiator.peer_id.to_base58()
            assert server.refused == 2 and server.served == 1
        finally:
            await shut(initiator, target, relay)

    asyncio.run(asyncio.wait_for(scenario(), timeout=90))
