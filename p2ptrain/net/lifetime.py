"""Processes that end with the process that started them, even one killed by SIGKILL (which runs no clean-up).

hivemind runs its DHT node and its averager each in a forked process, and the DHT process starts p2pd. When a peer
dies without shutting them down, they run on forever, serving a peer that is gone (p2pd exits by itself once no
client is connected to it, but the averager process is one). `DiesWithStarter` ties such a process's life to its
starter's and kills its children (p2pd) as it goes.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import select
import signal
import threading
import time

from p2ptrain.timing import TICK_S

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class DiesWithStarter:
    """Mixin for a multiprocessing.Process subclass (hivemind's DHT, DecentralizedAverager): its process ends with
    the process that started it, and kills its own children on the way out."""

    def start(self) -> None:
        self._starter_pid = os.getpid()
        self._started_from_main_thread = threading.current_thread() is threading.main_thread()
        super().start()  # type: ignore[misc]

    def run(self) -> None:
        """In the child process: tie its life to its starter's, then run as the base class does."""
        _die_with_parent(self._starter_pid, self._started_from_main_thread)
        try:
            super().run()  # type: ignore[misc]
        finally:
            kill_children(os.getpid())  # a daemon left behind (a node whose start failed)


def _die_with_parent(parent_pid: int, forked_from_main_thread: bool) -> None:
    """End this process as soon as `parent_pid` (the process that forked it) ends, however it ends.

    PR_SET_PDEATHSIG is the kernel's guarantee, but it fires when the *thread* that forked us ends, so we ask for it
    only if that was the main thread (whose end is the process's). A watchdog thread covers every case: it waits on
    a pidfd of the parent (Linux >= 5.3), or polls our parent pid. Elsewhere than Linux, only the polling works.
    """
    signal.signal(signal.SIGTERM, _exit_now)  # also what hivemind sends a DHT process that does not shut down
    if forked_from_main_thread:
        with contextlib.suppress(AttributeError, OSError):  # not Linux: no prctl
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    threading.Thread(target=_exit_with, args=(parent_pid,), name="exit-with-parent", daemon=True).start()


def _exit_with(parent_pid: int) -> None:
    """Wait until `parent_pid` has ended (it may have already), then end this process and its children."""
    try:
        pidfd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):  # no pidfds, or the parent is gone already
        pidfd = -1
    if pidfd >= 0 and os.getppid() == parent_pid:  # the pidfd is our parent's, not a recycled pid's
        select.select([pidfd], [], [])  # readable once it has exited
    while os.getppid() == parent_pid:  # no pidfd (not Linux >= 5.3): we look once a tick
        time.sleep(TICK_S)
    _exit_now()


def _exit_now(*_signal: object) -> None:
    """End this process and its children (p2pd) at once."""
    kill_children(os.getpid())
    os._exit(1)


def kill_children(pid: int) -> None:
    """SIGKILL the child processes of `pid` (its p2pd daemons). Linux only (/proc); elsewhere nothing."""
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError), open(path) as f:
            for child in f.read().split():
                with contextlib.suppress(OSError):
                    os.kill(int(child), signal.SIGKILL)


