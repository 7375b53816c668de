"""A multi-host testnet on one Linux machine, built from network namespaces, veth pairs, bridges and tbf.

Host ``i`` of testbed ``t`` lives in netns ``p2pt-t-h<i>`` with ``eth0`` = 10.213.0.<i+1>/24, a veth whose other end
``v<i>`` sits on bridge ``brA`` or ``brB`` in the switch netns ``p2pt-t-sw``; the bridges are joined by the trunk
veth ``trA``-``trB``, so a partition is ``ip link set trA down``. Nothing is added to the machine's own network and
interface names cannot collide with another testbed's. tbf shapes upload on ``eth0`` and download on ``v<i>``
(``netem`` is missing on some kernels). A host may instead live at home, behind a NAT router namespace
``p2pt-t-r<k>`` (homes.py). Every namespace is recorded in a state file under /run/p2ptrain-netns
before it is made, and a detached guard process tears the testbed down if its owner dies (SIGKILL included);
``python -m p2ptrain.testnet.netns --cleanup`` removes leftovers by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from p2ptrain.errors import ConfigError, UserError
from p2ptrain.testnet.forkserver import ForkedProcess, ForkServer, ForkServerError
from p2ptrain.testnet.homes import Home, attach_host, build_router, plan_homes, require_nat_support
from p2ptrain.testnet.hosttools import check_rate, child_env, process_start_ticks, run_tool, tbf_args, wait_for_exit
from p2ptrain.timing import BRIEF_S

STATE_DIR = Path("/run/p2ptrain-netns")
NETNS_RUN_DIR = Path("/run/netns")  # where `ip netns add` mounts each namespace, by name
NAMESPACE_MARKER = "p2pt-"  # every namespace a testbed creates starts with this, so --cleanup can find orphans
SUBNET_PREFIX = "10.213.0."  # hosts get .1, .2, ... /24; the subnet exists only inside the testbed's namespaces
MAX_HOSTS = 250

_PREFIX_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,23}$")
_HOST_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class HostSpec:
    """One host of the testbed; ``rate_mbit`` shapes its upload and download (None: unshaped); ``home`` puts it
    behind that home network's NAT router (hosts naming the same home share one; None: on the public switch)."""

    name: str
    rate_mbit: float | None = None
    home: str | None = None

    def __post_init__(self) -> None:
        for name in (self.name, self.home or "home"):
            if not _HOST_NAME_RE.match(name):
                raise ConfigError(f"host or home name {name!r}: use 1-64 letters, digits, '_', '.', '-'")
        check_rate(self.rate_mbit)


