"""The testnet's fork server (p2ptrain/testnet/forkserver.py): what a forked child gets is what `python -m` in a new
session would give it (argv, environment, working directory, output files, exit code or signal), its own random
streams, and nothing of the server's; the server refuses a preload that would run twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from p2ptrain.testnet.forkserver import PRELOADED, ForkServer, ForkServerError

pytestmark = pytest.mark.slow  # starts the server process

LIGHT = ("json", "numpy")  # the mechanics need no torch: a server that starts in a fraction of a second


@pytest.fixture
def server():
    started = ForkServer(dict(os.environ, FORKSERVER_TEST="from the server's env"), LIGHT)
    yield started
    started.close()


def write_module(directory: Path, name: str, body: str) -> None:
    (directory / f"{name}.py").write_text(body)


def test_a_child_runs_its_module_as_main_with_argv_env_cwd_and_exit_code(server: ForkServer, tmp_path: Path) -> None:
    write_module(tmp_path, "probe", "import os, sys\n"
                 "print('argv', sys.argv[1:], 'cwd', os.getcwd(), 'env', os.environ['FORKSERVER_TEST'])\n"
                 "print('to stderr', file=sys.stderr)\n"
                 "print('name', __name__, 'session leader', os.getsid(0) == os.getpid())\n"
                 "sys.exit(7)\n")
    log = tmp_path / "probe.log"
    log.write_text("earlier line\n")
    child = server.start({"script": str(tmp_path / "probe.py")}, ["--a", "b"], tmp_path, log, append=True,
                         session=True)
    assert child.wait(timeout=60) == 7 and child.poll() == 7
    text = log.read_text()
    assert text.startswith("earlier line\n"), text  # appended
    assert f"argv ['--a', 'b'] cwd {tmp_path} env from the server's env" in text
    assert "to stderr" in text and "name __main__ session leader True" in text


def test_output_files_are_truncated_unless_appended_and_may_be_two(server: ForkServer, tmp_path: Path) -> None:
    write_module(tmp_path, "two", "import sys\nprint('out')\nprint('err', file=sys.stderr)\n")
    out, err = tmp_path / "out", tmp_path / "err"
    out.write_text("old\n")
    assert server.start({"script": str(tmp_path / "two.py")}, [], tmp_path, out, err).wait(timeout=60) == 0
    assert out.read_text() == "out\n" and err.read_text() == "err\n"


def test_a_signalled_child_reports_minus_the_signal_and_an_uncaught_error_one(server: ForkServer,
                                                                              tmp_path: Path) -> None:
    write_module(tmp_path, "sleeper", "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    write_module(tmp_path, "raiser", "raise ValueError('boom')\n")
    log = tmp_path / "sleeper.log"
    sleeper = server.start({"script": str(tmp_path / "sleeper.py")}, [], tmp_path, log, session=True)
    deadline = time.monotonic() + 60
    while not (log.exists() and "up" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.1)
    os.killpg(sleeper.pid, signal.SIGKILL)  # its own process group
    assert sleeper.wait(timeout=60) == -signal.SIGKILL
    sleeper.kill()  # reaped: a no-op, not a signal to whoever has the pid now
    raiser_log = tmp_path / "raiser.log"
    assert server.start({"script": str(tmp_path / "raiser.py")}, [], tmp_path, raiser_log).wait(timeout=60) == 1
    assert "ValueError: boom" in raiser_log.read_text()


def test_children_draw_their_own_random_numbers(server: ForkServer, tmp_path: Path) -> None:
    write_module(tmp_path, "draw", "import random, numpy\nprint(random.random(), numpy.random.rand())\n")
    logs = [tmp_path / f"draw{i}.log" for i in range(2)]
    children = [server.start({"script": str(tmp_path / "draw.py")}, [], tmp_path, log) for log in logs]
    assert [child.wait(timeout=60) for child in children] == [0, 0]
    first, second = (log.read_text().split() for log in logs)
    assert first[0] != second[0] and first[1] != second[1], (first, second)


def test_a_child_killed_holding_an_import_time_lock_leaves_it_free_for_the_others(tmp_path: Path) -> None:
    """hivemind makes its MPFuture pipe's lock at import: one semaphore for the server and every child, unless each
    child makes its own. A peer killed while its DHT held it used to block every other peer's updates for good."""
    write_module(tmp_path, "heldlock", "import multiprocessing\nclass Shared:\n    lock = multiprocessing.Lock()\n")
    write_module(tmp_path, "holder", "import time, heldlock\nheldlock.Shared.lock.acquire()\n"
                 "print('held', flush=True)\ntime.sleep(60)\n")
    write_module(tmp_path, "taker", "import heldlock\nprint('acquired', heldlock.Shared.lock.acquire(timeout=5))\n")
    server = ForkServer(dict(os.environ, PYTHONPATH=str(tmp_path)), (*LIGHT, "heldlock"))
    try:
        log = tmp_path / "holder.log"
        holder = server.start({"script": str(tmp_path / "holder.py")}, [], tmp_path, log)
        deadline = time.monotonic() + 60
        while "held" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        holder.kill()
        assert holder.wait(timeout=60) == -signal.SIGKILL
        taker_log = tmp_path / "taker.log"
        assert server.start({"script": str(tmp_path / "taker.py")}, [], tmp_path, taker_log).wait(timeout=60) == 0
        assert taker_log.read_text() == "acquired True\n"
    finally:
        server.close()


