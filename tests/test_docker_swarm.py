"""The Docker kit for real: both images build from docker/Dockerfile.*, a compose swarm trains, a killed peer
container resumes with its identity and checkpoint, tc shapes a container's upload, `down` leaves nothing, and the
docker testnet backend passes the churn scenario. Needs root and a Docker engine, which
`.ci/docker-env up` installs and starts (and `down` stops); skips with the reason only where it cannot start."""

from __future__ import annotations

import json
import os
import re
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from docker_utils import (
    BOOTSTRAP_IMAGE,
    DOCKER_SETUP,
    PEER_IMAGE,
    REPO_ROOT,
    docker_environment,
    leftovers,
    run,
    wait_until,
)

from p2ptrain.metrics import read_metrics
from p2ptrain.testnet.docker_run import run_docker_testnet
from p2ptrain.testnet.engine import ScenarioOptions

pytestmark = [pytest.mark.docker, pytest.mark.slow]

COMPOSE_FILE = REPO_ROOT / "docker" / "docker-compose.yml"
SHAPED_PEER, SHAPED_MBIT = "peer3", 2.0  # 540 kB of fp32 parameters take ~2.2 s at 2 Mbit/s: the link dominates
PEERS = ("peer1", "peer2", "peer3")
SWARM_CONFIG = {  # tiny and fast; GASLoC: a slow peer starts its own exchanges, one at a time, with fast partners
    "model": {"name": "tiny", "max_seq_len": 64},
    "data": {"seq_len": 64, "batch_size": 4, "max_corpus_bytes": 2_000_000, "num_shards": 8, "val_batches": 2},
    "inner": {"steps": 40},  # rounds of ~0.5 s: at 10 steps (0.1 s) records lagged rounds and peers mostly ran alone
    "sync": {"mode": "gasloc", "gossip_peers": 1, "param_codec": "none"},
    "network": {"heartbeat_s": 0.5, "record_ttl_s": 5.0},
    "run": {"checkpoint_every": 1},
}


@pytest.fixture(scope="module")
def docker_env() -> Iterator[None]:
    yield from docker_environment()


@pytest.fixture(scope="module")
def images(docker_env: None) -> str:
    """`.ci/docker-env build`: both images from docker/Dockerfile.*, as users build them, on the CI base."""
    done = DOCKER_SETUP.outcome("build")
    assert done.returncode == 0, f".ci/docker-env build: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done.stderr


def test_both_images_build(images: str) -> None:
    assert "built p2ptrain-peer:ci" in images and "built p2ptrain-bootstrap:ci" in images, images
    probe = "import torch, p2ptrain.cli; print(torch.__version__, torch.cuda.is_available())"
    for image in (PEER_IMAGE, BOOTSTRAP_IMAGE):
        out = run(["docker", "run", "--rm", "--entrypoint", "python", image, "-c", probe]).stdout.split()
        assert out == ["2.13.0+cpu", "False"], f"{image}: torch {out}"  # the setup.cfg pin, CPU-only in CI
    helped = run(["docker", "run", "--rm", "--entrypoint", "p2ptrain", PEER_IMAGE, "peer", "--help"]).stdout
    assert "--initial-peers" in helped


