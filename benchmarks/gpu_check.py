"""What no CI machine runs: p2ptrain on a CUDA device, in one process (about 3 minutes on an H200).

1. memory: for the `base` preset and a 124M Llama (GPT-2 small's sizes, built from its config, no download), three
   inner steps and one outer step in bf16 autocast (the Llama also in fp16 with the loss scale and the outer state
   on the device, and in bf16 with activation checkpointing); the plan's device peak (memory/plan.py, less the CUDA
   context it assumes) against `torch.cuda.max_memory_allocated`, and tokens/s;
2. a swarm: two peers on loopback share the device and train the 124M model for 3 rounds with DiLoCo's exchange
   all-reduce: both losses fall and the two end in one state;
3. the peer command on the device: a model the plan says does not fit (Llama 2 70B's sizes) is refused at start in
   one line with the plan's advice; on CUDA, with that check off, a batch too big for the device runs out of memory
   and ends in one line with the same advice (a CPU raises no out-of-memory error to show).

    python benchmarks/gpu_check.py                   # a CUDA device
    python benchmarks/gpu_check.py --device cpu --quick   # the same code at toy sizes (CI: test_benchmark_gpu_check)

Prints a table and writes JSON to benchmarks/results/gpu_check.json (--output).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import LlamaConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loopback_sync import CORPUS, NETWORK, PeerRun  # noqa: E402
from p2ptrain.config import build_config  # noqa: E402
from p2ptrain.maths.inner import InnerConfig, InnerTrainer  # noqa: E402
from p2ptrain.maths.outer_optimizer import OuterConfig, OuterOptimizer  # noqa: E402
from p2ptrain.memory.plan import RUNTIME_BYTES, Settings, plan_memory  # noqa: E402
from p2ptrain.memory.shape import model_shape  # noqa: E402
from p2ptrain.models import ModelConfig, build_model  # noqa: E402
from p2ptrain.peer import TrainingPeer  # noqa: E402
from p2ptrain.tensor_layout import distance, norm  # noqa: E402

RESULTS_PATH = REPO / "benchmarks" / "results" / "gpu_check.json"
VOCAB_SIZE = 257  # the byte tokenizer's
GIB = 2**30
# Llama 2 70B's sizes (its config alone, no weights): no single device of today holds its training state
HUGE_LLAMA = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=32000)
OOM_BATCH = 512  # sequences of 1024 tokens of the 124M model in one step: its logits alone take over 100 GiB
PEER_COMMAND_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Size:
    """One run's sizes: the models' (hidden, layers, MLP, heads, vocab) and the steps' batches."""

    preset: str  # the preset measured beside the Llama
    llama: dict[str, int]  # the "124M" model's LlamaConfig sizes
    batch_size: int
    seq_len: int
    steps: int  # inner steps measured (after one warm-up step)
    swarm_batch: int
    swarm_seq_len: int
    swarm_inner_steps: int
    swarm_rounds: int


FULL = Size("base", dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 vocab_size=50304), batch_size=16, seq_len=1024, steps=3, swarm_batch=8, swarm_seq_len=512,
            swarm_inner_steps=40, swarm_rounds=5)
QUICK = Size("tiny", dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                          vocab_size=300), batch_size=2, seq_len=32, steps=2, swarm_batch=2, swarm_seq_len=32,
             swarm_inner_steps=3, swarm_rounds=2)


def llama_dir(size: Size, root: Path) -> str:
    """A local model directory holding only a config.json (what `--model DIR` reads)."""
    directory = root / "llama-124m"
    LlamaConfig(max_position_embeddings=max(size.seq_len, size.swarm_seq_len), num_key_value_heads=size.llama[
        "num_attention_heads"], tie_word_embeddings=True, **size.llama).save_pretrained(directory)
    return str(directory)


def run_peer_command(case: str, model: str, batch_size: int, seq_len: int, device: torch.device, root: Path,
                     check_memory: bool = True) -> dict[str, Any]:
    """`p2ptrain peer --config FILE` in a process of its own, on loopback, for one round: how it ended."""
    config = {"run": {"run_id": f"gpu-check-{uuid.uuid4().hex[:6]}", "rounds": 1, "device": device.type,
                      "progress": False, "check_memory": check_memory},
              "model": {"name": model, "max_seq_len": seq_len},
              "data": {"seq_len": seq_len, "batch_size": batch_size, **CORPUS},
              "network": NETWORK}
    path = root / f"{case.replace(' ', '-')}.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "p2ptrain", "peer", "--config", str(path)], capture_output=True,
                          text=True, timeout=PEER_COMMAND_TIMEOUT_S, cwd=root, env=dict(os.environ))
    lines = done.stderr.strip().splitlines()
    return {"case": case, "exit": done.returncode, "last_line": lines[-1] if lines else "",
            "error_lines": sum(line.startswith("error:") for line in lines),
            "traceback": "Traceback" in done.stderr, "seconds": round(time.perf_counter() - started, 1)}


