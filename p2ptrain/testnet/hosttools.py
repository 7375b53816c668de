"""What the testnet backends share: the host-control interface the scenario engine drives (``HostControl``), running
ip/tc/docker with one-line errors, tbf sizing, and telling whether a process (pid, start time) still lives, for the
guards that tear a testbed down after its owner."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from p2ptrain.errors import ConfigError, UserError
from p2ptrain.timing import SLOW_POLL_S

MIN_BURST_BYTES = 16 * 1024
TBF_QUEUE_S = 0.05  # how much traffic tbf may queue, in seconds at the shaped rate
SOURCE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory that holds the p2ptrain package


def child_env(**extra: str) -> dict[str, str]:
    """Our environment plus ``extra``, with this p2ptrain first on PYTHONPATH (for `python -m p2ptrain...`)."""
    path = os.pathsep.join(filter(None, [SOURCE_ROOT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


def process_env() -> dict[str, str]:
    """The environment of a testnet's bootstrap and peers: unbuffered logs, one torch thread, no hub downloads."""
    return child_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


class HostControl(Protocol):
    """A backend: the hosts of one run (``bootstrap``, ``peer0``...) and what can be done to them."""

    kind: str  # "netns" | "docker": in the run id and the launcher's first line
    poll_s: float  # how often the engine looks at the hosts and the metrics files

    def create(self) -> None:
        """Build the network for the hosts it was made for (every host the run may start), links shaped."""

    def teardown(self) -> None:
        """Kill everything started, remove the network. Idempotent; must not raise."""

    def start(self, host: str, command: str, args: list[str], log: Path) -> int:
        """Run ``p2ptrain COMMAND ARGS`` on ``host``, listening on its own address at PORT; returns a pid."""

    def refresh(self) -> None:
        """Look at the hosts once (exit codes below are as of the last refresh)."""

    def exit_code(self, host: str) -> int | None:
        """The exit code of the host's current process (-N: killed by signal N); None while it runs."""

    def signal(self, host: str, sig: signal.Signals) -> None:
        """SIGKILL: everything on the host. Else: wake the host, then signal its main process only."""

    def pause(self, host: str, pause: bool) -> None:
        """Freeze (SIGSTOP) or thaw (SIGCONT) every process of the host."""

    def address(self, host: str) -> str: ...

    def shell_prefix(self, host: str) -> list[str]:
        """What runs a command on the host from this machine's shell (``ip netns exec NS``, ``docker exec C``)."""

    def set_rate(self, host: str, rate_mbit: float | None) -> None: ...
    def cut_partition(self, group: list[str]) -> None: ...
    def heal_partition(self) -> None: ...


def check_rate(rate_mbit: float | None) -> None:
    if rate_mbit is not None and not 0.01 <= rate_mbit <= 100_000:
        raise ConfigError(f"rate_mbit={rate_mbit}: give a rate between 0.01 and 100000 Mbit/s, or None for unshaped")


def tbf_args(rate_mbit: float) -> list[str]:
    """``tc`` arguments after ``tbf`` for a rate: burst >= one timer tick's worth (rate/250) and >= 16 KiB."""
    rate_bytes_per_s = rate_mbit * 1e6 / 8
    burst_bytes = max(int(rate_bytes_per_s / 250), MIN_BURST_BYTES)
    limit_bytes = burst_bytes + int(rate_bytes_per_s * TBF_QUEUE_S)
    return ["rate", f"{int(rate_mbit * 1e6)}bit", "burst", str(burst_bytes), "limit", str(limit_bytes)]


def run_tool(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a host tool (ip, tc, docker); a failure becomes a one-line UserError naming the command."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise UserError(f"`{' '.join(argv)}` failed: {reason}")
    return done


def process_start_ticks(pid: int) -> int | None:
    """Start time of a live (non-zombie) process in clock ticks, which tells a pid from a reused one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name in (...) may hold spaces
    return None if fields[0] in ("Z", "X") else int(fields[19])


def wait_exit(hosts: HostControl, host: str, timeout_s: float) -> int | None:
    """Wait up to ``timeout_s`` for the host's process to exit; its exit code, or None if it still runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        hosts.refresh()
        code = hosts.exit_code(host)
        if code is not None or time.monotonic() >= deadline:
            return code
        time.sleep(min(0.1, hosts.poll_s))


def wait_for_exit(pid: int, start_ticks: int) -> None:
    """Block until the process (pid, start time) has exited: pidfd when available, else a 0.5 s poll."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd support, or the owner is already gone
        pidfd = None
    if pidfd is not None:
        if process_start_ticks(pid) == start_ticks:  # the pidfd refers to the owner, not to a reused pid
            select.select([pidfd], [], [])
        os.close(pidfd)
    while process_start_ticks(pid) == start_ticks:
        time.sleep(SLOW_POLL_S)  # owner-liveness poll where pidfd_open is unavailable


@contextlib.contextmanager
def handling_signals(handler: Any) -> Iterator[None]:
    """Install ``handler`` for SIGINT/SIGTERM/SIGHUP for the block (main thread only), then restore the old ones."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def interrupt(signum: int, _frame: object) -> None:
    """A handler for ``handling_signals``: a launcher stopped politely (Ctrl-C, SIGTERM, SIGHUP) unwinds, and so
    stops the processes it started."""
    raise KeyboardInterrupt(signal.Signals(signum).name)
