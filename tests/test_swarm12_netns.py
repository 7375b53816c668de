"""The mission's swarm in CI's size (issue 30): the shipped `swarm12.yaml` runs as written on the netns testnet, 12
peers in the default mode on home links, 3 behind NAT, one leaving and one joining, and its report's checks hold."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from p2ptrain.metrics import read_metrics
from p2ptrain.testnet.netns_run import NetnsTestnetOptions, run_netns_testnet

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SCENARIO = Path(__file__).resolve().parents[1] / "testnet" / "scenarios" / "swarm12.yaml"


def test_the_twelve_peer_home_swarm_trains_together_through_churn(netns_ok: None, tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    ok = run_netns_testnet(NetnsTestnetOptions(scenario_path=str(SCENARIO), workdir=str(workdir), timeout_s=400,
                                               name_prefix=f"sw{os.getpid() % 100000}"))
    report = json.loads((workdir / "report" / "report.json").read_text())
    assert ok and report["passed"], [c for c in report["checks"] if not c["passed"]]
    assert {c["name"] for c in report["checks"]} >= {"loss_fell", "averaging", "max_consensus_distance",
                                                      "reachability"}
    ids = {peer: read_metrics(workdir / f"{peer}.jsonl")[0]["peer_id"] for peer in ("peer6", "peer12")}
    joiner = read_metrics(workdir / "peer12.jsonl")
    assert joiner[0]["joined"] and sum(bool(row["partners"]) for row in joiner) >= len(joiner) // 2
    late_rounds = [row for peer in ("peer0", "peer11") for row in read_metrics(workdir / f"{peer}.jsonl")
                   if row["time"] > joiner[-1]["time"] - 30]
    assert ids["peer6"] not in {p for row in late_rounds for p in row["partners"]}  # the leaver is no partner
