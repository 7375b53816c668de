"""The network services a node runs beside its DHT, for reachability: it dials back peers that ask (every node),
passes streams for peers behind NAT (relays: the bootstrap, peers with `network.relay`), takes streams relays pass
to it (`RelayEntry`), and finds out and keeps its own reachability (`PresenceAgent`, peers only)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import random
from collections.abc import Callable, Sequence

from hivemind.p2p import P2P

from p2ptrain.net import reachability, relay
from p2ptrain.net.admission import Admission
from p2ptrain.net.dht import NetworkConfig, peer_id_of
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.net.presence import PresenceAgent
from p2ptrain.net.reachability import DialBackServer
from p2ptrain.net.relay import RelayEntry, RelayLimits, RelayServer
from p2ptrain.net.routes import Routes
from p2ptrain.timing import PATIENCE_S, SETUP_FLOOR_S, reachability_retry_s

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class NodeServices:
    """What `start_services` started, and the node's `routes` (its view of who reaches whom)."""

    routes: Routes
    entry: RelayEntry
    relay: RelayServer | None = None
    presence: PresenceAgent | None = None
    presence_task: concurrent.futures.Future[None] | None = None

    def start_presence(self, p2p: P2P, loop: BackgroundLoop, config: NetworkConfig, initial_peers: Sequence[str],
                       publish: Callable[..., None]) -> None:
        """Find out, in the background, whether others can reach us (`publish(**record fields)` tells them)."""
        if not config.check_reachability:
            return
        first = [peer_id_of(m) for m in initial_peers]
        own = self.routes.own_id

        def helpers() -> list[str]:  # initial peers first, then the swarm's in a random order
            others = [p for p in self.routes.known if p not in first]
            return [p for p in first if p != own] + random.sample(others, len(others))

        def relays() -> list[str]:  # the swarm's in a random order (no one relay for all), then initial peers
            swarm = [p for p in self.routes.relays() if p not in first and p != own]
            return random.sample(swarm, len(swarm)) + [p for p in first if p != own]

        self.presence = PresenceAgent(p2p, self.routes, self.entry, reachability.NAMESPACE, helpers, relays, publish,
                                      config.use_relays, retry_s=reachability_retry_s(config.heartbeat_s))
        self.presence_task = loop.submit(self.presence.run())

    def stop(self, loop: BackgroundLoop) -> None:
        if self.presence is not None:
            loop.loop.call_soon_threadsafe(self.presence.stop)
        if self.presence_task is not None:
            try:
                self.presence_task.result(timeout=SETUP_FLOOR_S)
            except Exception:  # a failed test or a cancelled task: nothing left to stop
                logger.debug("presence agent ended with an error", exc_info=True)


def start_services(p2p: P2P, loop: BackgroundLoop, config: NetworkConfig,
                   admission: Admission | None = None) -> NodeServices:
    """Register the dial-back server, the relay entry, and (with `config.relay`) a relay, on `p2p`. In a signed run
    (`admission`), our ticket goes with what we ask of relays, and our relay serves only peers with one."""
    relay_namespace = relay.NAMESPACE
    ticket = admission.ticket if admission is not None else ""
    services = NodeServices(Routes(p2p.peer_id.to_base58(), relay_namespace, ticket), RelayEntry())
    loop.run(DialBackServer(p2p).add_p2p_handlers(p2p, namespace=reachability.NAMESPACE),
             timeout=PATIENCE_S)
    loop.run(services.entry.add_p2p_handlers(p2p, namespace=relay_namespace), timeout=PATIENCE_S)
    if config.relay:
        services.relay = RelayServer(p2p, relay_namespace, RelayLimits.of(config),
                                     admission.policy if admission is not None else None)
        loop.run(services.relay.add_p2p_handlers(p2p, namespace=relay_namespace), timeout=PATIENCE_S)
    return services
