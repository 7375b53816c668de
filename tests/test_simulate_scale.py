"""benchmarks/simulate_scale.py: hand-computed utilisation on homogeneous swarms, straggler effects, conservation of
time, the stated link distribution, and the calibrate mode on its built-in sample."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "simulate_scale.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("simulate_scale", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulate_scale"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


sim = _load()
DILOCO, GOSSIP1, GOSSIP2 = sim.Algorithm("allreduce"), sim.Algorithm("gossip", 1), sim.Algorithm("gossip", 2)
INNER_S, PAYLOAD_BYTES = 10.0, 5e6  # at 8 Mbit/s one direction of a pair exchange takes 5e6 * 8 / 8e6 = 5 s


def _swarm(n: int, rate_mbit: float, straggler_rate_mbit: float | None = None, payload: float = PAYLOAD_BYTES) -> Any:
    """n identical peers (upload = download = rate), no latencies; peer 0 optionally a bandwidth straggler."""
    rates = np.full(n, rate_mbit)
    if straggler_rate_mbit is not None:
        rates[0] = straggler_rate_mbit
    return sim.Swarm(rates, rates.copy(), np.full(n, INNER_S), payload, 0.0, 0.0)


def test_homogeneous_diloco_waits_for_the_whole_allreduce() -> None:
    # n = 8 at 14 Mbit/s: 2 * 5e6 B * 8 bit * (7/8) / 14e6 bit/s = 5 s of all-reduce after 10 s of compute.
    result = sim.simulate(DILOCO, _swarm(8, 14.0), budget_s=150.0, min_rounds=10)
    assert result.end_s == 150.0
    np.testing.assert_allclose(result.utilisation, 10 / 15)
    assert all(durations == pytest.approx([15.0] * 10) for durations in result.round_s)
    assert list(result.rounds_in_budget) == [10] * 8
    latency = sim.Swarm(np.full(8, 14.0), np.full(8, 14.0), np.full(8, INNER_S), PAYLOAD_BYTES, 0.0, 5.0)
    np.testing.assert_allclose(sim.simulate(DILOCO, latency, 200.0, 10).utilisation, 10 / 20)


def test_homogeneous_gossip_pairs_triples_and_factored_match_hand_computed() -> None:
    pairs = sim.simulate(GOSSIP1, _swarm(8, 8.0), budget_s=150.0, min_rounds=10)
    np.testing.assert_allclose(pairs.utilisation, 10 / 15)  # 10 s compute + 5 s pair exchange
    assert all(len(partners) >= 1 for partners in pairs.partners)
    # Two partners: the initiator's 8 Mbit/s upload carries two 5 MB flows, 10 s; triples form (n = 9).
    triples = sim.simulate(GOSSIP2, _swarm(9, 8.0), budget_s=200.0, min_rounds=10)
    np.testing.assert_allclose(triples.utilisation, 10 / 20)
    # Factored, K = 2: Mix1 (5 s) hides behind the 10 s inner phase; Mix2 (10 s, two partners) every 2nd round.
    factored = sim.simulate(sim.Algorithm("factored", 2, 2), _swarm(9, 8.0), budget_s=90.0, min_rounds=6)
    np.testing.assert_allclose(factored.utilisation, 60 / 90)
    assert all(durations == pytest.approx([10.0, 20.0] * 3) for durations in factored.round_s)


def test_a_straggler_slows_every_diloco_peer_but_only_its_gossip_partners() -> None:
    # DiLoCo, n = 16: the all-reduce runs at the straggler's 0.8 Mbit/s: 2 * 5e6 * 8 * (15/16) / 0.8e6 = 93.75 s.
    even = sim.simulate(DILOCO, _swarm(16, 8.0), budget_s=193.75, min_rounds=10)
    slowed = sim.simulate(DILOCO, _swarm(16, 8.0, straggler_rate_mbit=0.8), budget_s=1037.5, min_rounds=10)
    np.testing.assert_allclose(even.utilisation, 10 / 19.375)
    np.testing.assert_allclose(slowed.utilisation, 10 / 103.75)

    homogeneous = 10 / 15
    gossip = sim.simulate(GOSSIP1, _swarm(16, 8.0, straggler_rate_mbit=0.8), budget_s=600.0, min_rounds=10, seed=1)
    utilisation, partners_of_straggler = gossip.utilisation, gossip.partners[0]
    assert utilisation[0] < homogeneous / 2
    dropped = {peer for peer in range(16) if utilisation[peer] < homogeneous - 1e-9}
    assert dropped <= {0} | partners_of_straggler and len(dropped) >= 2
    others = [peer for peer in range(1, 16) if peer not in partners_of_straggler]
    assert others, "some peers never met the straggler"
    np.testing.assert_allclose(utilisation[others], homogeneous)


def test_gossip_straggler_effects_stay_local_when_rounds_do_not_line_up() -> None:
    # 4 MB: 4 s pair exchanges, 40 s with the straggler; delayed partners rejoin off the 14 s grid, so peers that
    # never met the straggler can lose a little to busy links, but only a little.
    swarm = _swarm(16, 8.0, straggler_rate_mbit=0.8, payload=4e6)
    result = sim.simulate(GOSSIP1, swarm, budget_s=560.0, min_rounds=5, seed=3)
    homogeneous = 10 / 14
    others = [peer for peer in range(1, 16) if peer not in result.partners[0]]
    assert result.utilisation[0] < homogeneous / 2
    assert others and min(result.utilisation[others]) >= 0.95 * homogeneous
    assert np.median(np.delete(result.utilisation, 0)) > 0.95 * homogeneous


@pytest.mark.parametrize("name", ["diloco", "gossip-1", "gossip-2", "factored"])
def test_time_is_conserved_and_utilisation_is_a_fraction(name: str) -> None:
    scenario = sim.Scenario(peers=40, params=150e6, step_time_s=0.5, inner_steps=20, compute_spread=0.5,
                            stragglers=3, seed=7)
    swarm = sim.build_swarm(scenario)
    [algorithm] = sim._algorithms(name, 3)
    result = sim.simulate(algorithm, swarm, budget_s=3600.0, min_rounds=4, seed=7)
    np.testing.assert_allclose(result.compute_s + result.wait_s, result.end_s, rtol=1e-12)
    assert np.all(result.utilisation > 0) and np.all(result.utilisation <= 1 + 1e-12)
    # Independently: each completed round holds one whole inner phase; the round in progress holds what fits.
    for peer, durations in enumerate(result.round_s):
        inner_s = swarm.inner_phase_s[peer]
        expected = len(durations) * inner_s + min(inner_s, result.end_s - sum(durations))
        assert result.compute_s[peer] == pytest.approx(expected, rel=1e-9)
        assert len(durations) >= 4 and result.rounds_in_budget[peer] <= len(durations)
        assert min(durations) >= inner_s - 1e-9


def test_link_distribution_and_compute_model_are_the_stated_ones() -> None:
    upload = sim.sample_upload_mbit(200_000, np.random.default_rng(0))
    np.testing.assert_allclose(np.percentile(upload, [10, 50, 90]), [5.0, 22.36, 100.0], rtol=0.03)
    assert upload.min() >= 1.0 and upload.max() <= 1000.0
    swarm = sim.build_swarm(sim.Scenario(peers=50, params=150e6))
    np.testing.assert_allclose(swarm.download_mbit, np.minimum(5 * swarm.upload_mbit, 1000.0))
    assert swarm.payload_bytes == 300e6  # fp16
    rtx4090 = sim.GPUS["rtx4090"]
    assert sim.gpus_per_peer(150e6, rtx4090) == 1 and sim.gpus_per_peer(70e9, rtx4090) == 59  # 1.12 TB / 19.2 GB
    step_s = 6 * 150e6 * 131_072 / (165.2e12 * 0.4)
    assert sim.flops_step_time_s(150e6, rtx4090, 0.4, 131_072) == pytest.approx(step_s)
    np.testing.assert_allclose(swarm.inner_phase_s, 500 * step_s)


def test_calibrate_prints_model_and_ratio_for_the_sample(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim.main(["calibrate"]) == 0
    out = capsys.readouterr().out
    for row in sim.SAMPLE_RECORDS:
        predicted_s = row["payload_bytes"] * 8 / (row["link_rate_mbit"] * 1e6)
        ratio = row["measured_seconds"] / predicted_s
        expected = f"| {row['measured_seconds']:.3f} | {predicted_s:.3f} | {ratio:.3f} |"
        assert expected in out, f"{expected} missing from:\n{out}"
    assert "median measured / predicted: 1.04" in out


def test_calibrate_reads_a_records_file_and_rejects_bad_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = tmp_path / "records.json"
    rows = [{"payload_bytes": 10_000_000, "link_rate_mbit": 40, "measured_seconds": 3.0}]  # kind: exchange
    records.write_text(json.dumps({"format": sim.RECORD_FORMAT, "rows": rows}))
    assert sim.main(["calibrate", "--records", str(records), "--exchange-latency-s", "0.5"]) == 0
    assert "| 3.000 | 2.500 | 1.200 |" in capsys.readouterr().out  # 0.5 s + 10 MB * 8 / 40 Mbit/s = 2.5 s
    records.write_text(json.dumps([{"payload_bytes": 1, "link_rate_mbit": -2, "measured_seconds": 1}]))
    assert sim.main(["calibrate", "--records", str(records)]) == 2
    error = capsys.readouterr().err
    assert "row 0" in error and "link_rate_mbit" in error and error.count("\n") == 1


def test_simulate_mode_writes_markdown_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--peers", "12", "--params", "150M", "--compression", "1,10", "--step-time-s", "0.2", "--inner-steps",
            "10", "--budget-h", "0.5", "--min-rounds", "2", "--output-dir", str(tmp_path)]
    assert sim.main(argv) == 0
    document = json.loads((tmp_path / "simulate_scale.json").read_text())
    assert [row["algorithm"] for row in document["rows"]] == ["diloco", "gossip-1", "gossip-2", "factored-K4"] * 2
    assert all(0 < row["utilisation_p10"] <= row["utilisation_median"] <= 1 for row in document["rows"])
    markdown = (tmp_path / "simulate_scale.md").read_text()
    assert sim.HEADER in markdown and markdown.count("| 12 | 150M |") == 8
    assert sim.main(["--params", "big"]) == 2 and "150M" in capsys.readouterr().err
