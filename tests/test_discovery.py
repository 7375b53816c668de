"""Peer records: parsed through the schema, malformed and stale ones dropped, the freshest kept per peer."""

from __future__ import annotations

from types import SimpleNamespace

from p2ptrain.discovery import PeerRecord, SwarmView, parse_records
from p2ptrain.status import format_status_table

NOW = 1000.0


def entry(**fields: object) -> SimpleNamespace:
    record = dict(peer_id="12D3KooA", round=3, inner_step=2, phase="inner", round_eta=NOW + 5, updated=NOW - 1)
    record.update(fields)
    return SimpleNamespace(value=record)


def dht_result(*entries: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(value={f"subkey{i}".encode(): e for i, e in enumerate(entries)})


def test_malformed_and_stale_records_are_ignored_and_the_freshest_is_kept() -> None:
    raw = dht_result(
        entry(),
        entry(peer_id="12D3KooB", round="three"),  # wrong type
        entry(peer_id="12D3KooC", phase="hacking"),  # not a phase
        entry(peer_id="12D3KooD", round=-1),  # out of range
        SimpleNamespace(value=b"not a dict"),
        entry(peer_id="12D3KooE", updated=NOW - 60),  # stale: older than the TTL
        entry(peer_id="12D3KooA", round=4, updated=NOW - 0.5),  # a fresher record of A
    )
    records = parse_records(raw, ttl_s=8.0, now=NOW)
    assert [(r.peer_id, r.round) for r in records] == [("12D3KooA", 4)]
    assert parse_records(None, ttl_s=8.0, now=NOW) == []


def test_swarm_view_questions_and_the_status_table() -> None:
    records = [PeerRecord(peer_id=p, round=r, inner_step=0, phase=ph, round_eta=0.0, updated=NOW, train_loss=2.5)
               for p, r, ph in (("me", 3, "inner"), ("a", 3, "sync"), ("b", 4, "inner"), ("c", 9, "joining"))]
    view = SwarmView("me", records)
    assert [r.peer_id for r in view.others] == ["a", "b", "c"]
    assert [r.peer_id for r in view.at_round(3)] == ["a"]
    assert [r.peer_id for r in view.ahead_of(3)] == ["b"]  # a joining peer is not "ahead"
    table = format_status_table(records, NOW + 2)
    assert "4 live peer(s)" in table and "2.500" in table and "2.0s" in table
