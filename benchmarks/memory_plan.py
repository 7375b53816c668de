"""The memory plan (`p2ptrain plan`) against what training really holds on CPU, and which model fits which GPU.

Part 1, estimate vs measured: for the presets at several batch sizes, precisions and with or without activation
checkpointing, the plan's training peak on a CPU device (model, AdamW, gradients, activations, runtime, anchor and
outer momentum) against the peak RSS of a real InnerTrainer + OuterOptimizer run less its baseline (torch and
transformers imported, no model), each in a fresh subprocess (p2ptrain/memory/measure.py). Parameters, AdamW
state and gradients are also counted tensor by tensor and must equal the plan's bytes exactly. "live" RSS runs
with MALLOC_MMAP_THRESHOLD_=65536 (freed tensors go back to the system, RSS follows the allocations); "glibc
default" shows what a CPU peer's RSS really reaches with glibc's default malloc, which keeps freed activations.

Part 2, which model can my GPU join: the plan's verdict for 8, 12 and 24 GiB cards, for the presets and for a
1B Llama shape (a config.json written to a temporary directory: Llama-3.2-1B's published sizes, no weights).

    python benchmarks/memory_plan.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from p2ptrain.memory.measure import VOCAB_SIZE, measure  # noqa: E402
from p2ptrain.memory.plan import GIB, MIB, MemoryPlan, Settings, fit, model_state_bytes, plan_memory  # noqa: E402,E501
from p2ptrain.memory.shape import model_shape  # noqa: E402
from p2ptrain.models import PRESETS, ModelConfig  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
TOLERANCE = 0.15
GPU_GB = (8, 12, 24)


def configurations(quick: bool) -> list[tuple[str, Settings]]:
    """(preset, settings) to measure."""
    grid = {"tiny": [(8, 128, "fp32", False), (64, 512, "fp32", False), (64, 512, "bf16", False)],
            "small": [(8, 128, "fp32", False), (32, 256, "fp32", False), (64, 256, "bf16", False),
                      (32, 256, "fp32", True), (64, 512, "bf16", True)],
            "base": [(8, 128, "fp32", False), (8, 256, "fp32", False), (16, 256, "fp32", False),
                     (8, 256, "bf16", False), (8, 256, "fp32", True), (8, 256, "bf16", True)]}
    rows = [(name, Settings(b, s, precision=p, activation_checkpointing=c))
            for name, cases in grid.items() if name in PRESETS for b, s, p, c in cases]
    rows += [("base", Settings(16, 256, micro_batches=4, precision="fp32")),
             ("small", Settings(64, 256, micro_batches=4, precision="bf16"))]
    rows += [(name, Settings(64, 256)) for name in PRESETS if name not in grid]  # presets added since
    return rows[::3] if quick else rows


def label(settings: Settings) -> str:
    return (f"{settings.batch_size}×{settings.seq_len} {settings.precision}"
            + (f" m={settings.micro_batches}" if settings.micro_batches > 1 else "")
            + (" ckpt" if settings.activation_checkpointing else ""))


def measure_row(name: str, settings: Settings, with_default_malloc: bool) -> dict[str, Any]:
    shape = model_shape(ModelConfig(name=name, max_seq_len=max(512, settings.seq_len)), VOCAB_SIZE)
    estimate = plan_memory(shape, settings, "cpu").training_bytes
    started = time.monotonic()
    live = measure(name, settings)
    default = measure(name, settings, live_rss=False) if with_default_malloc else None
    exact = model_state_bytes(shape)
    return {"model": name, "settings": dataclasses.asdict(settings), "label": label(settings),
            "estimate_bytes": estimate, "measured_bytes": live.delta_bytes,
            "error": estimate / live.delta_bytes - 1,
            "default_malloc_bytes": default.delta_bytes if default else None,
            "exact_states": (exact["parameters"], exact["optimizer"], exact["gradients"]) == (
                live.parameters_bytes, live.optimizer_bytes, live.gradients_bytes),
            "baseline_bytes": live.baseline_bytes, "seconds": time.monotonic() - started}


def llama_1b_dir(root: Path) -> str:
    """A config.json with Llama-3.2-1B's sizes (no weights, nothing downloaded)."""
    LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True).save_pretrained(root)
    return str(root)


