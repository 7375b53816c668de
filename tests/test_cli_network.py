"""The CLI end to end on loopback: a bootstrap node, a peer that joins through its printed address, the kits."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from p2ptrain.config import load_config

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.network]

TINY_PEER_CONFIG = {
    "model": {"name": "tiny", "max_seq_len": 64},
    "data": {"seq_len": 64, "batch_size": 4, "max_corpus_bytes": 500_000, "num_shards": 4, "val_batches": 2},
    "inner": {"steps": 4, "warmup_steps": 1},
    "sync": {"matchmaking_s": 1.0},
}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2ptrain.cli", *args]


def start_bootstrap(tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    """Start `p2ptrain bootstrap` and return it with the address it printed for peers."""
    process = subprocess.Popen(
        cli("bootstrap", "--loopback", "--run-id", "cli-test", "--identity", str(tmp_path / "bootstrap.key"),
            "--address-file", str(tmp_path / "bootstrap.addr")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:  # blocks until the node prints; the global pytest timeout bounds it
        if "--initial-peers" in line:
            assert "--run-id cli-test" in line, line  # the line to hand out names the run the bootstrap serves
            return process, line.split("--initial-peers", 1)[1].strip()
    raise AssertionError(f"bootstrap printed no address; stderr: {process.stderr.read() if process.stderr else ''}")


def stop(process: subprocess.Popen[str]) -> int:
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=30)


def test_bootstrap_prints_an_address_a_peer_joins_and_keeps_it_across_restarts(tmp_path: Path) -> None:
    bootstrap, address = start_bootstrap(tmp_path)
    try:
        assert "/p2p/" in address and address.startswith("/ip4/127.0.0.1/")
        assert (tmp_path / "bootstrap.addr").read_text().split() == [address]
        config_path = tmp_path / "peer.yaml"
        config_path.write_text(yaml.safe_dump(TINY_PEER_CONFIG))
        peer = subprocess.run(
            cli("peer", "--loopback", "--initial-peers", address, "--config", str(config_path), "--rounds", "2",
                "--run-id", "cli-test", "--no-progress", "--metrics", str(tmp_path / "m.jsonl")),
            capture_output=True, text=True, timeout=300)
        assert peer.returncode == 0, peer.stderr[-2000:]
        assert "done: 2 rounds" in peer.stdout
        assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2
        # the peer left (its last record says so): the run lists no one, twice, as JSON lines
        status = subprocess.run(cli("status", "--loopback", "--initial-peers", address, "--run-id", "cli-test",
                                    "--json", "--watch", "0.5", "--count", "2"),
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr[-2000:]
        documents = [json.loads(line) for line in status.stdout.splitlines()]
        assert [(d["run_id"], d["live_peers"]) for d in documents] == [("cli-test", 0), ("cli-test", 0)]
    finally:
        assert stop(bootstrap) == 0, "bootstrap did not shut down cleanly on SIGTERM"
    restarted, second_address = start_bootstrap(tmp_path)
    try:
        assert second_address.split("/p2p/")[1] == address.split("/p2p/")[1], "identity changed across restarts"
    finally:
        assert stop(restarted) == 0


def test_bootstrap_refuses_a_corrupt_identity_file_in_one_line(tmp_path: Path) -> None:
    key = tmp_path / "broken.key"
    key.write_bytes(b"not a key")
    result = subprocess.run(cli("bootstrap", "--loopback", "--identity", str(key)), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")], result.stderr
    assert key.read_bytes() == b"not a key"


@pytest.mark.parametrize("config_file", ["peer/config.yaml"])
def test_the_peer_kit_config_is_valid(config_file: str) -> None:
    config = load_config(REPO_ROOT / config_file)
    assert config.sync.mode == "diloco" and config.network.nat_port_map


def test_the_kit_scripts_are_valid_posix_sh() -> None:
    for script in ("peer/run.sh", "bootstrap/run.sh"):
        checked = subprocess.run(["sh", "-n", str(REPO_ROOT / script)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
        usage = subprocess.run(["sh", str(REPO_ROOT / "peer/run.sh")], capture_output=True, text=True)
        assert usage.returncode == 2 and "usage:" in usage.stderr


def test_ctrl_c_writes_a_checkpoint_and_resume_continues_from_it(tmp_path: Path) -> None:
    config_path = tmp_path / "peer.yaml"
    config_path.write_text(yaml.safe_dump(TINY_PEER_CONFIG))
    metrics = tmp_path / "m.jsonl"
    common = ["peer", "--loopback", "--config", str(config_path), "--run-id", "ckpt-test", "--no-progress",
              "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics", str(metrics)]
    peer = subprocess.Popen(cli(*common, "--rounds", "0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert peer.poll() is None and time.monotonic() < deadline, "peer did not complete 2 rounds"
            time.sleep(0.2)  # the peer is another process: poll its metrics file
        peer.send_signal(signal.SIGINT)
        assert peer.wait(timeout=60) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
    rounds_done = len(metrics.read_text().splitlines())
    saved_round = int((tmp_path / "ckpt" / "latest").read_text().strip().split("-")[1])
    assert saved_round >= 2
    resumed = subprocess.run(cli(*common, "--rounds", "1", "--resume"), capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["round"] == saved_round and len(metrics.read_text().splitlines()) == rounds_done + 1
    # its rounds ran out: the final checkpoint is written, though round saved_round + 1 is no multiple of
    # run.checkpoint_every (10)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"round-{saved_round + 1:06d}"
