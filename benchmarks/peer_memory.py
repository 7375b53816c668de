"""Memory of a training peer beyond its model, on the loopback testnet: each peer's process, its DHT process, its
p2pd daemon (and any other process it started), with every peer forked from the testnet's fork server, as
`p2ptrain testnet` starts them, and side by side started as fresh interpreters, as a volunteer's shell does.

A peer's memory is the PSS (proportional set size) of its processes: a page shared by k processes counts 1/k to
each, so the peers' sum is what they take from the machine, where RSS would count a shared page once per process.
Forked peers share the pages of torch, transformers and hivemind that the server imported and nobody wrote since.
Each swarm size starts a bootstrap and N peers of the `tiny` model (117k parameters: the model is a rounding
error), waits until every peer has logged a few rounds, samples every peer's processes three times a few seconds
apart, and keeps each peer's largest sum. Prints a table and writes JSON to benchmarks/results/peer_memory.json;
the 32-peer line is the measured per-peer figure at the largest N times 32, plus the bootstrap and the server.

    python benchmarks/peer_memory.py --peers 4 8
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from p2ptrain.metrics import read_metrics  # noqa: E402
from p2ptrain.testnet.loopback import (  # noqa: E402
    ProcessGroup,
    TestnetOptions,
    TestnetProcess,
    start_swarm,
)

RESULTS_PATH = REPO / "benchmarks" / "results" / "peer_memory.json"
MODES = ("forked", "fresh")
PROJECTED_PEERS = 32
SAMPLES = 3
SAMPLE_GAP_S = 3.0
MIB = 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8], help="swarm sizes to measure")
    parser.add_argument("--rounds-before", type=int, default=3, help="rounds every peer logs before sampling")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="how peers are started")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the rounds, per swarm")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH, help="where to write the JSON results")
    args = parser.parse_args()
    if min(args.peers) < 2 or args.rounds_before < 1 or args.timeout <= 0:
        parser.error("--peers must be >= 2, --rounds-before >= 1, --timeout > 0")
    return args


def smaps_rollup(pid: int) -> dict[str, int]:
    """The process's memory totals in bytes (Rss, Pss, Private_Clean, ...); empty once it has exited."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            lines = rollup.read().splitlines()[1:]
    except OSError:
        return {}
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines if line.endswith("kB")}


def kind_of(process: psutil.Process, peer_pid: int) -> str:
    if process.pid == peer_pid:
        return "peer"
    name = process.name()
    return name if name in ("p2pd", "torch_shm_manager") else "other"


def peer_memory(peer_pid: int) -> dict[str, dict[str, int]]:
    """PSS and private bytes of the peer's processes, by kind: its own, p2pd, its other processes (DHT,
    averager), torch's shared-memory manager."""
    try:
        root = psutil.Process(peer_pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    by_kind: dict[str, dict[str, int]] = {}
    for process in tree:
        try:
            kind = kind_of(process, peer_pid)
        except psutil.Error:
            continue
        rollup = smaps_rollup(process.pid)
        entry = by_kind.setdefault(kind, {"processes": 0, "pss": 0, "private": 0, "rss": 0})
        entry["processes"] += 1
        entry["pss"] += rollup.get("Pss", 0)
        entry["private"] += rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0)
        entry["rss"] += rollup.get("Rss", 0)
    return by_kind


def total(by_kind: dict[str, dict[str, int]], key: str) -> int:
    return sum(entry[key] for entry in by_kind.values())


@contextmanager
def swarm(mode: str, peers: int, workdir: Path) -> Iterator[tuple[ProcessGroup, TestnetProcess, list[TestnetProcess]]]:
    group = ProcessGroup(fresh=mode == "fresh")
    try:
        options = TestnetOptions(num_peers=peers, rounds=100_000, model="tiny")
        bootstrap, started = start_swarm(group, options, f"mem-{uuid.uuid4().hex[:8]}", workdir)
        yield group, bootstrap, list(started.values())
    finally:
        group.stop_all()


