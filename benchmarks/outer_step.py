"""The outer step at short inner phases: why γ 0.9 with η 0.7 spikes the loss, and which defaults to ship.

DiLoCo on the algorithm benchmark's workbench (benchmarks/sim: production's inner trainer, exact mean of Δ, the
production OuterOptimizer), at equal tokens (every peer runs T inner steps in T / H rounds) for several H and outer
recipes (γ, η). Per round it records the validation loss of the peers' common θ and two quantities that explain the
spikes:
  cos     cos(Δ̄_r, Δ̄_{r−1}) of consecutive mean outer gradients: near 1, momentum keeps adding the same direction
  gain    ‖θ_{r+1} − θ_r‖ / ‖Δ̄_r‖, how far the outer step moves against what the inner phases moved: Nesterov's
          steady state on aligned Δ is η(1 + γ/(1 − γ)) = η / (1 − γ), 7 for γ 0.9 and η 0.7
A spike is a round whose loss exceeds the lowest loss before it by more than SPIKE_RATIO. Rows with one peer are
a peer averaging alone (its mean is its own Δ, with none of the cancellation an average brings): in the swarm tests'
rounds a peer is alone or in a pair whenever the others miss its round.

    python benchmarks/outer_step.py                  # the full run (~40 min of CPU, two rows at a time)
    python benchmarks/outer_step.py --setting tests  # the swarm tests' inner phase, H = 5 (~6 min)
    python benchmarks/outer_step.py --setting modes  # GASLoC's and Factored's η, H = 20 (~10 min)
    python benchmarks/outer_step.py --quick          # CI size, seconds
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.sim.peers import (  # noqa: E402
    Bench,
    build_bench,
    inner_phase_,
    make_peers,
    outer_step_,
    validation_loss,
)
from benchmarks.sim.rows import Algorithm, Settings  # noqa: E402
from benchmarks.sim.simulation import train_row  # noqa: E402
from p2ptrain.maths.mixing import exact_average  # noqa: E402
from p2ptrain.tensor_layout import distance, norm  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results"
SPIKE_RATIO = 1.25
# (γ, η): DiLoCo's paper recipe (the shipped default before this study), plain averaging at η 1 and 0.7, the paper's
# γ with the steady-state gain of plain averaging (η / (1 − γ) = 1), and a middle γ
RECIPES = ((0.9, 0.7), (0.0, 1.0), (0.0, 0.7), (0.9, 0.1), (0.5, 0.5))
FULL = dict(total_steps=400, inner_steps=(5, 20, 50), peers=(4,), seeds=2, model="tiny", batch_size=8,
            seq_len=64, val_batches=16)
# the swarm tests' inner phase (tests/swarm_utils.py: lr 3e-3, warmup 2, batch 4, no decay in reach), where the
# spikes were seen, 60 rounds of H = 5
TESTS = dict(total_steps=300, inner_steps=(5,), peers=(4, 2, 1), seeds=2, model="tiny", batch_size=4, seq_len=64,
             val_batches=16, inner_lr=3e-3, warmup_steps=2, constant_lr=True)
QUICK = dict(total_steps=6, inner_steps=(2,), peers=(2,), seeds=1, model="tiny", batch_size=2, seq_len=16,
             val_batches=2)
SETTINGS = {"bench": FULL, "tests": TESTS, "modes": dict(FULL, inner_steps=(20,))}
MODE_ROWS = {"gasloc-1peer": Algorithm("gasloc-1peer", "gasloc", graph="matching", momentum=0.0),
             "factored-local": Algorithm("factored-local", "factored", mix2_overlap="local", momentum=0.0)}
MODE_LRS = (0.7, 1.0)


@dataclasses.dataclass(frozen=True)
class Run:
    total_steps: int
    inner_steps: tuple[int, ...]
    peers: tuple[int, ...]
    seeds: int
    model: str
    batch_size: int
    seq_len: int
    val_batches: int
    inner_lr: float = 0.0  # 0: the workbench's (inner.lr's default)
    warmup_steps: int = 0  # 0: the workbench's (20, or a tenth of the run)
    constant_lr: bool = False  # no cosine decay within the run (production's horizon is 20,000 steps)


def cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b, strict=True))
    scale = norm(a) * norm(b)
    return dot / scale if scale else math.nan


def run_bench(run: Run, peers: int, inner_steps: int, seed: int) -> Bench:
    """The workbench of one seed at `inner_steps` (R = total_steps / H rounds), with the run's inner phase; at least
    two peers' shards (the workbench's floor: a row of one uses the first)."""
    settings = Settings(peers=max(2, peers), rounds=run.total_steps // inner_steps, inner_steps=inner_steps,
                        model=run.model, seq_len=run.seq_len, batch_size=run.batch_size, seed=seed,
                        val_batches=run.val_batches, max_corpus_bytes=2_000_000)
    bench = build_bench(settings)
    inner = bench.config.inner
    inner = dataclasses.replace(inner, lr=run.inner_lr or inner.lr, warmup_steps=run.warmup_steps or inner.warmup_steps,
                                total_steps=100 * run.total_steps if run.constant_lr else inner.total_steps)
    return dataclasses.replace(bench, config=dataclasses.replace(bench.config, inner=inner))


def train(run: Run, peers: int, inner_steps: int, momentum: float, lr: float, seed: int) -> dict[str, Any]:
    """DiLoCo with exact averaging; per round: the loss after the outer step, cos and gain."""
    bench = run_bench(run, peers, inner_steps, seed)
    sim_peers = make_peers(Algorithm("diloco", "diloco", momentum=momentum, outer_lr=lr), bench)[:peers]
    losses, cosines, gains, previous = [validation_loss(bench, sim_peers[0].theta)], [], [], None
    for _ in range(bench.settings.rounds):
        mean = exact_average([inner_phase_(p, inner_steps) for p in sim_peers])
        before = [t.clone() for t in sim_peers[0].theta]
        for peer in sim_peers:
            outer_step_(peer, mean)
        gains.append(distance(sim_peers[0].theta, before) / max(norm(mean), 1e-30))
        if previous is not None:
            cosines.append(cosine(mean, previous))
        previous = mean
        losses.append(validation_loss(bench, sim_peers[0].theta))
    return {"losses": losses, "cos": cosines, "gain": gains}


def spikes(losses: Sequence[float]) -> tuple[int, float]:
    """Rounds whose loss exceeds the lowest before them by more than SPIKE_RATIO, and the worst such ratio."""
    count, worst = 0, 1.0
    for r in range(2, len(losses)):
        ratio = losses[r] / min(losses[:r])
        worst = max(worst, ratio)
        count += ratio > SPIKE_RATIO
    return count, worst


def summary(traces: list[dict[str, Any]]) -> dict[str, Any]:
    finals = [t["losses"][-1] for t in traces]
    counted = [spikes(t["losses"]) for t in traces]
    every = [c for t in traces for c in t["cos"]]
    return {"final": statistics.fmean(finals), "final_sd": statistics.pstdev(finals), "finals": finals,
            "spikes": sum(c for c, _ in counted), "worst_spike": max(w for _, w in counted),
            "cos": statistics.fmean(every) if every else math.nan,
            "gain": statistics.fmean(g for t in traces for g in t["gain"][len(t["gain"]) // 2:]),
            "traces": [t["losses"] for t in traces]}


def run_row(run: Run, peers: int, inner_steps: int, momentum: float, lr: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    started = time.process_time()
    traces = [train(run, peers, inner_steps, momentum, lr, seed) for seed in range(run.seeds)]
    row = {"peers": peers, "H": inner_steps, "momentum": momentum, "lr": lr, **summary(traces),
           "cpu_s": time.process_time() - started}
    print(f"peers {peers} H {inner_steps:3d} γ {momentum:.1f} η {lr:.1f}: final {row['final']:.3f} "
          f"± {row['final_sd']:.3f}, spikes {row['spikes']} (worst ×{row['worst_spike']:.2f}), cos "
          f"{row['cos']:.2f}, gain {row['gain']:.2f}", flush=True)
    return row


def run_mode_row(run: Run, mode: str, inner_steps: int, lr: float) -> dict[str, Any]:
    """GASLoC (1-peer matching) or Factored with local overlap, both γ 0, at outer lr `lr`: the final loss of the
    peers' average model over the seeds (η moves GASLoC's proposal θ − ηΔ and Factored's step as it does DiLoCo's)."""
    torch.set_num_threads(1)
    started, finals = time.process_time(), []
    for seed in range(run.seeds):
        bench = run_bench(run, run.peers[0], inner_steps, seed)
        outer = dataclasses.replace(bench.config.outer, lr=lr, momentum=0.0)  # GASLoC's proposal reads the config's η
        bench = dataclasses.replace(bench, config=dataclasses.replace(bench.config, outer=outer))
        peers, rounds = bench.settings.peers, bench.settings.rounds
        sim_peers = train_row(dataclasses.replace(MODE_ROWS[mode], outer_lr=lr), bench, [inner_steps] * peers,
                              [rounds] * peers)
        finals.append(validation_loss(bench, exact_average([p.theta for p in sim_peers])))
    print(f"{mode} H {inner_steps} η {lr}: {statistics.fmean(finals):.3f}", flush=True)
    return {"mode": mode, "H": inner_steps, "lr": lr, "final": statistics.fmean(finals), "finals": finals,
            "final_sd": statistics.pstdev(finals), "cpu_s": time.process_time() - started}


def run_all(run: Run, jobs: int, modes: bool) -> dict[str, Any]:
    """Every row, `jobs` at a time in worker processes (one torch thread each)."""
    if modes:
        grid: list[tuple[Any, ...]] = [(m, h, lr) for m in MODE_ROWS for h in run.inner_steps for lr in MODE_LRS]
        work: Any = run_mode_row
    else:
        grid = [(peers, h, momentum, lr) for peers in run.peers for h in run.inner_steps for momentum, lr in RECIPES]
        work = run_row
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = list(pool.map(work, *zip(*[(run, *cell) for cell in grid], strict=True)))
    return {"run": dataclasses.asdict(run), "recipes": RECIPES, "spike_ratio": SPIKE_RATIO, "rows": rows,
            "cpu_s": sum(r["cpu_s"] for r in rows), "torch": torch.__version__, "machine": platform.machine()}


def markdown(report: dict[str, Any]) -> str:
    run = report["run"]
    if "mode" in report["rows"][0]:
        lines = ["# Outer lr of the gossip modes (γ 0)\n", f"{run['peers'][0]} peers, {run['model']} model, "
                 f"{run['total_steps']} inner steps each, seeds 0..{run['seeds'] - 1}: the final loss of the peers' "
                 f"average model.\n", "| mode | H | η | final loss |", "|---|---|---|---|"]
        lines += [f"| {r['mode']} | {r['H']} | {r['lr']} | {r['final']:.3f} ± {r['final_sd']:.3f} |"
                  for r in report["rows"]]
        return "\n".join(lines + [f"\nCPU: {report['cpu_s']:.0f} s; torch {report['torch']}.\n"])
    lines = ["# Outer step at short inner phases\n",
             f"DiLoCo, exact mean, {run['model']} model, {run['total_steps']} inner steps per peer at every H, batch "
             f"{run['batch_size']} × {run['seq_len']}, seeds 0..{run['seeds'] - 1}; gap against γ 0.9 / η 0.7 of the "
             f"same peers and H, paired per seed. A spike: a round's loss above ×{report['spike_ratio']} the lowest "
             f"before it. cos: consecutive mean Δ; gain: ‖step‖ / ‖Δ̄‖ over the second half.\n",
             "| peers | H | γ | η | final loss | gap | spikes | worst | cos | gain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    reference = {(r["peers"], r["H"]): r for r in report["rows"] if (r["momentum"], r["lr"]) == (0.9, 0.7)}
    for r in report["rows"]:
        base = reference[(r["peers"], r["H"])]
        gaps = [a / b - 1 for a, b in zip(r["finals"], base["finals"], strict=True)]
        lines.append(f"| {r['peers']} | {r['H']} | {r['momentum']} | {r['lr']} | {r['final']:.3f} ± {r['final_sd']:.3f}"
                     f" | {100 * statistics.fmean(gaps):+.1f} % | {r['spikes']} | ×{r['worst_spike']:.2f} | "
                     f"{r['cos']:.2f} | {r['gain']:.2f} |")
    lines.append(f"\nCPU: {report['cpu_s']:.0f} s; torch {report['torch']}.\n")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="bench",
                        help="bench: the workbench's inner phase at H 5, 20, 50; tests: the swarm tests' at H 5; "
                             "modes: GASLoC and Factored-local at outer lr 0.7 and 1.0, H 20")
    parser.add_argument("--quick", action="store_true", help="CI size: seconds")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--jobs", type=int, default=2, help="rows trained at once, one process each")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    run = Run(**(QUICK if args.quick else SETTINGS[args.setting]))
    report = run_all(run, args.jobs, modes=args.setting == "modes")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    name = "outer_step" if args.quick or args.setting == "bench" else f"outer_step_{args.setting}"
    (args.output_dir / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.output_dir / f"{name}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