def short_verdict(plan: MemoryPlan, gb: int) -> str:
    """fits / with <changes> / no (for a table cell)."""
    verdict = fit(plan, gb * GIB)
    if verdict.fits:
        return "fits"
    if verdict.advice is None:
        return f"no ({verdict.floor_bytes / GIB:.1f} GiB before activations)"
    changes = " + ".join("checkpointing" if v is True else f"{k} {v}" for k, v in verdict.advice.items())
    return f"with {changes} ({verdict.advised_bytes / GIB:.1f} GiB)"


def gpu_table(models: dict[str, str]) -> list[dict[str, Any]]:
    """The plan's verdict per model, setting and card (CUDA: bf16 autocast, outer state on the host)."""
    rows = []
    for label_, name in models.items():
        shape = model_shape(ModelConfig(name=name), VOCAB_SIZE)
        for settings in (Settings(8, 128), Settings(32, 1024)):
            plan = plan_memory(shape, settings, "cuda")
            verdicts = {gb: short_verdict(plan, gb) for gb in GPU_GB}
            rows.append({"model": label_, "parameters": shape.parameters, "batch": f"{settings.batch_size}×"
                         f"{settings.seq_len}", "peak_bytes": plan.device_bytes, "host_bytes": plan.host_bytes,
                         "verdicts": verdicts})
    return rows


def markdown(measured: list[dict[str, Any]], gpus: list[dict[str, Any]]) -> str:
    lines = ["# Memory plan: estimate vs measured (CPU), and which model fits which GPU", "",
             "| model | batch × seq, precision | estimate | measured (live RSS) | error | glibc default RSS | "
             "states exact |", "|---|---|---|---|---|---|---|"]
    for r in measured:
        default = f"{r['default_malloc_bytes'] / MIB:.1f} MiB" if r["default_malloc_bytes"] else "-"
        lines.append(f"| {r['model']} | {r['label']} | {r['estimate_bytes'] / MIB:.1f} MiB | "
                     f"{r['measured_bytes'] / MIB:.1f} MiB | {r['error']:+.1%} | {default} | "
                     f"{'yes' if r['exact_states'] else 'NO'} |")
    lines += ["", "| model | parameters | batch | device peak | host | " + " | ".join(f"{g} GiB" for g in GPU_GB)
              + " |", "|---|---|---|---|---|" + "---|" * len(GPU_GB)]
    for r in gpus:
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.1f} M | {r['batch']} | "
                     f"{r['peak_bytes'] / GIB:.2f} GiB | {r['host_bytes'] / GIB:.2f} GiB | "
                     + " | ".join(r["verdicts"][g] for g in GPU_GB) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every third configuration only, no glibc column")
    parser.add_argument("--output", type=Path, default=RESULTS / "memory_plan.json", help="JSON results")
    args = parser.parse_args()
    measured = []
    print(f"{'model':6} {'settings':24} {'estimate':>11} {'measured':>11} {'error':>7} {'glibc':>11}  exact")
    for name, settings in configurations(args.quick):
        row = measure_row(name, settings, with_default_malloc=not args.quick)
        measured.append(row)
        default = f"{row['default_malloc_bytes'] / MIB:8.1f} MiB" if row["default_malloc_bytes"] else f"{'-':>11}"
        print(f"{name:6} {row['label']:24} {row['estimate_bytes'] / MIB:7.1f} MiB {row['measured_bytes'] / MIB:7.1f}"
              f" MiB {row['error']:+7.1%} {default}  {row['exact_states']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        gpus = gpu_table({**{name: name for name in PRESETS}, "llama-1b shape": llama_1b_dir(Path(tmp))})
    text = markdown(measured, gpus)
    print("\n" + text.split("\n\n", 2)[2])
    worst = max(abs(r["error"]) for r in measured)
    summary = {"worst_abs_error": worst, "within_tolerance": worst <= TOLERANCE,
               "all_states_exact": all(r["exact_states"] for r in measured)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"machine": {"platform": platform.platform(), "torch": torch.__version__,
                                                   "threads": 2}, "summary": summary, "measured": measured,
                                       "gpus": gpus}, indent=2) + "\n")
    args.output.with_suffix(".md").write_text(text)
    print(f"worst error {worst:.1%}; states exact: {summary['all_states_exact']}; wrote {args.output}")


if __name__ == "__main__":
    main()
