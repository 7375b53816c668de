"""Joining the libp2p network: the DHT node every peer and bootstrap runs, and its settings."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import time
from collections.abc import Sequence

import hivemind
import torch.multiprocessing
from hivemind.p2p import P2PDaemonError
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain.choices import ADMISSION_MODES
from p2ptrain.errors import ConfigError, UserError, one_line
from p2ptrain.net import frame_cap, stream_bytes  # noqa: F401  (importing them caps and counts stream frames)
from p2ptrain.net.identity import fresh_identity_path, load_identity_key
from p2ptrain.net.lifetime import DiesWithStarter, kill_children
from p2ptrain.net.record_shards import SHARD_TARGET
from p2ptrain.timing import DIAL_S, PATIENCE_S, TICK_S

logger = logging.getLogger(__name__)
# what hivemind's DHTNode.create raises when initial peers were reached but none answered its one ping
UNANSWERED_PINGS = "none of the initial_peers responded to a ping"
# what p2pd exits with when it connected to none of its initial peers: at once where they refused (nothing listens),
# after its dial time-out where they were silent (a bootstrap too busy to answer, or behind a cut)
UNCONNECTED_INITIAL_PEERS = "failed to connect to bootstrap peers"

LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)


@dataclasses.dataclass(frozen=True)
class NetworkConfig:
    """How this node listens and what it probes. A volunteer keeps hivemind's NAT helpers; tests turn them off."""

    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)  # where to listen (tcp/0 = any free port)
    announce_maddrs: tuple[str, ...] = ()  # public addresses to announce, if behind a port forward
    identity_path: str = ""  # libp2p private key file (created if missing) for a stable peer id
    nat_port_map: bool = True  # ask the home router for a port mapping (UPnP / NAT-PMP)
    auto_nat: bool = True  # p2pd's AutoNAT service (and its hole punching, which needs 4+ peers' observations)
    use_relay: bool = True  # p2pd's circuit relay transport (limited to 128 KiB a connection: not our relays)
    client_mode: bool = False  # outbound connections only (behind a strict NAT)
    # reachability (net/reachability.py, net/relay.py): after joining, ask a peer to dial us back; if nobody can
    # connect to us, take a slot on a relay (the bootstrap, or a peer started with --relay) when `use_relays`
    check_reachability: bool = True
    use_relays: bool = True
    relay: bool = False  # serve as a relay for peers behind NAT (the bootstrap does unless --no-relay-service)
    relay_mbit: float = 100.0  # every byte this relay passes, both directions, Mbit/s at most (circuits then wait)
    relay_max_circuits: int = 16  # relayed streams at once; beyond, refused as busy
    relay_max_clients: int = 64  # peers holding a slot on this relay
    # records a shard of the run's peer records is kept near (net/record_shards.py): what a peer reads a heartbeat
    # is one to four times this; a swarm of up to twice this many peers keeps them in one key
    records_per_shard: int = SHARD_TARGET
    heartbeat_s: float = TICK_S  # how often the peer record is refreshed
    record_ttl_s: float = 8 * TICK_S  # a peer whose record is older than this (8 default heartbeats) is gone
    startup_timeout_s: float = PATIENCE_S  # time to start the daemon (seconds), and for its processes to answer
    # a DHT node that has not answered one of our requests within this long is skipped for it (hivemind's
    # `wait_timeout`; 3 s is its default). That equals a DiLoCo read's patience (`sync.matchmaking_s`): one member on
    # 64 kbit/s, whose node answers late, times the fast peers' reads out and splits them; 1.5 s (half the patience)
    # lets a read skip it (docs/design.md, Discovery). Not the default: on 2 loaded cores, answers of nodes that were
    # merely busy came later than 1.5 s and a loopback GASLoC swarm fell apart (1 of 4 runs, and one CI run)
    dht_request_timeout_s: float = 3.0
    # seconds to reach the initial peers (at most startup_timeout_s). p2pd dials them one after another and gives each
    # that accepts a connection but never answers (a frozen peer, a firewall that drops) 5 s: four such peers take
    # 20 s to fail. 12 leaves room for two of them ahead of a live one (and hivemind's 3 s ping); a healthy join takes
    # under 1 s. Raise it for a long list of initial peers of which many may be down
    join_timeout_s: float = 12.0
    # who may take part: open (anyone) | signed (peers holding a ticket from the organiser's key; net/admission.py)
    admission: str = "open"
    organiser_key: str = ""  # signed runs: the organiser's public key file (every peer checks tickets with it)
    admission_ticket: str = ""  # signed runs: this peer's ticket file, from `p2ptrain admit`

    def __post_init__(self) -> None:
        for maddr in (*self.host_maddrs, *self.announce_maddrs):
            parse_maddr(maddr)
        if not self.host_maddrs:
            raise ConfigError("network.host_maddrs must list at least one address, e.g. /ip4/0.0.0.0/tcp/31337")
        if not self.dht_request_timeout_s > 0:
            raise ConfigError(f"network.dht_request_timeout_s must be > 0 (seconds), got {self.dht_request_timeout_s}")
        if self.admission not in ADMISSION_MODES:
            raise ConfigError(f"network.admission must be one of {', '.join(ADMISSION_MODES)}, got {self.admission!r}")
        if self.admission == "signed" and not self.organiser_key:
            raise ConfigError("network.admission signed needs network.organiser_key (the organiser's public key file)")
        if not 0 < self.join_timeout_s <= self.startup_timeout_s:
            raise ConfigError(f"network.join_timeout_s must be > 0 and at most network.startup_timeout_s, got "
                              f"{self.join_timeout_s} and {self.startup_timeout_s} s: raise startup_timeout_s too")
        if self.relay_mbit <= 0 or min(self.relay_max_circuits, self.relay_max_clients) < 1:
            raise ConfigError(f"network.relay_mbit must be > 0 and relay_max_circuits, relay_max_clients >= 1, got "
                              f"{self.relay_mbit}, {self.relay_max_circuits}, {self.relay_max_clients}")
        if self.records_per_shard < 1:
            raise ConfigError(f"network.records_per_shard must be >= 1, got {self.records_per_shard}")
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
        raise ConfigError(f"{text!r} is not a multiaddr (expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/QmPeerId...)") \
            from None


