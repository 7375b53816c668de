"""A bootstrap node: a DHT-only peer with a persistent identity, so its address stays the same across restarts. It
also dials back peers that test their reachability, and (`network.relay`, on for `p2ptrain bootstrap`) serves as
a relay for peers behind NAT (net/services.py), and hands volunteers the run's manifest when started with the run's
config (net/run_manifest.py)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from p2ptrain.net.admission import Admission
from p2ptrain.net.dht import NetworkConfig, SwarmDHT, start_dht, visible_maddrs
from p2ptrain.net.discovery import add_record_validators
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.net.run_manifest import NAMESPACE as MANIFEST_NAMESPACE
from p2ptrain.net.run_manifest import ManifestServer
from p2ptrain.net.services import start_services

logger = logging.getLogger(__name__)


class BootstrapNode:
    """Starts a DHT node that peers use to find each other; it trains nothing.

    It stores records like any node of `run_id`, so it checks them as the run's peers do (the same validators; in
    a signed run the organiser's key, but no ticket of its own): a forged record, or one under a key outside the
    run's (net/dht_keys.py), is not kept here either. One bootstrap serves one run."""

    def __init__(self, config: NetworkConfig, run_id: str, address_file: str | None = None,
                 manifest: dict[str, Any] | None = None):
        admission = Admission.from_config(config, run_id)  # a bad key file fails before the daemon starts
        if config.identity_path:
            Path(config.identity_path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self.dht: SwarmDHT = start_dht(config)
        self.loop = BackgroundLoop("p2ptrain-bootstrap-loop")
        try:
            add_record_validators(self.dht, run_id, config.record_ttl_s, admission)
            self.maddrs = visible_maddrs(self.dht)
            self.p2p = self.loop.run(self.dht.replicate_p2p(), timeout=config.startup_timeout_s)
            self.services = start_services(self.p2p, self.loop, config, admission)
            # the run's manifest (p2ptrain/manifest.py), for volunteers that join through us; None: we serve none
            self.loop.run(ManifestServer(manifest).add_p2p_handlers(self.p2p, namespace=MANIFEST_NAMESPACE),
                          timeout=config.startup_timeout_s)
        except BaseException:
            self.loop.stop()
            self.dht.shutdown()
            raise
        if address_file:
            write_address_file(address_file, self.maddrs)

    def serve_until(self, stop: threading.Event) -> None:
        stop.wait()

    def shutdown(self) -> None:
        try:
            self.loop.run(self.p2p.shutdown(), timeout=10)
        except Exception:  # shutting down: the DHT's own shutdown below ends the daemon anyway
            logger.debug("error while closing the bootstrap's p2p replica", exc_info=True)
        self.loop.stop()
        self.dht.shutdown()


def write_address_file(path: str | Path, maddrs: list[str]) -> None:
    """One multiaddr per line, written atomically (peers poll for this file in compose and the testnet)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".tmp")
    staging.write_text("".join(f"{m}\n" for m in maddrs))
    staging.replace(path)
