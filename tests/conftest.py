"""Shared fixtures: every test reaps the processes it started, and the suite fails if a p2pd daemon outlives it.

The pytest process makes itself a child subreaper, so a daemon orphaned by a killed DHT process is re-parented
to pytest and still counts as ours; daemons of other programs on the machine are never looked at or touched.

Tiers (tests/README.md): a test that starts a process or opens a TCP/UDP socket carries a marker (slow, network,
netns or docker); one that does so unmarked fails, so the fast tier (none of the four) stays in-process.

Under pytest-xdist (setup.cfg: `-n 2 --dist loadgroup --no-loadscope-reorder`), the netns, docker and `alone` tests
form one group that one worker runs last, and while one of them runs no other test runs beside it (`MachineShare`):
each loads the whole machine, or counts rounds in wall-clock time. The other tests run two at a time before it, but
the `background` ones (CPU work that asserts nothing timed), which come after it: the other worker runs them beside
the group in the idle class (SCHED_IDLE), on the CPU time its wall-clock scenarios leave.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import cache_bytecode  # noqa: F401  (first: the imports below are cached as bytecode)
import psutil
import pytest
import torch
from docker_utils import DOCKER_SETUP
from early_jobs import BROWSER, TYPE_CHECK, WANDB, remove_ended, start_wanted, wait_ended
from subreaper import set_child_subreaper

from p2ptrain.testnet.forkserver import import_time_locks, kept_server_pids, renew_locks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a peer without a checkpoint directory keeps its model under XDG_DATA_HOME when it ends: never the user's own here
DATA_HOME = os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="p2ptrain-tests-data-")

REAP_GRACE_S = 10.0
HELD_LOCK_S = 2.0  # an import-time lock still held this long after a test's processes are gone is held by a dead one
EARLY_WAIT_NOTED_S = 2.0
TIER_MARKERS = ("slow", "network", "netns", "docker")
MACHINE_WIDE_MARKERS = ("docker", "netns", "alone")  # their tests form one xdist group, run in turn by one worker
MACHINE_WIDE_GROUP = "machine-wide"
PROCESS_EVENTS = ("os.fork", "os.forkpty", "os.posix_spawn", "os.system", "subprocess.Popen")
SOCKET_EVENTS = ("socket.bind", "socket.connect")


class _StartWatch:
    """Records, while on, what the main thread starts: processes, and sockets bound or connected over IP."""

    def __init__(self) -> None:
        self.on = False
        self.started: list[str] = []

    def __call__(self, event: str, args: tuple[object, ...]) -> None:
        if not self.on or threading.current_thread() is not threading.main_thread():
            return
        if event in PROCESS_EVENTS:
            self.started.append(f"{event} {args[0] if args else ''}"[:120])
        elif event in SOCKET_EVENTS and isinstance(args[0], socket.socket) and args[0].family in (
                socket.AF_INET, socket.AF_INET6):
            self.started.append(f"{event} {args[1]}")


_start_watch = _StartWatch()
sys.addaudithook(_start_watch)


def _machine_wide_group(item: pytest.Item) -> str | None:
    return MACHINE_WIDE_GROUP if any(item.get_closest_marker(name) for name in MACHINE_WIDE_MARKERS) else None


def _alone(item: pytest.Item) -> bool:
    return _machine_wide_group(item) is not None


def _background(item: pytest.Item) -> bool:
    return item.get_closest_marker("background") is not None and not _alone(item)


def _run_order(item: pytest.Item) -> tuple[int, bool]:
    """The other tests, then the machine-wide group (the docker tests last of it), then the background ones."""
    return 2 if _background(item) else 1 if _alone(item) else 0, item.get_closest_marker("docker") is not None


def pytest_itemcollected(item: pytest.Item) -> None:
    """The machine-wide tests go to one xdist worker: marked as they are collected, before xdist names each
    test's group from its marks."""
    group = _machine_wide_group(item)
    if group is not None:
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)  # after xdist's hook, which appends each test's group to its node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The machine-wide tests come after the others, the docker ones last of them, and the background tests after
    the group (`_run_order`): the niced early jobs (the Docker set-up) run beside the other tests and are over
    before the first test that must wait for them, and the background tests (and the type check, in the idle class)
    run beside the group. Under xdist this needs
    `--no-loadscope-reorder` (setup.cfg), which keeps the groups in this order; the default puts the largest first.

    Under `--dist loadgroup`, a grouped test whose id does not name its group stops the run: the groups would spread
    over the workers unnoticed (pytest 9 with xdist 3.8 did). Each part keeps its order (the sort is stable)."""
    if getattr(config.option, "loadgroup", False):
        ungrouped = [item.nodeid for item in items if _machine_wide_group(item) and "@" not in item.nodeid]
        if ungrouped:
            raise pytest.UsageError(f"xdist did not group {len(ungrouped)} tests ({ungrouped[0]}, ...): check the "
                                    f"pytest and pytest-xdist versions (setup.cfg)")
    items.sort(key=_run_order)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(DATA_HOME, ignore_errors=True)
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # a worker ending first must not take files the other still reads
        remove_ended([TYPE_CHECK, DOCKER_SETUP, BROWSER, WANDB])
    if _share is not None:
        _share.remove()


def pytest_configure(config: pytest.Config) -> None:
    """matplotlib lists the system's fonts with `fc-list` the first time it draws on a machine and keeps the list in
    its cache: done here, before xdist starts workers, the fast tier's plot test finds the list made on a fresh
    machine instead of starting `fc-list` itself (which an unmarked test may not)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        import matplotlib.font_manager  # noqa: F401  (importing it makes or loads the font list)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The type check, W&B's install and, as root, the Docker set-up and the browser's install start now in the
    background if a selected test reads them."""
    if not session.config.option.collectonly:
        start_wanted([TYPE_CHECK, WANDB, *([DOCKER_SETUP, BROWSER] if os.geteuid() == 0 else [])], session.items)


class MachineShare:
    """Under xdist, how tests share the machine between workers: a test that loads it whole (a netns or docker
    swarm, or one marked `alone`) runs with no other beside it; the others run side by side. A readers-writer lock
    on a file of this run (flock), behind a turnstile so that a waiting `alone` test is not starved; a worker keeps
    the machine to itself from one `alone` test to the next, so a docker swarm that spans a module's tests trains
    alone too."""

    def __init__(self, run_key: str) -> None:
        directory = Path(tempfile.gettempdir())
        self.turnstile = open(directory / f"p2ptrain-share-{run_key}.turnstile", "a")  # noqa: SIM115 (held for the session)
        self.lock = open(directory / f"p2ptrain-share-{run_key}.lock", "a")  # noqa: SIM115
        self.held: int | None = None

    def enter(self, alone: bool) -> None:
        mode = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
        if self.held == mode:
            return
        self.leave()
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.lock, mode)
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        self.held = mode

    def leave(self) -> None:
        if self.held is not None:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            self.held = None

    def remove(self) -> None:
        """At the end of a worker: the files go (the other worker holds its own open files, if still running)."""
        self.leave()
        for file in (self.turnstile, self.lock):
            file.close()
            Path(file.name).unlink(missing_ok=True)


_share = MachineShare(os.environ["PYTEST_XDIST_TESTRUNUID"]) if os.environ.get("PYTEST_XDIST_WORKER") else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Setup, call and teardown of a test (its module's fixtures included) hold the machine share it needs; a
    machine-wide test also waits for the niced early jobs (the Docker set-up) to end."""
    if _alone(item):
        started = time.monotonic()
        waited_for = wait_ended([TYPE_CHECK, DOCKER_SETUP])
        waited_s = time.monotonic() - started
        if waited_s > EARLY_WAIT_NOTED_S:  # in the warnings summary, which xdist forwards: the run's idle time
            item.warn(pytest.PytestWarning(f"waited {waited_s:.0f} s for the early jobs ({', '.join(waited_for)})"))
    in_background = _share is not None and _background(item)
    if in_background:
        _share.leave()
        _set_scheduling(os.SCHED_IDLE)
    elif _share is not None:
        _share.enter(_alone(item))
    yield
    if in_background:
        _set_scheduling(os.SCHED_OTHER)
    if _share is not None and not (nextitem is not None and _alone(item) and _alone(nextitem)):
        _share.leave()


