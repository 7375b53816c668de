"""A grid of scenarios through the simulation: one row per (scenario, algorithm), a table, Markdown and JSON."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.scale import model
from benchmarks.scale.model import GPUS, Scenario, build_swarm
from benchmarks.scale.sim import Algorithm, simulate
from p2ptrain.errors import ConfigError


def parse_params(text: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(text[-1:].upper())
    try:
        return float(text[:-1]) * scale if scale else float(text)
    except ValueError:
        raise ConfigError(f"model size {text!r}: write e.g. 150M, 1.5B or 7e9") from None


ALGORITHMS = "diloco,gossip-1,gossip-2,factored,gradgossip-1,gradgossip-1-overlap"


def algorithms(names: str, mix2_every: int) -> list[Algorithm]:
    known = {"diloco": Algorithm("allreduce"), "gossip-1": Algorithm("gossip", 1), "gossip-2": Algorithm("gossip", 2),
             "factored": Algorithm("factored", 2, mix2_every), "gradgossip-1": Algorithm("gradgossip", 1),
             "gradgossip-2": Algorithm("gradgossip", 2),
             "gradgossip-1-overlap": Algorithm("gradgossip", 1, overlap=True)}
    unknown = [name for name in names.split(",") if name not in known]
    if unknown:
        raise ConfigError(f"unknown algorithm {unknown[0]!r}: use {', '.join(known)}")
    return [known[name] for name in names.split(",")]


def run_grid(
    scenarios: list[Scenario], algorithms: list[Algorithm], budget_s: float, min_rounds: int
) -> list[dict[str, Any]]:
    """One row per (scenario, algorithm), printed as it comes; algorithms share the scenario's swarm."""
    rows = []
    for scenario in scenarios:
        swarm = build_swarm(scenario)
        for algorithm in algorithms:
            started = time.perf_counter()
            result = simulate(algorithm, swarm, budget_s, min_rounds, scenario.seed)
            rows.append({
                "peers": scenario.peers, "params": scenario.params, "codec": scenario.codec,
                "delta_ratio": scenario.delta_ratio, "algorithm": algorithm.name,
                "inner_phase_s_median": float(np.median(swarm.inner_phase_s)),
                "delta_payload_mb": swarm.delta_bytes / 1e6, "param_payload_mb": swarm.payload_bytes / 1e6,
                **result.summary(),
                "cpu_s": round(time.perf_counter() - started, 3),
            })
            print(format_row(rows[-1]), flush=True)
    return rows


HEADER = ("| peers | params | Δ codec (bytes ÷ fp32) | algorithm | inner phase s | Δ payload MB | θ payload MB "
          "| util median | util p10 | round s median | rounds in budget median / p10 |")
RULE = "|" + "---|" * 11


def _params_label(params: float) -> str:
    return f"{params / 1e9:g}B" if params >= 1e9 else f"{params / 1e6:g}M"


