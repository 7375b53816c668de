"""benchmarks/swarm_scale.py: the home links and NAT it gives a swarm, how it reads the runs' processes and reports,
and (netns, root) one small run end to end."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

from p2ptrain.config import build_config
from p2ptrain.testnet.scenario import parse_scenario

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import swarm_scale  # noqa: E402
from benchmarks.scale import measured  # noqa: E402
from benchmarks.scale.model import LINK_FLOOR_MBIT, UPLOAD_MEDIAN_MBIT, UPLOAD_P10_MBIT, UPLOAD_P90_MBIT  # noqa: E402


def test_the_links_are_the_home_distributions_quantiles() -> None:
    links = swarm_scale.home_links_mbit(100)
    assert links == sorted(links) and len(links) == 100
    assert statistics.geometric_mean(links) == pytest.approx(UPLOAD_MEDIAN_MBIT, rel=0.01)  # symmetric in log
    assert sum(rate < UPLOAD_P10_MBIT for rate in links) == 10 and sum(rate > UPLOAD_P90_MBIT for rate in links) == 10
    assert swarm_scale.home_links_mbit(8)[0] > LINK_FLOOR_MBIT


@pytest.mark.parametrize("peers", [3, 8, 16, 32])
def test_a_quarter_is_behind_nat_across_the_links_and_the_fastest_relays(peers: int) -> None:
    nat = swarm_scale.nat_peers(peers, 0.25)
    assert len(set(nat)) == len(nat) == round(peers / 4)
    indexes = [int(name.removeprefix("peer")) for name in nat]
    assert max(indexes) < peers - 1  # the relay is not behind NAT
    if peers >= 8:  # slow and fast links both
        assert min(indexes) < peers / 4 and max(indexes) >= peers / 2


@pytest.mark.parametrize("mode", list(swarm_scale.MODES))
def test_every_mode_is_a_valid_scenario_of_the_same_swarm(mode: str) -> None:
    raw = swarm_scale.scenario(mode, peers=16, budget_s=60.0, inner_steps=20, nat_fraction=0.25)
    scenario = parse_scenario(raw)
    assert scenario.peers == 16 and len(scenario.nat) == 4 and scenario.relays == ("peer15",)
    assert [f"{r:g}mbit" for r in scenario.bandwidth_mbit] == raw["bandwidth"]
    config = build_config(raw["peer_config"])
    assert config.sync.mode == swarm_scale.MODES[mode]["mode"] and config.data.num_shards >= 16


NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes packets errs drop fifo frame compressed multicast|bytes packets errs drop fifo colls carrier compressed
    lo: 29068243117 15242348 0 0 0 0 0 0 29068243117 15242348 0 0 0 0 0 0
  eth0: 5719219524 146175 0 0 0 0 0 0 9633774 93910 0 0 0 0 0 0
veth-p3: 120000 100 0 0 0 0 0 0 5000 40 0 0 0 0 0 0
"""


def test_a_hosts_sent_bytes_leave_loopback_and_received_bytes_out() -> None:
    assert swarm_scale.sent_beyond_loopback(NET_DEV) == 9633774 + 5000
    assert swarm_scale.sent_beyond_loopback("\n".join(NET_DEV.splitlines()[:3])) == 0  # loopback alone
    sent = swarm_scale.interface_sent_bytes(os.getpid())
    assert isinstance(sent, int) and sent >= 0
    assert swarm_scale.interface_sent_bytes(2**22 + 1) is None  # no such process


def rows(rounds: int, sent: int) -> list[dict[str, object]]:
    return [{"time": 10.0 * (i + 1), "round_s": 10.0, "compute_s": 8.0, "val_loss": 3.0 - 0.1 * i, "bytes_sent": sent,
             "inner_steps": 20, "peers_averaged": 2, "sync": "gasloc"} for i in range(rounds)]


def test_beyond_the_payloads_is_the_wire_less_the_exchanges_per_round_and_memory_its_peak() -> None:
    sampler = swarm_scale.ProcessSampler(Path("/nonexistent"))
    # readings at the end of each peer's last round (t = 40, 50); before it, a reading leaves out the last payloads
    sampler.sent_at = {"peer0": [(35.0, 8_000), (40.0, 10_000)], "peer1": [(50.5, 30_000), (51.0, 30_100)]}
    sampler.peak_pss = {"peer0": 100 * 2**20, "peer1": 300 * 2**20, "bootstrap": 50 * 2**20}
    report = {"passed": True, "peers": {"peer0": {"rounds": rows(4, 1_000)}, "peer1": {"rounds": rows(5, 2_000)},
                                        "peer2": {"rounds": []}}}
    row = swarm_scale.summarise("gasloc", 3, report, sampler)
    assert row["peers_with_rounds"] == 2 and row["median_utilisation"] == pytest.approx(0.8)
    assert row["payload_bytes_per_round"] == pytest.approx(1_500)
    assert row["wire_bytes_per_round"] == pytest.approx((10_000 / 4 + 30_000 / 5) / 2)
    assert row["beyond_payload_bytes_per_round"] == pytest.approx(((10_000 - 4_000) / 4 + (30_000 - 10_000) / 5) / 2)
    assert math.isnan(row["beyond_payload_in_rounds_per_round"])  # no samples in time
    assert sampler.sent_by("peer1", 51.5) is None and sampler.sent_by("peer9", 0.0) is None
    assert row["median_peak_pss"] == 200 * 2**20 and row["max_peak_pss"] == 300 * 2**20
    assert row["bootstrap_peak_pss"] == 50 * 2**20 and row["alone"] == 0.0
    assert "| 3 | gasloc |" in swarm_scale.table([row])


