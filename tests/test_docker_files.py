"""The Docker kit: compose file and Dockerfiles point at real files, entrypoints build the exact p2ptrain argv."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from docker_utils import DOCKER_ENV

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKER_DIR = REPO_ROOT / "docker"
COMPOSE_FILE = DOCKER_DIR / "docker-compose.yml"
PEER_ENTRYPOINT = DOCKER_DIR / "entrypoint-peer.sh"
BOOTSTRAP_ENTRYPOINT = DOCKER_DIR / "entrypoint-bootstrap.sh"
ENTRYPOINTS = {"peer": PEER_ENTRYPOINT, "bootstrap": BOOTSTRAP_ENTRYPOINT}
MADDR_A = "/ip4/172.20.0.2/tcp/31337/p2p/12D3KooWAAAA"
MADDR_B = "/ip4/172.20.0.3/tcp/4001/p2p/12D3KooWBBBB"
DATA_FLAGS = ["--identity", "/data/identity.key", "--checkpoint-dir", "/data/checkpoints"]  # a volume per peer
GPU_COMPOSE_FILE = DOCKER_DIR / "docker-compose.gpu.yml"


def _compose_services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    return services


def _variables_read(script: Path) -> set[str]:
    return set(re.findall(r"\bP2PTRAIN_[A-Z0-9_]+", script.read_text()))


def _run_entrypoint(script: Path, tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run an entrypoint with fakes first on PATH: `p2ptrain` prints its argv, `tc` writes it to bin/tc.argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, out in (("p2ptrain", ""), ("tc", f" > {bin_dir / 'tc.argv'}")):
        fake = bin_dir / tool
        if not fake.exists():  # a test may have put its own fake there
            fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "{tool}" "$@"{out}\n')
            fake.chmod(0o755)
    full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **env}
    return subprocess.run(["sh", str(script), *args], env=full_env, capture_output=True, text=True, timeout=30)


def test_compose_services_point_at_existing_build_files() -> None:
    services = _compose_services()
    assert set(services) == {"bootstrap", "peer1", "peer2", "peer3", "peer4"}
    for name, service in services.items():
        build = service["build"]
        context = (DOCKER_DIR / build["context"]).resolve()
        assert context == REPO_ROOT, f"{name}: the build context must be the repository root"
        assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']} missing"


def test_peers_are_shaped_differently_and_may_run_tc() -> None:
    services = _compose_services()
    peers = {name: service for name, service in services.items() if name.startswith("peer")}
    rates = [float(service["environment"]["P2PTRAIN_RATE_MBIT"]) for service in peers.values()]
    assert len(set(rates)) == 4 and all(rate > 0 for rate in rates)
    bootstrap_writes = services["bootstrap"]["environment"]["P2PTRAIN_ADDRESS_FILE"]
    for name, service in peers.items():
        assert "NET_ADMIN" in service["cap_add"], f"{name} needs NET_ADMIN for tc"
        assert service["environment"]["P2PTRAIN_BOOTSTRAP_ADDRESS_FILE"] == bootstrap_writes


def test_compose_sets_only_variables_its_entrypoints_read() -> None:
    for name, service in _compose_services().items():
        script = ENTRYPOINTS["bootstrap" if name == "bootstrap" else "peer"]
        unknown = set(service["environment"]) - _variables_read(script)
        assert not unknown, f"{name} sets {unknown}, which {script.name} never reads"


def test_every_entrypoint_variable_is_documented() -> None:
    readme = (DOCKER_DIR / "README.md").read_text()
    for script in ENTRYPOINTS.values():
        undocumented = {var for var in _variables_read(script) if f"`{var}`" not in readme}
        assert not undocumented, f"{script.name} reads {undocumented}, missing from docker/README.md"


def test_dockerfiles_copy_existing_files_and_install_the_torch_pin() -> None:
    for dockerfile in ("Dockerfile.peer", "Dockerfile.bootstrap"):
        text = (DOCKER_DIR / dockerfile).read_text()
        assert "ARG BASE_IMAGE=python:3.11-slim" in text
        assert "grep -oE 'torch==[0-9][0-9.]*' setup.cfg" in text and "pip install ." in text
        assert not re.search(r"torch==\d", text), f"{dockerfile} must take the torch pin from setup.cfg"
        ignored = (DOCKER_DIR / f"{dockerfile}.dockerignore").read_text().split()
        for source in re.findall(r"^COPY\s+(\S+)\s+\S+$", text, flags=re.MULTILINE):
            assert (REPO_ROOT / source).exists(), f"{dockerfile} copies {source}, which does not exist"
            assert not any(fnmatch.fnmatch(source, p) for p in ignored if not p.startswith("#")), source
    setup_cfg_pins = re.findall(r"^\s*(torch==\S+)", (REPO_ROOT / "setup.cfg").read_text(), flags=re.MULTILINE)
    assert setup_cfg_pins == ["torch==2.13.0"], "setup.cfg must pin torch exactly once"


@pytest.mark.slow
def test_entrypoints_parse_as_posix_sh() -> None:
    for script in ENTRYPOINTS.values():
        checked = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr


def _compose_config(*files: Path) -> dict[str, Any]:
    """`docker compose config` of these files, as compose v2 resolves them. As root, the CLI and the compose plugin
    are installed where missing (`.ci/docker-env tools`, as the Docker tests' `up` does); skips without them."""
    if os.geteuid() == 0 and subprocess.run(["sh", "-c", "docker compose version"], capture_output=True).returncode:
        subprocess.run([str(DOCKER_ENV), "tools"], capture_output=True, timeout=900)
    if shutil.which("docker") is None:
        pytest.skip("docker CLI not installed, cannot run `docker compose config` (.ci/docker-env tools installs it)")
    version = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if version.returncode != 0:
        reason = (version.stderr.strip().splitlines() or ["no output"])[0]
        pytest.skip(f"`docker compose` unavailable on this machine ({reason}); compose file checked as YAML only")
    argv = ["docker", "compose", *[arg for f in files for arg in ("-f", str(f))], "config", "--format", "json"]
    checked = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
    config: dict[str, Any] = json.loads(checked.stdout)
    return config


@pytest.mark.slow
@pytest.mark.docker  # may install the Docker CLI (apt): with the other Docker tests, never beside them
def test_docker_compose_config_accepts_the_file() -> None:
    services = _compose_config(COMPOSE_FILE)["services"]
    assert services["peer1"]["environment"]["P2PTRAIN_DEVICE"] == "cpu"


def test_every_peer_keeps_identity_and_checkpoints_in_a_volume_of_its_own() -> None:
    services = _compose_services()
    volumes = yaml.safe_load(COMPOSE_FILE.read_text())["volumes"]
    data = {name: [v.split(":")[0] for v in service.get("volumes", []) if v.split(":")[1] == "/data"]
            for name, service in services.items()}
    assert data == {"bootstrap": ["bootstrap-identity"], **{f"peer{i}": [f"peer{i}-data"] for i in range(1, 5)}}
    assert set(volumes) >= {f"peer{i}-data" for i in range(1, 5)}


@pytest.mark.slow
@pytest.mark.docker  # may install the Docker CLI (apt): with the other Docker tests, never beside them
def test_gpu_override_reserves_nvidia_gpus_for_every_peer_on_a_cuda_image() -> None:
    services = _compose_config(COMPOSE_FILE, GPU_COMPOSE_FILE)["services"]
    for name in ("peer1", "peer2", "peer3", "peer4"):
        service = services[name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": -1, "capabilities": ["gpu"]}], devices  # count: all
        assert service["environment"]["P2PTRAIN_DEVICE"] == "cuda"
        assert service["build"]["args"]["BASE_IMAGE"].startswith("nvidia/cuda:")
        assert "/whl/cu" in service["build"]["args"]["TORCH_INDEX_URL"]
        assert service["image"] == "p2ptrain-peer:cuda" and "NET_ADMIN" in service["cap_add"]
        assert any(v["target"] == "/data" for v in service["volumes"])  # the override keeps the base's volumes
    assert "deploy" not in services["bootstrap"] and services["bootstrap"]["image"] == "p2ptrain-bootstrap:latest"


@pytest.mark.slow
def test_peer_entrypoint_resumes_from_the_volume_and_can_drop_the_data_flags(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    env = {"P2PTRAIN_CHECKPOINT_DIR": str(checkpoints), "P2PTRAIN_INITIAL_PEERS": MADDR_A}
    done = _run_entrypoint(PEER_ENTRYPOINT, tmp_path, env)
    assert "--resume" not in done.stdout.split("\n"), "no checkpoint yet: a fresh start"
    (checkpoints / "latest").write_text("round-000004\n")
    done = _run_entrypoint(PEER_ENTRYPOINT, tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[2:7] == ["--identity", "/data/identity.key", "--checkpoint-dir", str(checkpoints),
                                             "--resume"]
    assert "resuming from the latest checkpoint" in done.stderr
    done = _run_entrypoint(PEER_ENTRYPOINT, tmp_path, {**env, "P2PTRAIN_IDENTITY": "", "P2PTRAIN_CHECKPOINT_DIR": ""})
    assert done.stdout.splitlines() == ["p2ptrain", "peer", "--initial-peers", MADDR_A, "--no-nat-port-map"]


@pytest.mark.slow
def test_peer_entrypoint_execs_p2ptrain_peer_with_flags_from_env(tmp_path: Path) -> None:
    env = {"P2PTRAIN_INITIAL_PEERS": f"{MADDR_A}, {MADDR_B}", "P2PTRAIN_RUN_ID": "run 7",
           "P2PTRAIN_CONFIG": "/config/peer.yaml", "P2PTRAIN_DEVICE": "cpu"}  # fmt: skip
    done = _run_entrypoint(PEER_ENTRYPOINT, tmp_path, env, "--rounds", "3", "two words")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "p2ptrain", "peer", *DATA_FLAGS, "--initial-peers", MADDR_A, "--initial-peers", MADDR_B, "--run-id",
        "run 7", "--config", "/config/peer.yaml", "--device", "cpu", "--no-nat-port-map", "--rounds", "3", "two words",
    ]  # fmt: skip


@pytest.mark.slow
def test_peer_entrypoint_joins_through_the_bootstrap_address_file(tmp_path: Path) -> None:
    address_file = tmp_path / "bootstrap.maddrs"
    address_file.write_text(f"/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWAAAA\n{MADDR_A}\n/ip6/::1/tcp/31337/p2p/X\n")
    env = {"P2PTRAIN_BOOTSTRAP_ADDRESS_FILE": str(address_file), "P2PTRAIN_NAT_PORT_MAP": "1"}
    done = _run_entrypoint(PEER_ENTRYPOINT, tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["p2ptrain", "peer", *DATA_FLAGS, "--initial-peers", MADDR_A]


@pytest.mark.slow
def test_peer_entrypoint_gives_up_on_a_missing_address_file(tmp_path: Path) -> None:
    env = {"P2PTRAIN_BOOTSTRAP_ADDRESS_FILE": str(tmp_path / "absent"), "P2PTRAIN_BOOTSTRAP_WAIT_S": "0"}
    done = _run_entrypoint(PEER_ENTRYPOINT, tmp_path, env)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "is the bootstrap service running?" in done.stderr


@pytest.mark.slow
def test_peer_entrypoint_shapes_upload_with_tbf_before_starting(tmp_path: Path) -> None:
    done = _run_entrypoint(PEER_ENTRYPOINT, tmp_path, {"P2PTRAIN_RATE_MBIT": "20", "P2PTRAIN_INITIAL_PEERS": MADDR_A})
    assert done.returncode == 0, done.stderr
    # 20 Mbit/s = 2.5e6 B/s: rate/250 = 10000 B < 16 KiB floor, so burst 16384; limit = 16384 + 50 ms * 2.5e6 B/s.
    tc_argv = ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", "20000000bit", "burst", "16384",
               "limit", str(16384 + 125000)]  # fmt: skip
    assert (tmp_path / "bin" / "tc.argv").read_text().splitlines() == tc_argv
    assert done.stdout.splitlines() == ["p2ptrain", "peer", *DATA_FLAGS, "--initial-peers", MADDR_A,
                                        "--no-nat-port-map"]


@pytest.mark.slow
def test_peer_entrypoint_stops_with_one_line_when_tc_fails(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "tc").write_text('#!/bin/sh\necho "RTNETLINK answers: Operation not permitted" >&2\nexit 2\n')
    (bin_dir / "tc").chmod(0o755)
    done = _run_entrypoint(PEER_ENTRYPOINT, tmp_path, {"P2PTRAIN_RATE_MBIT": "5"})
    assert done.returncode == 2 and done.stdout == "", "p2ptrain must not start unshaped"
    assert done.stderr.splitlines() == [
        "entrypoint-peer: cannot shape eth0 to 5 Mbit/s (run with --cap-add NET_ADMIN): "
        "RTNETLINK answers: Operation not permitted"
    ]
    done = _run_entrypoint(PEER_ENTRYPOINT, tmp_path, {"P2PTRAIN_RATE_MBIT": "fast"})
    assert done.returncode == 2 and "not a number" in done.stderr


@pytest.mark.slow
def test_bootstrap_entrypoint_execs_with_identity_and_fresh_address_file(tmp_path: Path) -> None:
    address_file = tmp_path / "shared" / "bootstrap.maddrs"
    address_file.parent.mkdir()
    address_file.write_text("/ip4/10.0.0.9/tcp/31337/p2p/stale\n")
    done = _run_entrypoint(BOOTSTRAP_ENTRYPOINT, tmp_path, {"P2PTRAIN_ADDRESS_FILE": str(address_file)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "p2ptrain", "bootstrap", "--identity", "/data/identity.key", "--host-maddrs", "/ip4/0.0.0.0/tcp/31337",
        "--address-file", str(address_file), "--no-nat-port-map",
    ]  # fmt: skip
    assert not address_file.exists(), "a stale address file must be removed before the bootstrap starts"
    done = _run_entrypoint(BOOTSTRAP_ENTRYPOINT, tmp_path, {"P2PTRAIN_RUN_ID": "my-run"})
    assert done.returncode == 0 and done.stdout.splitlines()[-3:] == ["--run-id", "my-run", "--no-nat-port-map"]


def test_entrypoints_are_executable() -> None:
    for script in ENTRYPOINTS.values():
        assert os.access(script, os.X_OK), f"{script.name} is not executable (chmod +x)"