def test_a_preload_with_a_multiprocessing_object_a_child_cannot_remake_is_refused(tmp_path: Path) -> None:
    write_module(tmp_path, "withevent", "import multiprocessing\nSTARTED = multiprocessing.Event()\n")
    done = subprocess.run([sys.executable, "-m", "p2ptrain.testnet.forkserver", "json", "withevent"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert done.returncode == 1 and "a child cannot remake: ['withevent.STARTED']" in done.stderr, done.stderr


LAUNCHER = """
import os, sys
from pathlib import Path
from p2ptrain.testnet.forkserver import ForkServer
workdir = Path(sys.argv[1])
server = ForkServer(dict(os.environ), ("json",))
polite = server.start({"script": str(workdir / "polite.py")}, [], workdir, workdir / "polite.log", session=True)
stubborn = server.start({"script": str(workdir / "stubborn.py")}, [], workdir, workdir / "stubborn.log", session=True)
print(polite.pid, stubborn.pid, flush=True)
sys.stdin.read()
"""


def test_the_children_of_a_launcher_that_died_are_stopped_politely_then_killed(tmp_path: Path) -> None:
    """A launcher killed by SIGKILL closes the server's stdin: the server SIGTERMs each child it started (a peer
    then checkpoints and stops its DHT), SIGKILLs the session of one still there after the grace, and ends."""
    write_module(tmp_path, "polite", "import signal, sys, time\n"
                 "def stop(*_):\n    print('stopped by SIGTERM', flush=True)\n    sys.exit(3)\n"
                 "signal.signal(signal.SIGTERM, stop)\nprint('up', flush=True)\ntime.sleep(120)\n")
    write_module(tmp_path, "stubborn", "import signal, subprocess, time\n"
                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nsubprocess.Popen(['sleep', '120'])\n"
                 "print('up', flush=True)\ntime.sleep(120)\n")
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        deadline = time.monotonic() + 60
        while not all("up" in _text(tmp_path / f"{name}.log") for name in ("polite", "stubborn")):
            assert time.monotonic() < deadline, "the children did not start"
            time.sleep(0.05)
        stubborn_session = [p for p in psutil.process_iter() if _session(p.pid) == pids[1]]
        assert len(stubborn_session) == 2  # it and its sleep
        launcher.kill()
        launcher.wait()
        gone, alive = psutil.wait_procs([psutil.Process(pids[0]), *stubborn_session], timeout=40)
        assert not alive, alive
        assert "stopped by SIGTERM" in _text(tmp_path / "polite.log")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_a_closed_server_refuses_in_one_error(tmp_path: Path) -> None:
    server = ForkServer(dict(os.environ), LIGHT)
    server.close()
    with pytest.raises(ForkServerError, match="exited"):
        server.start({"script": str(tmp_path / "none.py")}, [], tmp_path, tmp_path / "log")


def test_a_module_that_runs_as_main_cannot_be_preloaded(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "p2ptrain.testnet.forkserver", "json", "p2ptrain.cli"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 1 and "must not preload ['p2ptrain.cli']" in done.stderr, done.stderr


def test_the_testnet_preload_starts_no_thread_and_runs_the_cli(tmp_path: Path) -> None:
    """With what a testnet process imports preloaded, the server starts (it refuses if an import started a
    thread) and a forked `p2ptrain --help` runs as it would from a shell."""
    server = ForkServer(dict(os.environ), PRELOADED)
    try:
        log = tmp_path / "help.log"
        assert server.start({"module": "p2ptrain.cli"}, ["--help"], tmp_path, log).wait(timeout=120) == 0
        text = log.read_text()
        assert "Usage:" in text and "peer" in text and "RuntimeWarning" not in text, text
    finally:
        server.close()