def peer_id_of(maddr: str) -> str:
    """The peer id a multiaddr ends with (`/p2p/<id>`)."""
    return str(parse_maddr(maddr)).rsplit("/p2p/", 1)[-1]


def is_loopback(maddr: str) -> bool:
    """Whether a multiaddr is on this machine's loopback interface."""
    return str(parse_maddr(maddr)).startswith(("/ip4/127.", "/ip6/::1/"))


# hivemind's caching, off. Our reads ask for the latest values (`latest=True`) and never take a cached copy, yet each
# one cached the key, queued a background re-read of it before its expiry (`cache_refresh_before_expiry`, 5 s: at
# once for records that live 5-8 s) and sent the copy on to one more node (`cache_nearest`). With KEY_BEAM
# (net/dht_keys.py), an 8-peer loopback swarm's DHT processes spent 44 % less CPU and its p2pd daemons 29 % less
NO_CACHING: dict[str, object] = {"cache_locally": False, "cache_nearest": 0, "cache_refresh_before_expiry": 0}


class SwarmDHT(DiesWithStarter, hivemind.DHT):
    """hivemind's DHT node, plus the identity key it runs under: the key that signs this peer's records. Its process
    (and p2pd) ends with the peer's, however the peer ends (net/lifetime.py)."""

    signing_key: RSAPrivateKey
    initial_peers: tuple[str, ...] = ()  # the multiaddrs it joined through (net/routing_refill.py asks them again)


def start_dht(config: NetworkConfig, initial_peers: Sequence[str] = (), **dht_kwargs: object) -> SwarmDHT:
    """Start a DHT node (its own process and p2pd daemon); unreachable initial peers are a one-line UserError.

    Without `config.identity_path` the node runs under a throwaway identity generated for it; either way the
    identity key is kept as `signing_key` (net/identity.py: a record signed with it proves its peer id)."""
    peers = [parse_maddr(p) for p in initial_peers]
    for maddr in peers:
        if "p2p" not in maddr.protocols() and "/p2p/" not in str(maddr):
            raise UserError(f"initial peer {str(maddr)!r} lacks its /p2p/<peer id> part: copy the full address the "
                            f"bootstrap printed")
    _share_memory_by_descriptor()
    identity_path = config.identity_path or fresh_identity_path()
    try:
        dht = _launch(config, [str(p) for p in peers], identity_path, dht_kwargs)
        try:
            dht.signing_key = load_identity_key(identity_path)
            dht.initial_peers = tuple(str(p) for p in peers)
        except (OSError, ValueError) as e:
            dht.shutdown()
            raise UserError(f"cannot read the identity key {identity_path!r}: {one_line(e)}") from None
    finally:
        if not config.identity_path:  # a throwaway identity lives on in memory only
            shutil.rmtree(os.path.dirname(identity_path), ignore_errors=True)
    return dht


