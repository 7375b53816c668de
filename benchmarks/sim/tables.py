"""The algorithm benchmark end to end: every row at equal tokens for each seed, the sanity check, optionally table 2
(equal simulated wall clock), and the report.

Equal tokens: every peer runs R·H steps; validation loss of the peers' average model, bytes from the payloads, and
the compute utilisation the wall-clock model (clock.py) gives the row's exchanges on links with one straggler.
Table 2 (``Settings.wallclock``, first seed, the mode rows): the rows share a wall-clock budget, DiLoCo's time for
``budget_rounds`` rounds with the straggler; GASLoC's straggler takes fewer inner steps
(``pacing.inner_steps_for_link``), and a peer's state at the budget is its last completed round.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.sim.clock import (
    WallClock,
    clock_stats,
    equal_tokens_utilisation,
    exchange_units,
    make_wallclock,
    paced_steps,
    simulate_clock,
)
from benchmarks.sim.peers import Bench, build_bench, make_peers
from benchmarks.sim.report import RowResult, build_report, sanity_check, summarize, write_report
from benchmarks.sim.rows import REFERENCES, ROWS, Algorithm, Settings
from benchmarks.sim.simulation import make_graphs, train_row

NOMINAL_STEP_S = 1.0  # the utilisation column's clock: with links sized to the inner phase, any step time gives it


def selected_rows(settings: Settings) -> list[Algorithm]:
    """The rows of ``settings.sections`` and ``settings.rows`` (all when both are empty) and the fp32 DiLoCo
    REFERENCES (DiLoCo first)."""
    def chosen(row: Algorithm) -> bool:
        if not settings.sections and not settings.rows:
            return True
        return row.section in settings.sections or row.name in settings.rows
    return [row for row in ROWS if row.name in REFERENCES or chosen(row)]


def run_equal_tokens(bench: Bench, rows: list[Algorithm]) -> tuple[list[RowResult], float]:
    """Every row for the bench's seed; returns the rows and the measured mean inner step time in seconds."""
    s = bench.settings
    results, compute_s, steps_done = [], 0.0, 0
    for row in rows:
        started = time.perf_counter()
        peers = train_row(row, bench, [s.inner_steps] * s.peers, [s.rounds] * s.peers)
        result = summarize(row, bench, peers, [s.rounds] * s.peers, [s.inner_steps] * s.peers,
                           time.perf_counter() - started)
        result.utilisation = equal_tokens_utilisation(row, bench, NOMINAL_STEP_S)
        compute_s += sum(p.compute_s for p in peers)
        steps_done += sum(p.steps for p in peers)
        results.append(result)
        print(f"[seed {s.seed}] {row.name:<24} val loss {result.val_loss:.4f}  ({result.wall_s:.0f} s)", flush=True)
    return results, compute_s / steps_done


def run_equal_wallclock(bench: Bench, wall: WallClock, table1: list[RowResult]) -> list[RowResult]:
    """Table 2: each mode row trains exactly what its peers complete within the simulated budget."""
    s, by_name, rows = bench.settings, {r.name: r for r in table1}, []
    for row in (r for r in ROWS if r.section == "modes" and r.name in by_name):
        started = time.perf_counter()
        units = exchange_units(row, bench)
        steps = paced_steps(row, units, wall.step_s, wall.bandwidth_bytes_per_s, s.inner_steps)
        graphs = make_graphs(row, s.peers, wall.max_rounds, s.seed)
        clock = simulate_clock(row, units, steps, wall.step_s, wall.bandwidth_bytes_per_s, graphs, wall.budget_s,
                               wall.max_rounds)
        rounds, utilisation = clock_stats(clock, wall.budget_s)
        if rounds == [s.rounds] * s.peers and steps == [s.inner_steps] * s.peers:  # same training as table 1
            result = dataclasses.replace(by_name[row.name], reused_from_table1=True, wall_s=0.0)
        else:
            peers = train_row(row, bench, steps, rounds) if max(rounds) else make_peers(row, bench)
            result = summarize(row, bench, peers, rounds, steps, time.perf_counter() - started)
        result.utilisation, result.capped = utilisation, max(rounds) >= wall.max_rounds
        rows.append(result)
        print(f"[wall clock]   {row.name:<24} val loss {result.val_loss:.4f}  rounds {rounds}  "
              f"({result.wall_s:.0f} s)", flush=True)
    return rows


def run(settings: Settings, output_dir: Path, command: str) -> dict[str, Any]:
    """Every seed, the targets and the results files; returns the report (RowResults under ``rows``)."""
    started, cpu_started, threads_before = time.perf_counter(), time.process_time(), torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    rows, per_seed, step_times = selected_rows(settings), [], []
    table2: list[RowResult] = []
    wall: WallClock | None = None
    try:
        for offset in range(settings.seeds):
            bench = build_bench(dataclasses.replace(settings, seed=settings.seed + offset))
            results, step_s = run_equal_tokens(bench, rows)
            per_seed.append(results)
            step_times.append(step_s)
            if offset == 0:
                first_bench = bench
                if settings.wallclock:
                    wall = make_wallclock(bench, step_s)
                    table2 = run_equal_wallclock(bench, wall, results)
        sanity = sanity_check(first_bench)
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads_before)
    report = build_report(command, settings, first_bench, threads, per_seed, (table2, wall), sanity)
    report["step_s"] = step_times
    report["wall_s"] = time.perf_counter() - started
    report["cpu_s"] = time.process_time() - cpu_started
    write_report(report, output_dir)
    report["rows"] = {"equal_tokens": per_seed, "equal_wallclock": table2}
    return report