class Compose:
    """`docker compose` on docker/docker-compose.yml plus a test override, as its own project."""

    def __init__(self, tmp: Path):
        self.project = f"p2ptest{os.getpid() % 100000}"
        self.metrics, config = tmp / "metrics", tmp / "config"
        self.metrics.mkdir()
        config.mkdir()
        (config / "peer.yaml").write_text(yaml.safe_dump(SWARM_CONFIG))
        services: dict[str, Any] = {"bootstrap": {"image": BOOTSTRAP_IMAGE}}
        for peer in PEERS:
            environment = {"P2PTRAIN_CONFIG": "/config/peer.yaml", "OMP_NUM_THREADS": "1"}
            if peer == SHAPED_PEER:
                environment["P2PTRAIN_RATE_MBIT"] = f"{SHAPED_MBIT:g}"
            services[peer] = {"image": PEER_IMAGE, "environment": environment,
                              "command": ["--metrics", f"/metrics/{peer}.jsonl", "--torch-threads", "1",
                                          "--no-auto-nat", "--no-relay"],
                              "volumes": [f"{config}:/config:ro", f"{self.metrics}:/metrics"]}
        self.override = tmp / "override.yml"
        self.override.write_text(yaml.safe_dump({"services": services}))

    def __call__(self, *args: str, timeout_s: float = 180) -> str:
        argv = ["docker", "compose", "-p", self.project, "-f", str(COMPOSE_FILE), "-f", str(self.override), *args]
        return run(argv, timeout_s=timeout_s).stdout

    def rows(self, peer: str) -> list[dict[str, Any]]:
        path = self.metrics / f"{peer}.jsonl"
        return read_metrics(path) if path.exists() else []

    def logs(self, service: str) -> str:
        argv = ["docker", "compose", "-p", self.project, "-f", str(COMPOSE_FILE), "-f", str(self.override), "logs",
                "--no-color", service]
        done = run(argv, check=False)
        return done.stdout + done.stderr


