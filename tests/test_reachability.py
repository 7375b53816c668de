"""The reachability self-test (net/reachability.py) and the agent that keeps a peer's answer (net/presence.py), on
real hivemind P2P over loopback: a dial-back reaches a live libp2p listener and nothing else; requests are bounded;
a peer nobody reaches takes a relay slot, moves on when the relay goes, and says once, in plain words, when it is
outbound only. (Behind a real NAT: tests/test_nat_netns.py.)"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2

from p2ptrain.net import relay
from p2ptrain.net.presence import PresenceAgent
from p2ptrain.net.reachability import NAMESPACE, DialBackServer, Reachability, ask_dial_back, libp2p_answers
from p2ptrain.net.relay import RelayEntry, RelayLimits, RelayServer
from p2ptrain.net.routes import DIRECT, OUTBOUND, RELAYED, UNKNOWN, Presence, Routes
from p2ptrain.net.wire import WireError, encode_metadata

pytestmark = [pytest.mark.network]

OPTIONS: dict[str, Any] = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False,
                               use_relay=False)


async def helper_and_peer() -> tuple[P2P, P2P]:
    helper = await P2P.create(**OPTIONS)
    await DialBackServer(helper, timeout_s=1.0).add_p2p_handlers(helper, namespace=NAMESPACE)
    peer = await P2P.create(initial_peers=await helper.get_visible_maddrs(), **OPTIONS)
    return helper, peer


def port_of(maddr: object) -> int:
    return int(str(maddr).split("/tcp/")[1].split("/")[0])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once it is closed


def test_a_dial_back_reaches_a_libp2p_listener_and_not_a_closed_port_or_another_service() -> None:
    async def scenario() -> None:
        helper, peer = await helper_and_peer()
        other = await asyncio.start_server(lambda r, w: w.write(b"SSH-2.0-OpenSSH\r\n"), "127.0.0.1", 0)
        other_port = other.sockets[0].getsockname()[1]
        try:
            port = port_of((await peer.get_visible_maddrs())[0])
            helper_id = helper.peer_id.to_base58()
            reached = ("127.0.0.1", f"/ip4/127.0.0.1/tcp/{port}")
            assert await ask_dial_back(peer, helper_id, NAMESPACE, [port]) == reached
            assert await ask_dial_back(peer, helper_id, NAMESPACE, [closed_port(), port]) == reached  # in turn
            assert await ask_dial_back(peer, helper_id, NAMESPACE, [closed_port()]) == ("127.0.0.1", "")
            assert not await libp2p_answers("127.0.0.1", other_port, timeout_s=1.0)  # not a libp2p node
        finally:
            other.close()
            await peer.shutdown()
            await helper.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


@pytest.mark.parametrize("ports", [None, [], [1, 2, 3, 4, 5], [0], [70000], ["31337"], [True]])
def test_malformed_dial_back_requests_are_refused(ports: object) -> None:
    async def scenario() -> None:
        helper, peer = await helper_and_peer()
        try:
            server = DialBackServer(helper)
            stub = DialBackServer.get_stub(peer, helper.peer_id, namespace=NAMESPACE)
            request = averaging_pb2.DownloadData(metadata=encode_metadata({"ports": ports}))
            answer = await stub.rpc_dial_back(request, timeout=10)
            assert b"ports must be" in answer.metadata
            assert server.limit.take("anyone")  # (a fresh server's budget)
        finally:
            await peer.shutdown()
            await helper.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_a_peer_gets_a_few_dial_backs_and_then_refusals() -> None:
    async def scenario() -> None:
        helper, peer = await helper_and_peer()
        try:
            port = port_of((await peer.get_visible_maddrs())[0])
            for _ in range(3):  # the burst
                await ask_dial_back(peer, helper.peer_id.to_base58(), NAMESPACE, [port])
            with pytest.raises(WireError, match="dial-backs a second"):
                await ask_dial_back(peer, helper.peer_id.to_base58(), NAMESPACE, [port])
        finally:
            await peer.shutdown()
            await helper.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_the_reachability_line_says_how_and_what_to_do() -> None:
    assert Reachability(Presence(DIRECT), "/ip4/1.2.3.4/tcp/31337").line() == \
        "reachability: reachable directly at /ip4/1.2.3.4/tcp/31337"
    assert "behind NAT, reachable through relay QmRelay" in Reachability(Presence(RELAYED, "QmRelay")).line()
    outbound = Reachability(Presence(OUTBOUND), ports=(4242,)).line()
    assert outbound.startswith("reachability: outbound only: ") and "forward TCP port 4242" in outbound
    assert "--announce-maddrs /ip4/<your public IP>/tcp/4242" in outbound and "--relay" in outbound
    assert "unknown" in Reachability(Presence(UNKNOWN)).line()


class Agent:
    """A PresenceAgent on its own P2P, with its published fields and log lines kept."""

    def __init__(self, p2p: P2P, helpers: list[str], relays: list[str], use_relays: bool = True):
        self.published: list[dict[str, Any]] = []
        self.routes = Routes(p2p.peer_id.to_base58(), relay.NAMESPACE)
        self.entry = RelayEntry()
        self.agent = PresenceAgent(p2p, self.routes, self.entry, NAMESPACE, lambda: helpers, lambda: relays,
                                   lambda **fields: self.published.append(fields), use_relays, retry_s=0.5)

    def unreachable_(self) -> None:
        """As behind a NAT: the helper's dial-back finds nothing at our port."""
        async def closed() -> tuple[int, ...]:
            return (closed_port(),)

        self.agent._ports = closed  # type: ignore[method-assign]

    async def until(self, reach: str, timeout_s: float = 20.0, looks: int = 0) -> None:
        """Wait until our reach is `reach` (and the agent looked for a relay `looks` times)."""
        async def settled() -> None:
            while self.routes.own.reach != reach or self.agent.looks < looks:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(settled(), timeout_s)


