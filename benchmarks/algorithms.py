"""Algorithm benchmark: DiLoCo, GASLoC, Factored Gossip DiLoCo, DiLoCoX overlap and codecs, in one process.

N simulated peers, each with its own model replica, training shard and inner trainer, run R rounds of H inner
AdamW steps; rows differ only in what is exchanged between inner phases. No network: exchanges go through the
production codecs, mixing helpers and outer optimizer on local copies, and bytes are counted from the real payloads.

Table 1, equal tokens: every peer runs R·H steps; validation loss of the peers' average model.
Table 2, equal simulated wall clock: inner steps take the measured mean step time; fast peers have bandwidth B,
the last peer B·straggler_fraction; the budget is DiLoCo's time for ``budget_rounds`` rounds.

The code is in benchmarks/sim/: rows.py (settings and the rows), simulation.py (simulated peers, exchanges,
training a row), clock.py (the wall-clock model), report.py (summaries, targets, Markdown and JSON), tables.py
(both tables and the report, end to end).

    python benchmarks/algorithms.py            # default run (tiny model, 4 peers, 16 rounds x 20 steps)
    python benchmarks/algorithms.py --quick    # CI size, under a minute
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.sim.report import markdown  # noqa: E402
from benchmarks.sim.rows import QUICK, Settings  # noqa: E402
from benchmarks.sim.tables import run  # noqa: E402
from p2ptrain.errors import ConfigError  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results"
FLAGS = {"peers": int, "rounds": int, "inner_steps": int, "model": str, "seq_len": int, "batch_size": int,
         "seed": int, "threads": int, "val_batches": int, "bandwidth": float, "straggler_fraction": float,
         "budget_rounds": int, "max_rounds_factor": float}  # --bandwidth sets Settings.bandwidth_bytes_per_s


def _field(flag: str) -> str:
    return "bandwidth_bytes_per_s" if flag == "bandwidth" else flag


def parse_args(argv: Sequence[str] | None = None) -> tuple[Settings, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, kind in FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                            help=f"default {getattr(Settings, _field(name))}")
    parser.add_argument("--quick", action="store_true", help=f"CI size: {QUICK}")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    for name in FLAGS:
        if getattr(args, name) is not None:
            values[_field(name)] = getattr(args, name)
    try:
        return Settings(**values), args.output_dir
    except ConfigError as error:
        parser.error(str(error))
        raise


def main() -> None:
    settings, output_dir = parse_args()
    report = run(settings, output_dir, "python " + " ".join(sys.argv))
    print(markdown(report))
    print(f"wall time {report['wall_s']:.0f} s; written to {output_dir}/algorithms.md and algorithms.json")


if __name__ == "__main__":
    main()
