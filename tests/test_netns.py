"""The network-namespace testbed: shaped goodput both ways, partitions, live rate changes, and leak-free teardown."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns_utils import stop_and_clean_up

from p2ptrain.errors import ConfigError, UserError
from p2ptrain.testnet import netns
from p2ptrain.testnet.forkserver import ForkServer
from p2ptrain.testnet.netns import NETNS_RUN_DIR, HostSpec, list_namespaces, tbf_args

pytestmark = pytest.mark.netns

REPO_ROOT = Path(__file__).resolve().parent.parent
PORT = 5201  # fixed: every testbed host has a private network stack, so nothing else can hold it
SHAPED_MBIT = 20.0
TOLERANCE = 0.20

RECEIVER = f"""
import json, socket, time
server = socket.create_server(("0.0.0.0", {PORT}))
print("ready", flush=True)
conn, _ = server.accept()
total, first_s = 0, None
while chunk := conn.recv(1 << 18):
    first_s = first_s or time.monotonic()
    total += len(chunk)
print(json.dumps({{"bytes": total, "seconds": time.monotonic() - first_s}}), flush=True)
"""
SENDER = """
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
block, left = b"x" * 65536, int(sys.argv[3])
while left > 0:
    conn.sendall(block[:left]); left -= len(block)
conn.shutdown(socket.SHUT_WR); conn.recv(1)
"""
PONG_SERVER = f"""
import socket
server = socket.create_server(("0.0.0.0", {PORT}))
print("ready", flush=True)
while True:
    conn, _ = server.accept(); conn.sendall(b"pong"); conn.close()
"""
PING_CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as conn:
        sys.exit(0 if conn.recv(4) == b"pong" else 1)
except OSError:
    sys.exit(1)
"""



@pytest.fixture
def testbed(netns_ok: None, request: pytest.FixtureRequest) -> Iterator[netns.Testbed]:
    prefix = f"t{os.getpid() % 100000}-{request.node.name[5:12].replace('_', '')}"
    bed = netns.Testbed(prefix, [HostSpec("shaped", SHAPED_MBIT), HostSpec("b"), HostSpec("c")])
    try:
        bed.create()
        yield bed
    finally:
        bed.teardown()


