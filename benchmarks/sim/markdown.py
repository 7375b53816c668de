"""The algorithm benchmark's Markdown: one table per question the run answers, from the JSON document
(benchmarks/sim/report.py), so a results file can be re-rendered without training anything."""

from __future__ import annotations

import statistics
from typing import Any

CPU_BUDGET_MIN = 82  # the full run's stated budget (benchmarks/algorithms.py)


def _pm(stat: dict[str, float], digits: int = 2, unit: str = "") -> str:
    return f"{stat['mean']:+.{digits}f} ± {stat['sd']:.{digits}f}{unit}"


def _ratio(value: float) -> str:
    return f"1/{1 / value:.0f}" if 0 < value < 0.5 else f"{value:.3f}"


def _section(report: dict[str, Any], *sections: str) -> list[dict[str, Any]]:
    return [r for r in report["aggregate"] if r["section"] in sections]


def _reference(report: dict[str, Any]) -> dict[str, Any]:
    return report["aggregate"][0]


def _modes(report: dict[str, Any]) -> list[str]:
    diloco = _reference(report)
    lines = ["## 1. Modes at equal tokens\n",
             "| row | val loss (mean ± sd) | gap vs DiLoCo, % | per seed, % | sent/peer/round ÷ DiLoCo's "
             "| utilisation (clock, straggler) | max consensus dist |", "|---|---|---|---|---|---|---|"]
    for r in _section(report, "modes"):
        lines.append(f"| {r['name']} | {r['val_loss']['mean']:.4f} ± {r['val_loss']['sd']:.4f} "
                     f"| {_pm(r['gap_percent'])} | {', '.join(f'{g:+.2f}' for g in r['gaps_percent'])} "
                     f"| {r['bytes_per_round_vs_model'] / diloco['bytes_per_round_vs_model']:.3f} "
                     f"| {100 * r['utilisation']:.1f} % | {r['max_consensus_distance']:.1e} |")
    return lines


