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


def test_utilisation_is_compute_over_the_peers_own_wall_clock() -> None:
    rows = [{"time": 10.0, "round_s": 4.0, "compute_s": 3.0, "val_loss": 3.0, "bytes_sent": 5},
            {"time": 16.0, "round_s": 6.0, "compute_s": 3.0, "val_loss": 2.5, "bytes_sent": 5}]
    figures = bench.peer_figures(rows)
    assert figures["utilisation"] == pytest.approx(6.0 / 10.0)  # wall from 10 − 4 = 6 s to 16 s
    assert figures["val_loss"] == 2.5 and figures["rounds"] == 2 and figures["bytes_sent"] == 10
