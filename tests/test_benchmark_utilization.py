"""benchmarks/testnet_utilization.py: the scenarios it runs and how it reads their reports (no testnet here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from p2ptrain.config import build_config
from p2ptrain.testnet.scenario import parse_bandwidth

REPO = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmark_utilization",
                                                  REPO / "benchmarks" / "testnet_utilization.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load()


@pytest.mark.parametrize(("mode", "adapt"), [("diloco", False), ("gasloc", False), ("gasloc-paced", True),
                                             ("gasloc-overlap", False)])
def test_every_row_shares_the_swarm_and_the_paced_row_adapts(mode: str, adapt: bool) -> None:
    scenario = bench.scenario(mode, peers=6, fast_mbit=20.0, budget_s=100.0, inner_steps=100)
    assert parse_bandwidth(scenario["bandwidth"]) == (20.0,) * 5 + (2.0,)  # one straggler at 10 %
    config = build_config(scenario["peer_config"])  # a valid peer config
    assert config.sync.mode == mode.split("-")[0] and config.sync.adapt_inner_steps is adapt
    assert config.sync.overlap == ("delayed" if mode.endswith("-overlap") else "none")
    assert config.inner.steps == 100 and config.inner.min_steps == 5


@pytest.mark.parametrize(("mode", "overlap", "momentum"), [
    ("factored-local", "local", 0.0), ("diloco-g0.9", "none", 0.9), ("diloco", "none", 0.0)])
def test_a_row_runs_its_own_overlap_and_outer_momentum(mode: str, overlap: str, momentum: float) -> None:
    """Every row is a valid peer config; a row that sets the outer optimizer (DiLoCo's paper recipe) gets it."""
    config = build_config(bench.scenario(mode, peers=6, fast_mbit=20.0, budget_s=100.0, inner_steps=100)
                          ["peer_config"])
    assert config.sync.overlap == overlap
    assert config.sync.outer_momentum(config.outer.momentum) == momentum
    assert all(build_config(bench.scenario(m, 6, 20.0, 100.0, 100)["peer_config"]) for m in bench.VARIANTS)


def test_utilisation_is_compute_over_the_peers_own_wall_clock() -> None:
    rows = [{"time": 10.0, "round_s": 4.0, "compute_s": 3.0, "val_loss": 3.0, "bytes_sent": 5, "inner_steps": 100,
             "peers_averaged": 2},
            {"time": 16.0, "round_s": 6.0, "compute_s": 3.0, "val_loss": 2.5, "bytes_sent": 5, "inner_steps": 60,
             "peers_averaged": 2}]
    figures = bench.peer_figures(rows)
    assert figures["utilisation"] == pytest.approx(6.0 / 10.0)  # wall from 10 − 4 = 6 s to 16 s
    assert figures["val_loss"] == 2.5 and figures["rounds"] == 2 and figures["bytes_sent"] == 10
    assert figures["inner_steps"] == 160  # a phase cut short (aligned rounds) counts the steps it ran


def test_a_peers_phase_is_its_mean_compute_per_round() -> None:
    rows = [{"time": 10.0, "round_s": 4.0, "compute_s": 3.0, "val_loss": 3.0, "bytes_sent": 5, "inner_steps": 100,
             "peers_averaged": 1},
            {"time": 16.0, "round_s": 6.0, "compute_s": 5.0, "val_loss": 2.5, "bytes_sent": 5, "inner_steps": 60,
             "peers_averaged": 2}]
    assert bench.peer_figures(rows)["phase_s"] == pytest.approx(4.0)


@pytest.mark.parametrize(("phase_s", "step_s", "steps"), [(10.0, 0.0365, 274), (1.0, 0.5, 10), (1e4, 0.001, 2000)])
def test_phase_s_picks_the_h_of_that_phase_within_bounds(phase_s: float, step_s: float, steps: int) -> None:
    assert bench.inner_steps_for(phase_s, step_s) == steps


@pytest.mark.slow
def test_step_timing_measures_trainers_at_once_and_reports_a_failed_one() -> None:
    from benchmarks.step_timing import step_seconds

    config = {"model": bench.MODEL, "data": bench.DATA}
    seconds = step_seconds(config, trainers=2, steps=2, timeout_s=120)
    assert 0 < seconds < 10
    with pytest.raises(RuntimeError, match="trainer process failed"):  # an unknown model: the child dies at once
        step_seconds({**config, "model": {"name": "no-such-model"}}, trainers=1, steps=1, timeout_s=120)


def test_the_table_gives_each_row_against_diloco_in_utilisation_and_in_steps() -> None:
    def row(mode: str, utilisation: float, steps: float) -> dict[str, object]:
        return {"mode": mode, "median_utilisation": utilisation, "straggler_utilisation": 0.1, "mean_val_loss": 2.0,
                "mean_rounds": 3.0, "mean_inner_steps": steps, "median_phase_s": 2.0, "bytes_sent_per_peer": 1e6,
                "alone": 0.25}

    lines = bench.table([row("diloco", 0.4, 800), row("factored-overlap", 0.6, 1200)]).splitlines()
    assert lines[2].startswith("| diloco | 0.400 | 1.00× |") and "| 1.00× |" in lines[2]
    assert lines[3].startswith("| factored-overlap | 0.600 | 1.50× |") and "| 1.50× | 2.00 |" in lines[3]
    assert lines[3].endswith("| 1.00 | 25% |")


def test_rounds_alone_count_factoreds_mix2_and_the_other_modes_round_average() -> None:
    """Factored's rows count the Mix2 they applied (0: none that round, not counted); the others their average."""
    factored = [{"sync": "factored", "mix2_averaged": size, "peers_averaged": 3} for size in (0, 1, 2, 1, 3)]
    assert bench.alone_fraction(factored) == 0.5
    assert bench.alone_fraction([{"sync": "diloco", "peers_averaged": s} for s in (1, 4, 4, 4)]) == 0.25
