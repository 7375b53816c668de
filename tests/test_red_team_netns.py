"""The red team on the netns testnet: a scenario's `adversary:` starts a hostile peer among honest ones, and the
report judges the honest peers (their loss fell, they banned it); the shipped scenario file runs as written."""

from __future__ import annotations

from pathlib import Path

import pytest
from netns_utils import run_shipped_scenario

from p2ptrain.metrics import read_metrics

pytestmark = [pytest.mark.netns, pytest.mark.slow]


def test_the_red_team_scenario_runs_and_the_honest_peers_ban_the_attacker(netns_ok: None, tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    ok, report = run_shipped_scenario("red_team.yaml", workdir, timeout_s=300)
    checks = {c["name"]: c for c in report["checks"]}
    assert ok and report["passed"], [c for c in report["checks"] if not c["passed"]]
    assert {"loss_fell", "attackers_banned"} <= set(checks)
    assert "red team: this peer plays 'aimed' from round 2" in (workdir / "peer3.log").read_text()
    attacker = {row["peer_id"] for row in read_metrics(workdir / "peer3.jsonl")}
    for honest in ("peer0", "peer1", "peer2"):
        rows = read_metrics(workdir / f"{honest}.jsonl")
        assert attacker & {p for row in rows for p in row["banned_peers"]}, f"{honest} never banned the attacker"
        assert rows[-1]["val_loss"] < rows[0]["val_loss"] and rows[-1]["val_loss"] < 4.5
