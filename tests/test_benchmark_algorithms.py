"""benchmarks/algorithms.py and benchmarks/sim/: the wall-clock model by hand, and a --quick run (rows, sanity row,
bytes, JSON)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import algorithms  # noqa: E402
from benchmarks.sim.clock import Units, clock_stats, paced_steps, simulate_clock  # noqa: E402
from benchmarks.sim.rows import ROWS  # noqa: E402
from benchmarks.sim.simulation import build_bench  # noqa: E402
from benchmarks.sim.tables import run  # noqa: E402
from p2ptrain.maths.mixing import consensus_distance  # noqa: E402

PROTO_OVERHEAD_BYTES = 32  # upper bound on one runtime_pb2.Tensor's fields besides its buffer
ROW = {row.name: row for row in ROWS}
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
def test_quick_run(tmp_path: Path) -> None:
    settings, _ = algorithms.parse_args(["--quick"])
    report = run(settings, tmp_path, command="pytest")
    table1 = {r.name: r for r in report["rows"]["equal_tokens"]}
    table2 = {r.name: r for r in report["rows"]["equal_wallclock"]}
    assert set(table1) == set(ROW) and set(table2) == {r.name for r in ROWS if not r.sanity}
    for row in [*table1.values(), *table2.values()]:
        assert math.isfinite(row.val_loss) and math.isfinite(row.mean_peer_val_loss), row.name
    assert table1["diloco"].val_loss < 5.4  # it trained: a uniform guess over 257 tokens is ln 257 = 5.55

    diloco, complete = table1["diloco"], table1["gasloc-complete"]
    assert abs(complete.val_loss - diloco.val_loss) <= 1e-4 * diloco.val_loss
    assert consensus_distance(diloco.average, complete.average) <= 1e-4
    assert report["sanity"]["verdict"] == "PASS"
    assert diloco.max_consensus_distance == 0.0 and table1["gasloc-1peer-g0.9"].max_consensus_distance > 0.0

    numels = [t.numel() for t in build_bench(settings).theta0]
    n = settings.peers
    _assert_ratio(diloco.bytes_per_round_vs_model, 4 * sum(numels), 2 * (n - 1) / n, numels)
    _assert_ratio(table1["diloco-fp16"].bytes_per_round_vs_model, 2 * sum(numels), 2 * (n - 1) / n, numels)
    assert table1["diloco-fp16"].bytes_per_round_vs_model / diloco.bytes_per_round_vs_model == pytest.approx(0.5, 1e-3)
    int8_raw = sum(x + 4 * -(-x // min(4096, x)) + 16 for x in numels)
    _assert_ratio(table1["diloco-int8"].bytes_per_round_vs_model, int8_raw, 2 * (n - 1) / n, numels)
    for name, density in (("diloco-topk-1/128+EF", 1 / 128), ("diloco-topk-1/32+EF", 1 / 32)):
        raw = sum(_topk_bytes(x, density) for x in numels)
        _assert_ratio(table1[name].bytes_per_round_vs_model, raw, n - 1, numels)  # all-gather: n−1 payloads
    _assert_ratio(table1["gasloc-1peer-g0"].bytes_per_round_vs_model, 2 * sum(numels), 1, numels)  # fp16 y, 1 partner
    _assert_ratio(table1["gasloc-2peer-g0"].bytes_per_round_vs_model, 2 * sum(numels), 2, numels)
    factored_k4 = table1["factored-K4"].bytes_per_round_vs_model  # Mix1 every round, fp32 Mix2 in 1 round of 4
    assert factored_k4 == pytest.approx(0.5 + 2 * 1.0 / 4, rel=5e-3)

    assert table2["diloco"].rounds == [settings.rounds] * n and table2["diloco"].reused_from_table1
    assert table2["gasloc-1peer-g0.9"].inner_steps[-1] < table2["gasloc-1peer-g0.9"].inner_steps[0]
    assert all(0.0 < row.utilisation <= 1.0 for row in table2.values())

    written = json.loads((tmp_path / "algorithms.json").read_text())
    assert [r["name"] for r in written["equal_tokens"]] == [r.name for r in ROWS]
    assert len(written["equal_wallclock"]) == len(table2) and written["torch_threads"] == settings.threads
    assert written["command"] == "pytest" and written["wall_s"] > 0
    assert {t["verdict"] for t in written["targets"]} <= {"PASS", "MISS"} and len(written["targets"]) >= 5
    assert "## 2. Equal simulated wall clock" in (tmp_path / "algorithms.md").read_text()
