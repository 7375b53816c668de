"""The linter and the type checker, as tests: CI's one command runs them beside the other tests (the type check
alone takes minutes from a cold cache), and a failure names what they printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_ruff_finds_nothing_in_the_package_tests_and_benchmarks() -> None:
    result = run_tool("ruff", "check", "p2ptrain", "tests", "benchmarks")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_finds_nothing_in_the_package() -> None:
    result = run_tool("mypy", "p2ptrain")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success" in result.stdout
