"""The algorithm benchmark end to end: table 1 at equal tokens, table 2 at equal simulated wall clock, the report.

Table 1: every peer runs R·H steps; validation loss of the peers' average model. Table 2: the rows share a
wall-clock budget, DiLoCo's time for ``budget_rounds`` rounds with one straggler (benchmarks/sim/clock.py);
GASLoC's straggler takes fewer inner steps (``pacing.inner_steps_for_link``), and a peer's state at the budget
is its last completed round.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.sim.clock import WallClock, clock_stats, exchange_units, make_wallclock, paced_steps, simulate_clock
from benchmarks.sim.report import RowResult, build_report, sanity_check, summarize, write_report
from benchmarks.sim.rows import ROWS, Settings
from benchmarks.sim.simulation import Bench, build_bench, make_graphs, make_peers, train_row


def run_equal_tokens(bench: Bench) -> tuple[list[RowResult], float]:
    """Table 1; returns the rows and the measured mean inner step time in seconds."""
    s = bench.settings
    rows, compute_s, steps_done = [], 0.0, 0
    for row in ROWS:
        started = time.perf_counter()
        peers = train_row(row, bench, [s.inner_steps] * s.peers, [s.rounds] * s.peers)
        result = summarize(row.name, bench, peers, [s.rounds] * s.peers, [s.inner_steps] * s.peers,
                           time.perf_counter() - started)
        compute_s += sum(p.compute_s for p in peers)
        steps_done += sum(p.steps for p in peers)
        rows.append(result)
        print(f"[equal tokens] {row.name:<24} val loss {result.val_loss:.4f}  ({result.wall_s:.0f} s)", flush=True)
    return rows, compute_s / steps_done


def run_equal_wallclock(bench: Bench, wall: WallClock, table1: list[RowResult]) -> list[RowResult]:
    """Table 2: each row trains exactly what its peers complete within the simulated budget."""
    s, by_name, rows = bench.settings, {r.name: r for r in table1}, []
    for row in (r for r in ROWS if not r.sanity):
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
            result = summarize(row.name, bench, peers, rounds, steps, time.perf_counter() - started)
        result.utilisation, result.capped = utilisation, max(rounds) >= wall.max_rounds
        rows.append(result)
        print(f"[wall clock]   {row.name:<24} val loss {result.val_loss:.4f}  rounds {rounds}  "
              f"({result.wall_s:.0f} s)", flush=True)
    return rows


def run(settings: Settings, output_dir: Path, command: str) -> dict[str, Any]:
    """Both tables, the targets, and the results files; returns the report (rows as RowResult under ``rows``)."""
    started, threads_before = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        bench = build_bench(settings)
        table1, step_s = run_equal_tokens(bench)
        wall = make_wallclock(bench, step_s)
        table2 = run_equal_wallclock(bench, wall, table1)
        sanity = sanity_check(bench, table1)
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads_before)
    report = build_report(command, settings, bench, threads, (table1, table2), wall, sanity)
    report["wall_s"] = time.perf_counter() - started
    write_report(report, output_dir)
    report["rows"] = {"equal_tokens": table1, "equal_wallclock": table2}
    return report
