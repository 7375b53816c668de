"""Can other peers connect to this one? A dial-back self-test, and the one line that tells the user the answer.

A joined peer asks another node (its initial peers first: the bootstrap, then any peer) to dial it back. The helper
looks up the address our connection to it comes from (what libp2p saw: behind a NAT, the router's public
address), opens a plain TCP connection to that IP at the port(s) we listen on (announced ports, when we announce
some) and checks that a libp2p node answers (the multistream header every libp2p TCP listener sends first). So
it tests what a stranger would meet, works offline (loopback, namespaces), and needs neither AutoNAT nor UPnP. The
helper dials only the address the request itself came from, a few ports at most, at a bounded rate per peer: it
cannot be made to probe a third party.

Peers are untrusted: a helper can lie (say we are unreachable, or reachable). A peer asks its helpers in turn and
takes the first answer; a wrong "unreachable" costs it a relay slot it did not need, a wrong "reachable" makes
other peers' streams to it fail (they then skip it, as they skip any peer that does not answer).
"""

# No `from __future__ import annotations`: hivemind's ServicerBase reads the rpc_* annotations at runtime.
import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
from collections.abc import Sequence

from hivemind.p2p import P2P, P2PContext, P2PDaemonError, PeerID, ServicerBase
from hivemind.proto import averaging_pb2

from p2ptrain.net.dht import NetworkConfig, is_loopback, peer_id_of
from p2ptrain.net.responder_limits import RateLimit
from p2ptrain.net.routes import DIRECT, OUTBOUND, RELAYED, Presence
from p2ptrain.net.wire import WireError, decode_metadata, encode_metadata
from p2ptrain.timing import DIAL_S

logger = logging.getLogger(__name__)

MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"  # what a libp2p TCP listener sends as soon as it accepts
MAX_PORTS = 4  # ports one request may have dialed back, one after another (each a dial: DIAL_S)
DIAL_BACKS_PER_S, DIAL_BACK_BURST = 0.2, 3  # requests one peer may make (a peer asks once, and on relay loss)


NAMESPACE = "p2ptrain.reach"  # one for every run: a bootstrap serves any run's peers


@dataclasses.dataclass(frozen=True)
class Reachability:
    """The self-test's answer: `presence` as published in our record, and the address others dialed."""

    presence: Presence
    address: str = ""  # reach direct: the multiaddr the helper reached us at
    ports: tuple[int, ...] = ()  # the TCP ports we listen on (for the advice line)

    def line(self) -> str:
        """The one line a user reads: can others reach this peer, and how."""
        reach, relay = self.presence.reach, self.presence.relay_via
        if reach == DIRECT:
            return f"reachability: reachable directly at {self.address}"
        if reach == RELAYED:
            return (f"reachability: behind NAT, reachable through relay {relay} (peers that cannot reach it directly "
                    f"exchange through that relay)")
        if reach == OUTBOUND:
            return "reachability: outbound only: " + self.advice()
        return "reachability: unknown (no peer answered the dial-back test yet; asking again next round)"

    def advice(self) -> str:
        port = self.ports[0] if self.ports else 31337
        return (f"no peer can connect to this one and no relay took it, so it trains and starts every exchange "
                f"itself and others do not wait for it. To be reachable, forward TCP port {port} on your router to "
                f"this machine and pass --announce-maddrs /ip4/<your public IP>/tcp/{port} (and --host-maddrs "
                f"/ip4/0.0.0.0/tcp/{port}), or join through a bootstrap or peer that serves as a relay (--relay)")


async def libp2p_answers(ip: str, port: int, timeout_s: float = DIAL_S) -> bool:
    """Whether a libp2p TCP listener answers at ip:port within `timeout_s` (a fresh connection, never reused)."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout_s)
        header = await asyncio.wait_for(reader.readexactly(len(MULTISTREAM_HEADER)), timeout_s)
        return header == MULTISTREAM_HEADER
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def observed_ip(addrs: Sequence[object]) -> str | None:
    """The IP of the first direct (not relayed) connection among a peer's connection addresses."""
    for addr in addrs:
        parts = str(addr).split("/")
        if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and "p2p-circuit" not in parts:
            with contextlib.suppress(ValueError):
                return str(ipaddress.ip_address(parts[2]))
    return None