def _set_scheduling(policy: int) -> None:
    """Every thread of this worker (torch's pool too) to `policy`; what they start inherits it. Leaving SCHED_IDLE
    needs root: elsewhere the worker stays in it, and only background tests come after one."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setscheduler(int(task), policy, os.sched_param(0))


@pytest.fixture(autouse=True)
def unmarked_tests_start_nothing(request: pytest.FixtureRequest):
    """A test without a tier marker that starts a process or an IP socket fails: the fast tier must not."""
    if any(request.node.get_closest_marker(name) for name in TIER_MARKERS):
        yield
        return
    _start_watch.started.clear()
    _start_watch.on = True
    try:
        yield
    finally:
        _start_watch.on = False
    if _start_watch.started:
        pytest.fail(f"this test starts {sorted(set(_start_watch.started))[:5]}: mark it "
                    f"(@pytest.mark.slow, or network / netns / docker; see tests/README.md)", pytrace=False)


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return ""


def _our_descendants() -> list[psutil.Process]:
    """Descendants of this pytest process, except torch's shared-memory manager, the fork servers this process
    keeps (forkserver.kept_server) and multiprocessing's resource tracker: they must outlive each test (the tracker
    ignores SIGTERM, so reaping it cost a benchmark test's teardown the whole grace). A kept server's children are
    reaped as any."""
    kept = {*kept_server_pids(), resource_tracker._resource_tracker._pid}
    return [p for p in psutil.Process().children(recursive=True)
            if _name(p) not in ("", "torch_shm_manager") and p.pid not in kept]


def _terminate(processes: list[psutil.Process]) -> list[psutil.Process]:
    """SIGTERM, wait, SIGKILL what is left; returns the processes that needed SIGKILL."""
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _gone, alive = psutil.wait_procs(processes, timeout=REAP_GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(autouse=True)
def reap_children():
    """Kill whatever child processes a test left behind (hivemind's DHT, averager and p2pd run as children)."""
    yield
    leftovers = _our_descendants()
    if leftovers:
        _gone, alive = psutil.wait_procs(leftovers, timeout=0.5)
        _terminate(alive)
    _free_import_time_locks()


_scanned: tuple[int, list[tuple[object, str, Any]]] = (0, [])  # len(sys.modules) then, and what was found


def _free_import_time_locks() -> None:
    """hivemind's MPFuture pipe lock is one semaphore for this process and every DHT or averager it forks; one killed
    while holding it (a test's kill, or the reaping above) blocks every later DHT's start in this worker (stop 36's
    ci9: 24 tests, each "did not start within 30 s"). Such a lock is renewed, with a warning naming the test."""
    global _scanned
    if _scanned[0] != len(sys.modules):  # a scan takes ~0.2 s; modules are added by the first tests only
        _scanned = (len(sys.modules), import_time_locks())
    held = []
    for owner, name, lock in _scanned[1]:
        if lock.acquire(timeout=HELD_LOCK_S):
            lock.release()
        else:
            held.append((owner, name, lock))
    if held:
        renew_locks(held)
        _scanned = (0, [])
        warnings.warn(pytest.PytestWarning(f"renewed {[name for _owner, name, _lock in held]}: held by a process "
                                           "that this test killed or left"), stacklevel=1)


@pytest.fixture(scope="session", autouse=True)
def no_leftover_p2pd():
    """A p2pd daemon of ours still running at the end of the suite is a failure (and is killed)."""
    set_child_subreaper(True)
    yield
    daemons = [p for p in _our_descendants() if _name(p) == "p2pd"]
    _gone, alive = psutil.wait_procs(daemons, timeout=REAP_GRACE_S)
    if alive:
        _terminate(alive)
        pytest.fail(f"{len(alive)} p2pd daemon(s) outlived the test suite: {sorted(p.pid for p in alive)}")


@pytest.fixture
def one_torch_thread():
    """In-process peers share torch's thread pool: one thread each, as the testnet gives every peer."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _netns_unusable_reason() -> str | None:
    if os.geteuid() != 0:
        return "not running as root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip` or `tc` not installed"
    probe = f"p2pt-probe-{os.getpid()}"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if added.returncode != 0:
        return f"`ip netns add` failed: {added.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


@pytest.fixture
def netns_ok() -> None:
    """Skip (saying why, never silently) where network namespaces cannot be made."""
    reason = _netns_unusable_reason()
    if reason is not None:
        pytest.skip(f"netns tests need root and iproute2: {reason}")
