"""A fork server: one process imports torch, transformers, hivemind and the peer once, then forks each testnet
process (a bootstrap, a peer, the red team's peer) from itself.

A fresh interpreter spends about 7 s of CPU on those imports before it reads its first flag: a testnet of 32 peers
on 2 cores spent minutes starting, and every restart paid it again. A forked child shares the imported modules'
pages with the server until it writes them. The server runs nothing with torch (a fork is safe only before torch
starts its thread pools) and starts no thread.

A child takes its request's working directory, environment, argv, output file and, on the netns testbed, the host's
network namespace (before it starts a thread, so its daemons start there too); it leads its own session, as
`subprocess.Popen(start_new_session=True)` would make it; runs the module or script as `__main__`, as `python -m` /
`python SCRIPT` would; runs the exit handlers and exits with the code Python would. The server reaps it and reports
its exit code (negative for a signal, as Popen's).

    python -m p2ptrain.testnet.forkserver MODULE...    (started by ``ForkServer``; JSON lines on stdin/stdout)
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import json
import multiprocessing
import multiprocessing.synchronize
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# What a testnet process imports before it trains. The modules run as `__main__` (p2ptrain.cli,
# p2ptrain.testnet.red_team) must not be among them: runpy would warn, and run a second copy.
PRELOADED = ("torch", "transformers", "transformers.models.llama.modeling_llama", "hivemind", "p2ptrain.peer",
             "p2ptrain.peer_command", "p2ptrain.testnet.adversary")
RUN_AS_MAIN = ("p2ptrain.cli", "p2ptrain.testnet.red_team")
CLONE_NEWNET = 0x40000000
ORPHAN_GRACE_S = 10.0  # a child left when the launcher has gone: SIGTERM, and SIGKILL this long after
REPLY_TIMEOUT_S = 60.0  # the server answers a request with the child's pid once it has forked


class ForkServerError(RuntimeError):
    """The server died or did not answer."""


# ---- the server ----------------------------------------------------------------------------------------------------
def _enter_network_namespace(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        setns = getattr(os, "setns", None)  # Python 3.12+
        if setns is not None:
            setns(fd, CLONE_NEWNET)
        elif ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns {path}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def _redirect(request: Mapping[str, Any]) -> None:
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.get("append") else os.O_TRUNC)
    out = os.open(request["stdout"], flags, 0o644)
    os.dup2(out, 1)
    os.dup2(out if request["stderr"] == request["stdout"] else os.open(request["stderr"], flags, 0o644), 2)


def import_time_locks() -> list[tuple[Any, str, Any]]:
    """The multiprocessing locks that loaded modules made at import, as module globals or class attributes:
    (owner, name, lock). hivemind keeps its MPFuture pipe's lock so. Such a lock is one semaphore for the process
    and everything forked from it; a forked child that dies holding it (a peer killed while its DHT sends an update)
    leaves it held for all the others, whose sends then block for good."""
    found = []
    with warnings.catch_warnings():  # a deprecated name warns when looked at (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")
        for module in list(sys.modules.values()):
            found += _locks_of(module)
    return found


MULTIPROCESSING_OBJECTS = (multiprocessing.synchronize.SemLock, multiprocessing.synchronize.Condition,
                           multiprocessing.synchronize.Event, multiprocessing.synchronize.Barrier)


def _locks_of(module: Any) -> list[tuple[Any, str, Any]]:
    """The multiprocessing objects among a module's globals and the attributes of the classes it defines."""
    try:
        names = vars(module)
    except TypeError:
        return []
    owners = [module] + [value for value in list(names.values())
                         if isinstance(value, type) and value.__module__ == names.get("__name__")]
    return [(owner, name, value) for owner in owners for name, value in list(vars(owner).items())
            if isinstance(value, MULTIPROCESSING_OBJECTS)]


def renew_locks(locks: Sequence[tuple[Any, str, Any]]) -> None:
    """Give this process its own, unlocked, copy of each lock (what a fresh interpreter's imports would make)."""
    for owner, name, lock in locks:
        recursive = isinstance(lock, multiprocessing.synchronize.RLock)
        setattr(owner, name, multiprocessing.RLock() if recursive else multiprocessing.Lock())


def _unrenewable(locks: Sequence[tuple[Any, str, Any]]) -> list[str]:
    """Those of `locks` that `renew_locks` cannot remake as they were (a semaphore's count, an event's state)."""
    return [f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{name}" for owner, name, lock in locks
            if type(lock) not in (multiprocessing.synchronize.Lock, multiprocessing.synchronize.RLock)]