def test_growth_is_each_cost_at_the_largest_swarm_over_the_smallest() -> None:
    def row(mode: str, peers: int, scale: float) -> dict[str, object]:
        return {"mode": mode, "peers": peers, **{key: scale * 100.0 for key in swarm_scale.GROWTH_KEYS.values()}}

    found = swarm_scale.growth([row("swarm", 8, 1.0), row("swarm", 32, 1.1), row("diloco", 8, 1.0),
                                row("diloco", 16, 2.0), row("diloco", 32, 4.0), row("alone", 8, 1.0)])
    assert [(g["mode"], g["from"], g["to"]) for g in found] == [("swarm", 8, 32), ("diloco", 8, 32)]
    assert all(math.isclose(found[0][label], 1.1) for label in swarm_scale.GROWTH_KEYS)
    assert all(math.isclose(found[1][label], 4.0) for label in swarm_scale.GROWTH_KEYS)


@pytest.mark.parametrize("argv", [["--sizes", "2"], ["--modes", "swarm,nope"], ["--budget-s", "0"],
                                  ["--nat-fraction", "1"]])
def test_bad_arguments_are_one_line_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        swarm_scale.main(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.netns
@pytest.mark.slow
def test_a_small_run_measures_every_column(tmp_path: Path) -> None:
    out = tmp_path / "swarm_scale"
    assert swarm_scale.main(["--sizes", "3", "--modes", "swarm", "--budget-s", "20", "--out", str(out)]) == 0
    written = json.loads(out.with_suffix(".json").read_text())
    (row,) = written["rows"]
    assert row["peers_with_rounds"] == 3 and row["mean_rounds"] >= 2
    assert row["mean_val_loss"] < 5.0 and 0 < row["median_utilisation"] <= 1
    assert row["payload_bytes_per_round"] > 0  # the peers exchanged
    # DHT and framing besides: each peer's host sent more than its payloads by the end of its last round
    assert row["beyond_payload_bytes_per_round"] > 0 and row["wire_bytes_per_round"] > 0
    assert 50 * 2**20 < row["median_peak_pss"] < 2**31  # a peer's processes: more than the model, less than 2 GiB
    assert "| 3 | swarm |" in out.with_suffix(".md").read_text()


def synthetic_report(peers: int, compute_s: float = 1.0, rate_mbit: float = 20.0) -> dict[str, object]:
    rounds = [{"compute_s": compute_s, "eval_s": 0.1, "exchanges": [{"bytes_sent": 10_000}]} for _ in range(5)]
    return {"peers": {f"peer{i}": {"rate_mbit": rate_mbit, "rounds": rounds} for i in range(peers)}}


@pytest.mark.parametrize("mode", ["swarm", "diloco"])
def test_the_fitted_round_cost_gives_back_the_utilisation_it_was_fitted_to(mode: str) -> None:
    report = synthetic_report(8)
    utilisation = measured.simulated_utilisation(mode, report, parameters=100_000, budget_s=60.0, round_cost_s=0.5)
    assert utilisation < measured.simulated_utilisation(mode, report, parameters=100_000, budget_s=60.0)
    cost = measured.fit_round_cost(mode, report, parameters=100_000, budget_s=60.0, measured=utilisation)
    assert cost == pytest.approx(0.5, abs=0.02)


def test_diloco_on_the_exchange_transport_sends_n_minus_1_payloads_and_falls_with_the_swarm() -> None:
    small, large = synthetic_report(8, rate_mbit=5.0), synthetic_report(32, rate_mbit=5.0)
    swarm, share = measured.measured_swarm("diloco", small, parameters=1_000_000, round_cost_s=0.0)
    assert swarm.sparse_deltas and swarm.delta_bytes == 4_000_000  # fp32 Δ, an all-gather
    assert share == pytest.approx(np.full(8, 1.0 / 1.1))  # validation is not compute
    assert not measured.measured_swarm("diloco-scatter", small, 1_000_000, 0.0)[0].sparse_deltas
    assert measured.measured_swarm("swarm", small, 1_000_000, 0.0)[0].delta_bytes == 10_000  # what it sent
    assert measured.simulated_utilisation("diloco", large, 1_000_000, 60.0) < \
        measured.simulated_utilisation("diloco", small, 1_000_000, 60.0) / 2


def test_kept_runs_are_read_again_with_the_simulation_beside_them(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    (kept / "swarm-3-report").mkdir(parents=True)
    report = {"passed": True, "peers": {f"peer{i}": {"rate_mbit": 10.0 * (i + 1), "rounds": [
        r | {"eval_s": 0.1, "exchanges": [{"bytes_sent": 5_000}]} for r in rows(6, 20_000)]} for i in range(3)}}
    (kept / "swarm-3-report" / "report.json").write_text(json.dumps(report))
    sampler = swarm_scale.ProcessSampler(kept)
    sampler.sent_at = {f"peer{i}": [(60.0, 200_000)] for i in range(3)}
    sampler.peak_pss = {f"peer{i}": 2**28 for i in range(3)}
    row = swarm_scale.summarise("swarm", 3, report, sampler) | {"parameters": 117_120}
    (kept / "swarm-3.row.json").write_text(json.dumps(row))
    out = tmp_path / "out" / "scale"
    assert swarm_scale.main(["--sizes", "3", "--modes", "swarm", "--from-runs", str(kept), "--out", str(out)]) == 0
    (simulated,) = json.loads(out.with_suffix(".json").read_text())["simulation"]
    assert simulated["fitted_here"] and simulated["round_cost_s"] > 0  # 0.8 measured, 8 / 8.1 without a cost
    assert "| swarm | 3 | 0.800 | (fitted here) |" in out.with_suffix(".md").read_text()
    # runs it did not keep are left out (runs of different sizes and budgets are kept side by side); none at all,
    # a one-line error
    assert swarm_scale.main(["--sizes", "3", "4", "--modes", "swarm,gasloc", "--from-runs", str(kept), "--out",
                             str(out)]) == 0
    assert [r["peers"] for r in json.loads(out.with_suffix(".json").read_text())["rows"]] == [3]
    with pytest.raises(SystemExit):
        swarm_scale.main(["--sizes", "4", "--modes", "swarm", "--from-runs", str(kept), "--out", str(out)])


def test_beyond_the_payloads_in_rounds_leaves_the_start_out() -> None:
    """peer0's rounds end at t = 10, 20, 30, 40; its host sent 50 kB while it joined and waited, then 3 kB a
    round: 1 kB beyond its 2 kB payload a round, where the whole run reads (62 - 8) / 4 = 13.5 kB."""
    sampler = swarm_scale.ProcessSampler(Path("/nonexistent"))
    sampler.sent_at = {"peer0": [(0.0, 0), (9.0, 50_000), (25.0, 56_000), (41.0, 62_000)]}
    row = swarm_scale.summarise("gasloc", 1, {"passed": True, "peers": {"peer0": {"rounds": rows(4, 2_000)}}}, sampler)
    assert row["beyond_payload_bytes_per_round"] == pytest.approx(13_500)
    assert row["beyond_payload_in_rounds_per_round"] == pytest.approx((62_000 - 50_000 - 6_000) / 3)
    assert "| 2.0 |" in swarm_scale.table([row])
    assert sampler.sent_between("peer0", 9.5, 42.0) is None and sampler.sent_between("peer9", 0.0, 1.0) is None


def test_a_run_in_which_no_peer_ended_a_round_is_a_row_of_its_own_not_a_crash() -> None:
    report = {"passed": False, "peers": {"peer0": {"rounds": []}, "peer1": {"rounds": []}}}
    row = swarm_scale.summarise("swarm", 32, report, swarm_scale.ProcessSampler(Path("/nonexistent")))
    assert row["peers_with_rounds"] == 0 and math.isnan(row["median_utilisation"])
    assert "| 32 | swarm | nan |" in swarm_scale.table([row])
    assert swarm_scale.against_simulation([row | {"parameters": 1}], [report], 60.0) == []


def test_the_start_wait_is_the_peers_min_peers_wait() -> None:
    raw = swarm_scale.scenario("swarm", peers=32, budget_s=360.0, inner_steps=20, nat_fraction=0.25,
                               start_wait_s=240.0)
    assert build_config(raw["peer_config"]).run.min_peers_wait_s == 240.0
    assert "min_peers_wait_s" not in swarm_scale.scenario("swarm", 8, 60.0, 20, 0.25)["peer_config"]["run"]


def test_the_results_name_each_sizes_budget_where_kept_runs_differ() -> None:
    rows = [{"peers": 8, "budget_s": 120.0}, {"peers": 16, "budget_s": 120.0}, {"peers": 32, "budget_s": 360.0}]
    assert swarm_scale.budgets(rows, 60.0) == "120 s a run (32 peers: 360 s)"
    assert swarm_scale.budgets([{"peers": 8}], 60.0) == "60 s a run"
