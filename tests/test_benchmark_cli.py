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


@pytest.fixture(scope="module")
def helps() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every script's `--help`, started together: each pays the interpreter's imports (torch) once, side by side."""
    started = {script.name: subprocess.Popen([sys.executable, str(script), "--help"], stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True) for script in BENCHMARKS}
    done = {}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return done


@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_a_benchmark_prints_its_help(script: Path, helps: dict[str, subprocess.CompletedProcess[str]]) -> None:
    done = helps[script.name]
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
