"""`p2ptrain peer --workers N`: start the same command as the N processes of one node, as torchrun would (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on loopback), and end them together.

torchrun itself works too (`torchrun --nproc-per-node N -m p2ptrain peer …`); this launcher only keeps a
volunteer's terminal clean (torchrun prints a traceback for any worker that exits non-zero, a one-line user error
included) and ties the workers' lives to it. When a worker fails, rank 0 finds out at its next collective and
stops cleanly (checkpoint, leave the swarm), and the rest end with it; whoever has not ended after `grace_s` gets
SIGTERM (rank 0: stop after this step), and after another `grace_s` SIGKILL. When rank 0 fails, the others are
killed at once (they hold nothing of their own).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from p2ptrain.net.lifetime import PR_SET_PDEATHSIG

POLL_S = 0.2


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _end_with_launcher() -> None:
    """In a worker, before exec: SIGTERM when the launcher dies, however it dies (Linux)."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def worker_environment(rank: int, workers: int, port: int) -> dict[str, str]:
    return dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(workers),
                LOCAL_WORLD_SIZE=str(workers), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def run_node(workers: int, argv: Sequence[str], grace_s: float = 60.0, module: str = "p2ptrain") -> int:
    """Run `python -m MODULE *argv` as `workers` processes; returns the node's exit code (rank 0's, or the
    first failure's)."""
    port = free_loopback_port()
    processes = [subprocess.Popen([sys.executable, "-m", module, *argv], preexec_fn=_end_with_launcher,
                                  env=worker_environment(rank, workers, port)) for rank in range(workers)]
    # Ctrl-C reaches every worker from the terminal; a SIGTERM to us is passed on
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: _signal_all(processes, signal.SIGTERM))
    failed = _wait_for_first_failure(processes)
    if failed == 0:  # rank 0 is gone: the others hold nothing of their own
        _signal_all(processes, signal.SIGKILL)
    elif failed is not None:  # rank 0 sees it at its next collective and stops cleanly; if not, we tell it to
        for signum in (signal.SIGTERM, signal.SIGKILL):
            _wait_for_all(processes, grace_s)
            _signal_all(processes, signum)
    codes = [p.wait() for p in processes]
    return codes[0] if codes[0] != 0 else next((c for c in codes if c != 0), 0)


def _wait_for_first_failure(processes: list[subprocess.Popen]) -> int | None:
    """Wait until every worker has exited 0 (None) or one has failed (its rank)."""
    while True:
        codes = [p.poll() for p in processes]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            return failed[0]
        if all(code == 0 for code in codes):
            return None
        time.sleep(POLL_S)


def _wait_for_all(processes: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(POLL_S)


def _signal_all(processes: list[subprocess.Popen], signum: int) -> None:
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)