def _reseed() -> None:
    """A fresh interpreter seeds numpy's global generator from the OS; a forked child would share the server's.
    (Python's `random` reseeds itself after a fork; torch's default generator starts from a fixed seed anyway.)"""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _run_child(request: Mapping[str, Any], locks: Sequence[tuple[Any, str, Any]]) -> int:
    """In the forked child: set up as the request says, run its target as `__main__`; the exit code."""
    renew_locks(locks)
    if request.get("session"):
        os.setsid()
    if request.get("netns"):
        _enter_network_namespace(request["netns"])
    os.chdir(request["cwd"])
    _redirect(request)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the child's own stdio, line-buffered)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(request["env"])
    _reseed()
    code = 0
    try:
        if "module" in request:
            sys.argv, sys.path[0] = [request["module"], *request["argv"]], os.getcwd()
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = [request["script"], *request["argv"]], os.path.dirname(request["script"])
            runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 (what an interpreter does with an uncaught exception)
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve(preloaded: Sequence[str]) -> None:
    """The server's loop: fork a child per request line, answer its pid, report each exit. When its stdin closes
    (the launcher has finished, or died) it stops the children still running, SIGTERM then, after
    `ORPHAN_GRACE_S`, SIGKILL to each one's session, and ends once they have exited."""
    clash = set(preloaded) & set(RUN_AS_MAIN)
    if clash:
        raise SystemExit(f"the fork server must not preload {sorted(clash)}: they run as __main__")
    for name in preloaded:
        __import__(name)
    if threading.active_count() != 1:  # a thread would not exist in the children, and its locks could be held
        raise SystemExit(f"importing {list(preloaded)} started threads: {threading.enumerate()}")
    locks = import_time_locks()
    if _unrenewable(locks):
        raise SystemExit(f"importing {list(preloaded)} made multiprocessing objects a child cannot remake: "
                         f"{_unrenewable(locks)}")
    gc.freeze()  # the collector never walks (so never writes) the preloaded objects: their pages stay shared
    replies = _Replies(os.fdopen(os.dup(1), "w", buffering=1))
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends the server by closing its stdin
    running: dict[int, Mapping[str, Any]] = {}  # pid: its request
    pending, stdin_open, orphaned_at = b"", True, None
    while stdin_open or running:
        readable, _, _ = select.select([0] if stdin_open else [], [], [], 0.05)
        if readable:
            chunk = os.read(0, 1 << 16)
            stdin_open, pending = bool(chunk), pending + chunk
        while b"\n" in pending and not replies.gone:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    replies.file.close()  # the server's: a child holding it would keep the launcher reading
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    code = _run_child(request, locks)
                finally:
                    os._exit(code)
            running[pid] = request
            replies.send({"id": request["id"], "pid": pid})
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            replies.send({"id": running.pop(pid)["id"], "returncode": os.waitstatus_to_exitcode(status)})
        if (not stdin_open or replies.gone) and running:
            orphaned_at = _stop_orphans(running, orphaned_at)
            stdin_open = False


class _Replies:
    """The server's answers on its stdout; a launcher that has gone reads none, and that is not an error."""

    def __init__(self, file: Any):
        self.file, self.gone = file, False

    def send(self, reply: Mapping[str, Any]) -> None:
        if not self.gone:
            try:
                self.file.write(json.dumps(reply) + "\n")
            except BrokenPipeError:
                self.gone = True


def _stop_orphans(running: Mapping[int, Mapping[str, Any]], since: float | None) -> float:
    """Children left when the launcher has gone: SIGTERM each (a peer checkpoints and shuts its DHT down), then
    SIGKILL each one's session (its DHT process and p2pd too) once `ORPHAN_GRACE_S` has passed; not yet reaped,
    so each pid is still that child's."""
    now = time.monotonic()
    if since is None or now - since >= ORPHAN_GRACE_S:
        sig = signal.SIGTERM if since is None else signal.SIGKILL
        for pid, request in running.items():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if sig == signal.SIGKILL and request.get("session"):
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
        return now if since is None else now - ORPHAN_GRACE_S + 1.0  # SIGKILL again each second until reaped
    return since


