"""Command-line runs that fork from a process which has already imported torch, transformers and hivemind.

A CLI or benchmark run spends 4 to 8 s of CPU importing those libraries before it reads its first flag; a suite that
runs fifty of them to check their error lines spends minutes on imports alone. The zygote imports them once (and
runs nothing with them: a fork is safe only before torch starts its thread pools), then forks a child per command.
The child takes the command's working directory, environment, argv and output files, runs the module or script as
`__main__` as `python -m` / `python SCRIPT` would, runs the exit handlers and exits with the code Python would.

What it does not check is the interpreter's own start-up; tests/test_cli_errors.py keeps real subprocesses for that.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

PRELOADED = ("torch", "transformers", "transformers.models.llama.modeling_llama", "hivemind", "p2ptrain.peer",
             "p2ptrain.node", "p2ptrain.testnet.netns_run")

SERVER = r"""
import atexit, json, os, runpy, select, sys, traceback
for name in sys.argv[1:]:
    __import__(name)
if "p2ptrain.cli" in sys.modules:  # run as __main__ below; runpy warns on stderr when it is imported already
    raise SystemExit("p2ptrain.cli must not be preloaded")
replies = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
running = {}


def run(request):
    os.chdir(request["cwd"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.environ.clear()
    os.environ.update(request["env"])
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
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


pending, open_ = b"", True
while open_ or running:
    readable, _, _ = select.select([0] if open_ else [], [], [], 0.05)
    if readable:
        chunk = os.read(0, 1 << 16)
        open_, pending = bool(chunk), pending + chunk
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run(request)
            finally:
                os._exit(code)
        running[pid] = request["id"]
        replies.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        replies.write(json.dumps({"id": running.pop(pid), "returncode": os.waitstatus_to_exitcode(status)}) + "\n")
"""


class ZygoteChild:
    """One command run by the zygote, as much of `subprocess.Popen` as the tests use: `wait`, `kill`, `pid`."""

    def __init__(self, zygote: Zygote, request_id: int, args: list[str]):
        self.zygote, self.request_id, self.args = zygote, request_id, args
        self.pid = zygote.reply(request_id, "pid", timeout_s=60)
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self.zygote.reply(self.request_id, "returncode", timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Zygote:
    """The forking process, started on first use with `env` (read once: libraries read some variables at import)."""

    def __init__(self, env: Mapping[str, str], preloaded: Sequence[str] = PRELOADED):
        self.env = dict(env)
        self.process = subprocess.Popen([sys.executable, "-c", SERVER, *preloaded], env=self.env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=1)
        self.replies: dict[tuple[int, str], int] = {}
        self.changed = threading.Condition()
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            reply = json.loads(line)
            with self.changed:
                key = "pid" if "pid" in reply else "returncode"
                self.replies[(reply["id"], key)] = reply[key]
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def reply(self, request_id: int, key: str, timeout_s: float | None) -> int:
        with self.changed:
            if not self.changed.wait_for(lambda: (request_id, key) in self.replies or self.process.poll() is not None,
                                         timeout_s):
                raise TimeoutError(f"no {key} for command {request_id} within {timeout_s} s")
            if (request_id, key) not in self.replies:
                raise RuntimeError(f"the zygote exited with {self.process.returncode}")
            return self.replies[(request_id, key)]

    def start(self, target: dict[str, str], args: list[str], cwd: Path, stdout: Path, stderr: Path) -> ZygoteChild:
        """Fork a child that runs `target` ({"module": name} or {"script": path}) with `args`."""
        assert self.process.stdin is not None
        with self.changed:
            request_id, self.next_id = self.next_id, self.next_id + 1
        request = {"id": request_id, **target, "argv": args, "cwd": str(cwd), "stdout": str(stdout),
                   "stderr": str(stderr), "env": self.env}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return ZygoteChild(self, request_id, [*target.values(), *args])

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_zygotes: dict[tuple[tuple[str, str], ...], Zygote] = {}


def zygote(env: Mapping[str, str]) -> Zygote:
    """The zygote of this process for `env`, started on first use and closed at exit."""
    key = tuple(sorted(env.items()))
    if key not in _zygotes:
        _zygotes[key] = Zygote(env)
        atexit.register(_zygotes[key].close)
    return _zygotes[key]
