"""The algorithm benchmark's results: a summary per row, the sanity check, the team's targets, Markdown and JSON."""

from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path
from typing import Any

import torch

from benchmarks.sim.clock import WallClock
from benchmarks.sim.rows import ROWS, Settings
from benchmarks.sim.simulation import Bench, SimPeer, Tensors, train_row, validation_loss
from p2ptrain.maths.mixing import consensus_distance, exact_average


@dataclasses.dataclass
class RowResult:
    name: str
    val_loss: float  # of the peers' average model
    mean_peer_val_loss: float
    max_consensus_distance: float  # max over peers of ‖θ_i − θ̄‖ / ‖θ̄‖
    bytes_per_round_vs_model: float  # bytes sent per peer per completed round / fp32 model bytes
    rounds: list[int]  # completed rounds per peer
    inner_steps: list[int]  # inner steps per round per peer
    wall_s: float
    utilisation: float | None = None  # table 2: compute time within the budget / budget, mean over peers
    capped: bool = False  # table 2: the row hit max_rounds before the budget ran out
    reused_from_table1: bool = False
    average: Tensors = dataclasses.field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields.pop("average")
        return fields


def summarize(name: str, bench: Bench, peers: list[SimPeer], rounds: list[int], steps: list[int],
              wall_s: float) -> RowResult:
    thetas = [p.theta for p in peers]
    average = exact_average(thetas)
    completed = sum(rounds)
    return RowResult(
        name=name,
        val_loss=validation_loss(bench, average),
        mean_peer_val_loss=sum(validation_loss(bench, t) for t in thetas) / len(thetas),
        max_consensus_distance=max(consensus_distance(average, t) for t in thetas),
        bytes_per_round_vs_model=sum(p.bytes_sent for p in peers) / max(1, completed) / bench.model_bytes,
        rounds=list(rounds), inner_steps=list(steps), wall_s=wall_s, average=average)


def sanity_check(bench: Bench, table1: list[RowResult]) -> dict[str, Any]:
    """GASLoC on the complete graph with exact averaging must reproduce DiLoCo (ALGORITHMS.md §2).

    Checked on the final validation loss and on the parameters after one round. The final parameters are
    reported too: float rounding (~1e-7 after a round) is amplified by hundreds of AdamW steps.
    """
    by_name, s = {r.name: r for r in table1}, bench.settings
    diloco, complete = by_name["diloco"], by_name["gasloc-complete"]
    loss_rel = abs(complete.val_loss - diloco.val_loss) / diloco.val_loss
    one_round = [exact_average([p.theta for p in train_row(row, bench, [s.inner_steps] * s.peers, [1] * s.peers)])
                 for row in ROWS[:2]]
    first_rel = consensus_distance(one_round[0], one_round[1])
    return {"check": "gasloc-complete == diloco", "loss_relative_difference": loss_rel,
            "parameter_relative_distance_after_1_round": first_rel,
            "parameter_relative_distance_final": consensus_distance(diloco.average, complete.average),
            "tolerance": 1e-4, "verdict": "PASS" if max(loss_rel, first_rel) <= 1e-4 else "FAIL"}


# ---- targets ----------------------------------------------------------------------------------------------------


def gap_percent(loss: float, reference: float) -> float:
    return 100.0 * (loss - reference) / reference


def _target(what: str, row: str, figure: str, passed: bool) -> dict[str, Any]:
    return {"target": what, "row": row, "figure": figure, "verdict": "PASS" if passed else "MISS"}


def evaluate_targets(table1: list[RowResult], table2: list[RowResult]) -> list[dict[str, Any]]:
    """The team's targets; the codec target compares bytes with DiLoCo's fp32 all-reduce (same exchange)."""
    d1, d2 = table1[0], table2[0]
    targets = []
    for row in table1:
        gap = gap_percent(row.val_loss, d1.val_loss)
        for prefix, limit in (("gasloc-1peer", 2.0), ("gasloc-2peer", 1.0)):
            if row.name.startswith(prefix):
                targets.append(_target(f"equal tokens: {prefix} within {limit:g} % of DiLoCo", row.name,
                                       f"{gap:+.2f} %", gap <= limit))
    for row in table2:
        if row.name.startswith("gasloc"):
            targets.append(_target("equal wall clock, straggler: GASLoC below DiLoCo", row.name,
                                   f"{row.val_loss:.4f} vs {d2.val_loss:.4f}", row.val_loss < d2.val_loss))
    small = [r for r in table1 if r.name.startswith("diloco-") and r.name not in ("diloco-delay1", "diloco-eager")
             and r.bytes_per_round_vs_model <= d1.bytes_per_round_vs_model / 32]
    for row in small:
        gap = gap_percent(row.val_loss, d1.val_loss)
        ratio = d1.bytes_per_round_vs_model / row.bytes_per_round_vs_model
        targets.append(_target("codec at <= 1/32 of fp32 bytes costs <= 1 % loss", row.name,
                               f"1/{ratio:.0f} of the bytes, {gap:+.2f} %", gap <= 1.0))
    if not small:
        targets.append(_target("codec at <= 1/32 of fp32 bytes costs <= 1 % loss", "-", "no codec row <= 1/32", False))
    return targets


# ---- the report and its files -----------------------------------------------------------------------------------


