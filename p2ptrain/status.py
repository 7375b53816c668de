"""`p2ptrain status`: a table of a run's live peers, read from the DHT."""

from __future__ import annotations

from collections.abc import Sequence

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


def print_status(config: PeerConfig, initial_peers: Sequence[str]) -> list[PeerRecord]:
    """Join as a client, print the table; in a signed run only peers with a valid ticket are listed."""
    admission = Admission.from_config(config.network, config.run.run_id)  # a bad key file fails before joining
    dht = start_dht(config.network, initial_peers)
    try:
        add_record_validators(dht, config.run.run_id, config.network.record_ttl_s, admission)
        records = present(fetch_peers(dht, config.run.run_id, config.network.record_ttl_s, admission=admission))
        click.echo(f"run {config.run.run_id!r}{' (signed)' if admission.signed else ''}:")
        click.echo(format_status_table(records, get_dht_time()))
        return records
    finally:
        dht.shutdown()