def _paired_difference(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """(loss of b − loss of a) / loss of a, in %, per seed, from both rows' gaps to the same seed's DiLoCo."""
    diffs = [100 * (gb - ga) / (100 + ga) for ga, gb in zip(a["gaps_percent"], b["gaps_percent"], strict=True)]
    return {"mean": statistics.fmean(diffs), "sd": statistics.stdev(diffs) if len(diffs) > 1 else 0.0}


MOMENTUM_PAIRS = (("diloco", "diloco-g0", "DiLoCo: γ 0.9 → 0"), ("gasloc-1peer-g0.9", "gasloc-1peer",
                                                                 "GASLoC 1-peer: γ 0.9 → 0"))


def _momentum(report: dict[str, Any]) -> list[str]:
    by_name = {r["name"]: r for r in report["aggregate"]}
    lines = ["## 2. Outer momentum re-checked (the earlier finding: γ 0 beats 0.9 by ~6 %)\n",
             "| change | loss with γ 0.9 | loss with γ 0 | γ 0 against γ 0.9, % (paired, mean ± sd) |",
             "|---|---|---|---|"]
    for high, low, what in MOMENTUM_PAIRS:
        if high in by_name and low in by_name:
            a, b = by_name[high], by_name[low]
            lines.append(f"| {what} | {a['val_loss']['mean']:.4f} | {b['val_loss']['mean']:.4f} "
                         f"| {_pm(_paired_difference(a, b))} |")
    return lines


def _mix2(report: dict[str, Any]) -> list[str]:
    diloco = _reference(report)
    rows = sorted(_section(report, "modes", "mix2"), key=lambda r: r["name"])
    rows = [r for r in rows if r["name"].startswith("factored-K") and "delay" not in r["name"]]
    lines = ["## 3. Factored: Mix1 every round, Mix2 every K rounds (utilisation against loss)\n",
             "| row | K | utilisation (clock, straggler) | sent ÷ DiLoCo's | gap vs DiLoCo, % | max consensus dist |",
             "|---|---|---|---|---|---|"]
    diloco_line = (f"| diloco | - | {100 * diloco['utilisation']:.1f} % | 1.000 | {_pm(diloco['gap_percent'])} "
                   f"| {diloco['max_consensus_distance']:.1e} |")
    for r in sorted(rows, key=lambda r: int(r["name"].removeprefix("factored-K"))):
        lines.append(f"| {r['name']} | {r['name'].removeprefix('factored-K')} | {100 * r['utilisation']:.1f} % "
                     f"| {r['bytes_per_round_vs_model'] / diloco['bytes_per_round_vs_model']:.3f} "
                     f"| {_pm(r['gap_percent'])} | {r['max_consensus_distance']:.1e} |")
    return lines + [diloco_line]


def _codec_rows(report: dict[str, Any], *sections: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    definitions = {d["name"]: d for d in report["rows_definition"]}
    rows = [(r, definitions[r["name"]]) for r in _section(report, *sections)]
    return sorted(rows, key=lambda pair: (pair[1]["codec"], pair[1]["bits"], -pair[0]["payload_vs_fp32"]))


def _frontier(report: dict[str, Any]) -> list[str]:
    diloco = _reference(report)
    lines = ["## 4. Codec frontier: loss gap against bytes (DiLoCo's exchange, error feedback)\n",
             "One curve per codec (rows sorted by bytes within it); the first line is DiLoCo's fp32 all-reduce.\n",
             "| curve | row | density | value bits | payload ÷ fp32 | sent ÷ DiLoCo's | γ, β, η | gap vs DiLoCo, % "
             "| gap vs best fp32, % | per seed (vs best), % |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, recipe in (("diloco", "0.9, -, 0.7"), ("diloco-g0", "0, -, 0.7")):
        r = next((r for r in report["aggregate"] if r["name"] == name), None)
        if r:
            lines.append(f"| fp32 | {name} | 1 | 32 | 1 | 1 | {recipe} | {_pm(r['gap_percent'])} "
                         f"| {_pm(r['gap_best_percent'])} | {', '.join(f'{g:+.2f}' for g in r['gaps_best_percent'])} |")
    for r, d in _codec_rows(report, "codecs"):
        curve = f"{d['codec']}-{d['bits']}bit" if d["codec"] == "sparse" else f"{d['codec']}-8bit"
        lines.append(f"| {curve} | {r['name']} | {d['density']:.4g} | {d['bits'] if d['codec'] == 'sparse' else 8} "
                     f"| {_ratio(r['payload_vs_fp32'])} "
                     f"| {_ratio(r['bytes_per_round_vs_model'] / diloco['bytes_per_round_vs_model'])} "
                     f"| {d['momentum']:g}, {d['ef_decay']:g}, {d['outer_lr'] or 0.7:g} | {_pm(r['gap_percent'])} "
                     f"| {_pm(r['gap_best_percent'])} | {', '.join(f'{g:+.2f}' for g in r['gaps_best_percent'])} |")
    return lines


def _gossip_codecs(report: dict[str, Any]) -> list[str]:
    by_name = {r["name"]: r for r in report["aggregate"]}
    lines = ["## 5. Compressed gossip (what gossip modes could send instead of fp16 parameters)\n",
             "| row | payload ÷ fp32 | sent/peer/round ÷ fp32 model | gap vs DiLoCo, % | gap vs best fp32, % "
             "| max consensus dist |", "|---|---|---|---|---|---|"]
    references = [by_name[n] for n in ("gasloc-1peer", "gasloc-2peer") if n in by_name]
    for r in references + [r for r, _ in _codec_rows(report, "gossip-codecs")]:
        lines.append(f"| {r['name']} | {_ratio(r['payload_vs_fp32'])} | {_ratio(r['bytes_per_round_vs_model'])} "
                     f"| {_pm(r['gap_percent'])} | {_pm(r['gap_best_percent'])} | {r['max_consensus_distance']:.1e} |")
    return lines


def _wallclock(report: dict[str, Any]) -> list[str]:
    t2, wall = report["equal_wallclock"], report["wallclock_model"]
    if not t2:
        return []
    d2, (fast, slow) = t2[0], (wall["bandwidth_bytes_per_s"][0], wall["bandwidth_bytes_per_s"][-1])
    lines = ["## 6. Equal simulated wall clock, one straggler (first seed, mode rows)\n",
             f"Step time {wall['step_s'] * 1e3:.2f} ms (measured), fast links {fast / 1e6:.3f} MB/s, straggler "
             f"{slow / 1e6:.4f} MB/s; budget {wall['budget_s']:.2f} s = DiLoCo's time for {wall['budget_rounds']} "
             f"rounds; rows stop at {wall['max_rounds']} rounds (capped).\n",
             "| row | val loss at budget | gap vs DiLoCo | rounds completed (mean, min–max) | compute utilisation "
             "| inner steps/round (fast, straggler) | note |", "|---|---|---|---|---|---|---|"]
    for r in t2:
        rounds = r["rounds"]
        lines.append(f"| {r['name']} | {r['val_loss']:.4f} | {100 * (r['val_loss'] / d2['val_loss'] - 1):+.2f} % "
                     f"| {sum(rounds) / len(rounds):.1f} ({min(rounds)}–{max(rounds)}) "
                     f"| {100 * r['utilisation']:.1f} % "
                     f"| {r['inner_steps'][0]}, {r['inner_steps'][-1]} | {'capped' if r['capped'] else ''} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    cpu = report.get("cpu_s", 0.0)
    lines = [f"# Algorithm benchmark\n\n`{report['command']}`  \n{report['settings_line']}  \n"
             f"CPU time {cpu / 60:.1f} min (the full run's budget: {CPU_BUDGET_MIN} min on one core), wall time "
             f"{report.get('wall_s', 0.0) / 60:.1f} min.\n"]
    for part in (_modes, _momentum, _mix2, _frontier, _gossip_codecs, _wallclock):
        lines += part(report) + [""]
    sanity = report["sanity"]
    lines.append(f"Sanity: GASLoC on the complete graph, exact fp32 averaging, against DiLoCo: parameters differ by "
                 f"{sanity['parameter_relative_distance_after_1_round']:.1e} after one round, loss by "
                 f"{sanity['loss_relative_difference']:.1e} after {sanity['rounds']}: {sanity['verdict']} "
                 f"(tolerance 1e-4).\n")
    lines += ["## Targets\n", "| target | row | figure | verdict |", "|---|---|---|---|"]
    lines += [f"| {t['target']} | {t['row']} | {t['figure']} | {t['verdict']} |" for t in report["targets"]]
    lines += ["", report["notes"]]
    return "\n".join(lines) + "\n"