def test_a_reachable_peer_says_so_and_publishes_it(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        helper, peer = await helper_and_peer()
        agent = Agent(peer, [helper.peer_id.to_base58()], [])
        try:
            with caplog.at_level(logging.INFO, logger="p2ptrain.net.presence"):
                await asyncio.wait_for(agent.agent.run(), 20)  # returns once it knows: nothing to keep
            port = port_of((await peer.get_visible_maddrs())[0])
            assert agent.published[-1] == {"reach": DIRECT, "relay_via": "", "seen_as": "127.0.0.1"}
            assert [r.message for r in caplog.records] == [f"reachability: reachable directly at /ip4/127.0.0.1/tcp/"
                                                           f"{port}"]
        finally:
            await peer.shutdown()
            await helper.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_an_unreachable_peer_takes_a_relay_slot_then_goes_outbound_only_when_the_relay_goes(
        caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        helper, peer = await helper_and_peer()
        relay_node = await P2P.create(initial_peers=await helper.get_visible_maddrs(), **OPTIONS)
        server = RelayServer(relay_node, relay.NAMESPACE, RelayLimits(lease_s=1.5))
        await server.add_p2p_handlers(relay_node, namespace=relay.NAMESPACE)
        relay_id = relay_node.peer_id.to_base58()
        agent = Agent(peer, [helper.peer_id.to_base58()], [helper.peer_id.to_base58(), relay_id])
        agent.unreachable_()
        task = asyncio.create_task(agent.agent.run())
        try:
            with caplog.at_level(logging.INFO, logger="p2ptrain.net.presence"):
                await agent.until(RELAYED)
                assert agent.routes.own.relay_via == relay_id and agent.entry.relays == {relay_id}
                assert peer.peer_id.to_base58() in server.clients
                await relay_node.shutdown()  # the relay goes: the next renewal fails, no other relay is left
                await agent.until(OUTBOUND)
            assert agent.published[-1] == {"reach": OUTBOUND, "relay_via": "", "seen_as": "127.0.0.1"}
            lines = [r.message for r in caplog.records if r.message.startswith("reachability: ")]
            assert lines[0].startswith("reachability: behind NAT, reachable through relay")
            assert lines[-1].startswith("reachability: outbound only: ") and len(lines) == 2  # said once
            assert not agent.entry.relays
        finally:
            agent.agent.stop()
            await asyncio.wait_for(task, 20)
            await peer.shutdown()
            await helper.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=90))


def test_a_peer_that_may_not_use_relays_is_outbound_only_at_once(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        helper, peer = await helper_and_peer()
        agent = Agent(peer, [helper.peer_id.to_base58()], [helper.peer_id.to_base58()], use_relays=False)
        agent.unreachable_()
        task = asyncio.create_task(agent.agent.run())
        try:
            with caplog.at_level(logging.WARNING, logger="p2ptrain.net.presence"):
                await agent.until(OUTBOUND, looks=3)  # and two more looks for a relay: nothing new to say
            assert [r.levelno for r in caplog.records] == [logging.WARNING] and len(agent.published) == 1
        finally:
            agent.agent.stop()
            await asyncio.wait_for(task, 20)
            await peer.shutdown()
            await helper.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_no_initial_peer_taking_the_probes_connection_is_no_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's daemon exits when no initial peer takes its connection (a bootstrap down, or too busy to answer:
    joiners of the 32-peer netns swarm crashed with a traceback): nothing was asked, and the DHT's join says why."""
    from p2ptrain.net import reachability
    from p2ptrain.net.dht import NetworkConfig

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    dead = f"/ip4/127.0.0.1/tcp/{port}/p2p/QmcTZNACrXZmNwbM5vcvTiZ3dnJpkqnUzrAXNsVM5GCEXF"
    monkeypatch.setattr(reachability, "is_loopback", lambda _maddr: False)  # ask, though we listen on loopback
    config = NetworkConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), nat_port_map=False, auto_nat=False,
                           use_relay=False)
    assert reachability.reachable_before_joining(config, [dead]) is None


def test_a_probe_daemon_that_exits_before_we_connect_is_no_crash(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The probe's daemon can give up on the initial peers and remove its socket before hivemind connects to it
    (FileNotFoundError: a joiner of the 32-peer netns swarm crashed so with a traceback): nothing was asked."""
    from p2ptrain.net import reachability
    from p2ptrain.net.dht import NetworkConfig

    async def vanishing_daemon(**_options: object) -> None:
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(reachability.P2P, "create", vanishing_daemon)
    monkeypatch.setattr(reachability, "is_loopback", lambda _maddr: False)
    config = NetworkConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), nat_port_map=False, auto_nat=False,
                           use_relay=False)
    with caplog.at_level(logging.INFO, logger="p2ptrain.net.reachability"):
        assert reachability.reachable_before_joining(
            config, ["/ip4/127.0.0.1/tcp/1/p2p/QmcTZNACrXZmNwbM5vcvTiZ3dnJpkqnUzrAXNsVM5GCEXF"]) is None
    assert "reachability not asked: its daemon exited" in caplog.text