def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """One stdout line of ``proc`` or a test failure once ``timeout_s`` has passed."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        assert selector.select(timeout_s), f"no output from {proc.args!r} within {timeout_s} s"
    return proc.stdout.readline().strip()


def _goodput_mbit(bed: netns.Testbed, src: str, dst: str, n_bytes: int) -> float:
    """Send ``n_bytes`` over TCP from ``src`` to ``dst``; goodput as measured at the receiver."""
    receiver = bed.popen(dst, [sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    assert _read_line(receiver, timeout_s=10) == "ready"
    sender = bed.popen(src, [sys.executable, "-c", SENDER, bed.address(dst), str(PORT), str(n_bytes)])
    result = json.loads(_read_line(receiver, timeout_s=30))
    assert sender.wait(timeout=10) == 0 and receiver.wait(timeout=10) == 0
    assert result["bytes"] == n_bytes
    return float(result["bytes"] * 8 / result["seconds"] / 1e6)


def _can_reach(bed: netns.Testbed, src: str, dst: str, timeout_s: float = 1.0) -> bool:
    client = bed.popen(src, [sys.executable, "-c", PING_CLIENT, bed.address(dst), str(PORT), str(timeout_s)])
    return client.wait(timeout=timeout_s + 10) == 0


def _wait_until(condition: object, deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out after {deadline_s} s waiting for {what}"
        time.sleep(0.05)


def _process_gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"  # a zombie no longer runs nor holds a namespace


def _assert_within(measured_mbit: float, expected_mbit: float, what: str) -> None:
    error = abs(measured_mbit - expected_mbit) / expected_mbit
    assert error <= TOLERANCE, f"{what}: {measured_mbit:.1f} Mbit/s, expected {expected_mbit} ±{TOLERANCE:.0%}"


def test_tbf_args_burst_and_queue_by_rate() -> None:
    # 1 Mbit/s = 125000 B/s: rate/250 = 500 B < 16 KiB floor; queue 50 ms = 6250 B on top of the burst.
    assert tbf_args(1) == ["rate", "1000000bit", "burst", "16384", "limit", str(16384 + 6250)]
    # 1000 Mbit/s = 125e6 B/s: burst = 500000 B, queue 50 ms = 6.25e6 B.
    assert tbf_args(1000) == ["rate", "1000000000bit", "burst", "500000", "limit", str(500000 + 6250000)]


def test_bad_specs_and_missing_privileges_are_one_line_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="rate_mbit"):
        HostSpec("a", rate_mbit=0)
    with pytest.raises(ConfigError, match="unique"):
        netns.Testbed("x", [HostSpec("a"), HostSpec("a")])
    with pytest.raises(ConfigError, match="prefix"):
        netns.Testbed("Bad Prefix", [HostSpec("a")])
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match="need root") as info:
        netns.Testbed("x", [HostSpec("a")]).create()
    assert "\n" not in str(info.value)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(UserError, match="install iproute2"):
        netns.Testbed("x", [HostSpec("a")]).create()


def test_shaped_host_gets_its_rate_both_ways_and_unshaped_pair_is_much_faster(testbed: netns.Testbed) -> None:
    upload = _goodput_mbit(testbed, "shaped", "b", 5_000_000)
    download = _goodput_mbit(testbed, "c", "shaped", 5_000_000)
    unshaped = _goodput_mbit(testbed, "b", "c", 5_000_000)
    _assert_within(upload, SHAPED_MBIT, "upload from the shaped host")
    _assert_within(download, SHAPED_MBIT, "download to the shaped host")
    assert unshaped > 3 * SHAPED_MBIT, f"unshaped pair only reached {unshaped:.1f} Mbit/s"


def test_set_rate_changes_goodput_live(testbed: netns.Testbed) -> None:
    testbed.set_rate("shaped", 40)
    _assert_within(_goodput_mbit(testbed, "shaped", "b", 4_000_000), 40, "upload after set_rate(40)")
    testbed.set_rate("shaped", 8)
    _assert_within(_goodput_mbit(testbed, "b", "shaped", 2_000_000), 8, "download after set_rate(8)")
    testbed.set_rate("shaped", None)
    assert testbed.rate_mbit("shaped") is None
    assert _goodput_mbit(testbed, "shaped", "c", 4_000_000) > 3 * 40


def test_partition_blocks_between_groups_and_heal_restores(testbed: netns.Testbed) -> None:
    for host in ("b", "c"):
        server = testbed.popen(host, [sys.executable, "-c", PONG_SERVER], stdout=subprocess.PIPE, text=True)
        assert _read_line(server, timeout_s=10) == "ready"
    assert _can_reach(testbed, "shaped", "c") and _can_reach(testbed, "shaped", "b")

    testbed.cut_partition(["c"])
    started = time.monotonic()
    assert not _can_reach(testbed, "shaped", "c", timeout_s=1.0)
    assert not _can_reach(testbed, "b", "c", timeout_s=1.0)
    assert time.monotonic() - started < 6.0, "a blocked connect should fail within its 1 s timeout"
    assert _can_reach(testbed, "shaped", "b"), "hosts on the same side of the cut must still talk"

    testbed.heal_partition()
    _wait_until(lambda: _can_reach(testbed, "shaped", "c"), deadline_s=10, what="shaped -> c after heal")
    assert _can_reach(testbed, "b", "c")


def test_a_forked_process_runs_in_its_hosts_namespace_and_teardown_stops_it(testbed: netns.Testbed,
                                                                               tmp_path: Path) -> None:
    (tmp_path / "nsprobe.py").write_text(
        "import socket, sys, time\n"
        "with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as conn:\n"
        "    print(conn.recv(4).decode(), flush=True)\n"
        "time.sleep(120)\n")
    server = ForkServer(dict(os.environ, PYTHONPATH=str(tmp_path)), ("json",))
    try:
        pong = testbed.popen("c", [sys.executable, "-c", PONG_SERVER], stdout=subprocess.PIPE, text=True)
        assert _read_line(pong, timeout_s=10) == "ready"
        log = tmp_path / "probe.log"
        probe = testbed.fork("b", server, "nsprobe", [testbed.address("c"), str(PORT)], log)
        _wait_until(lambda: "pong" in log.read_text() or probe.poll() is not None, 30, "the probe's pong")
        assert log.read_text() == "pong\n" and probe.poll() is None
        in_namespace = os.stat(f"/proc/{probe.pid}/ns/net").st_ino
        assert in_namespace == os.stat(NETNS_RUN_DIR / testbed.namespace("b")).st_ino != os.stat(
            "/proc/self/ns/net").st_ino
        assert os.getpgid(probe.pid) == probe.pid  # a session of its own, which teardown signals whole
        testbed.teardown()
        assert probe.wait(timeout=30) == -signal.SIGTERM
    finally:
        testbed.teardown()  # stops the probe, so that the server can end
        server.close()


def _root_links_and_qdiscs() -> tuple[str, str]:
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, check=True).stdout
    names = sorted(line.split(":")[1].strip() for line in links.splitlines())
    handles = sorted(" ".join(line.split()[:5]) for line in qdiscs.splitlines())
    return "\n".join(names), "\n".join(handles)


def _our_namespaces(prefix: str) -> list[str]:
    return [ns for ns in list_namespaces() if ns.startswith(f"p2pt-{prefix}-")]


def test_teardown_leaves_no_namespace_link_qdisc_or_process(netns_ok: None) -> None:
    root_before = _root_links_and_qdiscs()
    prefix = f"td{os.getpid() % 100000}"
    bed = netns.Testbed(prefix, [HostSpec("a", 10), HostSpec("b")])
    try:
        bed.create()
        assert len(_our_namespaces(prefix)) == 3 and bed.state_path.exists()
        assert _root_links_and_qdiscs() == root_before, "the testbed must add nothing to the root namespace"
        worker = bed.popen("a", ["tail", "-f", "/dev/null"])
        guard_pid = json.loads(bed.state_path.read_text())["guard_pid"]
    finally:
        bed.teardown()
    assert _our_namespaces(prefix) == []
    assert not bed.state_path.exists()
    assert _process_gone(worker.pid) and _process_gone(guard_pid)
    assert _root_links_and_qdiscs() == root_before
    bed.teardown()  # idempotent


CRASHING_OWNER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from p2ptrain.testnet.netns import HostSpec, Testbed
bed = Testbed(sys.argv[2], [HostSpec("a", 10), HostSpec("b")])
bed.create()
worker = bed.popen("a", ["tail", "-f", "/dev/null"])
print(json.dumps({"state": str(bed.state_path), "worker": worker.pid}), flush=True)
sys.stdin.read()
"""


def test_guard_cleans_up_after_owner_is_sigkilled(netns_ok: None) -> None:
    prefix = f"tk{os.getpid() % 100000}"
    argv = [sys.executable, "-c", CRASHING_OWNER, str(REPO_ROOT), prefix]
    owner = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(_read_line(owner, timeout_s=20))
        guard_pid = json.loads(Path(info["state"]).read_text())["guard_pid"]
        assert len(_our_namespaces(prefix)) == 3 and not _process_gone(guard_pid)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        _wait_until(lambda: not _our_namespaces(prefix), deadline_s=15, what="the guard to delete the namespaces")
        _wait_until(lambda: not Path(info["state"]).exists(), deadline_s=5, what="the state file to go")
        _wait_until(lambda: _process_gone(info["worker"]), deadline_s=5, what="the worker to be killed")
        _wait_until(lambda: _process_gone(guard_pid), deadline_s=5, what="the guard to exit")
    finally:
        stop_and_clean_up(owner, prefix)
