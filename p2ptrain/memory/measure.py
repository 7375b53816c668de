"""Measure what a peer's training really holds on CPU, to check the memory plan against: the tensors of a real
InnerTrainer run (parameters, AdamW state, gradients), counted exactly, and the process's peak RSS.

Each configuration runs in a fresh subprocess (`python -m p2ptrain.memory.measure`), so peaks do not mix. Its
baseline is the RSS once torch, transformers and the trainer are imported, before any model exists; the peak is
reset to it there (Linux), so a peak of the imports does not hide a smaller one of the run. The run
builds the model, an InnerTrainer and an OuterOptimizer (anchor; the outer momentum appears at the first outer
step), takes `steps` inner steps, one outer step, and `steps` more on random tokens (no data pipeline, no network).

glibc keeps freed blocks below its dynamic mmap threshold in its heap, so by default RSS stays near the highest
sum of live and cached blocks (about a third above the live tensors after a few steps); with `live_rss` (the
default) the subprocess runs with MALLOC_MMAP_THRESHOLD_=65536 so large tensors are mmapped and returned when
freed, and RSS follows what is allocated, which is what the plan estimates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from p2ptrain.errors import UserError, one_line
from p2ptrain.maths.inner import InnerConfig, InnerTrainer
from p2ptrain.maths.outer_optimizer import OuterConfig, OuterOptimizer
from p2ptrain.memory.plan import Settings
from p2ptrain.models import ModelConfig, build_model
from p2ptrain.timing import HUNG_AFTER_S

VOCAB_SIZE = 257  # the byte tokenizer's, which presets get by default
LIVE_RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One configuration's counted tensors and RSS, in bytes."""

    model: str
    settings: Settings
    parameters_bytes: int
    optimizer_bytes: int
    gradients_bytes: int
    baseline_bytes: int  # RSS after imports, before the model (the peak is reset to it)
    peak_bytes: int  # peak RSS after the run
    live_rss: bool  # measured with large blocks returned to the system when freed

    @property
    def delta_bytes(self) -> int:
        return self.peak_bytes - self.baseline_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Measurement:
        return cls(**dict(values, settings=Settings(**values["settings"])))


def peak_rss_bytes() -> int:
    """This process's peak RSS: the kernel's high-water mark of its own memory map (VmHWM). getrusage's ru_maxrss
    reads the same mark but also keeps the one of the map before exec, which a vforked child shares with its
    parent: a subprocess of a large process would start from its parent's peak."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))


def reset_peak_rss() -> None:
    """Make the peak RSS the current RSS (Linux: writing 5 to /proc/self/clear_refs); a no-op elsewhere."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def measure_here(model_name: str, settings: Settings, steps: int = 2, live_rss: bool = False) -> Measurement:
    """Run the measurement in this process (call it in a fresh one: `measure`)."""
    from transformers import LlamaForCausalLM  # noqa: F401  # in the baseline: models.py imports it only to build one

    reset_peak_rss()
    baseline = peak_rss_bytes()
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=model_name, max_seq_len=max(512, settings.seq_len)), VOCAB_SIZE, seed=0)
    trainer, seen = _trainer(model, settings)
    outer = OuterOptimizer([p for p in model.parameters() if p.requires_grad], OuterConfig())
    grads = [0]

    def count_grads(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        grads[0] = sum(p.grad.numel() * p.grad.element_size() for p in outer.params if p.grad is not None)

    trainer.optimizer.register_step_pre_hook(count_grads)
    generator = torch.Generator().manual_seed(0)
    for step in range(2 * steps):
        if step == steps:
            outer.step_(outer.outer_gradient())
        trainer.train_step(torch.randint(0, VOCAB_SIZE, (settings.batch_size, settings.seq_len), generator=generator))
    if seen["autocast"] != (settings.precision in ("bf16", "fp16")):
        raise RuntimeError(f"asked for precision {settings.precision} but autocast was {seen['autocast']}")
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return Measurement(model_name, settings, sum(p.numel() * p.element_size() for p in outer.params),
                       sum(t.numel() * t.element_size() for t in state), grads[0], baseline, peak_rss_bytes(),
                       live_rss)


def _trainer(model: torch.nn.Module, settings: Settings) -> tuple[InnerTrainer, dict[str, bool]]:
    """An InnerTrainer with `settings`' inner knobs, and whether its forward really ran under autocast (`seen`)."""
    config = InnerConfig(micro_batches=settings.micro_batches, precision=settings.precision,
                         activation_checkpointing=settings.activation_checkpointing)
    trainer = InnerTrainer(model, config, torch.device("cpu"))
    seen = {"autocast": False}

    def note_autocast(_module: Any, _args: Any) -> None:
        seen["autocast"] = seen["autocast"] or torch.is_autocast_enabled("cpu")

    model.register_forward_pre_hook(note_autocast)
    return trainer, seen


def measure(model_name: str, settings: Settings, steps: int = 2, live_rss: bool = True,
            threads: int = 2) -> Measurement:
    """Measure in a fresh subprocess (peaks do not mix); `live_rss`: RSS follows live allocations (see above)."""
    args = [sys.executable, "-m", "p2ptrain.memory.measure", "--model", model_name, "--steps", str(steps),
            "--settings", json.dumps(dataclasses.asdict(settings)), "--threads", str(threads)]
    env = dict(os.environ, **(LIVE_RSS_ENV if live_rss else {}))
    if not live_rss:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=HUNG_AFTER_S)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {model_name} {settings} failed: {done.stderr.strip()[-2000:]}")
    return Measurement.from_dict(dict(json.loads(done.stdout.strip().splitlines()[-1]), live_rss=live_rss))


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure one training configuration's memory (prints JSON).")
    parser.add_argument("--model", required=True)
    parser.add_argument("--settings", required=True, help="JSON of p2ptrain.memory.plan.Settings")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        settings = Settings(**json.loads(args.settings))
        measured = measure_here(args.model, settings, args.steps, "MALLOC_MMAP_THRESHOLD_" in os.environ)
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(measured.to_dict()))


if __name__ == "__main__":
    main()
