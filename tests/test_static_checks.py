"""The linter and the type checker, as tests: CI's one command runs them beside the other tests, and a failure names
what they printed. The type check takes minutes from a cold cache: it starts in the background when collection
ends, in the idle class (tests/early_jobs.py), and its test comes after the machine-wide ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from early_jobs import TYPE_CHECK

REPO = Path(__file__).resolve().parents[1]


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_ruff_finds_nothing_in_the_package_tests_and_benchmarks() -> None:
    result = run_tool("ruff", "check", "p2ptrain", "tests", "benchmarks")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def type_check() -> subprocess.CompletedProcess[str]:
    """`mypy p2ptrain`, started when collection ended if this test was selected (minutes from a cold cache)."""
    return TYPE_CHECK.outcome("check")


@pytest.mark.slow
@pytest.mark.background  # it waits for the type check, which runs in the idle class beside the machine-wide tests
def test_mypy_finds_nothing_in_the_package(type_check: subprocess.CompletedProcess[str]) -> None:
    result = type_check
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success" in result.stdout