def require_netns_support() -> None:
    """Raise a one-line UserError unless we are root and ``ip`` and ``tc`` are installed."""
    if os.geteuid() != 0:
        raise UserError("network-namespace testbeds need root: run as root (or with sudo)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UserError(f"`{'` and `'.join(missing)}` not found: install iproute2 (apt-get install iproute2)")


def _read_state(path: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        return cast(dict[str, Any], json.loads(path.read_text()))
    return None


def _write_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def list_namespaces() -> list[str]:
    """Names of all network namespaces on the machine (``ip netns list``)."""
    out = run_tool(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(namespace: str, deadline_s: float = 5.0) -> None:
    """SIGKILL every process inside a namespace and wait until none is left (zombies no longer count)."""
    deadline = time.monotonic() + deadline_s
    while True:
        out = run_tool(["ip", "netns", "pids", namespace], check=False).stdout
        pids = [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def delete_namespaces(namespaces: list[str]) -> list[str]:
    """Kill the processes in, then delete, each namespace that exists; return the names deleted."""
    existing = set(list_namespaces())
    deleted = []
    for namespace in namespaces:
        if namespace in existing:
            _kill_namespace_processes(namespace)
            run_tool(["ip", "netns", "del", namespace], check=False)  # also removes its veths, bridges and qdiscs
            deleted.append(namespace)
    return deleted


def _teardown_state_file(path: Path) -> list[str]:
    state = _read_state(path)
    deleted = delete_namespaces(list(state["namespaces"])) if state else []
    path.unlink(missing_ok=True)
    return deleted


def teardown_stale(prefix: str | None = None) -> list[str]:
    """Tear down testbeds (of one prefix, or all) whose state file names an owner that is dead."""
    deleted: list[str] = []
    for path in sorted(STATE_DIR.glob("*.json" if prefix is None else f"{prefix}.json")):
        state = _read_state(path)
        if state is None or process_start_ticks(int(state["owner_pid"])) != state["owner_start_ticks"]:
            deleted += _teardown_state_file(path)
    return deleted


def cleanup_all() -> list[str]:
    """Remove stale testbeds and any ``p2pt-*`` namespace that no live testbed claims; return what was deleted."""
    deleted = teardown_stale()
    live_states = [state for state in map(_read_state, STATE_DIR.glob("*.json")) if state is not None]
    claimed = {namespace for state in live_states for namespace in state["namespaces"]}
    orphans = [ns for ns in list_namespaces() if ns.startswith(NAMESPACE_MARKER) and ns not in claimed]
    return deleted + delete_namespaces(orphans)


def run_guard(state_path: Path, owner_pid: int) -> None:
    """Guard process body: wait for the owner to die, then tear down whatever the state file names."""
    state = _read_state(state_path)
    if state is None or int(state["owner_pid"]) != owner_pid:
        return
    wait_for_exit(owner_pid, int(state["owner_start_ticks"]))
    _teardown_state_file(state_path)


@dataclass
class _Host:
    spec: HostSpec
    index: int
    namespace: str
    rate_mbit: float | None
    home: Home | None = None


class Testbed:
    """Hosts in their own network namespaces on a shaped, partitionable switch; use as a context manager."""

    def __init__(self, name_prefix: str, hosts: list[HostSpec]) -> None:
        if not _PREFIX_RE.match(name_prefix):
            raise ConfigError(f"testbed prefix {name_prefix!r}: use 1-24 lowercase letters, digits or '-'")
        names = [h.name for h in hosts]
        if not 1 <= len(hosts) <= MAX_HOSTS or len(set(names)) != len(names):
            raise ConfigError(f"testbed hosts {names}: give 1-{MAX_HOSTS} hosts with unique names")
        self.name_prefix = name_prefix
        self.switch_namespace = f"{NAMESPACE_MARKER}{name_prefix}-sw"  # holds the bridges and the trunk
        self.state_path = STATE_DIR / f"{name_prefix}.json"
        self._hosts = {
            spec.name: _Host(spec, i, f"{NAMESPACE_MARKER}{name_prefix}-h{i}", spec.rate_mbit)
            for i, spec in enumerate(hosts)
        }
        self._homes = plan_homes(f"{NAMESPACE_MARKER}{name_prefix}", [(i, h.home) for i, h in enumerate(hosts)],
                                 {i: f"{SUBNET_PREFIX}{i + 1}" for i in range(len(hosts))})
        for host in self._hosts.values():
            host.home = self._homes.get(host.spec.home) if host.spec.home is not None else None
        self._processes: list[subprocess.Popen[Any] | ForkedProcess] = []
        self._guard: subprocess.Popen[bytes] | None = None
        self._state: dict[str, Any] = {}
        self._created = False

    @property
    def hosts(self) -> list[str]:
        return list(self._hosts)

    def address(self, host: str) -> str:
        """IPv4 address of a host, e.g. ``10.213.0.1`` (at home: its LAN address, e.g. ``10.213.1.2``)."""
        target = self._host(host)
        return target.home.lan_address(target.index) if target.home else f"{SUBNET_PREFIX}{target.index + 1}"

    def public_address(self, host: str) -> str:
        """The address others see a host's connections come from: its own, or at home its router's."""
        target = self._host(host)
        return target.home.wan_address if target.home else self.address(host)

    def home_of(self, host: str) -> str | None:
        return self._host(host).spec.home

    def namespace(self, host: str) -> str:
        """Name of the host's network namespace (for ``ip netns exec``)."""
        return self._host(host).namespace

    def rate_mbit(self, host: str) -> float | None:
        return self._host(host).rate_mbit

    def _host(self, host: str) -> _Host:
        if host not in self._hosts:
            raise UserError(f"unknown testbed host {host!r}: known hosts are {self.hosts}")
        return self._hosts[host]

    def __enter__(self) -> Testbed:
        self.create()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.teardown()

    def create(self) -> None:
        """Build the namespaces, links, bridges and qdiscs; on any failure, tear down and re-raise."""
        require_netns_support()
        self._claim_state_file()
        try:
            self._start_guard()
            self._add_namespace(self.switch_namespace)
            self._build_switch()
            if self._homes:
                require_nat_support()
            for home in self._homes.values():
                self._add_namespace(home.namespace)
                build_router(home, self.switch_namespace)
            for host in self._hosts.values():
                self._add_namespace(host.namespace)
                self._build_host(host)
        except BaseException:
            self.teardown()
            raise
        self._created = True

    def _claim_state_file(self) -> None:
        teardown_stale(self.name_prefix)
        state = _read_state(self.state_path)
        if state is not None:
            raise UserError(f"testbed prefix {self.name_prefix!r} is in use by pid {state['owner_pid']}: pick another")
        owner_start_ticks = process_start_ticks(os.getpid())
        self._state = {"owner_pid": os.getpid(), "owner_start_ticks": owner_start_ticks, "namespaces": []}
        _write_state(self.state_path, self._state)

    def _start_guard(self) -> None:
        env = child_env()
        argv = [sys.executable, "-m", "p2ptrain.testnet.netns", "--guard", str(self.state_path), str(os.getpid())]
        quiet = subprocess.DEVNULL
        self._guard = subprocess.Popen(argv, env=env, start_new_session=True, stdin=quiet, stdout=quiet, stderr=quiet)
        self._state["guard_pid"] = self._guard.pid
        _write_state(self.state_path, self._state)

    def _add_namespace(self, namespace: str) -> None:
        if namespace in list_namespaces():
            raise UserError(f"namespace {namespace} already exists: run `python -m p2ptrain.testnet.netns --cleanup`")
        self._state["namespaces"].append(namespace)
        _write_state(self.state_path, self._state)  # recorded before it exists, so a crash cannot leak it
        run_tool(["ip", "netns", "add", namespace])
        run_tool(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def _build_switch(self) -> None:
        sw = ["ip", "-n", self.switch_namespace, "link"]
        for bridge in ("brA", "brB"):
            run_tool(sw + ["add", bridge, "type", "bridge", "forward_delay", "0", "stp_state", "0"])
            run_tool(sw + ["set", bridge, "up"])
        run_tool(sw + ["add", "trA", "type", "veth", "peer", "name", "trB"])
        run_tool(sw + ["set", "trA", "master", "brA", "up"])
        run_tool(sw + ["set", "trB", "master", "brB", "up"])

    def _build_host(self, host: _Host) -> None:
        if host.home is not None:
            attach_host(host.home, host.index, host.namespace)
            self._apply_rate(host)
            return
        port = f"v{host.index}"
        sw = ["ip", "-n", self.switch_namespace, "link"]
        run_tool(sw + ["add", port, "type", "veth", "peer", "name", "eth0", "netns", host.namespace])
        run_tool(sw + ["set", port, "master", "brA", "up"])
        in_host = ["ip", "-n", host.namespace]
        run_tool(in_host + ["addr", "add", f"{self.address(host.spec.name)}/24", "dev", "eth0"])
        run_tool(in_host + ["link", "set", "eth0", "up"])
        self._apply_rate(host)

    def teardown(self) -> None:
        """Kill our processes, delete every namespace, stop the guard, remove the state file. Idempotent."""
        self._stop_processes()
        state = _read_state(self.state_path)
        if state is not None and int(state["owner_pid"]) == os.getpid():
            delete_namespaces(list(state["namespaces"]))
            self.state_path.unlink(missing_ok=True)
        if self._guard is not None:
            self._guard.kill()
            self._guard.wait()
            self._guard = None
        self._created = False

    def _stop_processes(self) -> None:
        for proc in self._processes:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + BRIEF_S  # SIGTERM -> SIGKILL for processes started with popen
        for proc in self._processes:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                with contextlib.suppress(ForkServerError):
                    proc.wait()
            except ForkServerError:  # its exit code is lost; deleting the namespace kills what is left of it
                _signal_group(proc.pid, signal.SIGKILL)
        self._processes.clear()

    def fork(self, host: str, server: ForkServer, module: str, args: list[str], log: Path) -> ForkedProcess:
        """Run ``module`` as ``python -m`` would, forked from ``server`` into the host's namespace, in a new
        session (process group) that teardown kills; its output is appended to ``log``."""
        if not self._created:
            raise UserError("testbed is not created: call create() or use `with Testbed(...)` first")
        proc = server.start({"module": module}, args, Path.cwd(), log, append=True, session=True,
                            netns=str(NETNS_RUN_DIR / self.namespace(host)))
        self._processes.append(proc)
        return proc

    def popen(self, host: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the host's namespace in a new session (process group) that teardown kills."""
        if not self._created:
            raise UserError("testbed is not created: call create() or use `with Testbed(...)` first")
        kwargs["start_new_session"] = True
        proc: subprocess.Popen[Any] = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], **kwargs)
        self._processes.append(proc)
        return proc

    def set_rate(self, host: str, rate_mbit: float | None) -> None:
        """Change a host's upload and download rate live (None removes shaping)."""
        check_rate(rate_mbit)
        target = self._host(host)
        target.rate_mbit = rate_mbit
        self._apply_rate(target)

    def _apply_rate(self, host: _Host) -> None:
        down = (host.home.namespace, f"l{host.index}") if host.home else (self.switch_namespace, f"v{host.index}")
        for namespace, dev in ((host.namespace, "eth0"), down):  # up, down
            tc = ["tc", "-n", namespace, "qdisc"]
            if host.rate_mbit is None:
                run_tool(tc + ["del", "dev", dev, "root"], check=False)  # fails harmlessly when there is none
            else:
                run_tool(tc + ["replace", "dev", dev, "root", "tbf", *tbf_args(host.rate_mbit)])

    def cut_partition(self, group_b_hosts: list[str]) -> None:
        """Put ``group_b_hosts`` on bridge B, the rest on bridge A, and cut the trunk between the bridges (a home's
        hosts share its router's switch port: they go all together or not at all)."""
        group_b = {self._host(name).index for name in group_b_hosts}
        ports: dict[str, bool] = {}
        for host in self._hosts.values():
            port = host.home.switch_port if host.home else f"v{host.index}"
            if ports.setdefault(port, host.index in group_b) != (host.index in group_b):
                raise UserError(f"partition: the hosts of home {host.spec.home!r} share one router; put all of "
                                f"them on one side")
        for port, in_b in ports.items():
            run_tool(["ip", "-n", self.switch_namespace, "link", "set", port, "master", "brB" if in_b else "brA"])
        run_tool(["ip", "-n", self.switch_namespace, "link", "set", "trA", "down"])

    def heal_partition(self) -> None:
        """Bring the trunk back up: all hosts reach each other again."""
        run_tool(["ip", "-n", self.switch_namespace, "link", "set", "trA", "up"])


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.testnet.netns", description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--cleanup", action="store_true", help="remove leftover testbed namespaces and state files")
    group.add_argument("--guard", nargs=2, metavar=("STATE_FILE", "OWNER_PID"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.guard:
        run_guard(Path(args.guard[0]), int(args.guard[1]))
        return 0
    try:
        require_netns_support()
        deleted = cleanup_all()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"removed {len(deleted)} namespace(s)" + (": " + " ".join(deleted) if deleted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
