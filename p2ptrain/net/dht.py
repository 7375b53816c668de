"""Joining the libp2p network: the DHT node every peer and bootstrap runs, and its settings."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import hivemind
from hivemind.p2p import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain.errors import ConfigError, UserError, one_line

logger = logging.getLogger(__name__)

LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)


@dataclasses.dataclass(frozen=True)
class NetworkConfig:
    """How this node listens and what it probes. A volunteer keeps hivemind's NAT helpers; tests turn them off."""

    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)  # where to listen (tcp/0 = any free port)
    announce_maddrs: tuple[str, ...] = ()  # public addresses to announce, if behind a port forward
    identity_path: str = ""  # libp2p private key file (created if missing) for a stable peer id
    nat_port_map: bool = True  # ask the home router for a port mapping (UPnP / NAT-PMP)
    auto_nat: bool = True  # ask other peers whether we are reachable
    use_relay: bool = True  # accept relayed connections when not reachable
    client_mode: bool = False  # outbound connections only (behind a strict NAT)
    heartbeat_s: float = 1.0  # how often the peer record is refreshed
    record_ttl_s: float = 8.0  # a peer whose record is older than this is gone
    startup_timeout_s: float = 30.0  # time to start the daemon and reach the initial peers

    def __post_init__(self) -> None:
        for maddr in (*self.host_maddrs, *self.announce_maddrs):
            parse_maddr(maddr)
        if not self.host_maddrs:
            raise ConfigError("network.host_maddrs must list at least one address, e.g. /ip4/0.0.0.0/tcp/31337")
        if not 0 < self.heartbeat_s < self.record_ttl_s:
            raise ConfigError(f"network.heartbeat_s must be > 0 and < network.record_ttl_s, got "
                              f"{self.heartbeat_s} and {self.record_ttl_s}")

    @classmethod
    def loopback(cls, **changes: object) -> NetworkConfig:
        """Loopback only, no NAT probing, no relays: for tests, the demo and the netns testnet."""
        fields: dict[str, object] = dict(host_maddrs=LOOPBACK_MADDRS, nat_port_map=False, auto_nat=False,
                                         use_relay=False)
        fields.update(changes)
        return cls(**fields)  # type: ignore[arg-type]


def parse_maddr(text: str) -> Multiaddr:
    """A multiaddr, or a one-line error that shows the expected form."""
    try:
        return Multiaddr(text)
    except Exception:  # the multiaddr package raises several unrelated types
        raise ConfigError(f"{text!r} is not a multiaddr (expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...)") \
            from None


def start_dht(config: NetworkConfig, initial_peers: Sequence[str] = (), **dht_kwargs: object) -> hivemind.DHT:
    """Start a DHT node (its own process and p2pd daemon); unreachable initial peers are a one-line UserError."""
    peers = [parse_maddr(p) for p in initial_peers]
    for maddr in peers:
        if "p2p" not in maddr.protocols() and "/p2p/" not in str(maddr):
            raise UserError(f"initial peer {str(maddr)!r} lacks its /p2p/<peer id> part: copy the full address the "
                            f"bootstrap printed")
    try:
        return hivemind.DHT(
            initial_peers=[str(p) for p in peers],
            host_maddrs=list(config.host_maddrs),
            announce_maddrs=list(config.announce_maddrs) or None,
            identity_path=config.identity_path or None,
            nat_port_map=config.nat_port_map,
            auto_nat=config.auto_nat,
            use_relay=config.use_relay,
            use_auto_relay=False,
            client_mode=config.client_mode,
            startup_timeout=config.startup_timeout_s,
            start=True,
            **dht_kwargs,
        )
    except (P2PDaemonError, TimeoutError, RuntimeError, ValueError, OSError) as e:
        text = one_line(e)
        if initial_peers:
            raise UserError(f"cannot join the swarm through {', '.join(initial_peers)}: {text}") from None
        raise UserError(f"cannot start the p2p daemon on {', '.join(config.host_maddrs)}: {text}") from None


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """The full multiaddrs (with /p2p/<id>) other nodes can pass as --initial-peers."""
    return [str(m) for m in dht.get_visible_maddrs(latest=True)]