def measure(mode: str, peers: int, rounds_before: int, timeout_s: float) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-mem-"))  # kept when the swarm fails: its logs say why
    began = time.monotonic()
    with swarm(mode, peers, workdir) as (group, bootstrap, started):
        while True:
            logged = [len(read_metrics(path)) if (path := workdir / f"peer{i}.jsonl").exists() else 0
                      for i in range(peers)]
            if min(logged) >= rounds_before:
                break
            exited = [i for i, process in enumerate(started) if process.poll() is not None]
            if exited or time.monotonic() - began > timeout_s:
                raise SystemExit(f"{mode} {peers}: peers {exited} exited or no {rounds_before} rounds within "
                                 f"{timeout_s:.0f} s (logged {logged}); see the logs in {workdir}")
            time.sleep(1.0)
        ready_s = time.monotonic() - began
        best: list[dict[str, dict[str, int]]] = [{} for _ in started]
        for sample in range(SAMPLES):
            if sample:
                time.sleep(SAMPLE_GAP_S)
            for i, process in enumerate(started):
                now = peer_memory(process.pid)
                if total(now, "pss") > total(best[i], "pss"):
                    best[i] = now
        server_pss = smaps_rollup(group.server.process.pid).get("Pss", 0) if group.server else 0
        bootstrap_pss = total(peer_memory(bootstrap.pid), "pss")
    shutil.rmtree(workdir, ignore_errors=True)
    per_peer_pss = [total(b, "pss") for b in best]
    kinds = sorted({kind for b in best for kind in b})
    return {
        "mode": mode, "peers": peers, "seconds_to_rounds": round(ready_s, 1),
        "per_peer_pss_mib": {"mean": sum(per_peer_pss) / peers / MIB, "max": max(per_peer_pss) / MIB},
        "per_peer_private_mib": sum(total(b, "private") for b in best) / peers / MIB,
        "per_peer_rss_mib": sum(total(b, "rss") for b in best) / peers / MIB,
        "by_kind_pss_mib": {kind: sum(b.get(kind, {}).get("pss", 0) for b in best) / peers / MIB for kind in kinds},
        "processes_per_peer": sum(total(b, "processes") for b in best) / peers,
        "bootstrap_pss_mib": bootstrap_pss / MIB, "server_pss_mib": server_pss / MIB,
    }


def projected_mib(row: dict[str, Any], peers: int = PROJECTED_PEERS) -> float:
    return peers * row["per_peer_pss_mib"]["mean"] + row["bootstrap_pss_mib"] + row["server_pss_mib"]


def format_table(rows: list[dict[str, Any]]) -> str:
    kinds = sorted({kind for row in rows for kind in row["by_kind_pss_mib"]})
    header = (f"{'start':<7} {'peers':>5} {'PSS/peer':>9} {'max':>6} {'private':>8} {'RSS':>6} "
              + " ".join(f"{kind:>12}" for kind in kinds) + f" {'procs':>5} {f'{PROJECTED_PEERS} peers':>9}")
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(f"{row['mode']:<7} {row['peers']:>5} {row['per_peer_pss_mib']['mean']:>9.0f} "
                     f"{row['per_peer_pss_mib']['max']:>6.0f} {row['per_peer_private_mib']:>8.0f} "
                     f"{row['per_peer_rss_mib']:>6.0f} "
                     + " ".join(f"{row['by_kind_pss_mib'].get(kind, 0.0):>12.0f}" for kind in kinds)
                     + f" {row['processes_per_peer']:>5.1f} {projected_mib(row) / 1024:>7.1f} G")
    lines.append(f"(MiB per peer; '{PROJECTED_PEERS} peers': that many peers at the row's PSS per peer, plus the "
                 "bootstrap and the fork server, in GiB)")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    rows = []
    for peers in args.peers:
        for mode in args.modes:  # side by side at each size: the machine's state is as alike as it gets
            rows.append(measure(mode, peers, args.rounds_before, args.timeout))
            print(f"measured {mode} x{peers}: {rows[-1]['per_peer_pss_mib']['mean']:.0f} MiB PSS per peer",
                  flush=True)
    print(format_table(rows))
    memory_gib = psutil.virtual_memory().total / 2**30
    largest = max(args.peers)
    verdicts = {row["mode"]: projected_mib(row) / 1024 for row in rows if row["peers"] == largest}
    for mode, gib in verdicts.items():
        print(f"{PROJECTED_PEERS} {mode} peers of the tiny model: {gib:.1f} GiB of this machine's {memory_gib:.1f} GiB")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpus": psutil.cpu_count(), "memory_gib": memory_gib},
        "rounds_before": args.rounds_before, "rows": rows,
        "projected": {mode: {"peers": PROJECTED_PEERS, "gib": gib} for mode, gib in verdicts.items()},
    }, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
