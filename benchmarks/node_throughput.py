"""Tokens per second of a 2-process node (`p2ptrain peer --workers 2`, DDP over gloo on CPU) against one process
on the same total batch, both real peers alone on loopback (the whole round loop: inner steps, the outer step,
the round's parameters handed to the other worker, evaluation).

A: one process, `data.batch_size` = 2 × B, `--torch-threads T`.
B: a node of 2 processes, each B samples a step and T / 2 threads (the same cores in all).

The two run interleaved (A B A B ...); each run's figure is the median tokens/s of its rounds after the first
(`tokens_per_s` in the metrics: the node counts both workers' samples). On a machine with 2 cores the node cannot
win: DDP's gradient all-reduce and the per-step agreement cost time that one process with 2 threads does not
spend; the point is the ratio, reported as measured. Prints a table, writes Markdown and JSON to
benchmarks/results/node_throughput.{md,json}.

    python benchmarks/node_throughput.py [--model small] [--batch 8] [--rounds 6] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
RUN_TIMEOUT_S = 900


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="model preset (tiny, small, base)")
    parser.add_argument("--batch", type=int, default=8, help="B: samples per worker and step (one process: 2 B)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample")
    parser.add_argument("--steps", type=int, default=10, help="inner steps per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per run (the first is not counted)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the one process (node: half each)")
    parser.add_argument("--output", type=Path, default=RESULTS / "node_throughput.json")
    args = parser.parse_args()
    if min(args.batch, args.seq_len, args.steps, args.repeats, args.threads) < 1 or args.rounds < 2:
        parser.error("--batch, --seq-len, --steps, --repeats and --threads must be >= 1, --rounds >= 2")
    return args


def peer_config(args: argparse.Namespace, batch: int, threads: int, run_id: str) -> dict[str, Any]:
    return {"model": {"name": args.model},
            "data": {"batch_size": batch, "seq_len": args.seq_len, "val_batches": 1, "num_shards": 4},
            "inner": {"steps": args.steps, "warmup_steps": 1},
            "run": {"run_id": run_id, "torch_threads": threads, "shard_index": 0, "device": "cpu"}}


def run_variant(args: argparse.Namespace, workers: int, workdir: Path, index: int) -> float:
    """One run alone on loopback; the median tokens/s of its rounds after the first."""
    batch = args.batch * (2 // workers)
    threads = max(1, args.threads // workers)
    config = workdir / f"w{workers}-{index}.yaml"
    config.write_text(yaml.safe_dump(peer_config(args, batch, threads, f"bench-node-{workers}-{index}")))
    metrics = workdir / f"w{workers}-{index}.jsonl"
    command = [sys.executable, "-m", "p2ptrain.cli", "peer", "--loopback", "--no-progress", "--config", str(config),
               "--rounds", str(args.rounds), "--metrics", str(metrics)] + (["--workers", "2"] if workers > 1 else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if done.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
    rates = [json.loads(line)["tokens_per_s"] for line in metrics.read_text().splitlines()][1:]
    return statistics.median(rates)


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    one, node = [], []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            one.append(run_variant(args, 1, Path(tmp), i))
            node.append(run_variant(args, 2, Path(tmp), i))
    ratios = [b / a for a, b in zip(one, node, strict=True)]
    return {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "one_process_tokens_per_s": one, "node_tokens_per_s": node, "pair_ratios": ratios,
            "ratio_of_medians": statistics.median(node) / statistics.median(one),
            "wall_s": time.monotonic() - started, "cpus": os.cpu_count(), "python": platform.python_version()}


def table(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [f"model {s['model']}, {2 * s['batch']} samples × {s['seq_len']} tokens per step in all, H = {s['steps']}, "
             f"{s['rounds']} rounds (first not counted), {s['repeats']} interleaved repeats, {result['cpus']} CPUs",
             "", "| variant | threads | median tokens/s | runs |", "|---|---|---|---|"]
    for name, key, threads in (("one process, batch 2B", "one_process_tokens_per_s", s["threads"]),
                               ("2-process node (gloo), B each", "node_tokens_per_s",
                                f"{max(1, s['threads'] // 2)} × 2")):
        runs = ", ".join(f"{x:.0f}" for x in result[key])
        lines.append(f"| {name} | {threads} | {statistics.median(result[key]):.0f} | {runs} |")
    pairs = ", ".join(f"{r:.3f}" for r in result["pair_ratios"])
    lines += ["", f"node ÷ one process: {result['ratio_of_medians']:.3f} (medians; per pair {pairs})"]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    result = benchmark(args)
    text = table(result)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    args.output.with_suffix(".md").write_text(f"# Node throughput (issue 13)\n\n`python benchmarks/node_throughput.py`"
                                              f"\n\n{text}\n")
    print(f"written to {args.output} and {args.output.with_suffix('.md')}")


if __name__ == "__main__":
    main()
