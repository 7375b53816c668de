"""The mission's swarm in CI's size (issue 30): the shipped `swarm12.yaml` runs as written on the netns testnet, 12
peers in the default mode on home links, 3 behind NAT, one leaving and one joining, and its report's checks hold."""

from __future__ import annotations

from pathlib import Path

import pytest
from netns_utils import run_shipped_scenario

from p2ptrain.metrics import read_metrics

pytestmark = [pytest.mark.netns, pytest.mark.slow]


def test_the_twelve_peer_home_swarm_trains_together_through_churn(netns_ok: None, tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    ok, report = run_shipped_scenario("swarm12.yaml", workdir, timeout_s=400)
    assert ok and report["passed"], [c for c in report["checks"] if not c["passed"]]
    assert {c["name"] for c in report["checks"]} >= {"loss_fell", "averaging", "max_consensus_distance",
                                                      "reachability"}
    leaver = read_metrics(workdir / "peer6.jsonl")[0]["peer_id"]
    joiner = read_metrics(workdir / "peer12.jsonl")
    assert joiner[0]["joined"] and sum(bool(row["partners"]) for row in joiner) >= len(joiner) // 2
    late_rounds = [row for peer in ("peer0", "peer11") for row in read_metrics(workdir / f"{peer}.jsonl")
                   if row["time"] > joiner[-1]["time"] - 30]
    assert leaver not in {p for row in late_rounds for p in row["partners"]}  # the leaver is no partner
