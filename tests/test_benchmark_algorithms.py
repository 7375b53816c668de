"""benchmarks/algorithms.py and benchmarks/sim/: the wall-clock model by hand, CHOCO-Gossip against GASLoC, and a
--quick run (rows, seeds and paired gaps, sanity check, bytes, JSON and Markdown)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import algorithms  # noqa: E402
from benchmarks.sim.clock import Units, clock_stats, paced_steps, simulate_clock  # noqa: E402
from benchmarks.sim.peers import build_bench, row_codec  # noqa: E402
from benchmarks.sim.rows import QUICK, ROWS, Algorithm, Settings  # noqa: E402
from benchmarks.sim.simulation import train_row  # noqa: E402
from benchmarks.sim.tables import run, selected_rows  # noqa: E402
from p2ptrain.maths.mixing import consensus_distance  # noqa: E402

PROTO_OVERHEAD_BYTES = 32  # upper bound on one runtime_pb2.Tensor's fields besides its buffer
ROW = {row.name: row for row in ROWS} | {
    "gasloc-1peer-g0": Algorithm("gasloc-1peer-g0", "gasloc", graph="matching", momentum=0.0),
    "factored-K1-delay1": Algorithm("factored-K1-delay1", "factored", mix2_overlap="delayed", momentum=0.0)}
PAIRS = [[1], [0], [3], [2]]
CROSS = [[2], [3], [0], [1]]
CYCLE = [[3, 1], [0, 2], [1, 3], [2, 0]]
BANDWIDTH = [10.0, 10.0, 10.0, 1.0]  # bytes/s; peer 3 is the straggler
UNITS = Units(delta_bytes=10, param_bytes=5)


def _clock(name: str, graphs: tuple[list, list], budget_s: float = math.inf, rounds: int = 2):
    return simulate_clock(ROW[name], UNITS, [2, 2, 2, 2], 1.0, BANDWIDTH, graphs, budget_s, rounds)


def test_diloco_waits_for_the_slowest_member() -> None:
    clock = _clock("diloco", ([], []))
    assert clock.ends == [[17.0] * 4, [34.0] * 4]  # 2 s compute + 1.5 × 10 bytes at 1 byte/s


def test_delayed_overlaps_the_allreduce_with_the_next_inner_phase() -> None:
    clock = _clock("diloco-delay1", ([], []), rounds=3)
    assert clock.ends == [[2.0] * 4, [17.0] * 4, [32.0] * 4]


def test_gossip_pairs_wait_only_for_their_partner() -> None:
    clock = _clock("gasloc-1peer-g0.9", ([PAIRS, CROSS], []))
    assert clock.ends[0] == [2.5, 2.5, 7.0, 7.0]
    assert clock.ends[1] == [9.5, 14.0, 9.5, 14.0]
    rounds, utilisation = clock_stats(clock, budget_s=9.5)
    assert rounds == [2, 1, 2, 1]
    assert utilisation == pytest.approx(4.0 / 9.5)  # every peer computed 2 × 2 s within the budget


def test_factored_mix1_overlaps_and_mix2_blocks() -> None:
    clock = _clock("factored-K1", ([PAIRS], [CYCLE]), rounds=1)
    assert clock.ends[0] == [16.0, 7.0, 16.0, 25.0]


def test_factored_with_overlap_runs_mix2_during_the_next_round() -> None:
    graphs = ([PAIRS] * 3, [CYCLE] * 3)
    blocking, delayed = _clock("factored-K1", graphs, rounds=3), _clock("factored-K1-delay1", graphs, rounds=3)
    assert delayed.ends[0] == [2.0, 2.0, 5.0, 5.0]  # Mix1 only, which overlaps the 2 s of compute
    assert delayed.ends[1] == blocking.ends[0]  # round 1 ends once round 0's Mix2 is done (compute is shorter)
    assert max(delayed.ends[2]) < max(blocking.ends[2]) - 40


def test_pacing_gives_the_straggler_fewer_steps() -> None:
    steps = paced_steps(ROW["gasloc-1peer-g0"], UNITS, 1.0, BANDWIDTH, 10)
    assert steps == [10, 10, 10, 6]  # ceil(10 + 0.5) − ceil(5 / 1)
    assert paced_steps(ROW["diloco"], UNITS, 1.0, BANDWIDTH, 10) == [10] * 4


def _fp32_model_bytes(shapes: list[int]) -> int:
    return 4 * sum(shapes)


def _topk_bytes(numel: int, density: float) -> int:
    chunk = min(4096, numel)
    k = max(1, min(chunk, round(density * chunk)))
    return 20 + -(-numel // chunk) * (4 + 3 * k)


def _assert_ratio(measured: float, raw_bytes: float, copies: float, numels: list[int]) -> None:
    """``measured`` (a fraction of the fp32 model) is ``copies`` payloads of ``raw_bytes`` plus protobuf fields."""
    model = _fp32_model_bytes(numels)
    assert copies * raw_bytes / model <= measured <= copies * (raw_bytes + PROTO_OVERHEAD_BYTES * len(numels)) / model


@pytest.mark.slow
@pytest.mark.background  # CPU work, nothing timed (tests/README.md)
def test_local_overlap_rows_keep_the_swarm_mean_on_diloco_and_lose_no_round() -> None:
    """After one round a `local` peer holds θ_0 − η Δ_i (its own Δ, at once: no round lost to the delay), so the
    swarm's mean is DiLoCo's step without momentum; with Mix2 (factored-local) the mean is the same, since Mix1 and
    Mix2 both keep it."""
    bench = build_bench(Settings(**{**QUICK, "rounds": 1}))
    steps, rounds = [3] * 4, [1] * 4
    diloco = train_row(Algorithm("diloco-g0", "diloco", momentum=0.0), bench, steps, rounds)
    for name in ("diloco-local", "factored-local"):
        local = train_row(ROW[name], bench, steps, rounds)
        assert consensus_distance(local[0].theta, local[1].theta) > 1e-4  # each holds its own Δ
        mean = [sum(group) / len(local) for group in zip(*(p.theta for p in local), strict=True)]
        assert consensus_distance(mean, diloco[0].theta) <= 1e-6, name


@pytest.mark.slow
def test_choco_with_an_exact_codec_is_gasloc_on_its_overlay() -> None:
    """With codec none the public estimates are the proposals themselves, so a CHOCO round with γ_c = 1 is GASLoC's
    mix of y with the ring's Metropolis weights (1/3): the same parameters, to float rounding."""
    bench = build_bench(Settings(**{**QUICK, "rounds": 2}))
    choco = Algorithm("choco-exact", "choco", codec="none", graph="ring", momentum=0.0, consensus_step=1.0)
    gasloc = Algorithm("gasloc-ring", "gasloc", graph="ring", momentum=0.0, param_codec="none")
    steps, rounds = [3] * 4, [2] * 4
    for a, b in zip(train_row(choco, bench, steps, rounds), train_row(gasloc, bench, steps, rounds), strict=True):
        assert consensus_distance(a.theta, b.theta) <= 1e-6
        assert a.bytes_sent == 2 * 2 * 4 * sum(t.numel() for t in bench.theta0)  # 2 rounds x 2 neighbours, fp32


