"""Compute utilisation of DiLoCo, GASLoC and Factored on the netns testnet, side by side in one run (root only).

Every algorithm gets the same swarm (N peers on fast links, one straggler at 10 % of their rate, shaped both
ways with tc tbf), the same model, data and wall-clock budget. Per algorithm it prints: median compute
utilisation over peers (compute seconds / wall seconds of the peer's life), the straggler's utilisation, the
mean validation loss the peers reached by the budget, and bytes sent per peer. Writes Markdown and JSON to
benchmarks/results/. Targets we compare against: gossip >= 0.95 median utilisation and >= 1.5× DiLoCo's in the
same run; validation loss at equal wall clock <= DiLoCo's.

    sudo python benchmarks/testnet_utilization.py [--peers 6] [--budget-s 150] [--fast-mbit 20]

The 2 CPU cores of a CI machine carry all peers at once (one torch thread each), so compute time is shared
between peers: a step takes longer the more peers compute at once, and a row whose peers wait less reads a higher
utilisation partly because its steps stretch. Inner steps completed per peer in the budget is the steadier figure
of throughput; the table gives both, and each row's median inner phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_timing import step_seconds  # noqa: E402
from p2ptrain.testnet.netns_run import NetnsTestnetOptions, run_netns_testnet  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("diloco", "gasloc", "factored")
# rows beyond the three, by name: the sync section they run with
VARIANTS = {"gasloc-paced": {"mode": "gasloc", "adapt_inner_steps": True, "param_codec": "adaptive"},
            "factored-overlap": {"mode": "factored", "overlap": "delayed"},  # Mix2 during the next inner phase
            "factored-eager": {"mode": "factored", "overlap": "eager"},  # that, and its own Δ applied at once
            "factored-local": {"mode": "factored", "overlap": "local"},  # all its own Δ at once, the mean a round late
            "factored-local-gossip": {"mode": "factored", "overlap": "local", "mix2_transport": "gossip"},
            # compressed outer-gradient gossip overlapped with the next inner phase: partners of its round only, or of
            # rounds up to 2 away (sync.mix2_round_gap)
            "factored-gossip": {"mode": "factored", "overlap": "delayed", "mix2_transport": "gossip",
                                "grad_codec": "sparse"},
            "factored-gossip-gap2": {"mode": "factored", "overlap": "delayed", "mix2_transport": "gossip",
                                     "grad_codec": "sparse", "mix2_round_gap": 2},
            # the mission's shape: compressed outer-gradient gossip with partners up to 2 rounds away, overlapped
            # (local: its own s at once, the partners' pulls a round late), a parameter mix (Mix1) every 4 rounds;
            # -mix1: Mix1 every round
            "swarm": {"mode": "factored", "overlap": "local", "mix2_transport": "gossip", "grad_codec": "sparse",
                      "mix2_round_gap": 2, "mix1_every": 4},
            "swarm-mix1": {"mode": "factored", "overlap": "local", "mix2_transport": "gossip", "grad_codec": "sparse",
                           "mix2_round_gap": 2},
            "diloco-overlap": {"mode": "diloco", "overlap": "delayed"},
            "gasloc-overlap": {"mode": "gasloc", "overlap": "delayed"},  # its exchanges during the next inner phase
            # DiLoCo's paper recipe, the default until benchmarks/outer_step.py measured it (runs before: diloco-g0
            # was the default's γ 0 beside it)
            "diloco-g0.9": {"mode": "diloco", "outer": {"momentum": 0.9, "lr": 0.7}}}


MODEL = {"name": "tiny", "max_seq_len": 64}
DATA = {"seq_len": 64, "batch_size": 8, "max_corpus_bytes": 2_000_000, "num_shards": 8, "val_batches": 2}
H_RANGE = (10, 2000)  # the H that --phase-s may choose


def scenario(mode: str, peers: int, fast_mbit: float, budget_s: float, inner_steps: int) -> dict[str, Any]:
    variant = VARIANTS.get(mode, {"mode": mode})
    sync = {key: value for key, value in variant.items() if key != "outer"} | {"matchmaking_s": 2.0}
    rates = [f"{fast_mbit:g}mbit"] * (peers - 1) + [f"{fast_mbit / 10:g}mbit"]
    return {
        "description": f"utilisation benchmark: {mode}, one straggler at 10 %",
        "peers": peers,
        "bandwidth": rates,
        "duration_s": budget_s,
        "peer_config": {
            "model": MODEL,
            "data": DATA,
            "inner": {"steps": inner_steps, "min_steps": max(1, inner_steps // 20)},
            "sync": sync,
            "network": {"heartbeat_s": 0.5, "record_ttl_s": 5.0},
        } | ({"outer": variant["outer"]} if "outer" in variant else {}),
        "checks": {"loss_fell": True},
    }


def inner_steps_for(phase_s: float, step_s: float) -> int:
    """The H whose inner phase lasts about `phase_s` at `step_s` seconds a step, within H_RANGE."""
    return min(max(round(phase_s / step_s), H_RANGE[0]), H_RANGE[1])


def peer_figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Utilisation = compute seconds / wall seconds from the start of its first round to the end of its last."""
    wall_s = rows[-1]["time"] - (rows[0]["time"] - rows[0]["round_s"])
    return {"utilisation": sum(r["compute_s"] for r in rows) / max(wall_s, 1e-9),
            "val_loss": rows[-1]["val_loss"], "rounds": len(rows),
            "phase_s": sum(r["compute_s"] for r in rows) / len(rows),
            "inner_steps": sum(r["inner_steps"] for r in rows),
            "bytes_sent": float(sum(r["bytes_sent"] for r in rows)), "alone": alone_fraction(rows)}


