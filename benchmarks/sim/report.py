"""The algorithm benchmark's results: a summary per row and seed, the sanity check, the aggregate over seeds (mean ±
sd, gaps paired per seed), the team's targets, and the JSON document (benchmarks/sim/markdown.py renders it)."""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.sim.clock import WallClock, exchange_units
from benchmarks.sim.markdown import markdown
from benchmarks.sim.peers import Bench, SimPeer, Tensors, validation_loss
from benchmarks.sim.rows import REFERENCES, ROWS, SANITY_ROW, Algorithm, Settings
from benchmarks.sim.simulation import train_row
from p2ptrain.maths.mixing import consensus_distance, exact_average

CODEC_TARGET_RATIO, CODEC_TARGET_GAP = 1 / 100, 1.0  # issue 12: <= 1/100 of fp32 bytes at <= 1 % loss (mean)


@dataclasses.dataclass
class RowResult:
    name: str
    section: str
    seed: int
    val_loss: float  # of the peers' average model
    mean_peer_val_loss: float
    max_consensus_distance: float  # max over peers of ‖θ_i − θ̄‖ / ‖θ̄‖
    bytes_per_round_vs_model: float  # bytes sent per peer per completed round / fp32 model bytes
    payload_vs_fp32: float  # one message of the row (Δ; GASLoC's y; Mix1's θ) / fp32 model bytes
    rounds: list[int]  # completed rounds per peer
    inner_steps: list[int]  # inner steps per round per peer
    wall_s: float
    utilisation: float | None = None  # the clock model's compute utilisation (equal tokens, or table 2's budget)
    capped: bool = False  # table 2: the row hit max_rounds before the budget ran out
    reused_from_table1: bool = False
    average: Tensors = dataclasses.field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields.pop("average")
        return fields


def summarize(row: Algorithm, bench: Bench, peers: list[SimPeer], rounds: list[int], steps: list[int],
              wall_s: float) -> RowResult:
    thetas = [p.theta for p in peers]
    average = exact_average(thetas)
    units = exchange_units(row, bench)
    message = units.param_bytes if row.kind in ("gasloc", "factored") else units.delta_bytes
    return RowResult(
        name=row.name, section=row.section, seed=bench.settings.seed,
        val_loss=validation_loss(bench, average),
        mean_peer_val_loss=sum(validation_loss(bench, t) for t in thetas) / len(thetas),
        max_consensus_distance=max(consensus_distance(average, t) for t in thetas),
        bytes_per_round_vs_model=sum(p.bytes_sent for p in peers) / max(1, sum(rounds)) / bench.model_bytes,
        payload_vs_fp32=message / bench.model_bytes, rounds=list(rounds), inner_steps=list(steps), wall_s=wall_s,
        average=average)


def sanity_check(bench: Bench) -> dict[str, Any]:
    """GASLoC on the complete graph with exact averaging must reproduce DiLoCo (docs/algorithms.md §2): parameters after
    one round, then loss and parameters after a few (float rounding, ~1e-7 a round, grows through the AdamW steps)."""
    s, rounds = bench.settings, min(3, bench.settings.rounds)
    after = {n: [exact_average([p.theta for p in train_row(row, bench, [s.inner_steps] * s.peers, [n] * s.peers)])
                 for row in (ROWS[0], SANITY_ROW)] for n in (1, rounds)}
    losses = [validation_loss(bench, theta) for theta in after[rounds]]
    loss_rel = abs(losses[1] - losses[0]) / losses[0]
    first_rel = consensus_distance(*after[1])
    return {"check": "gasloc-complete == diloco", "rounds": rounds, "loss_relative_difference": loss_rel,
            "parameter_relative_distance_after_1_round": first_rel,
            "parameter_relative_distance_final": consensus_distance(*after[rounds]),
            "tolerance": 1e-4, "verdict": "PASS" if max(loss_rel, first_rel) <= 1e-4 else "FAIL"}


def gap_percent(loss: float, reference: float) -> float:
    return 100.0 * (loss - reference) / reference


def _mean_sd(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0}


def aggregate(per_seed: list[list[RowResult]]) -> list[dict[str, Any]]:
    """Per row, over seeds: mean ± sd of loss, of the gap to the same seed's DiLoCo (paired) and to the same seed's
    best fp32 DiLoCo (the lower loss of REFERENCES), bytes, utilisation, consensus distance."""
    rows = []
    best = [min(r.val_loss for r in seed_rows if r.name in REFERENCES) for seed_rows in per_seed]
    for position, first in enumerate(per_seed[0]):
        runs = [seed_rows[position] for seed_rows in per_seed]
        gaps = [gap_percent(r.val_loss, seed_rows[0].val_loss) for r, seed_rows in zip(runs, per_seed, strict=True)]
        gaps_best = [gap_percent(r.val_loss, reference) for r, reference in zip(runs, best, strict=True)]
        rows.append({"name": first.name, "section": first.section, "seeds": [r.seed for r in runs],
                     "val_loss": _mean_sd([r.val_loss for r in runs]), "gap_percent": _mean_sd(gaps),
                     "gaps_percent": gaps, "gap_best_percent": _mean_sd(gaps_best), "gaps_best_percent": gaps_best,
                     "payload_vs_fp32": first.payload_vs_fp32,
                     "bytes_per_round_vs_model": statistics.fmean(r.bytes_per_round_vs_model for r in runs),
                     "utilisation": statistics.fmean(r.utilisation or 0.0 for r in runs),
                     "max_consensus_distance": statistics.fmean(r.max_consensus_distance for r in runs)})
    return rows


