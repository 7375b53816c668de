"""`p2ptrain status`: a run's live peers, read from the DHT, as a table or JSON, once or every few seconds."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import click
from hivemind.utils import get_dht_time

from p2ptrain.config import PeerConfig
from p2ptrain.net.admission import Admission
from p2ptrain.net.dht import start_dht
from p2ptrain.net.discovery import PeerRecord, add_record_validators, fetch_peers, present


def reach_of(record: PeerRecord) -> str:
    """How others reach a peer, as its record says (net/reachability.py): direct, relay (and which: the relay's
    peer id's last 6 characters), outbound (nobody can), ? (not tested yet); "+relay" if it serves as one."""
    reach = {"direct": "direct", "outbound": "outbound", "relay": f"relay:{record.relay_via[-6:]}"}.get(record.reach,
                                                                                                        "?")
    return reach + ("+relay" if record.relay else "")


def format_status_table(records: Sequence[PeerRecord], now: float) -> str:
    """One line per peer; `reach`: how others reach it (`reach_of`); `bans`: how many peers it bans now (its
    reputation record of offences)."""
    header = (f"{'peer':<54} {'round':>5} {'phase':<7} {'loss':>7} {'val':>7} {'tok/s':>8} {'reach':<19} {'bans':>5} "
              f"{'seen':>6}")
    lines = [header, "-" * len(header)]
    for r in records:
        loss = f"{r.train_loss:.3f}" if r.train_loss is not None else "-"
        val = f"{r.val_loss:.3f}" if r.val_loss is not None else "-"
        lines.append(f"{r.peer_id:<54} {r.round:>5} {r.phase:<7} {loss:>7} {val:>7} {r.tokens_per_s:>8.0f} "
                     f"{reach_of(r):<19} {r.banned:>5} {now - r.updated:>5.1f}s")
    lines.append(f"{len(records)} live peer(s)")
    return "\n".join(lines)


def status_document(run_id: str, signed: bool, records: Sequence[PeerRecord], now: float) -> dict[str, Any]:
    """The run's live peers as JSON-ready data: every record field (the ticket aside), and `seen_s`, the seconds
    since its last heartbeat."""
    peers = [{**record.dict(exclude={"ticket"}), "seen_s": round(now - record.updated, 3)} for record in records]
    return {"run_id": run_id, "signed": signed, "time": now, "live_peers": len(records), "peers": peers}


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
                 stop: threading.Event | None = None) -> list[PeerRecord]:
    """Join as a client and print the live peers (a table, or one JSON document a line): once, or every `every_s`
    seconds over the same connection until `count` refreshes or `stop`. In a signed run only peers with a valid
    ticket are listed. Returns the last refresh's records."""
    reader = RunReader(config, initial_peers)
    stop = stop or threading.Event()
    records: list[PeerRecord] = []
    try:
        refreshes = 0
        while True:
            started = time.monotonic()
            records, now = reader.read()
            if as_json:
                click.echo(json.dumps(reader.document(records, now)))
            else:
                stamp = f" at {time.strftime('%H:%M:%S')}" if every_s else ""
                click.echo(f"run {config.run.run_id!r}{' (signed)' if reader.admission.signed else ''}{stamp}:")
                click.echo(format_status_table(records, now))
            refreshes += 1
            if every_s is None or (count is not None and refreshes >= count):
                return records
            if stop.wait(max(0.0, every_s - (time.monotonic() - started))):
                return records
    finally:
        reader.close()