def alone_fraction(rows: list[dict[str, Any]]) -> float:
    """The fraction of a peer's averaging rounds that averaged with nobody: Factored's Mix2 (rounds that applied
    one), the other modes' round average."""
    sizes = [r["mix2_averaged"] if r.get("sync") == "factored" else r["peers_averaged"] for r in rows]
    averaged = [size for size in sizes if size >= 1]
    return sum(size == 1 for size in averaged) / len(averaged) if averaged else float("nan")


def summarise(mode: str, report: dict[str, Any], straggler: str) -> dict[str, Any]:
    figures = {peer: peer_figures(info["rounds"]) for peer, info in report["peers"].items() if info["rounds"]}
    utilisation = [f["utilisation"] for f in figures.values()]
    return {
        "mode": mode,
        "passed_checks": report["passed"],
        "median_utilisation": statistics.median(utilisation),
        "straggler_utilisation": figures.get(straggler, {}).get("utilisation", float("nan")),
        "mean_val_loss": statistics.fmean(f["val_loss"] for f in figures.values()),
        "mean_rounds": statistics.fmean(f["rounds"] for f in figures.values()),
        "median_phase_s": statistics.median(f["phase_s"] for f in figures.values()),
        "mean_inner_steps": statistics.fmean(f["inner_steps"] for f in figures.values()),
        "bytes_sent_per_peer": statistics.fmean(f["bytes_sent"] for f in figures.values()),
        "alone": statistics.fmean(f["alone"] for f in figures.values()),
        "peers": figures,
    }


def run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    scenario_path = workdir / f"{mode}.yaml"
    scenario_path.write_text(yaml.safe_dump(scenario(mode, args.peers, args.fast_mbit, args.budget_s,
                                                     args.inner_steps)))
    report_dir = workdir / f"{mode}-report"
    run_netns_testnet(NetnsTestnetOptions(scenario_path=str(scenario_path), workdir=str(workdir / mode),
                                          report_dir=str(report_dir), timeout_s=args.budget_s * 3 + 120))
    report = json.loads((report_dir / "report.json").read_text())
    return summarise(mode, report, straggler=f"peer{args.peers - 1}")


def table(rows: list[dict[str, Any]]) -> str:
    diloco = next((r for r in rows if r["mode"] == "diloco"), None)
    lines = ["| algorithm | median utilisation | ÷ DiLoCo | straggler utilisation | mean val loss | rounds (mean) "
             "| inner steps ÷ DiLoCo | inner phase s (median) | MB sent per peer | averaged alone |", "|---" * 10 + "|"]
    for r in rows:
        ratio = r["median_utilisation"] / diloco["median_utilisation"] if diloco else float("nan")
        steps = r["mean_inner_steps"] / diloco["mean_inner_steps"] if diloco else float("nan")
        lines.append(f"| {r['mode']} | {r['median_utilisation']:.3f} | {ratio:.2f}× | "
                     f"{r['straggler_utilisation']:.3f} | {r['mean_val_loss']:.4f} | {r['mean_rounds']:.1f} | "
                     f"{steps:.2f}× | {r['median_phase_s']:.2f} | "
                     f"{r['bytes_sent_per_peer'] / 1e6:.2f} | {r['alone']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=150.0, help="wall-clock budget per algorithm")
    parser.add_argument("--fast-mbit", type=float, default=20.0, help="rate of the fast links (straggler: 10 %%)")
    parser.add_argument("--inner-steps", type=int, default=20, help="H of every peer (paced rows: at most H)")
    parser.add_argument("--phase-s", type=float, default=None,
                        help="instead of --inner-steps: the H whose inner phase lasts about this long on this machine, "
                             "timed first with as many trainer processes at once as there are peers")
    parser.add_argument("--keep", default=None, help="write the scenarios and reports here, and keep them")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES + tuple(VARIANTS))}")
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES) - set(VARIANTS)
    if unknown or args.inner_steps < 1 or (args.phase_s is not None and args.phase_s <= 0):
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}" if unknown
                     else "--inner-steps must be >= 1 and --phase-s > 0")
    started, step_s = time.time(), None
    if args.phase_s is not None:
        step_s = step_seconds({"model": MODEL, "data": DATA}, trainers=args.peers)
        args.inner_steps = inner_steps_for(args.phase_s, step_s)
        print(f"{args.peers} trainers at once: {step_s * 1e3:.1f} ms a step; H = {args.inner_steps} "
              f"for inner phases of about {args.phase_s:g} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="p2ptrain-util-") as tmp:
        workdir = Path(args.keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        rows = [run_mode(mode, args, workdir) for mode in args.modes.split(",")]
    text = table(rows)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    settings = {"command": " ".join(["python", *sys.argv]), "peers": args.peers, "budget_s": args.budget_s,
                "inner_steps": args.inner_steps,
                "phase_s": args.phase_s, "timed_step_s": step_s,
                "fast_mbit": args.fast_mbit, "straggler_mbit": args.fast_mbit / 10, "wall_s": time.time() - started}
    (RESULTS / "testnet_utilization.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    (RESULTS / "testnet_utilization.md").write_text(
        f"# Compute utilisation on the netns testnet\n\n`{settings['command']}`: {args.peers} peers, "
        f"{args.fast_mbit:g} Mbit/s links, one at {args.fast_mbit / 10:g}, {args.budget_s:g} s per algorithm, "
        f"H = {args.inner_steps}, tiny model, 1 torch thread per peer on 2 shared cores.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
