"""benchmarks/simulate_scale.py and benchmarks/scale/: hand-computed utilisation on homogeneous swarms, straggler
effects, conservation of time, the stated link distribution, the exchange-time model, and the calibration against a
testnet run's exchange records (synthetic records here; a real netns run where root)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks/ is not installed; simulate_scale.py does the same

from benchmarks import simulate_scale  # noqa: E402
from benchmarks.scale import calibrate, codecs, grid, model, sim  # noqa: E402
from p2ptrain.errors import ConfigError, UserError  # noqa: E402
from p2ptrain.testnet.netns import NAMESPACE_MARKER, list_namespaces  # noqa: E402

DILOCO, GOSSIP1, GOSSIP2 = sim.Algorithm("allreduce"), sim.Algorithm("gossip", 1), sim.Algorithm("gossip", 2)
# At 16 Mbit/s a pair exchange of 5 MB takes 2.5 s out, then 2.5 s back: 5 s. (All-reduce tests use other rates.)
INNER_S, PAYLOAD_BYTES = 10.0, 5e6


def _swarm(n: int, rate_mbit: float, straggler_rate_mbit: float | None = None, payload: float = PAYLOAD_BYTES) -> Any:
    """n identical peers (upload = download = rate), no latencies, full efficiency; peer 0 optionally a
    bandwidth straggler."""
    rates = np.full(n, rate_mbit)
    if straggler_rate_mbit is not None:
        rates[0] = straggler_rate_mbit
    return model.Swarm(rates, rates.copy(), np.full(n, INNER_S), payload, 0.0, 0.0, 1.0)


def test_homogeneous_diloco_waits_for_the_whole_allreduce() -> None:
    # n = 8 at 14 Mbit/s: 2 * 5e6 B * 8 bit * (7/8) / 14e6 bit/s = 5 s of all-reduce after 10 s of compute.
    result = sim.simulate(DILOCO, _swarm(8, 14.0), budget_s=150.0, min_rounds=10)
    assert result.end_s == 150.0
    np.testing.assert_allclose(result.utilisation, 10 / 15)
    assert all(durations == pytest.approx([15.0] * 10) for durations in result.round_s)
    assert list(result.rounds_in_budget) == [10] * 8
    latency = model.Swarm(np.full(8, 14.0), np.full(8, 14.0), np.full(8, INNER_S), PAYLOAD_BYTES, 0.0, 5.0,
                          1.0)
    np.testing.assert_allclose(sim.simulate(DILOCO, latency, 200.0, 10).utilisation, 10 / 20)


def test_homogeneous_gossip_pairs_triples_and_factored_match_hand_computed() -> None:
    pairs = sim.simulate(GOSSIP1, _swarm(8, 16.0), budget_s=150.0, min_rounds=10)
    np.testing.assert_allclose(pairs.utilisation, 10 / 15)  # 10 s compute + 5 s pair exchange
    assert all(len(partners) >= 1 for partners in pairs.partners)
    # Two partners: the initiator's 16 Mbit/s upload carries two 5 MB flows, 5 s, then its download two, 5 s;
    # triples form (n = 9).
    triples = sim.simulate(GOSSIP2, _swarm(9, 16.0), budget_s=200.0, min_rounds=10)
    np.testing.assert_allclose(triples.utilisation, 10 / 20)
    # Factored, K = 2: Mix1 (5 s) hides behind the 10 s inner phase; Mix2 (10 s, two partners) every 2nd round.
    factored = sim.simulate(sim.Algorithm("factored", 2, 2), _swarm(9, 16.0), budget_s=90.0, min_rounds=6)
    np.testing.assert_allclose(factored.utilisation, 60 / 90)
    assert all(durations == pytest.approx([10.0, 20.0] * 3) for durations in factored.round_s)


def test_a_rounds_cost_is_time_without_compute_before_the_inner_phase() -> None:
    """1 s of the client's own work a round: gossip pairs take 1 + 10 + 5 s for 10 s of compute, and an overlapped
    exchange (5 s, started with the round) hides behind the cost and the inner phase (11 s)."""
    costly = dataclasses.replace(_swarm(8, 16.0), round_cost_s=1.0)
    pairs = sim.simulate(GOSSIP1, costly, budget_s=160.0, min_rounds=10)
    np.testing.assert_allclose(pairs.utilisation, 10 / 16)
    assert all(durations == pytest.approx([16.0] * 10) for durations in pairs.round_s)
    overlap = sim.simulate(sim.Algorithm("gradgossip", 1, overlap=True), costly, budget_s=110.0, min_rounds=10)
    np.testing.assert_allclose(overlap.utilisation, 10 / 11)
    assert model.Scenario(8, 150e6).round_cost_s == model.ROUND_COST_S > 0
    with pytest.raises(ConfigError, match="round's cost"):
        dataclasses.replace(costly, round_cost_s=-1.0)


def test_a_straggler_slows_every_diloco_peer_but_only_its_gossip_partners() -> None:
    # DiLoCo, n = 16: the all-reduce runs at the straggler's 0.8 Mbit/s: 2 * 5e6 * 8 * (15/16) / 0.8e6 = 93.75 s.
    even = sim.simulate(DILOCO, _swarm(16, 8.0), budget_s=193.75, min_rounds=10)
    slowed = sim.simulate(DILOCO, _swarm(16, 8.0, straggler_rate_mbit=0.8), budget_s=1037.5, min_rounds=10)
    np.testing.assert_allclose(even.utilisation, 10 / 19.375)
    np.testing.assert_allclose(slowed.utilisation, 10 / 103.75)

    homogeneous = 10 / 15
    gossip = sim.simulate(GOSSIP1, _swarm(16, 16.0, straggler_rate_mbit=1.6), budget_s=600.0, min_rounds=10,
                          seed=1)  # 5 s pair exchanges, 50 s with the straggler
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
    swarm = _swarm(16, 16.0, straggler_rate_mbit=1.6, payload=4e6)
    result = sim.simulate(GOSSIP1, swarm, budget_s=560.0, min_rounds=5, seed=3)
    homogeneous = 10 / 14
    others = [peer for peer in range(1, 16) if peer not in result.partners[0]]
    assert result.utilisation[0] < homogeneous / 2
    assert others and min(result.utilisation[others]) >= 0.95 * homogeneous
    assert np.median(np.delete(result.utilisation, 0)) > 0.95 * homogeneous


@pytest.mark.parametrize("name", ["diloco", "gossip-1", "gossip-2", "factored"])
def test_time_is_conserved_and_utilisation_is_a_fraction(name: str) -> None:
    scenario = model.Scenario(peers=40, params=150e6, step_time_s=0.5, inner_steps=20, compute_spread=0.5,
                              stragglers=3, seed=7)
    swarm = model.build_swarm(scenario)
    [algorithm] = grid.algorithms(name, 3)
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
    upload = model.sample_upload_mbit(200_000, np.random.default_rng(0))
    np.testing.assert_allclose(np.percentile(upload, [10, 50, 90]), [5.0, 22.36, 100.0], rtol=0.03)
    assert upload.min() >= 1.0 and upload.max() <= 1000.0
    swarm = model.build_swarm(model.Scenario(peers=50, params=150e6))
    np.testing.assert_allclose(swarm.download_mbit, np.minimum(5 * swarm.upload_mbit, 1000.0))
    assert swarm.payload_bytes == 300e6  # fp16
    rtx4090 = model.GPUS["rtx4090"]
    assert model.gpus_per_peer(150e6, rtx4090) == 1 and model.gpus_per_peer(70e9, rtx4090) == 59  # 1.12 TB / 19.2 GB
    step_s = 6 * 150e6 * 131_072 / (165.2e12 * 0.4)
    assert model.flops_step_time_s(150e6, rtx4090, 0.4, 131_072) == pytest.approx(step_s)
    np.testing.assert_allclose(swarm.inner_phase_s, 500 * step_s)


def test_an_exchange_sends_both_ways_one_after_the_other_through_each_directions_bottleneck() -> None:
    up, down = [10.0, 4.0], [50.0, 20.0]
    # 0 -> 1: 1 MB out through min(10, 20) = 10 Mbit/s, 0.8 s; 2 MB back through min(4, 50), 4 s; plus 0.3 s,
    # the transfers at 80 % efficiency: 0.3 + 4.8 / 0.8 = 6.3 s.
    assert model.exchange_transfer_s(up, down, 0, [1], 1e6, 2e6, 0.3, 0.8) == pytest.approx(6.3)
    # 1 -> 0: 1 MB out through min(4, 50), 2 s; 2 MB back through min(10, 20), 1.6 s.
    assert model.exchange_transfer_s(up, down, 1, [0], 1e6, 2e6, 0.0, 1.0) == pytest.approx(3.6)
    # Two partners at once: the initiator's 10 Mbit/s split in two, 1.6 s out and 1.6 s back for each flow.
    assert model.exchange_transfer_s([10.0, 40, 40], [10.0, 40, 40], 0, [1, 2], 1e6, 1e6, 0.0, 1.0) == \
        pytest.approx(3.2)
    # --duplex, a what-if: both directions at once, 0.3 + max(0.8, 4) / 0.8 = 5.3 s
    assert model.exchange_transfer_s(up, down, 0, [1], 1e6, 2e6, 0.3, 0.8, duplex=True) == pytest.approx(5.3)
    swarm = model.Swarm(np.array(up), np.array(down), np.ones(2), 1e6, 0.3, 5.0, 0.8)
    assert model.exchange_s(swarm, 0, [1]) == pytest.approx(0.3 + (0.8 + 2.0) / 0.8)  # the payload both ways
    assert model.allreduce_s(swarm) == pytest.approx(5.0 + 2 * 1e6 * 8 * (1 / 2) / (4e6 * 0.8))


def test_calibration_predicts_a_record_from_the_tcp_goodput_of_both_ends_tbf_rates() -> None:
    record = calibrate.MeasuredExchange("peer0", "peer2", 20.0, 5.0, "fp16", 234_240, 117_120, 1.0, 3)
    goodput_bit_s = 5e6 * 1448 / 1514  # the slower end bounds both directions
    expected = 0.1 + (234_240 + 117_120) * 8 / goodput_bit_s / 0.9
    assert calibrate.predict_s(record, calibrate.ExchangeConstants(0.1, 0.9)) == pytest.approx(expected)
    assert record.pair == (20.0, 5.0)


def _write_run(run_dir: Path, peers: dict[str, tuple[str, float | None]], exchanges: dict[str, list[dict[str, Any]]],
               ) -> None:
    """A testnet workdir: report/report.json with each peer's rate, and <peer>.jsonl metrics, two rows each (the
    exchanges in the second), plus a torn line."""
    (run_dir / "report").mkdir(parents=True)
    report = {"started": 1_795_000_000.0, "ended": 1_795_000_060.0,
              "peers": {host: {"rate_mbit": rate} for host, (_, rate) in peers.items()}}
    (run_dir / "report" / "report.json").write_text(json.dumps(report))
    for host, (peer_id, _) in peers.items():
        rows = [{"peer_id": peer_id, "round": r, "exchanges": exchanges.get(host, []) if r else []} for r in (0, 1)]
        (run_dir / f"{host}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"peer_id": "tor')


def _record(partner: str, seconds: float, nbytes: int = 234_240) -> dict[str, Any]:
    return {"partner": partner, "codec": "fp16", "bytes_sent": nbytes, "bytes_received": nbytes, "seconds": seconds}


def test_exchange_records_are_matched_to_both_ends_rates(tmp_path: Path) -> None:
    peers = {"peer0": ("Qm0", 20.0), "peer1": ("Qm1", 5.0), "peer2": ("Qm2", None)}
    _write_run(tmp_path, peers, {"peer0": [_record("Qm1", 0.9), _record("Qm2", 0.5), _record("QmGone", 0.4)],
                                 "peer1": [_record("Qm0", 0.8)]})
    run = calibrate.read_run(tmp_path)
    assert [(e.initiator, e.partner, e.initiator_mbit, e.partner_mbit, e.seconds, e.round) for e in run.exchanges] \
        == [("peer0", "peer1", 20.0, 5.0, 0.9, 1), ("peer1", "peer0", 5.0, 20.0, 0.8, 1)]
    # peer2 is unshaped (no rate to predict from), QmGone wrote no metrics row: both set apart, not guessed
    assert [(r["initiator"], r["partner_host"]) for r in run.unmatched] == [("peer0", "peer2"), ("peer0", None)]
    assert "3 peers at 20, 5, unshaped Mbit/s, 60 s" in run.description
    with pytest.raises(ConfigError, match="report.json"):
        calibrate.read_run(tmp_path / "nothing")


def test_calibrate_fits_the_constants_and_writes_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truth = calibrate.ExchangeConstants(0.05, 0.8)
    peers = {"peer0": ("Qm0", 20.0), "peer1": ("Qm1", 20.0), "peer2": ("Qm2", 5.0), "peer3": ("Qm3", 2.0)}
    partners = {"peer0": ["Qm1"] * 3, "peer2": ["Qm0", "Qm1", "Qm0"], "peer3": ["Qm2", "Qm0", "Qm1"]}
    exchanges = {}
    for host, ids in partners.items():
        rates = [(peers[host][1], next(rate for peer_id, rate in peers.values() if peer_id == i)) for i in ids]
        exact = [calibrate.predict_s(calibrate.MeasuredExchange(host, "", a, b, "fp16", 234_240, 234_240, 0, 0),
                                     truth) for a, b in rates]
        exchanges[host] = [_record(i, s) for i, s in zip(ids, exact, strict=True)]
    exchanges["peer0"].append(_record("Qm1", 5.0))  # one exchange stalled by a busy CPU: the medians ignore it
    _write_run(tmp_path / "run", peers, exchanges)
    argv = ["calibrate", "--from-run", str(tmp_path / "run"), "--output-dir", str(tmp_path), "--exchange-latency-s",
            "0.25", "--link-efficiency", "1"]
    assert simulate_scale.main(argv) == 0
    out = capsys.readouterr().out
    document = json.loads((tmp_path / "simulate_scale_calibration.json").read_text())
    assert document["fitted"]["fixed_s"] == pytest.approx(0.05, abs=1e-6)
    assert document["fitted"]["efficiency"] == pytest.approx(0.8, rel=1e-6)
    assert [(row["pair_mbit"], row["exchanges"]) for row in document["pairs"]] == [
        ([20.0, 20.0], 4), ([20.0, 5.0], 3), ([20.0, 2.0], 2), ([5.0, 2.0], 1)]
    for row in document["pairs"]:
        assert row["ratio_after"] == pytest.approx(1.0)
        # before: 0.25 s + the transfers at full efficiency
        transfer_s = 2 * 234_240 * 8 / (row["pair_mbit"][1] * 1e6 * 1448 / 1514)
        assert row["predicted_before_s"] == pytest.approx(0.25 + transfer_s)
        assert f"| {row['predicted_before_s']:.3f} | {row['ratio_before']:.3f} |" in out
    assert "set on the command line" in out and "fitted from the netns testnet run of" in out
    assert "| 20 – 5 | 3 | 234240 |" in (tmp_path / "simulate_scale_calibration.md").read_text()


def test_calibrate_needs_two_link_speeds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_run(tmp_path, {"peer0": ("Qm0", 20.0), "peer1": ("Qm1", 20.0)}, {"peer0": [_record("Qm1", 0.2)]})
    assert simulate_scale.main(["calibrate", "--from-run", str(tmp_path), "--output-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "two link pairs of different speed" in error and error.count("\n") == 1


@pytest.mark.netns
@pytest.mark.slow
def test_calibrate_on_the_netns_testnet(netns_ok: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 50 s: under CI load a 35 s run once had its 2 Mbit/s peer in no exchange at all (one link pair to fit)
    argv = ["calibrate", "--bandwidth", "20mbit,5mbit,2mbit", "--duration-s", "50", "--name-prefix", "calt",
            "--output-dir", str(tmp_path)]
    try:
        assert simulate_scale.main(argv) == 0
    finally:
        assert not [ns for ns in list_namespaces() if ns.startswith(f"{NAMESPACE_MARKER}calt-")]
    document = json.loads((tmp_path / "simulate_scale_calibration.json").read_text())
    assert not document["unmatched"], "every partner id is a peer of the run"
    rate = {"peer0": 20.0, "peer1": 5.0, "peer2": 2.0}
    assert all(rate[e["initiator"]] == e["initiator_mbit"] and rate[e["partner"]] == e["partner_mbit"]
               for e in document["exchanges"])
    assert len(document["pairs"]) >= 2
    # No exchange beats both directions, one after the other, at its bottleneck's TCP goodput (tbf's 16 KiB burst
    # may save up to ~7 % of a 234 KB payload): the matching found the right rates and the directions do not overlap.
    ideal = calibrate.ExchangeConstants(0.0, 1.0)
    for e in document["exchanges"]:
        assert e["seconds"] >= 0.9 * calibrate.predict_s(calibrate.MeasuredExchange(**e), ideal), e
    # The links set the time, not the protocol: an exchange behind the slower bottleneck takes longer, and the
    # fitted fixed cost stays under the slowest pair's transfer. The efficiency itself is not bounded below: peers
    # that train on 2 shared cores beside other tests stretch their exchanges (a CI run fitted 0.45, an idle one 0.89).
    slowest_transfer_s = max(calibrate.predict_s(calibrate.MeasuredExchange(**e), ideal) for e in document["exchanges"])
    assert 0.0 < document["fitted"]["efficiency"] <= 1.0, document["fitted"]
    assert document["fitted"]["fixed_s"] < slowest_transfer_s, (document["fitted"], slowest_transfer_s)
    by_bottleneck: dict[float, list[float]] = {}
    for row in document["pairs"]:
        by_bottleneck.setdefault(min(row["pair_mbit"]), []).append(row["measured_median_s"])
    if len(by_bottleneck) >= 2:
        slow, fast = min(by_bottleneck), max(by_bottleneck)
        assert statistics.median(by_bottleneck[slow]) > statistics.median(by_bottleneck[fast]), document["pairs"]
    # With the run's own constants: every exchange's median ratio within a factor 2, and every pair measured 3
    # times or more (a pair seen once is one sample on a shared 2-core machine: CI saw a single 5–2 Mbit/s
    # exchange at 2.04× its prediction, and a 35 s run with only 1–2 exchanges per pair).
    fitted = calibrate.ExchangeConstants(document["fitted"]["fixed_s"], document["fitted"]["efficiency"])
    ratios = [e["seconds"] / calibrate.predict_s(calibrate.MeasuredExchange(**e), fitted)
              for e in document["exchanges"]]
    # A pair is judged loosely (a factor 4): on 2 cores shared with other tests one pair's 8 exchanges once had a
    # median of 7.7 s, beyond a factor 2, while the fit held for the others; a wrong rate matching is off by more.
    assert len(ratios) >= 3 and 0.5 < statistics.median(ratios) < 2.0, ratios
    measured = [row["ratio_after"] for row in document["pairs"] if row["exchanges"] >= 3]
    assert not measured or 0.5 < statistics.median(measured) < 2.0, document["pairs"]
    assert all(0.25 < ratio < 4.0 for ratio in measured), document["pairs"]


def test_simulate_mode_writes_markdown_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--peers", "12", "--params", "150M", "--codecs", "fp16,delivered", "--delivered-ratio", "0.01",
            "--step-time-s", "0.2", "--inner-steps", "10", "--budget-h", "0.5", "--min-rounds", "2", "--output-dir",
            str(tmp_path)]
    assert simulate_scale.main(argv) == 0
    document = json.loads((tmp_path / "simulate_scale.json").read_text())
    names = ["diloco", "gossip-1", "gossip-2", "factored-K4", "gradgossip-1", "gradgossip-1-overlap"]
    assert [row["algorithm"] for row in document["rows"]] == names * 2
    assert [row["delta_ratio"] for row in document["rows"]] == [0.5] * 6 + [0.01] * 6
    assert all(row["param_payload_mb"] == 300.0 for row in document["rows"])  # parameters stay fp16
    assert all(0 < row["utilisation_p10"] <= row["utilisation_median"] <= 1 for row in document["rows"])
    markdown = (tmp_path / "simulate_scale.md").read_text()
    assert grid.HEADER in markdown and markdown.count("| 12 | 150M |") == 12 and "sparse (1/100)" in markdown
    # the exchange constants used, and the calibration run they were fitted from
    assert document["settings"]["link_efficiency"] == model.LINK_EFFICIENCY
    assert document["assumptions"]["exchange_constants"]["fitted_from"] == model.FITTED_FROM
    assert f"link efficiency {model.LINK_EFFICIENCY:g} (the defaults, {model.FITTED_FROM})" in markdown
    assert simulate_scale.main(["--params", "big"]) == 2 and "150M" in capsys.readouterr().err
    assert simulate_scale.main(["--codecs", "zip"]) == 2 and "unknown codec 'zip'" in capsys.readouterr().err
    assert simulate_scale.main([*argv, "--duplex", "--name", "what_if", "--codecs", "delivered"]) == 0
    assert "What-if: gossip exchanges stream both directions" in (tmp_path / "what_if.md").read_text()
    assert document["settings"]["round_cost_s"] == model.ROUND_COST_S
    assert f"costs the client {model.ROUND_COST_S:g} s before its inner phase" in markdown
    capsys.readouterr()
    assert simulate_scale.main([*argv, "--round-cost-s", "-1"]) == 2 and "round's cost" in capsys.readouterr().err


def test_sparse_outer_gradients_make_diloco_an_all_gather_and_gradient_gossip_carries_them() -> None:
    # 8 peers at 16 Mbit/s; parameters 5 MB, outer gradients 1 MB. All-gather: 7 x 1 MB x 8 / 16 Mbit/s = 3.5 s.
    rates = np.full(8, 16.0)
    swarm = model.Swarm(rates, rates.copy(), np.full(8, INNER_S), PAYLOAD_BYTES, 0.0, 0.0, 1.0, 1e6, True)
    assert model.allreduce_s(swarm) == pytest.approx(3.5)
    np.testing.assert_allclose(sim.simulate(DILOCO, swarm, 135.0, 10).utilisation, 10 / 13.5)
    # gradient gossip, a pair: 0.5 s out and 0.5 s back; GASLoC's gossip still sends 5 MB parameters (5 s)
    grad = sim.simulate(sim.Algorithm("gradgossip", 1), swarm, 110.0, 10)
    np.testing.assert_allclose(grad.utilisation, 10 / 11)
    np.testing.assert_allclose(sim.simulate(GOSSIP1, swarm, 150.0, 10).utilisation, 10 / 15)
    # with overlap the 1 s exchange runs behind the 10 s inner phase: nobody waits
    overlapped = sim.simulate(sim.Algorithm("gradgossip", 1, overlap=True), swarm, 100.0, 10)
    np.testing.assert_allclose(overlapped.utilisation, 1.0)
    assert sim.Algorithm("gradgossip", 1, overlap=True).name == "gradgossip-1-overlap"
    with pytest.raises(ConfigError):
        sim.Algorithm("gossip", 1, overlap=True)


def test_the_delivered_codec_is_the_fewest_bytes_within_one_percent(tmp_path: Path) -> None:
    def row(name: str, section: str, ratio: float, gap: float) -> dict[str, Any]:
        return {"name": name, "section": section, "payload_vs_fp32": ratio,
                "gap_best_percent": {"mean": gap, "sd": 0.1}}

    results = tmp_path / "algorithms.json"
    results.write_text(json.dumps({"aggregate": [
        row("diloco", "modes", 1.0, 0.0), row("sparse2-3%", "codecs", 1 / 107, -0.5),
        row("sparse2-2%", "codecs", 1 / 148, 0.9), row("sparse2-1%", "codecs", 1 / 248, 3.0),
        row("gradgossip", "gossip-codecs", 1 / 300, 0.0)]}))
    point = codecs.delivered(results)
    assert (point.name, point.delta_ratio, point.sparse) == ("sparse2-2%", 1 / 148, True)
    assert "1/148 of fp32 bytes at +0.90" in point.source
    assert codecs.delivered(results, 0.02).delta_ratio == 0.02
    assert [p.name for p in codecs.codec_points("fp16,delivered", results, None)] == ["fp16", "sparse2-2%"]
    results.write_text(json.dumps({"aggregate": [row("sparse2-1%", "codecs", 1 / 248, 3.0)]}))
    with pytest.raises(UserError, match="within 1 %"):
        codecs.delivered(results)
    with pytest.raises(UserError, match="--delivered-ratio"):
        codecs.delivered(tmp_path / "missing.json")
    with pytest.raises(ConfigError):
        codecs.delivered(results, 1.5)