def check_peer_command(size: Size, device: torch.device, root: Path, llama: str) -> list[dict[str, Any]]:
    """The peer's refusals on this device: the plan at start, and (CUDA) an out-of-memory error with the check off."""
    huge = root / "llama-70b"
    LlamaConfig(max_position_embeddings=4096, **HUGE_LLAMA).save_pretrained(huge)
    rows = [run_peer_command("does not fit", str(huge), size.swarm_batch, size.swarm_seq_len, device, root)]
    if device.type == "cuda":
        rows.append(run_peer_command("out of memory", llama, OOM_BATCH, size.seq_len, device, root,
                                     check_memory=False))
    return rows


def measure_memory(name: str, size: Size, device: torch.device, precision: str = "auto",
                   checkpointing: bool = False, state_device: str = "auto") -> dict[str, Any]:
    """Steps of an InnerTrainer and one outer step: the peak allocated against the plan. `auto` precision is bf16
    autocast on CUDA, fp32 on CPU."""
    precision = ("bf16" if device.type == "cuda" else "fp32") if precision == "auto" else precision
    settings = Settings(batch_size=size.batch_size, seq_len=size.seq_len, precision=precision,
                        activation_checkpointing=checkpointing, state_device=state_device)
    model_config = ModelConfig(name=name, max_seq_len=max(size.seq_len, size.swarm_seq_len))
    plan = plan_memory(model_shape(model_config, VOCAB_SIZE), settings, device.type)
    torch.manual_seed(0)
    model = build_model(model_config, VOCAB_SIZE, seed=0).to(device)
    trainer = InnerTrainer(model, InnerConfig(precision=precision, activation_checkpointing=checkpointing), device)
    outer = OuterOptimizer([p for p in model.parameters() if p.requires_grad], OuterConfig(state_device=state_device))
    batch = torch.randint(0, VOCAB_SIZE, (size.batch_size, size.seq_len))
    losses = [trainer.train_step(batch)]  # warm-up: kernels chosen, allocator primed
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    losses += [trainer.train_step(batch) for _ in range(size.steps)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - started) / size.steps
    outer.step_(outer.outer_gradient())
    losses.append(trainer.train_step(batch))
    measured = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    planned = plan.device_bytes - RUNTIME_BYTES[device.type]  # the context is not an allocation torch counts
    row = {"model": Path(name).name, "parameters": plan.shape.parameters,
           "batch": f"{size.batch_size}x{size.seq_len}",
           "precision": precision + ("+ckpt" if checkpointing else "") + ("/dev" if state_device == "device" else ""),
           "planned_bytes": planned,
           "measured_bytes": measured, "plan_error": None if measured is None else planned / measured - 1,
           "tokens_per_s": size.batch_size * size.seq_len / step_s, "losses": losses,
           "finite": all(math.isfinite(x) for x in losses)}
    del model, trainer, outer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run_swarm(model: str, size: Size, device: torch.device) -> dict[str, Any]:
    """Two peers on loopback share the device for `swarm_rounds` rounds of DiLoCo (the exchange all-reduce)."""
    run_id = f"gpu-check-{uuid.uuid4().hex[:6]}"

    def config(shard: int) -> Any:
        return build_config({
            "run": {"run_id": run_id, "rounds": size.swarm_rounds, "device": str(device), "progress": False,
                    "shard_index": shard, "min_peers": 2},
            "model": {"name": model, "max_seq_len": size.swarm_seq_len},
            "data": {"seq_len": size.swarm_seq_len, "batch_size": size.swarm_batch, **CORPUS},
            "inner": {"steps": size.swarm_inner_steps},
            "sync": {"mode": "diloco"},  # the exact mean: both peers end with one state
            "network": NETWORK,
        })

    started = time.perf_counter()
    peers = [TrainingPeer(config(0))]
    try:
        peers.append(TrainingPeer(config(1), peers[0].maddrs))
        runs = [PeerRun(p) for p in peers]
        for r in runs:
            r.thread.name = f"peer-{r.peer.peer_id[-6:]}"  # the log says which peer a line is of
            r.thread.start()
        for r in runs:
            r.thread.join(600)
        states = [[p.detach().float().cpu() for p in peer.params] for peer in peers]
    finally:
        for p in peers:
            p.shutdown()
    histories = [r.history for r in runs]
    return {"peers": 2, "rounds": [len(h) for h in histories], "errors": [r.error for r in runs if r.error],
            "val_loss": [[round(m.val_loss, 4) for m in h] for h in histories],
            "peers_averaged": [[m.peers_averaged for m in h] for h in histories],
            "round_s": [[round(m.round_s, 2) for m in h] for h in histories],
            "failed_refused": [[(m.failed_exchanges, m.refused_exchanges) for m in h] for h in histories],
            "tokens_per_s": [round(sum(m.tokens_per_s for m in h) / max(1, len(h))) for h in histories],
            "state_distance": distance(states[0], states[1]) / max(norm(states[0]), 1e-12),
            "wall_s": time.perf_counter() - started}


