"""Every benchmark script answers --help (argparse formats each help string only then: a stray % broke one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def test_the_benchmarks_are_found() -> None:
    assert {p.name for p in BENCHMARKS} >= {"algorithms.py", "overhead.py", "simulate_scale.py",
                                             "testnet_utilization.py"}


@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_a_benchmark_prints_its_help(script: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