@pytest.mark.slow
@pytest.mark.background  # CPU work, nothing timed (tests/README.md)
def test_quick_run(tmp_path: Path) -> None:
    settings, _ = algorithms.parse_args(["--quick"])
    assert settings.seeds == 2 and settings.wallclock
    report = run(settings, tmp_path, command="pytest")
    per_seed = report["rows"]["equal_tokens"]
    names = [row.name for row in selected_rows(settings)]
    assert [[r.name for r in seed_rows] for seed_rows in per_seed] == [names, names] and names == [r.name for r in ROWS]
    assert [seed_rows[0].seed for seed_rows in per_seed] == [0, 1]
    for row in [r for seed_rows in per_seed for r in seed_rows]:
        assert math.isfinite(row.val_loss) and math.isfinite(row.mean_peer_val_loss), row.name
        assert 0.0 < (row.utilisation or 0.0) <= 1.0, row.name
    first = {r.name: r for r in per_seed[0]}
    assert first["diloco"].val_loss < 5.4  # it trained: a uniform guess over 257 tokens is ln 257 = 5.55
    assert per_seed[0][0].val_loss != per_seed[1][0].val_loss  # seeds differ
    assert report["sanity"]["verdict"] == "PASS"
    assert first["diloco"].max_consensus_distance == 0.0 and first["gasloc-1peer"].max_consensus_distance > 0.0

    aggregate = {row["name"]: row for row in json.loads((tmp_path / "algorithms.json").read_text())["aggregate"]}
    for name, row in aggregate.items():  # gaps are paired with the same seed's DiLoCo
        expected = [100 * (seed_rows[names.index(name)].val_loss / seed_rows[0].val_loss - 1) for seed_rows in per_seed]
        assert row["gaps_percent"] == pytest.approx(expected)
        assert row["gap_percent"]["mean"] == pytest.approx(sum(expected) / 2)

    numels = [t.numel() for t in build_bench(settings).theta0]
    n = settings.peers
    _assert_ratio(first["diloco"].bytes_per_round_vs_model, 4 * sum(numels), 2 * (n - 1) / n, numels)
    for name in ("topk8-1/32", "topk8-1/128"):
        raw = sum(_topk_bytes(x, ROW[name].density) for x in numels)
        _assert_ratio(first[name].bytes_per_round_vs_model, raw, n - 1, numels)  # all-gather: n−1 payloads
    for name in ("sparse2-2%", "sparse4-1%", "gradgossip-sparse2-2%", "choco-sparse2-2%"):
        codec = row_codec(ROW[name])
        raw = sum(codec.payload_bytes_for(x) for x in numels)  # type: ignore[union-attr]
        copies = {"diloco": n - 1, "gradgossip": 1, "choco": 2}[ROW[name].kind]
        _assert_ratio(first[name].bytes_per_round_vs_model, raw, copies, numels)
        assert first[name].payload_vs_fp32 == pytest.approx(raw / _fp32_model_bytes(numels), rel=1e-2)
    _assert_ratio(first["gasloc-1peer"].bytes_per_round_vs_model, 2 * sum(numels), 1, numels)  # fp16 y, 1 partner
    _assert_ratio(first["gasloc-2peer"].bytes_per_round_vs_model, 2 * sum(numels), 2, numels)
    factored_k4 = first["factored-K4"].bytes_per_round_vs_model  # Mix1 every round, fp32 Mix2 in 1 round of 4
    assert factored_k4 == pytest.approx(0.5 + 2 * 1.0 / 4, rel=5e-3)
    assert first["factored-K4"].utilisation > first["factored-K1"].utilisation  # Mix2 blocks: rarer is faster

    table2 = {r.name: r for r in report["rows"]["equal_wallclock"]}
    assert set(table2) == {r.name for r in ROWS if r.section == "modes"}
    assert table2["diloco"].rounds == [settings.rounds] * n and table2["diloco"].reused_from_table1
    assert table2["gasloc-1peer"].inner_steps[-1] < table2["gasloc-1peer"].inner_steps[0]

    written = json.loads((tmp_path / "algorithms.json").read_text())
    assert written["command"] == "pytest" and written["wall_s"] > 0 and 0 < written["cpu_s"]
    assert {t["verdict"] for t in written["targets"]} <= {"PASS", "MISS"} and len(written["targets"]) >= 5
    text = (tmp_path / "algorithms.md").read_text()
    for heading in ("## 1. Modes", "## 2. Outer momentum", "## 3. Factored", "## 4. Codec frontier",
                    "## 5. Compressed gossip", "## 6. Equal simulated wall clock", "## Targets"):
        assert heading in text


def test_sections_keep_the_reference_and_bad_flags_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    settings, _ = algorithms.parse_args(["--sections", "codecs", "--seeds", "1"])
    assert [r.name for r in selected_rows(settings)][0] == "diloco"
    assert {r.name for r in selected_rows(settings) if r.section != "codecs"} == {"diloco", "diloco-g0"}
    assert (settings.model, settings.rounds, settings.seeds) == ("bench-1m", 50, 1)  # FULL under the flags
    with pytest.raises(SystemExit):
        algorithms.parse_args(["--sections", "everything"])
    assert "unknown section 'everything'" in capsys.readouterr().err
    settings, _ = algorithms.parse_args(["--rows", "factored-local-sparse2-2%,gasloc-1peer", "--sections", "mix2"])
    assert [r.name for r in selected_rows(settings)] == ["diloco", "gasloc-1peer", "diloco-g0", "factored-K2",
                                                         "factored-K4", "factored-local-sparse2-2%"]
    with pytest.raises(SystemExit):
        algorithms.parse_args(["--rows", "diloco-g7"])
    assert "unknown row 'diloco-g7'" in capsys.readouterr().err