def verdict(report: dict[str, Any]) -> list[str]:
    """What must hold; an empty list passes."""
    problems = [f"{row['model']}: a loss is not finite" for row in report["memory"] if not row["finite"]]
    # the plan guards a peer's start: below the peak it lets an out-of-memory through, above it refuses too early
    problems += [f"{row['model']} {row['precision']}: the plan is {100 * row['plan_error']:+.1f} % off the peak"
                 for row in report["memory"] if row["plan_error"] is not None and not -0.05 <= row["plan_error"] <= 0.2]
    swarm = report["swarm"]
    problems += [f"swarm: {e}" for e in swarm["errors"]]
    if any(n != swarm["rounds_asked"] for n in swarm["rounds"]):
        problems.append(f"swarm: rounds run {swarm['rounds']}, not {swarm['rounds_asked']} each")
    if not all(h and h[-1] < h[0] for h in swarm["val_loss"]):
        problems.append(f"swarm: a validation loss did not fall: {swarm['val_loss']}")
    if not all(2 in averaged for averaged in swarm["peers_averaged"]):
        problems.append(f"swarm: no round averaged both peers: {swarm['peers_averaged']}")
    if swarm["state_distance"] > 1e-4:
        problems.append(f"swarm: the peers end {swarm['state_distance']:.2e} apart (relative)")
    said = {"does not fit": "does not fit its device", "out of memory": "memory at round"}
    for row in report.get("peer_command", []):
        if row["exit"] != 2 or row["traceback"] or row["error_lines"] != 1 or said[row["case"]] not in row["last_line"]:
            problems.append(f"peer command, {row['case']}: exit {row['exit']}, traceback {row['traceback']}, "
                            f"last line {row['last_line'][:200]!r}")
    return problems


def table(report: dict[str, Any]) -> str:
    lines = [f"device: {report['device_name']} (torch {report['torch']})", "",
             f"{'model':<12}{'params':>12}{'batch':>10}{'precision':>15}{'plan GiB':>10}{'measured':>10}{'error':>8}"
             f"{'tok/s':>10}"]
    for r in report["memory"]:
        measured = f"{r['measured_bytes'] / GIB:.2f}" if r["measured_bytes"] is not None else "-"
        error = f"{100 * r['plan_error']:+.1f}%" if r["plan_error"] is not None else "-"
        lines.append(f"{r['model']:<12}{r['parameters']:>12,}{r['batch']:>10}{r['precision']:>15}"
                     f"{r['planned_bytes'] / GIB:>10.2f}{measured:>10}{error:>8}{r['tokens_per_s']:>10.0f}")
    s = report["swarm"]
    lines += ["", f"swarm of 2 on one device: rounds {s['rounds']}, val loss {s['val_loss']}, peers averaged "
                  f"{s['peers_averaged']}, tokens/s per peer {s['tokens_per_s']}, end distance "
                  f"{s['state_distance']:.1e}, {s['wall_s']:.0f} s", "",
              ""]
    lines += [f"peer command, {r['case']}: exit {r['exit']} in {r['seconds']:.0f} s, {r['last_line'][:160]}"
              for r in report.get("peer_command", [])]
    lines += ["", "PASS" if not report["problems"] else "FAIL: " + "; ".join(report["problems"])]
    return "\n".join(lines)


def run(device: torch.device, size: Size, output: Path, memory_rows: bool = True) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        llama = llama_dir(size, Path(root))
        memory = [measure_memory(size.preset, size, device), measure_memory(llama, size, device),
                  measure_memory(llama, size, device, "fp16", state_device="device"),
                  measure_memory(llama, size, device, "bf16", checkpointing=True)] if memory_rows else []
        swarm = dict(run_swarm(llama, size, device), rounds_asked=size.swarm_rounds)
        peer_command = check_peer_command(size, device, Path(root), llama)
    report = {"device": str(device), "torch": torch.__version__, "memory": memory, "swarm": swarm,
              "peer_command": peer_command,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    report["problems"] = verdict(report)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="toy sizes (what CI runs on CPU)")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH, help="where the JSON goes")
    parser.add_argument("--swarm-only", action="store_true", help="skip the memory rows")
    args = parser.parse_args()
    logging.basicConfig(format="%(asctime)s %(threadName)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("p2ptrain").setLevel(logging.INFO)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: --device cpu --quick runs the CPU path")
    report = run(device, QUICK if args.quick else FULL, args.output, memory_rows=not args.swarm_only)
    print(table(report))
    sys.exit(1 if report["problems"] else 0)


if __name__ == "__main__":
    main()