def format_row(row: dict[str, Any]) -> str:
    cells = (
        row["peers"], _params_label(row["params"]), f"{row['codec']} (1/{1 / row['delta_ratio']:.0f})",
        row["algorithm"], f"{row['inner_phase_s_median']:.0f}", f"{row['delta_payload_mb']:.4g}",
        f"{row['param_payload_mb']:.4g}", f"{row['utilisation_median']:.3f}",
        f"{row['utilisation_p10']:.3f}", f"{row['round_s_median']:.0f}",
        f"{row['rounds_in_budget_median']:g} / {row['rounds_in_budget_p10']:g}",
    )
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def write_results(rows: list[dict[str, Any]], settings: dict[str, Any], command: str, output_dir: Path,
                  name: str = "simulate_scale") -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    assumptions = {
        "upload_mbit": {"distribution": "log-normal", "p10": model.UPLOAD_P10_MBIT, "median": model.UPLOAD_MEDIAN_MBIT,
                        "p90": model.UPLOAD_P90_MBIT, "sigma": model.UPLOAD_SIGMA,
                        "clip": [model.LINK_FLOOR_MBIT, model.LINK_CAP_MBIT]},
        "download_per_upload": model.DOWNLOAD_PER_UPLOAD, "gpus": {k: asdict(v) for k, v in GPUS.items()},
        "train_bytes_per_param": model.TRAIN_BYTES_PER_PARAM,
        "param_payload_ratio": model.FP16_RATIO, "exchange_constants": exchange_constants(),
    }
    document = {"command": command, "settings": settings, "assumptions": assumptions, "rows": rows}
    (output_dir / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")
    lines = [
        "# Simulated compute utilisation at scale", "", f"Command: `{command}`", "",
        f"Settings: {json.dumps(settings)}", "",
        "Model and assumptions: see the docstring of benchmarks/scale/model.py (home links log-normal, "
        "p10 5 / median 22.4 / p90 100 Mbit/s upload, download 5x; compute from 6·N·tokens FLOPs at the stated "
        "MFU). Utilisation = compute time / wall time per peer; rounds in budget counted at the budget.", "",
        describe_exchange_constants(settings), "",
        HEADER, RULE, *(format_row(row) for row in rows), "", *NOTES,
    ]
    (output_dir / f"{name}.md").write_text("\n".join(lines))


def exchange_constants() -> dict[str, Any]:
    """The transfer model's default constants and the run they were fitted from."""
    return {"exchange_fixed_s": model.EXCHANGE_FIXED_S, "link_efficiency": model.LINK_EFFICIENCY,
            "fitted_from": model.FITTED_FROM}


def describe_exchange_constants(settings: dict[str, Any]) -> str:
    """One line: the exchange constants this run used and where they come from."""
    used = (settings["exchange_latency_s"], settings["link_efficiency"])
    defaults = (model.EXCHANGE_FIXED_S, model.LINK_EFFICIENCY)
    origin = (f"the defaults, {model.FITTED_FROM}" if used == defaults else
              f"set on the command line; the defaults, {defaults[0]:g} s and {defaults[1]:g}, are {model.FITTED_FROM}")
    what_if = (" What-if: gossip exchanges stream both directions at once (--duplex; p2ptrain's push-pull sends them "
               "one after the other)." if settings.get("duplex") else "")
    cost = settings.get("round_cost_s", 0.0)
    fitted = "fitted by benchmarks/swarm_scale.py to its 8-peer gossip rows"
    cost_origin = f"the default, {fitted}" if cost == model.ROUND_COST_S else \
        f"set on the command line; the default, {model.ROUND_COST_S:g} s, is {fitted}"
    return (f"Exchange model: fixed cost {used[0]:g} s per exchange, link efficiency {used[1]:g} ({origin}).{what_if} "
            f"Each round also costs the client {cost:g} s before its inner phase, no compute ({cost_origin}).")


NOTES = [
    "Notes:",
    "- The Δ codec applies to outer gradients only (DiLoCo's all-reduce, Factored's Mix2, gradient gossip); "
    "parameters (gossip's y, Mix1's θ) travel as fp16 differences from θ_0, as in production. A sparse Δ codec makes "
    "DiLoCo's all-reduce an all-gather ((n − 1) payloads per peer).",
    "- gradgossip mixes outer gradients only: nothing pulls parameters together, and its loss at 4 peers (algorithm "
    "benchmark) says nothing of 1,000 (each peer averages with 1 of 999 others).",
    "- DiLoCo's peers all run the same H; hivemind's target-batch-size pacing or GASLoC's adaptive H, which let "
    "slow peers do fewer steps, are not simulated.",
    "- The exchange model (push, then pull, through each direction's bottleneck) and its constants come from a netns "
    "testnet with no propagation delay and 234 KB payloads (simulate_scale_calibration.md): on the Internet each "
    "exchange also pays a few round trips. The all-reduce model was not calibrated (same efficiency assumed).",
    "- Rounds in budget 0 means the first round did not end within the budget; utilisation and round time then "
    "come from the run past the budget (min_rounds per peer).",
    "",
]
