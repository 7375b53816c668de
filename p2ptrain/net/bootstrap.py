"""A bootstrap node: a DHT-only peer with a persistent identity, so its address stays the same across restarts."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import hivemind

from p2ptrain.net.dht import NetworkConfig, start_dht, visible_maddrs

logger = logging.getLogger(__name__)


class BootstrapNode:
    """Starts a DHT node that peers use to find each other; it trains nothing."""

    def __init__(self, config: NetworkConfig, address_file: str | None = None):
        if config.identity_path:
            Path(config.identity_path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self.dht: hivemind.DHT = start_dht(config)
        self.maddrs = visible_maddrs(self.dht)
        if address_file:
            write_address_file(address_file, self.maddrs)

    def serve_until(self, stop: threading.Event) -> None:
        stop.wait()

    def shutdown(self) -> None:
        self.dht.shutdown()


def write_address_file(path: str | Path, maddrs: list[str]) -> None:
    """One multiaddr per line, written atomically (peers poll for this file in compose and the testnet)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".tmp")
    staging.write_text("".join(f"{m}\n" for m in maddrs))
    staging.replace(path)
