"""Every benchmark script answers --help (argparse formats each help string only then: a stray % broke one)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_zygote import zygote
from test_cli_errors import Outcome, cli_env, finish

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def test_the_benchmarks_are_found() -> None:
    assert {p.name for p in BENCHMARKS} >= {"algorithms.py", "overhead.py", "simulate_scale.py",
                                             "testnet_utilization.py"}


@pytest.fixture(scope="module")
def helps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Every script's `--help`, as `python SCRIPT --help` runs it, forked from a process that has imported torch
    once (tests/cli_zygote.py)."""
    workdir = tmp_path_factory.mktemp("benchmark-help")
    started = {}
    for script in BENCHMARKS:
        out, err = workdir / f"{script.name}.stdout", workdir / f"{script.name}.stderr"
        started[script.name] = zygote(cli_env()).start({"script": str(script)}, ["--help"], workdir, out, err), out, err
    return {name: finish(*run) for name, run in started.items()}


@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_a_benchmark_prints_its_help(script: Path, helps: dict[str, Outcome]) -> None:
    done = helps[script.name]
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