@pytest.fixture(scope="module")
def swarm(images: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    compose = Compose(tmp_path_factory.mktemp("compose"))
    compose("up", "--detach", "--no-build", "bootstrap", *PEERS)
    try:
        yield compose
    finally:
        compose("down", "--volumes", "--timeout", "5")


def test_compose_swarm_trains_with_falling_validation_loss(swarm: Compose) -> None:
    wait_until(lambda: all(len(swarm.rows(peer)) >= 4 for peer in PEERS), 300, "every peer to log 4 rounds")
    for peer in PEERS:
        losses = [row["val_loss"] for row in swarm.rows(peer)]
        assert statistics.median(losses[-2:]) < losses[0], f"{peer}: validation loss did not fall: {losses}"
    averaged = [row for peer in PEERS for row in swarm.rows(peer) if row["peers_averaged"] > 1]
    assert averaged, "no peer averaged with another: they never found each other"
    log = swarm.logs("peer1")
    # one line per round, no progress frames ("round R (N) ...": R the swarm's round, N this peer's count)
    assert "\r" not in log and re.search(r"round \d+ \(\d+\) train \d", log), log[-2000:]
    bad = [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line]
    assert not bad, "\n".join(bad[:20]) + "\n---\n" + log[-3000:]


def test_killed_peer_container_resumes_from_its_checkpoint_with_its_peer_id(swarm: Compose) -> None:
    before = swarm.rows("peer2")
    swarm("kill", "peer2")
    killed_at = before[-1]["time"]
    swarm("start", "peer2")
    wait_until(lambda: any(row["time"] > killed_at for row in swarm.rows("peer2")[len(before):]), 180,
               "peer2 to log a round after its restart")
    after = [row for row in swarm.rows("peer2") if row["time"] > killed_at]
    assert {row["peer_id"] for row in after} == {row["peer_id"] for row in before}, "a new identity after restart"
    assert after[0]["round"] >= before[-1]["round"], "it started over instead of resuming"
    log = swarm.logs("peer2")
    assert "resuming from the latest checkpoint in /data/checkpoints" in log, log[-3000:]


def test_shaped_upload_measured_by_an_exchange_matches_the_shaping(swarm: Compose) -> None:
    def exchanges() -> list[dict[str, Any]]:
        return [e for row in swarm.rows(SHAPED_PEER) for e in row["exchanges"] if e["bytes_sent"] > 200_000]

    wait_until(lambda: len(exchanges()) >= 8, 300, f"{SHAPED_PEER} to finish 8 exchanges")
    # Each exchange sends our payload at the shaped rate, then takes the partner's answer from an unshaped link; the
    # fastest is the one that shared our upload with no other transfer. 8, not 4: the unshaped peers' 0.3 s rounds
    # keep offering it exchanges, and in a CI run all of the first 4 shared its upload (best 1.12 of 2 Mbit/s).
    # An exchange's seconds also hold the partner's answer, our commit and its ack (~0.4 s of ~2.4 s here), so even
    # an exchange alone on the link reads ~80 % of it: the best of 8 read 1.60 and 1.56 Mbit/s in two CI runs (the
    # second failed a ±20 % bound). Hence 0.65-1.2 × the configured rate for the best exchange (an unshaped link
    # reads tens of Mbit/s, one shaped to half or double the rate reads ~0.8 or ~3.2), and no exchange above 1.2 ×.
    rates = [8 * e["bytes_sent"] / e["seconds"] / 1e6 for e in exchanges()]
    measured = max(rates)
    print(f"{SHAPED_PEER} upload: configured {SHAPED_MBIT} Mbit/s, measured {measured:.3f} Mbit/s "
          f"(exchanges: {', '.join(f'{r:.2f}' for r in rates)})")
    assert 0.65 * SHAPED_MBIT <= measured <= 1.2 * SHAPED_MBIT, rates
    assert f"upload on eth0 shaped to {SHAPED_MBIT:g} Mbit/s" in swarm.logs(SHAPED_PEER)


def test_down_leaves_no_container_network_or_volume(swarm: Compose) -> None:
    assert all(leftovers(swarm.project).values()), "the swarm should be up before `down`"
    swarm("down", "--volumes", "--timeout", "5")
    assert leftovers(swarm.project) == {"containers": [], "networks": [], "volumes": []}


def test_docker_backend_passes_the_churn_scenario(images: str, tmp_path: Path) -> None:
    # The scenario file with its churn clock 1.6x as fast, for 72 s instead of 300: the same victims at 1/1.6 of the
    # times (churn_events divides each seeded gap by the rate). Churn kills peer0 and peer2 at 21 and 27 s and
    # restarts them at 34 and 39 s; it stops at 50 s, so the last 22 s are calm, as the file's last minute is. A
    # restart needs ~15 s to log its first round in a container on 2 busy cores: in a CI run of 62 s, peer2 logged
    # none in the 22 s it had left, and a kill at 54 s with its restart at 66 s left that one no time.
    # The netns backend ran the same file beside it until 2026-12-01 and always passed the same checks; its kills and
    # restarts are tested in test_testnet_netns.py and its churn in test_swarm12_netns.py (75 s of CI saved).
    spec = yaml.safe_load((REPO_ROOT / "testnet" / "scenarios" / "churn.yaml").read_text())
    churn, rate = spec["churn"], 1.6
    spec["churn"] = {**churn, "kills_per_min": churn["kills_per_min"] * rate, "start_s": churn["start_s"] / rate,
                     "down_s": churn["down_s"] / rate, "stop_s": 50.0}
    scenario = tmp_path / "churn.yaml"
    scenario.write_text(yaml.safe_dump(spec))
    workdir = tmp_path / "docker"
    options = ScenarioOptions(scenario_path=str(scenario), duration_s=72, workdir=str(workdir), timeout_s=300,
                              name_prefix=f"chd{os.getpid() % 10000}")
    ok = run_docker_testnet(options, PEER_IMAGE, BOOTSTRAP_IMAGE)
    report = json.loads((workdir / "report" / "report.json").read_text())
    checks = {check["name"]: check["passed"] for check in report["checks"]}
    assert ok and report["passed"], [c for c in report["checks"] if not c["passed"]]
    # whether a restart resumed from a checkpoint (a check of its own) depends on how many rounds the peer made
    # before its kill, which the machine's load decides
    assert checks.keys() >= {"finished", "clean_exits", "events_fired", "loss_fell", "max_stall_s"}, checks
    fired = [(e["description"], e["ok"]) for e in report["events"]]
    assert fired == [("kill peer0", True), ("kill peer2", True), ("restart peer0", True), ("restart peer2", True)], \
        fired
    for peer in ("peer0", "peer2"):
        lives = report["peers"][peer]["lives"]
        assert [life["end_reason"] for life in lives] == ["killed", "stopped_at_end"], (peer, lives)
        rows = report["peers"][peer]["rounds"]
        assert any(row["time"] > lives[1]["started"] for row in rows), f"{peer} never came back"
    assert run(["docker", "ps", "-aq", "--filter", "label=p2ptrain.testnet"]).stdout.split() == []
