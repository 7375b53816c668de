"""Helpers of the Docker tests: the CI Docker environment (.ci/docker-env) and docker/compose commands."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from early_jobs import EarlyJob

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCKER_ENV = REPO_ROOT / ".ci" / "docker-env"
STATE = Path("/run/p2ptrain-docker")
PEER_IMAGE, BOOTSTRAP_IMAGE = "p2ptrain-peer:ci", "p2ptrain-bootstrap:ci"  # what `.ci/docker-env build` tags
# install, start dockerd, base image and wheelhouse; then both images, as users build them (minutes on a fresh CI)
DOCKER_SETUP = EarlyJob("docker", [("up", [str(DOCKER_ENV), "up"]), ("build", [str(DOCKER_ENV), "build"])],
                        reader="docker_env", timeout_s=1800)
WAS_UP = (STATE / "base-image").exists()  # before this session: then the session leaves it up


def run(argv: list[str], timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if check:
        assert done.returncode == 0, f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout[-2000:]}" \
                                     f"{done.stderr[-3000:]}"
    return done


def engine_answers() -> bool:
    try:
        return run(["docker", "info"], timeout_s=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def docker_environment() -> Iterator[None]:
    """`.ci/docker-env up` (install, start dockerd, base image, wheelhouse) for the tests, `down` after them
    unless it was up before. Skips only where the engine cannot start (no root, no engine)."""
    if os.geteuid() != 0:
        pytest.skip("the Docker tests need root (apt-get, dockerd, tc); run the suite as root")
    done = DOCKER_SETUP.outcome("up")
    print(done.stderr)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        if not engine_answers():
            pytest.skip(f"the Docker engine cannot start here: {reason}")
        pytest.fail(f".ci/docker-env up failed: {done.stderr[-3000:]}")
    try:
        yield
    finally:
        if not WAS_UP:
            subprocess.run([str(DOCKER_ENV), "down"], timeout=120, check=False)


def wait_until(condition: Callable[[], object], deadline_s: float, what: str, poll_s: float = 1.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {deadline_s} s waiting for {what}"
        time.sleep(poll_s)


def leftovers(project: str) -> dict[str, list[str]]:
    """Containers, networks and volumes of a compose project that still exist."""
    label = f"label=com.docker.compose.project={project}"
    return {kind: run(["docker", *args, "--filter", label], check=False).stdout.split()
            for kind, args in (("containers", ["ps", "-a", "-q"]), ("networks", ["network", "ls", "-q"]),
                               ("volumes", ["volume", "ls", "-q"]))}
