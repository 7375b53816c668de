"""How long `p2ptrain status --json` takes to answer while a netns testnet trains (root only), by both paths side by
side: a DHT client of its own (`--initial-peers`), and a status page's JSON (`--page`, no DHT node).

A netns testnet of N peers trains on the machine's cores; its bootstrap serves the run's status page (which reads
the run every 5 s), and the testnet prints the command that reads it. In the bootstrap's namespace, that command and
a DHT client's run alternately, each a fresh process as a user would type it. Per path: the median and the slowest
wall time, and how many answers listed every peer. Writes Markdown and JSON to benchmarks/results/. The target
(issue 32): an answer within 3 s at any load the testnet makes.

    sudo python benchmarks/status_latency.py [--peers 4] [--tries 5] [--duration-s 150]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
TARGET_S = 3.0


def watch_command(printed: Path, timeout_s: float) -> tuple[str, str]:
    """The namespace and the page address in the testnet's `testnet: watch the run with `...`` line, once printed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"watch the run with `ip netns exec (\S+) p2ptrain status --page (\S+) ", printed.read_text())
        if found:
            return found.group(1), found.group(2)
        time.sleep(0.5)
    raise SystemExit(f"the testnet printed no watch command within {timeout_s:.0f} s (see {printed})")


def bootstrap_of(workdir: Path) -> tuple[str, str]:
    """The testnet bootstrap's address on its host's link (not loopback) and the run id it serves."""
    address_file, log = workdir / "bootstrap.addr", workdir / "bootstrap.log"
    address = next(m for m in address_file.read_text().split() if "/127.0.0.1/" not in m)
    return address, re.search(r"--run-id (\S+)", log.read_text()).group(1)  # type: ignore[union-attr]


def timed(namespace: str, args: list[str], peers: int) -> dict[str, Any]:
    """One `p2ptrain status` in the namespace: its wall time, exit code and whether it listed every peer."""
    started = time.monotonic()
    done = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-m", "p2ptrain", "status", *args,
                           "--json"], capture_output=True, text=True, timeout=300)
    wall_s = time.monotonic() - started
    try:
        listed = json.loads(done.stdout.splitlines()[-1])["live_peers"]
    except (IndexError, ValueError, KeyError):
        listed = None
    return {"wall_s": round(wall_s, 3), "returncode": done.returncode, "listed": listed,
            "all_listed": listed == peers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--tries", type=int, default=5, help="answers per path")
    parser.add_argument("--duration-s", type=float, default=150.0, help="the testnet's run (it must outlast the tries)")
    parser.add_argument("--output", type=Path, default=RESULTS / "status_latency.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the netns testnet needs root")
    workdir = Path(tempfile.mkdtemp(prefix="status-latency-"))
    printed = workdir.parent / f"{workdir.name}.out"
    with open(printed, "wb") as out:  # the testnet serves its page and prints the command that reads it
        testnet = subprocess.Popen([sys.executable, "-m", "p2ptrain", "testnet", "--backend", "netns", "--peers",
                                    str(args.peers), "--duration", str(args.duration_s), "--workdir", str(workdir)],
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        namespace, page_url = watch_command(printed, 120)
        address, run_id = bootstrap_of(workdir)
        dht = ["--initial-peers", address, "--run-id", run_id, "--no-nat-port-map", "--no-auto-nat", "--no-relay"]
        paths = {"dht": dht, "page": ["--page", page_url]}
        deadline = time.monotonic() + 120  # the peers start and the page makes its first read
        while timed(namespace, paths["page"], args.peers)["listed"] != args.peers:
            if time.monotonic() > deadline:
                raise SystemExit("the page never listed every peer")
            time.sleep(2)
        answers: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
        for _ in range(args.tries):  # alternately: both paths see the same moments of the run
            for name, path_args in paths.items():
                answers[name].append(timed(namespace, path_args, args.peers))
        assert testnet.poll() is None, "the testnet ended before the last answer: raise --duration-s"
    finally:
        testnet.terminate()
        testnet.wait(timeout=120)
    rows = []
    for name, runs in answers.items():
        walls = [r["wall_s"] for r in runs]
        rows.append({"path": name, "median_s": round(statistics.median(walls), 2), "max_s": round(max(walls), 2),
                     "all_listed": sum(r["all_listed"] for r in runs), "tries": len(runs),
                     "met": "yes" if max(walls) <= TARGET_S and all(r["returncode"] == 0 for r in runs) else "no"})
    table = ["| path | median s | slowest s | answers listing every peer | within 3 s |", "|---|---|---|---|---|"]
    table += [f"| {r['path']} | {r['median_s']} | {r['max_s']} | {r['all_listed']}/{r['tries']} | {r['met']} |"
              for r in rows]
    print("\n".join(table))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"peers": args.peers, "rows": rows, "answers": answers,
                                       "command": " ".join(sys.argv)}, indent=1))
    args.output.with_suffix(".md").write_text(f"`{' '.join(sys.argv)}`, {args.peers} peers of the netns "
                                              f"testnet training meanwhile\n\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