NOTES = """Notes: one seed, so differences of about 1 % between rows may be noise. Validation loss is on the shared
validation split (the same batches for every row). Parameters (GASLoC's y, Mix1's θ) travel as fp16 differences from
θ_0; each peer mixes its own exact y with its partners' decoded y. Outer gradients travel in fp32 except in the codec
rows: fp16 and int8 go through a butterfly all-reduce (each averaged part is encoded again), top-k through an
all-gather of the sparse payloads (n−1 payloads per peer) with error feedback. Factored's Mix2 uses fp32 Δ.
Encoding time is not in the wall-clock model. Bytes are payload bytes from p2ptrain.net.wire.payload_bytes.
Table 2 models synchronous gossip rounds (a fresh random matching or cycle each round, each peer waiting only for
its partners); the asynchronous form of ALGORITHMS.md §2 (busy peers refuse, the initiator draws another) is not
modelled, so the straggler's delay still spreads through its partners. GASLoC's pacing uses the expected transfer
time. The inner cosine schedule spans R·H steps; peers that run longer in table 2 stay at its minimum LR. With the
default --bandwidth (0: one fp32 model per inner phase) the simulated outcome does not depend on the measured step
time, only the seconds shown do."""


def build_report(command: str, s: Settings, bench: Bench, threads: int, tables: tuple[list[RowResult], ...],
                 wall: WallClock, sanity: dict[str, Any]) -> dict[str, Any]:
    """The JSON document of a run (without its total wall time); ``tables`` = (equal tokens, equal wall clock)."""
    table1, table2 = tables
    return {
        "command": command,
        "settings": dataclasses.asdict(s),
        "settings_line": f"{s.peers} peers, model {s.model} ({bench.model_bytes // 4:,} parameters), {s.rounds} rounds"
                         f" x {s.inner_steps} inner steps, batch {s.batch_size} x {s.seq_len} tokens, seed {s.seed}, "
                         f"{threads} torch thread(s)",
        "torch_threads": threads,
        "model_parameters": bench.model_bytes // 4,
        "rows_definition": [dataclasses.asdict(r) for r in ROWS],
        "equal_tokens": [r.to_json() for r in table1],
        "equal_wallclock": [r.to_json() for r in table2],
        "wallclock_model": dataclasses.asdict(wall),
        "sanity": sanity,
        "targets": evaluate_targets(table1, table2),
        "notes": NOTES.replace("\n", " "),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
    }


def write_report(report: dict[str, Any], output_dir: Path) -> None:
    """algorithms.json and algorithms.md in ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "algorithms.json").write_text(json.dumps(report, indent=1) + "\n")
    (output_dir / "algorithms.md").write_text(markdown(report) + f"\nTotal wall time {report['wall_s']:.0f} s.\n")


def _table1_lines(report: dict[str, Any]) -> list[str]:
    t1 = report["equal_tokens"]
    d1 = t1[0]
    lines = ["## 1. Equal tokens\n",
             "| row | val loss (avg model) | gap vs DiLoCo | bytes/peer/round ÷ fp32 model | ÷ DiLoCo bytes "
             "| mean peer val loss | max consensus dist |", "|---|---|---|---|---|---|---|"]
    for r in (r for r in t1 if r["name"] != "gasloc-complete"):
        lines.append(f"| {r['name']} | {r['val_loss']:.4f} | {gap_percent(r['val_loss'], d1['val_loss']):+.2f} % "
                     f"| {r['bytes_per_round_vs_model']:.4f} "
                     f"| {r['bytes_per_round_vs_model'] / d1['bytes_per_round_vs_model']:.4f} "
                     f"| {r['mean_peer_val_loss']:.4f} | {r['max_consensus_distance']:.2e} |")
    sanity = report["sanity"]
    lines.append(f"\nSanity: GASLoC on the complete graph, exact fp32 averaging, vs DiLoCo: final loss differs by "
                 f"{sanity['loss_relative_difference']:.1e} (relative), parameters by "
                 f"{sanity['parameter_relative_distance_after_1_round']:.1e} after one round: {sanity['verdict']} "
                 f"(tolerance 1e-4); final parameters differ by {sanity['parameter_relative_distance_final']:.1e} "
                 "(rounding amplified by the inner AdamW steps).\n")
    return lines


def _table2_lines(report: dict[str, Any]) -> list[str]:
    t2, wall = report["equal_wallclock"], report["wallclock_model"]
    d2 = t2[0]
    fast, slow = wall["bandwidth_bytes_per_s"][0], wall["bandwidth_bytes_per_s"][-1]
    lines = ["## 2. Equal simulated wall clock, one straggler\n",
             f"Step time {wall['step_s'] * 1e3:.2f} ms (measured mean of table 1), fast links "
             f"{fast / 1e6:.3f} MB/s, straggler {slow / 1e6:.4f} MB/s; budget {wall['budget_s']:.2f} s = DiLoCo's "
             f"time for {wall['budget_rounds']} rounds; rows stop at {wall['max_rounds']} rounds (capped).\n",
             "| row | val loss at budget | gap vs DiLoCo | rounds completed (mean, min–max) | compute utilisation "
             "| inner steps/round (fast, straggler) | note |", "|---|---|---|---|---|---|---|"]
    for r in t2:
        rounds, note = r["rounds"], "capped" if r["capped"] else ""
        lines.append(f"| {r['name']} | {r['val_loss']:.4f} | {gap_percent(r['val_loss'], d2['val_loss']):+.2f} % "
                     f"| {sum(rounds) / len(rounds):.1f} ({min(rounds)}–{max(rounds)}) "
                     f"| {100 * r['utilisation']:.1f} % "
                     f"| {r['inner_steps'][0]}, {r['inner_steps'][-1]} | {note} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Algorithm benchmark\n\n`{report['command']}`  \n{report['settings_line']}\n"]
    lines += _table1_lines(report) + _table2_lines(report)
    lines += ["\n## Targets\n", "| target | row | figure | verdict |", "|---|---|---|---|"]
    lines += [f"| {t['target']} | {t['row']} | {t['figure']} | {t['verdict']} |" for t in report["targets"]]
    lines += ["", report["notes"]]
    return "\n".join(lines) + "\n"