# ---- the launcher's side -------------------------------------------------------------------------------------------
class ForkedProcess:
    """One child of the server, as much of `subprocess.Popen` as the testnet uses: `pid`, `poll`, `wait`,
    `send_signal`, `kill`, `returncode`."""

    def __init__(self, server: ForkServer, request_id: int, args: list[str]):
        self.server, self.request_id, self.args = server, request_id, args
        pid = server.reply(request_id, "pid", REPLY_TIMEOUT_S)
        assert pid is not None
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.reply(self.request_id, "returncode", 0.0, wait=False)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self.server.reply(self.request_id, "returncode", timeout)
                assert self.returncode is not None
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # once reaped, the pid may be another process's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The server process, started with `env` (read once: libraries read some variables at import; every child is
    given the same), and the replies it sends."""

    def __init__(self, env: Mapping[str, str], preloaded: Sequence[str] = PRELOADED):
        self.env = dict(env)
        self.process = subprocess.Popen([sys.executable, "-m", __name__, *preloaded], env=self.env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=1,
                                        start_new_session=True)  # a Ctrl-C in the terminal is the launcher's
        self.replies: dict[tuple[int, str], int] = {}
        self.ended = False  # its replies are all read: it has exited
        self.changed = threading.Condition()
        self.next_id = 0
        threading.Thread(target=self._read, name="forkserver-replies", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            reply = json.loads(line)
            with self.changed:
                key = "pid" if "pid" in reply else "returncode"
                self.replies[(reply["id"], key)] = reply[key]
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def reply(self, request_id: int, key: str, timeout_s: float | None, wait: bool = True) -> int | None:
        """The pid or exit code of a request; with `wait`, waits for it (TimeoutError after `timeout_s`),
        otherwise None while it has not come. ForkServerError once the server has exited without it."""
        with self.changed:
            if wait and not self.changed.wait_for(lambda: (request_id, key) in self.replies or self.ended,
                                                  timeout_s):
                raise TimeoutError(f"the fork server sent no {key} for request {request_id} within {timeout_s} s")
            if (request_id, key) in self.replies:
                return self.replies[(request_id, key)]
            if self.ended:
                raise ForkServerError(f"the fork server exited with {self.process.wait()}")
            return None

    def start(self, target: Mapping[str, str], args: list[str], cwd: Path, stdout: Path, stderr: Path | None = None,
              *, append: bool = False, session: bool = False, netns: str | None = None) -> ForkedProcess:
        """Fork a child that runs `target` ({"module": name} or {"script": path}) with `args`; its output goes to
        `stdout` and `stderr` (the same file when `stderr` is None), appended or truncated; with `session`, it leads
        a new session; with `netns`, a namespace's path, it runs in that network namespace."""
        assert self.process.stdin is not None
        for path in {stdout, stderr or stdout}:  # there once this returns, as a file handed to Popen would be
            with open(path, "ab" if append else "wb"):
                pass
        with self.changed:
            request_id, self.next_id = self.next_id, self.next_id + 1
        request = {"id": request_id, **target, "argv": args, "cwd": str(cwd), "stdout": str(stdout),
                   "stderr": str(stderr or stdout), "append": append, "session": session, "netns": netns,
                   "env": self.env}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise ForkServerError(f"the fork server exited with {self.process.poll()}") from None
        return ForkedProcess(self, request_id, [*target.values(), *args])

    def close(self) -> None:
        """Close its stdin: it stops the children still running (SIGTERM, then SIGKILL after `ORPHAN_GRACE_S`) and
        ends."""
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# ---- one server a process keeps -----------------------------------------------------------------------------------
# pytest sets this variable per test phase, and neither an import nor a testnet process reads it: a kept server is
# not replaced when it alone differs
PER_CHILD_VARIABLES = ("PYTEST_CURRENT_TEST",)

_kept: dict[tuple[str, ...], tuple[dict[str, str], ForkServer]] = {}  # preloaded: (its import-time env, the server)


def _import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name not in PER_CHILD_VARIABLES}


def kept_server(env: Mapping[str, str], preloaded: Sequence[str] = PRELOADED) -> ForkServer:
    """The fork server this process keeps for `preloaded`: started on first use and reused by every later testnet
    of the process (each stops its own children), so that one run after another pays the imports once; replaced
    when `env` differs at import time or the server has died; closed at exit."""
    key, wanted = tuple(preloaded), _import_time_env(env)
    held = _kept.get(key)
    if held is not None and (held[0] != wanted or held[1].process.poll() is not None):
        held[1].close()
        held = None
    if held is None:
        held = _kept[key] = wanted, ForkServer(env, preloaded)
        atexit.register(held[1].close)
    return held[1]


def kept_server_pids() -> set[int]:
    """The pids of the servers this process keeps: they outlive each testnet on purpose."""
    return {server.process.pid for _env, server in _kept.values() if server.process.poll() is None}


if __name__ == "__main__":
    serve(sys.argv[1:])
