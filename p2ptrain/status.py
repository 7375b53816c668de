"""`p2ptrain status`: a run's live peers read from the DHT by a client node of our own (status_view.py shows them,
and reads a status page instead, without a DHT node)."""

from __future__ import annotations

import statistics
import threading
from collections.abc import Sequence
from typing import Any

from hivemind.utils import get_dht_time

from p2ptrain.config import PeerConfig
from p2ptrain.net.admission import Admission
from p2ptrain.net.dht import start_dht
from p2ptrain.net.discovery import PeerRecord, add_record_validators, fetch_peers, present, short_id
from p2ptrain.status_view import show_status


def status_document(run_id: str, signed: bool, records: Sequence[PeerRecord], now: float) -> dict[str, Any]:
    """The run's live peers as JSON-ready data: every record field (the ticket aside), `seen_s`, the seconds since
    its last heartbeat, and `verified_tokens` (`verified_tokens`; None where no other record vouches for it)."""
    verified = verified_tokens(records)
    peers = [{**record.dict(exclude={"ticket"}), "seen_s": round(now - record.updated, 3),
              "verified_tokens": verified.get(record.peer_id)} for record in records]
    return {"run_id": run_id, "signed": signed, "time": now, "live_peers": len(records), "peers": peers}


def verified_tokens(records: Sequence[PeerRecord]) -> dict[str, int]:
    """Per peer, the lower median of the tokens its partners' records say they verified of its claims (by its
    outer gradients, sync/contribution.py); peers no other record vouches for are left out. What `status` shows
    beside the tokens a peer claims. A vouch is a claim too, which cheap identities can make about anyone: the
    median needs half the vouchers to lie, and decides nothing but this display."""
    by_short: dict[str, list[str]] = {}
    for record in records:
        by_short.setdefault(short_id(record.peer_id), []).append(record.peer_id)
    vouches: dict[str, list[int]] = {}
    for voucher in records:
        for short, tokens in voucher.vouched.items():
            for peer in by_short.get(short, []):
                if peer != voucher.peer_id:
                    vouches.setdefault(peer, []).append(tokens)
    return {peer: statistics.median_low(tokens) for peer, tokens in vouches.items()}


class RunReader:
    """A client DHT node that reads a run's live records (in a signed run, only those with a valid ticket)."""

    def __init__(self, config: PeerConfig, initial_peers: Sequence[str]):
        self.run_id, self.ttl_s = config.run.run_id, config.network.record_ttl_s
        self.admission = Admission.from_config(config.network, self.run_id)  # a bad key file fails before joining
        self.dht = start_dht(config.network, initial_peers)
        try:
            add_record_validators(self.dht, self.run_id, self.ttl_s, self.admission)
        except BaseException:
            self.dht.shutdown()
            raise

    def read(self) -> tuple[list[PeerRecord], float]:
        """The live records and the DHT time they were read at."""
        return present(fetch_peers(self.dht, self.run_id, self.ttl_s, admission=self.admission)), get_dht_time()

    def document(self, records: Sequence[PeerRecord], now: float) -> dict[str, Any]:
        return status_document(self.run_id, self.admission.signed, records, now)

    def close(self) -> None:
        self.dht.shutdown()


def print_status(config: PeerConfig, initial_peers: Sequence[str], as_json: bool = False,
                 every_s: float | None = None, count: int | None = None,
                 stop: threading.Event | None = None) -> dict[str, Any]:
    """Join as a client and print the live peers (a table, or one JSON document a line): once, or every `every_s`
    seconds over the same connection until `count` refreshes or `stop`. In a signed run only peers with a valid
    ticket are listed. Returns the last refresh's status document."""
    reader = RunReader(config, initial_peers)
    try:
        return show_status(lambda: reader.document(*reader.read()), as_json, every_s, count,
                           stop or threading.Event())
    finally:
        reader.close()
