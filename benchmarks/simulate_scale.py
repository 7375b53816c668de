"""Event-driven simulation of a volunteer swarm: compute utilisation of DiLoCo, gossip and Factored at scale.

No training and no sockets: each peer alternates inner phases (compute) with exchanges over its home link, and a
heap of timed events decides who waits for whom. Pure Python + numpy; 100-1,000 peers, 150M-70B parameters.
Outer gradients travel with fp16 or with the codec the algorithm benchmark delivered (its measured bytes at <= 1 %
loss, read from benchmarks/results/algorithms.json), parameters as fp16 differences from θ_0.
The code is in benchmarks/scale/: model.py (links, compute, the transfer model and its assumptions), sim.py (the
event loop and each algorithm's timing), grid.py (the grid and its tables), codecs.py (fp16 and the codec the
algorithm benchmark delivered), calibrate.py (the transfer model against a netns testnet run's own exchanges).
Outputs per (swarm, model, outer-gradient codec, algorithm): utilisation = compute time / wall time per peer
(median, 10th percentile), round time (median over peers of each peer's mean), rounds completed within the budget
(median, 10th percentile). A run goes on past the budget until every peer has min_rounds rounds, so that utilisation
and round time rest on several rounds even where few fit the budget.

calibrate (root): runs the netns testnet (sync: gasloc, tiny model, peers on links of different tbf rates),
predicts every push-pull exchange the peers logged with the simulation's transfer model, prints measured against
predicted per link pair before and after fitting the model's fixed per-exchange cost and link efficiency, and
writes benchmarks/results/simulate_scale_calibration.{md,json}. --from-run DIR reads a finished run instead.

    python benchmarks/simulate_scale.py                 # default grid -> benchmarks/results/simulate_scale.{md,json}
    python benchmarks/simulate_scale.py --peers 100 --params 7B --codecs fp16 --stragglers 5
    python benchmarks/simulate_scale.py --delivered-ratio 0.01   # a codec at 1/100 of fp32 bytes
    sudo python benchmarks/simulate_scale.py calibrate [--bandwidth 20mbit,20mbit,5mbit,2mbit] [--duration-s 60]
    python benchmarks/simulate_scale.py calibrate --from-run DIR    # re-read a run kept with --workdir DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.scale import calibrate, codecs, grid, model  # noqa: E402
from p2ptrain.errors import ConfigError, UserError, one_line  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="simulate", choices=("simulate", "calibrate"))
    add = parser.add_argument
    add("--peers", default="100,1000", help="comma-separated swarm sizes")
    add("--params", default="150M,1B,7B,70B", help="comma-separated model sizes (150M, 1B, 7e9)")
    add("--algorithms", default=grid.ALGORITHMS, help="comma-separated, of the default ones and gradgossip-2")
    add("--mix2-every", type=int, default=4, help="factored: Mix2 after every K-th inner phase")
    add("--budget-h", type=float, default=24.0, help="wall-clock budget in which rounds are counted, hours")
    add("--min-rounds", type=int, default=10, help="simulate at least this many rounds per peer")
    add("--gpu", default="rtx4090", choices=sorted(model.GPUS))
    add("--mfu", type=float, default=0.4)
    add("--tokens-per-step", type=int, default=131_072)
    add("--inner-steps", type=int, default=500, help="H, inner steps per round")
    add("--step-time-s", type=float, default=None, help="seconds per inner step; replaces the FLOP model")
    add("--compute-spread", type=float, default=0.0, help="σ of per-peer log-normal GPU throughput factors")
    add("--codecs", default="fp16,delivered", help="outer gradients' codecs: fp16, delivered (the algorithm "
        "benchmark's fewest bytes within 1 %% of fp32 DiLoCo)")
    add("--delivered-ratio", type=float, default=None, help="the delivered codec's payload ÷ fp32 bytes (default: "
        "read from --algorithm-results)")
    add("--algorithm-results", type=Path, default=RESULTS_DIR / "algorithms.json")
    add("--exchange-latency-s", type=float, default=model.EXCHANGE_FIXED_S, help="fixed cost of one exchange "
        "(default: fitted by calibrate)")
    add("--link-efficiency", type=float, default=model.LINK_EFFICIENCY, help="fraction of a link's goodput a "
        "transfer gets (default: fitted by calibrate)")
    add("--allreduce-latency-s", type=float, default=model.ALLREDUCE_LATENCY_S)
    add("--round-cost-s", type=float, default=model.ROUND_COST_S, help="a round's client work before its inner "
        "phase, no compute (default: fitted by benchmarks/swarm_scale.py)")
    add("--duplex", action="store_true", help="what-if: gossip exchanges stream both directions at once")
    add("--name", default="simulate_scale", help="results file names: NAME.md and NAME.json in --output-dir")
    add("--stragglers", type=int, default=0, help="peers whose links are slowed by --straggler-factor")
    add("--straggler-factor", type=float, default=0.1)
    add("--seed", type=int, default=0)
    add("--output-dir", type=Path, default=RESULTS_DIR)
    add("--bandwidth", default=calibrate.BANDWIDTH, help="calibrate: one tbf rate per testnet peer")
    add("--duration-s", type=float, default=calibrate.DURATION_S, help="calibrate: length of the testnet run")
    add("--name-prefix", default="cal", help="calibrate: the testnet's namespace prefix")
    add("--workdir", type=Path, default=None, help="calibrate: keep the testnet run here (default: a temp dir)")
    add("--from-run", type=Path, default=None, help="calibrate: read the run a --workdir kept instead of running")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(parse_args(argv), argv)
    except (UserError, OSError, json.JSONDecodeError) as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    command = ("python benchmarks/simulate_scale.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    if args.mode == "calibrate":
        return _calibrate(args, command)
    algorithms = grid.algorithms(args.algorithms, args.mix2_every)
    knobs = ("gpu", "mfu", "tokens_per_step", "inner_steps", "step_time_s", "compute_spread",
             "exchange_latency_s", "allreduce_latency_s", "link_efficiency", "round_cost_s", "duplex", "stragglers",
             "straggler_factor", "seed")
    settings: dict[str, Any] = {knob: getattr(args, knob) for knob in knobs}
    sizes = [grid.parse_params(m) for m in args.params.split(",")]
    points = codecs.codec_points(args.codecs, args.algorithm_results, args.delivered_ratio)
    try:
        scenarios = [model.Scenario(int(p), m, codec=c.name, delta_ratio=c.delta_ratio, sparse_deltas=c.sparse,
                                    **settings) for p, m, c in itertools.product(args.peers.split(","), sizes, points)]
    except ValueError as error:
        raise ConfigError(f"--peers takes comma-separated numbers: {error}") from None
    for point in points:
        print(f"codec {point.name}: Δ payload = 1/{1 / point.delta_ratio:.0f} of fp32 bytes ({point.source})")
    print(grid.describe_exchange_constants(settings))
    print(grid.HEADER + "\n" + grid.RULE)
    started = time.perf_counter()
    rows = grid.run_grid(scenarios, algorithms, args.budget_h * 3600, args.min_rounds)
    print(f"simulated {len(rows)} runs in {time.perf_counter() - started:.1f} s")
    settings.update(budget_h=args.budget_h, min_rounds=args.min_rounds, mix2_every=args.mix2_every)
    settings["codecs"] = [dataclasses.asdict(point) for point in points]
    grid.write_results(rows, settings, command, args.output_dir, args.name)
    return 0


def _calibrate(args: argparse.Namespace, command: str) -> int:
    before = calibrate.ExchangeConstants(args.exchange_latency_s, args.link_efficiency)
    defaults = (model.EXCHANGE_FIXED_S, model.LINK_EFFICIENCY)
    origin = (f"the simulation's constants, {model.FITTED_FROM}" if (before.fixed_s, before.efficiency) == defaults
              else "set on the command line")
    calibrate.calibrate(args.from_run, args.workdir, args.bandwidth, args.duration_s, args.name_prefix, before,
                        origin, command, args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