class DialBackServer(ServicerBase):
    """Answers dial-back requests: {"ports": [int, ...]} → {"seen_as": ip or "", "reached": multiaddr or ""}."""

    def __init__(self, p2p: P2P, timeout_s: float = DIAL_S):
        self.p2p, self.timeout_s = p2p, timeout_s
        self.limit = RateLimit(DIAL_BACKS_PER_S, DIAL_BACK_BURST)

    async def rpc_dial_back(self, request: averaging_pb2.DownloadData,
                            context: P2PContext) -> averaging_pb2.DownloadData:
        peer = context.remote_id
        if not self.limit.take(peer.to_base58()):
            return _answer(refused=f"at most {DIAL_BACKS_PER_S:g} dial-backs a second")
        try:
            ports = decode_metadata(request.metadata).get("ports")
        except WireError:
            ports = None
        if not (isinstance(ports, list) and 0 < len(ports) <= MAX_PORTS and all(
                type(p) is int and 0 < p < 65536 for p in ports)):
            return _answer(refused=f"ports must be a list of 1..{MAX_PORTS} TCP ports")
        ip = observed_ip([a for info in await self.p2p.list_peers() if info.peer_id == peer for a in info.addrs])
        if ip is None:
            return _answer(refused="no direct connection from this peer to look at")
        for port in ports:
            if await libp2p_answers(ip, port, self.timeout_s):
                family = "ip6" if ":" in ip else "ip4"
                return _answer(seen_as=ip, reached=f"/{family}/{ip}/tcp/{port}")
        return _answer(seen_as=ip)


def _answer(seen_as: str = "", reached: str = "", refused: str = "") -> averaging_pb2.DownloadData:
    return averaging_pb2.DownloadData(metadata=encode_metadata({"seen_as": seen_as, "reached": reached,
                                                                "refused": refused}))


def reachable_before_joining(config: NetworkConfig, initial_peers: Sequence[str]) -> bool | None:
    """Whether strangers can connect to this machine at the port(s) it is to listen on, asked before the DHT starts:
    a throwaway daemon on `config.host_maddrs` asks the initial peers to dial it back (about a second). A peer nobody
    can reach runs its DHT node as a client: others then never try (and wait 3 s for) connections it cannot take.
    None where nothing was asked (no initial peers, loopback only, `check_reachability` off) or nobody answered."""
    loopback = all(is_loopback(m) for m in config.host_maddrs)
    if not initial_peers or loopback or not config.check_reachability:
        return None
    return asyncio.run(_ask_as_a_stranger(config, initial_peers))


async def _ask_as_a_stranger(config: NetworkConfig, initial_peers: Sequence[str]) -> bool | None:
    try:
        p2p = await P2P.create(initial_peers=list(initial_peers), host_maddrs=list(config.host_maddrs),
                               announce_maddrs=list(config.announce_maddrs) or None,
                               nat_port_map=config.nat_port_map, auto_nat=False, use_relay=False,
                               startup_timeout=config.startup_timeout_s)
    except P2PDaemonError as e:  # no initial peer took the daemon's connection: the DHT's join waits and says so
        logger.info(f"reachability not asked: {str(e).strip().splitlines()[-1][:200]}")
        return None
    except FileNotFoundError:  # the same, when the daemon gave up and took its socket with it before we connected
        logger.info("reachability not asked: its daemon exited on the way up (no initial peer took its connection)")
        return None
    try:
        ports = [int(str(m).split("/tcp/")[1].split("/")[0]) for m in await p2p.get_visible_maddrs()
                 if "/tcp/" in str(m)]
        for helper in (peer_id_of(m) for m in initial_peers):
            with contextlib.suppress(Exception):  # refused, P2P errors, timeouts: the next initial peer
                return bool((await ask_dial_back(p2p, helper, NAMESPACE, ports))[1])
        return None
    finally:
        await p2p.shutdown()


async def ask_dial_back(p2p: P2P, helper: str, namespace: str, ports: Sequence[int],
                        timeout_s: float = MAX_PORTS * DIAL_S) -> tuple[str, str]:
    """(the IP the helper sees us at, the multiaddr it reached us at or ""); raises WireError when it refuses or
    answers nonsense, and P2P errors or TimeoutError when it does not answer."""
    stub = DialBackServer.get_stub(p2p, PeerID.from_base58(helper), namespace=namespace)
    request = averaging_pb2.DownloadData(metadata=encode_metadata({"ports": list(ports)[:MAX_PORTS]}))
    answer = decode_metadata((await stub.rpc_dial_back(request, timeout=timeout_s)).metadata)
    seen_as, reached, refused = answer.get("seen_as"), answer.get("reached"), answer.get("refused")
    if refused or not isinstance(seen_as, str) or not isinstance(reached, str):
        raise WireError(f"{helper} did not dial back: {str(refused)[:200] or 'malformed answer'}")
    if (seen_as and observed_ip([f"/ip4/{seen_as}/tcp/1", f"/ip6/{seen_as}/tcp/1"]) != seen_as) or (
            reached and observed_ip([reached]) != seen_as):
        raise WireError(f"{helper} answered a malformed address")
    return seen_as, reached
