"""Handing the run's manifest to a volunteer: every peer of a run, and a bootstrap started with the run's config,
answers `rpc_run_manifest` with the manifest it runs under (a small JSON document, p2ptrain/manifest.py says what it
holds). A volunteer asks the peers it was told to join, before its own DHT node starts, through a throwaway daemon:
the address it was given is what it trusts, so the manifest is taken from that peer and no other.
"""

# No `from __future__ import annotations` here: hivemind's ServicerBase reads the rpc_* annotations at runtime
import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2

from p2ptrain.net.dht import NetworkConfig, is_loopback, peer_id_of
from p2ptrain.net.responder_limits import RateLimit
from p2ptrain.net.wire import WireError, decode_metadata, encode_metadata
from p2ptrain.timing import PATIENCE_S

logger = logging.getLogger(__name__)

NAMESPACE = "p2ptrain_manifest"
MAX_MANIFEST_BYTES = 32 * 1024  # a manifest is ~2 KB of settings; the wire's metadata cap (64 KiB) bounds it again
MANIFESTS_PER_S, MANIFEST_BURST = 0.5, 4  # a volunteer asks once at start (its node's workers once each)


class ManifestServer(ServicerBase):
    """Answers `{}` with `{"manifest": document}`, or `{"manifest": null}` where it serves none."""

    def __init__(self, document: dict[str, Any] | None):
        encoded = encode_metadata({"manifest": document})
        if len(encoded) > MAX_MANIFEST_BYTES:
            raise ValueError(f"a run manifest of {len(encoded)} bytes exceeds {MAX_MANIFEST_BYTES}")
        self.answer = averaging_pb2.DownloadData(metadata=encoded)
        self.limit = RateLimit(MANIFESTS_PER_S, MANIFEST_BURST)
        self.answered = 0  # requests answered with the manifest

    async def rpc_run_manifest(self, _request: averaging_pb2.DownloadData,
                               context: P2PContext) -> averaging_pb2.DownloadData:
        if not self.limit.take(context.remote_id.to_base58()):
            return averaging_pb2.DownloadData(metadata=encode_metadata({"refused": "too many manifest requests"}))
        self.answered += 1
        return self.answer


async def request_manifest(p2p: P2P, peer_id: str, timeout_s: float = PATIENCE_S) -> dict[str, Any] | None:
    """The manifest document `peer_id` serves (None: it serves none). Raises WireError for a refusal or an answer
    that is not one, and P2P errors or TimeoutError when it does not answer."""
    stub = ManifestServer.get_stub(p2p, PeerID.from_base58(peer_id), namespace=NAMESPACE)
    message = await stub.rpc_run_manifest(averaging_pb2.DownloadData(), timeout=timeout_s)
    if len(message.metadata) > MAX_MANIFEST_BYTES:
        raise WireError(f"{peer_id} answered a manifest of {len(message.metadata)} bytes (at most "
                        f"{MAX_MANIFEST_BYTES})")
    answer = decode_metadata(message.metadata)
    if "refused" in answer:
        raise WireError(f"{peer_id} refused to send its manifest: {str(answer['refused'])[:200]}")
    document = answer.get("manifest")
    if document is not None and not isinstance(document, dict):
        raise WireError(f"{peer_id} answered a manifest that is not a JSON object")
    return document


def fetch_manifest(config: NetworkConfig, initial_peers: Sequence[str]) -> tuple[str, dict[str, Any] | None] | None:
    """(the initial peer that answered, its manifest or None), asking the initial peers in order; None when none of
    them answered at all (the peer's own DHT start-up then says that the swarm cannot be reached)."""
    if not initial_peers:
        return None
    return asyncio.run(_ask(config, initial_peers))


async def _ask(config: NetworkConfig, initial_peers: Sequence[str]) -> tuple[str, dict[str, Any] | None] | None:
    host_maddrs = ["/ip4/127.0.0.1/tcp/0"] if all(is_loopback(m) for m in initial_peers) else ["/ip4/0.0.0.0/tcp/0"]
    try:
        p2p = await P2P.create(initial_peers=list(initial_peers), host_maddrs=host_maddrs, nat_port_map=False,
                               auto_nat=False, use_relay=config.use_relay, startup_timeout=config.startup_timeout_s)
    except Exception as e:  # no initial peer reached: the DHT's start-up reports it in the peer's own words
        logger.debug(f"no daemon to ask for the run's manifest: {e}")
        return None
    try:
        for maddr in initial_peers:
            peer_id = peer_id_of(maddr)
            try:
                return peer_id, await request_manifest(p2p, peer_id)
            except WireError:
                raise
            except Exception as e:  # refused stream (an older peer without the service), timeouts: the next one
                logger.debug(f"{peer_id} sent no manifest: {e!r}")
        return None
    finally:
        with contextlib.suppress(Exception):
            await p2p.shutdown()
