"""Shared fixtures: every test reaps the processes it started, and the suite fails if a p2pd daemon outlives it."""

from __future__ import annotations

import os
import time

import psutil
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REAP_GRACE_S = 10.0


def _p2pd_pids() -> set[int]:
    pids = set()
    for process in psutil.process_iter(["name", "cmdline"]):
        try:
            name = process.info["name"] or ""
            cmdline = " ".join(process.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if name == "p2pd" or cmdline.split(" ")[0].endswith("/p2pd"):
            pids.add(process.pid)
    return pids


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _gone, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return alive


def _reapable(process: psutil.Process) -> bool:
    """torch's shared-memory manager lives as long as this process and must not be killed before it."""
    try:
        return process.name() != "torch_shm_manager"
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(autouse=True)
def reap_children():
    """Kill whatever child processes a test left behind (hivemind's DHT and averager run as children)."""
    yield
    children = [c for c in psutil.Process().children(recursive=True) if _reapable(c)]
    alive = _wait_gone(children, timeout_s=0.5) if children else []
    for child in alive:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    for child in _wait_gone(alive, timeout_s=REAP_GRACE_S):
        child.kill()


@pytest.fixture(scope="session", autouse=True)
def no_leftover_p2pd():
    """A p2pd daemon started during the suite and still running at its end is a failure (and is killed)."""
    before = _p2pd_pids()
    yield
    deadline = time.monotonic() + REAP_GRACE_S
    leftover = _p2pd_pids() - before
    while leftover and time.monotonic() < deadline:
        time.sleep(0.2)  # daemons exit asynchronously after their owner's shutdown; poll with a deadline
        leftover = _p2pd_pids() - before
    for pid in leftover:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    if leftover:
        pytest.fail(f"{len(leftover)} p2pd daemon(s) outlived the test suite: {sorted(leftover)}")
