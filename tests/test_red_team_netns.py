"""The red team on the netns testnet: a scenario's `adversary:` starts a hostile peer among honest ones, and the
report judges the honest peers (their loss fell, they banned it); the shipped scenario file runs as written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from p2ptrain.metrics import read_metrics
from p2ptrain.testnet.netns_run import NetnsTestnetOptions, run_netns_testnet

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SCENARIO = Path(__file__).resolve().parents[1] / "testnet" / "scenarios" / "red_team.yaml"


def test_the_red_team_scenario_runs_and_the_honest_peers_ban_the_attacker(netns_ok: None, tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    ok = run_netns_testnet(NetnsTestnetOptions(scenario_path=str(SCENARIO), workdir=str(workdir), timeout_s=300,
                                               name_prefix=f"rt{os.getpid() % 100000}"))
    report = json.loads((workdir / "report" / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert ok and report["passed"], [c for c in report["checks"] if not c["passed"]]
    assert {"loss_fell", "attackers_banned"} <= set(checks)
    assert "red team: this peer plays 'aimed' from round 2" in (workdir / "peer3.log").read_text()
    attacker = {row["peer_id"] for row in read_metrics(workdir / "peer3.jsonl")}
    for honest in ("peer0", "peer1", "peer2"):
        rows = read_metrics(workdir / f"{honest}.jsonl")
        assert attacker & {p for row in rows for p in row["banned_peers"]}, f"{honest} never banned the attacker"
        assert rows[-1]["val_loss"] < rows[0]["val_loss"] and rows[-1]["val_loss"] < 4.5
