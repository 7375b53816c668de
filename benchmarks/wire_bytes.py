"""Bytes on the wire, from the kernel's own TCP counters: what a swarm's P2P daemons sent and received over TCP.

The peers' figures count the tensor payloads they put on their streams; this counts everything a daemon's
connections carried: payloads, protobuf and yamux framing, encryption, DHT traffic, handshakes and matchmaking.
`ss -tinpO` reads tcp_info per socket (bytes_acked, bytes_received) with the process that owns it. Connections
that close before the second reading are not counted: libp2p keeps one connection per pair of peers open, so the
counters of a swarm that trains between two readings hold what it sent.

Alone, it prints what every P2P daemon on this machine has carried so far (a local testnet's, say):

    python benchmarks/wire_bytes.py [--pids 1234,5678]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
import sys

import psutil

DAEMON_NAME = "p2pd"
_OWNER = re.compile(r"pid=(\d+)")
_ACKED = re.compile(r"\bbytes_acked:(\d+)")
_RECEIVED = re.compile(r"\bbytes_received:(\d+)")


@dataclasses.dataclass(frozen=True)
class WireBytes:
    sent: int
    received: int

    def __sub__(self, earlier: WireBytes) -> WireBytes:
        return WireBytes(self.sent - earlier.sent, self.received - earlier.received)


def daemon_pids() -> set[int]:
    """The P2P daemons among this process's descendants (every peer it runs has one)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name() == DAEMON_NAME:
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def parse_ss(output: str, pids: set[int]) -> WireBytes:
    """Sum the counters of the sockets (one per line: `ss -O`) that one of `pids` owns."""
    sent = received = 0
    for line in output.splitlines():
        owners = {int(pid) for pid in _OWNER.findall(line)}
        if not owners & pids:
            continue
        acked, got = _ACKED.search(line), _RECEIVED.search(line)
        sent += int(acked.group(1)) if acked else 0
        received += int(got.group(1)) if got else 0
    return WireBytes(sent, received)


def tcp_bytes(pids: set[int]) -> WireBytes | None:
    """What the established TCP sockets of `pids` have carried so far; None when `ss` cannot tell (not installed,
    or no daemon to read)."""
    if not pids or shutil.which("ss") is None:
        return None
    try:
        output = subprocess.run(["ss", "-tinpHO", "state", "established"], capture_output=True, text=True,
                                timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_ss(output, pids)


def all_daemon_pids() -> set[int]:
    """Every P2P daemon on this machine."""
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == DAEMON_NAME}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TCP bytes the P2P daemons on this machine have sent and received "
                                                 "over their established connections (kernel counters, via ss)")
    parser.add_argument("--pids", default="", help="comma-separated daemon pids (default: every p2pd)")
    args = parser.parse_args(argv)
    try:
        pids = {int(p) for p in args.pids.split(",") if p} or all_daemon_pids()
    except ValueError:
        parser.error(f"--pids must be comma-separated numbers, got {args.pids!r}")
    if not pids:
        print("no P2P daemon (p2pd) is running on this machine")
        return 0
    print(f"{'pid':>8} {'sent MB':>10} {'received MB':>12}")
    for pid in sorted(pids):
        counted = tcp_bytes({pid})
        print(f"{pid:>8} " + (f"{counted.sent / 1e6:>10.3f} {counted.received / 1e6:>12.3f}" if counted else
                              f"{'–':>10} {'–':>12}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