def _share_memory_by_descriptor() -> None:
    """hivemind sets torch's tensor sharing to `file_system` when imported, and the first shared tensor then starts
    a torch_shm_manager process: 60 MiB of a tiny-model peer's 290 (benchmarks/peer_memory.py). File descriptors
    need no such process. A strategy named in HIVEMIND_MEMORY_SHARING_STRATEGY is the user's, and stays."""
    if "HIVEMIND_MEMORY_SHARING_STRATEGY" not in os.environ:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")


def _launch(config: NetworkConfig, initial_peers: list[str], identity_path: str,
            dht_kwargs: dict[str, object]) -> SwarmDHT:
    """Start the node and wait until it is ready, within `join_timeout_s` when it joins through initial peers; any
    failure is a one-line UserError, and leaves neither the node's process nor its p2pd behind. A join whose initial
    peers were busy starts again while the join's time lasts: they were reached but answered no ping in time
    (hivemind pings once, for `dht_request_timeout_s`), or took no connection within a dial (p2pd exits; in the
    32-peer netns swarm a joiner gave up so at once, its bootstrap too busy to answer). Initial peers that refused the
    connection at once are not there: that fails at once."""
    ready_s = config.join_timeout_s if initial_peers else config.startup_timeout_s
    deadline = time.monotonic() + ready_s
    failure = f"cannot join the swarm through {', '.join(initial_peers)}" if initial_peers else \
        f"cannot start the p2p daemon on {', '.join(config.host_maddrs)}"

    def busy(error: Exception, tried_s: float) -> bool:
        """Whether to join again after `error`, which took `tried_s`: busy initial peers and time for two more
        tries (after a pause: an error at once must not spin up daemons)."""
        # p2pd that gave up on the initial peers exits, taking its socket with it (FileNotFoundError on the way up)
        silent = (UNCONNECTED_INITIAL_PEERS in str(error) or isinstance(error, FileNotFoundError)) and tried_s >= DIAL_S
        if not (UNANSWERED_PINGS in str(error) or silent) or time.monotonic() + 2 * config.dht_request_timeout_s \
                >= deadline:
            return False
        logger.info(f"no initial peer answered within {max(tried_s, config.dht_request_timeout_s):.1f} s; "
                    f"joining again")
        time.sleep(config.dht_request_timeout_s)
        return True

    while True:
        started = time.monotonic()
        try:
            dht = SwarmDHT(
                initial_peers=initial_peers,
                host_maddrs=list(config.host_maddrs),
                announce_maddrs=list(config.announce_maddrs) or None,
                identity_path=identity_path,
                nat_port_map=config.nat_port_map,
                auto_nat=config.auto_nat,
                use_relay=config.use_relay,
                use_auto_relay=False,
                client_mode=config.client_mode,
                startup_timeout=config.startup_timeout_s,
                wait_timeout=config.dht_request_timeout_s,
                start=True,
                await_ready=False,
                **{**NO_CACHING, **dht_kwargs},
            )
        except (P2PDaemonError, RuntimeError, ValueError, OSError) as e:
            if busy(e, time.monotonic() - started):
                continue
            raise UserError(f"{failure}: {one_line(e)}") from None
        try:
            dht.wait_until_ready(max(deadline - time.monotonic(), 0.1))
            return dht
        except Exception as e:  # whatever the node's process reports is a failure to start; a bare TimeoutError is ours
            _kill(dht)
            if busy(e, time.monotonic() - started):
                continue
            late = "no initial peer answered" if initial_peers else "the daemon did not start"
            raise UserError(f"{failure}: {one_line(e) if str(e) else f'{late} within {ready_s:.0f} s'}") from None


def _kill(dht: SwarmDHT) -> None:
    """Kill a node's process and the p2pd daemons it started (stopped first: none can start in between)."""
    if dht.pid is not None:
        with contextlib.suppress(OSError):
            os.kill(dht.pid, signal.SIGSTOP)
            kill_children(dht.pid)
    dht.kill()
    dht.join()


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """The full multiaddrs (with /p2p/<id>) other nodes can pass as --initial-peers."""
    return [str(m) for m in dht.get_visible_maddrs(latest=True)]
