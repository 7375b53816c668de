"""`p2ptrain testnet` on loopback, the README's first command, end to end at a small size: a bootstrap and two
peers forked from the fork server train together, every peer's loss falls, and the stop leaves no process, a
SIGTERM to the launcher included."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from p2ptrain.metrics import read_metrics
from p2ptrain.status_view import read_page
from p2ptrain.testnet.forkserver import kept_server_pids
from p2ptrain.testnet.loopback import TestnetOptions as LoopbackOptions
from p2ptrain.testnet.loopback import run_testnet

pytestmark = [pytest.mark.slow, pytest.mark.network]


def test_a_loopback_testnet_trains_together_and_leaves_no_process(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    assert run_testnet(LoopbackOptions(num_peers=2, rounds=4, model="tiny", workdir=str(tmp_path), timeout_s=300))
    printed = capsys.readouterr().out
    assert "every peer trained" in printed and "peer1 round   3" in printed, printed[-2000:]
    for peer in ("peer0", "peer1"):
        rows = read_metrics(tmp_path / f"{peer}.jsonl")
        # GASLoC's rounds are a peer's own: one that came up after the other's round 0 (a loaded CI box) joins
        # with its state, in its round, and runs its 4 from there
        first = rows[0]["round"]
        assert [row["round"] for row in rows] == list(range(first, first + 4)) and (first == 0 or rows[0]["joined"])
        assert rows[-1]["val_loss"] < rows[0]["val_loss"]
        assert max(row["peers_averaged"] for row in rows) == 2, [row["peers_averaged"] for row in rows]
    # the fork server stays for this process's next testnet (forkserver.kept_server); nothing it forked does
    kept = kept_server_pids()
    assert kept and all(not psutil.Process(pid).children() for pid in kept)
    left = [child for child in psutil.Process().children(recursive=True) if child.pid not in before | kept]
    assert not _still_alive(left, 30)


def test_a_sigterm_to_the_launcher_stops_every_process_it_started(tmp_path: Path) -> None:
    """The peers lead sessions of their own (a stop kills each with its daemons), so no signal reaches them from
    the launcher's: it must stop them itself, on SIGTERM as on Ctrl-C. Before that, the status page the command
    line's testnet prints lists both peers."""
    out = tmp_path / "launcher.out"
    with open(out, "wb") as printed:
        launcher = subprocess.Popen([sys.executable, "-m", "p2ptrain.cli", "testnet", "--peers", "2", "--model",
                                     "tiny", "--rounds", "500", "--workdir", str(tmp_path)], stdin=subprocess.DEVNULL,
                                    stdout=printed, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not all(read_metrics(path) if path.exists() else [] for path in
                      (tmp_path / "peer0.jsonl", tmp_path / "peer1.jsonl")):
            assert launcher.poll() is None and time.monotonic() < deadline, "the peers logged no round"
            time.sleep(0.2)
        listed = None
        while listed != 2:  # the page reads the run every 5 s
            assert launcher.poll() is None and time.monotonic() < deadline, f"the page listed {listed} peers"
            url = next((line.split()[5] for line in out.read_text().splitlines()
                        if line.startswith("testnet: watch the run at")), None)
            listed = None if url is None else read_page(url)["live_peers"]
            time.sleep(0.5)
        started = psutil.Process(launcher.pid).children(recursive=True)
        assert len(started) >= 3  # the fork server, the bootstrap, the peers (and their daemons)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) != 0
        assert not _still_alive(started, 30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def _still_alive(processes: list[psutil.Process], within_s: float) -> list[str]:
    """The names of those still running after `within_s` (torch's shared-memory managers end once their clients
    have: a moment after the peers)."""
    deadline = time.monotonic() + within_s
    while (alive := [process for process in processes if _alive(process)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [process.name() for process in alive]


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie: an orphan that exited waits as a zombie of the suite (a child subreaper)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