def _target(what: str, row: str, figure: str, passed: bool) -> dict[str, Any]:
    return {"target": what, "row": row, "figure": figure, "verdict": "PASS" if passed else "MISS"}


def evaluate_targets(rows: list[dict[str, Any]], table2: list[RowResult]) -> list[dict[str, Any]]:
    """The team's targets, each on the mean over seeds; a codec's against the better fp32 DiLoCo of each seed (a codec
    row's outer recipe differs from DiLoCo's: its gain from γ 0 alone is not the codec's)."""
    targets = []
    for row in rows:
        gap = row["gap_percent"]["mean"]
        for prefix, limit in (("gasloc-1peer", 2.0), ("gasloc-2peer", 1.0)):
            if row["name"] == prefix:
                targets.append(_target(f"equal tokens: {prefix} within {limit:g} % of DiLoCo", row["name"],
                                       f"{gap:+.2f} %", gap <= limit))
    for row in table2:
        if row.name.startswith("gasloc"):
            reference = table2[0].val_loss
            targets.append(_target("equal wall clock, straggler: GASLoC below DiLoCo", row.name,
                                   f"{row.val_loss:.4f} vs {reference:.4f}", row.val_loss < reference))
    what = (f"codec at <= 1/{1 / CODEC_TARGET_RATIO:.0f} of fp32 bytes costs <= {CODEC_TARGET_GAP:g} % loss "
            f"(mean; against the better fp32 DiLoCo)")
    small = [r for r in rows if r["section"] in ("codecs", "gossip-codecs") and
             r["payload_vs_fp32"] <= CODEC_TARGET_RATIO]
    for row in small:
        gap = row["gap_best_percent"]
        targets.append(_target(what, row["name"], f"1/{1 / row['payload_vs_fp32']:.0f} of the bytes, "
                               f"{gap['mean']:+.2f} ± {gap['sd']:.2f} %", gap["mean"] <= CODEC_TARGET_GAP))
    if not small:
        targets.append(_target(what, "-", "no codec row this small", False))
    return targets


NOTES = """Notes: gaps are paired: each seed's row against the same seed's DiLoCo (same θ_0, batches and graphs), then
mean ± sd over seeds. Validation loss is of the peers' average model on the shared validation split. Parameters
(GASLoC's y, Mix1's θ) travel as fp16 differences from θ_0. Outer gradients travel in fp32 except in the codec rows:
topk and sparse through an all-gather of the sparse payloads (n−1 payloads per peer, SparseLoCo's exchange) with error
feedback e ← β·e + Δ and SparseLoCo's outer recipe (momentum 0, β 0.95, outer lr 1.0; CODEC_RECIPE in rows.py).
"vs best fp32" is the gap to the lower loss of DiLoCo with γ 0.9 and with γ 0 in the same seed.
"payload ÷ fp32" is one message against the fp32 model; "sent ÷ DiLoCo" counts what a peer sends per round
against DiLoCo's fp32 butterfly (2(n−1)/n payloads): an all-gather of 4 peers sends 3 payloads, twice the
butterfly's 1.5. Utilisation is the wall-clock model's (benchmarks/sim/clock.py: fast links carry one fp32 model
per inner phase, one peer 10 % of that; synchronous rounds) until the last peer ends round R. Encoding time is not
in the clock."""


def build_report(command: str, s: Settings, bench: Bench, threads: int, per_seed: list[list[RowResult]],
                 table2: tuple[list[RowResult], WallClock | None], sanity: dict[str, Any]) -> dict[str, Any]:
    """The JSON document of a run (without its total wall and CPU time)."""
    rows, (wall_rows, wall) = aggregate(per_seed), table2
    seeds = f"seeds {s.seed}..{s.seed + s.seeds - 1}" if s.seeds > 1 else f"seed {s.seed}"
    return {
        "command": command,
        "settings": dataclasses.asdict(s),
        "settings_line": f"{s.peers} peers, model {s.model} ({bench.model_bytes // 4:,} parameters), {s.rounds} rounds"
                         f" x {s.inner_steps} inner steps, batch {s.batch_size} x {s.seq_len} tokens, {seeds}, "
                         f"{threads} torch thread(s)",
        "torch_threads": threads,
        "model_parameters": bench.model_bytes // 4,
        "rows_definition": [dataclasses.asdict(r) for r in ROWS],
        "aggregate": rows,
        "equal_tokens": [[r.to_json() for r in seed_rows] for seed_rows in per_seed],
        "equal_wallclock": [r.to_json() for r in wall_rows],
        "wallclock_model": dataclasses.asdict(wall) if wall else None,
        "sanity": sanity,
        "targets": evaluate_targets(rows, wall_rows),
        "notes": NOTES.replace("\n", " "),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
    }


def write_report(report: dict[str, Any], output_dir: Path) -> None:
    """algorithms.json and algorithms.md in ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "algorithms.json").write_text(json.dumps(report, indent=1) + "\n")
    (output_dir / "algorithms.md").write_text(markdown(report))
