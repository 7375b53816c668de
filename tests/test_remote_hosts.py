"""Which host a connected peer comes from (net/remote_hosts.py): the address of its connection as p2pd lists it,
read again only when stale or for a peer not in the last read, and no host for this machine or a circuit."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from p2ptrain.net.remote_hosts import MIN_READ_S, RemoteHosts, host_of_address


@pytest.mark.parametrize(("address", "host"), [
    ("/ip4/203.0.113.7/tcp/31337", "203.0.113.7"),
    ("/ip6/2001:db8::1/tcp/4001", "2001:db8::1"),
    ("/ip4/10.0.0.2/udp/4001/quic-v1", "10.0.0.2"),
    ("/ip4/127.0.0.2/tcp/5000", "127.0.0.2"),  # another loopback address: tests use them as other hosts
    ("/ip4/127.0.0.1/tcp/5000", None),  # this machine's own: a testnet on one machine
    ("/ip6/::1/tcp/5000", None),
    ("/ip4/198.51.100.4/tcp/1/p2p/12D3KooWA/p2p-circuit", None),  # through a relay: not where the peer is
    ("/dns4/example.org/tcp/1", None),
    ("/ip4/999.1.1.1/tcp/1", None),
    ("", None),
])
def test_the_host_is_the_connections_ip_address(address: str, host: str | None) -> None:
    assert host_of_address(address) == host


class ListedPeers:
    """A P2P stand-in whose connection list is set by the test, counting reads."""

    def __init__(self) -> None:
        self.connections: dict[str, list[str]] = {}
        self.reads = 0

    async def list_peers(self) -> list[Any]:
        self.reads += 1
        return [types.SimpleNamespace(peer_id=types.SimpleNamespace(to_base58=lambda p=peer: p), addrs=addrs)
                for peer, addrs in self.connections.items()]


def test_the_list_is_read_when_stale_or_for_a_new_peer_at_most_every_min_read_s() -> None:
    p2p, now = ListedPeers(), [100.0]
    hosts = RemoteHosts(p2p, refresh_s=5.0, clock=lambda: now[0])  # type: ignore[arg-type]
    p2p.connections = {"a": ["/ip4/127.0.0.1/tcp/1", "/ip4/203.0.113.7/tcp/2"], "b": ["/ip4/127.0.0.1/tcp/3"]}

    async def scenario() -> list[object]:
        seen: list[object] = [await hosts.host_of("a"), await hosts.host_of("b"), p2p.reads]
        now[0] += 2 * MIN_READ_S
        seen += [await hosts.host_of("b"), p2p.reads]  # listed, with no host: not read again for it
        p2p.connections["c"] = ["/ip4/198.51.100.9/tcp/4"]
        seen += [await hosts.host_of("c"), p2p.reads]  # a new peer: read again
        p2p.connections["d"] = ["/ip4/198.51.100.10/tcp/5"]
        seen += [await hosts.host_of("d"), p2p.reads]  # within MIN_READ_S of the last read: not read again
        del p2p.connections["a"]
        now[0] += 1.0
        seen += [await hosts.host_of("a"), p2p.reads]  # fresh enough: what the last read said
        now[0] += 5.0
        seen += [await hosts.host_of("a"), p2p.reads]  # stale: read, and "a" is gone
        return seen

    # "b" connects only from this machine: no host, and no read again for it until the list is stale
    assert asyncio.run(scenario()) == ["203.0.113.7", None, 1, None, 1, "198.51.100.9", 2, None, 2,
                                       "203.0.113.7", 2, None, 3]


def test_a_daemon_that_does_not_answer_leaves_what_the_last_read_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("p2ptrain.net.remote_hosts.READ_TIMEOUT_S", 0.05)
    p2p, now = ListedPeers(), [100.0]
    hosts = RemoteHosts(p2p, refresh_s=5.0, clock=lambda: now[0])  # type: ignore[arg-type]
    p2p.connections = {"a": ["/ip4/203.0.113.7/tcp/2"]}
    answered = p2p.list_peers

    async def hanging() -> list[Any]:
        p2p.reads += 1
        await asyncio.Event().wait()
        return []

    async def scenario() -> list[object]:
        seen: list[object] = [await hosts.host_of("a")]
        p2p.list_peers = hanging  # type: ignore[method-assign]
        now[0] += 6.0
        seen += [await hosts.host_of("a"), await hosts.host_of("a"), p2p.reads]  # one try, then what we knew
        p2p.list_peers = answered  # type: ignore[method-assign]
        now[0] += 6.0
        seen += [await hosts.host_of("a"), p2p.reads]
        return seen

    assert asyncio.run(scenario()) == ["203.0.113.7", "203.0.113.7", "203.0.113.7", 2, "203.0.113.7", 3]
