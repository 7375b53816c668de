"""Seconds per inner step when several trainers share this machine, one process and one torch thread each.

That is how the netns testnet's peers run, so a benchmark can size H to give an inner phase of a chosen length on
whatever machine it runs on, instead of a fixed H whose phase is 3 times longer on a slow morning than on a fast one.
"""

from __future__ import annotations

import json
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WARMUP_STEPS = 3
READY = "ready"  # a child's first line: its model is built and warm
CHILD = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import json; from benchmarks.step_timing import _time_steps; "
         "_time_steps(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))")


def _time_steps(config_values: dict[str, Any], shard: int, steps: int) -> None:
    """In a child process: build the peer's model and batches, say so, wait for the word, time `steps` steps."""
    import torch

    from p2ptrain.config import build_config
    from p2ptrain.data import TextShards, build_tokenizer
    from p2ptrain.maths.inner import InnerTrainer
    from p2ptrain.models import build_model

    torch.set_num_threads(1)
    config = build_config(config_values)
    tokenizer = build_tokenizer(config.data)
    shards = TextShards(config.data, tokenizer, shard % config.data.num_shards)
    trainer = InnerTrainer(build_model(config.model, tokenizer.vocab_size, config.run.seed), config.inner,
                           torch.device("cpu"))
    batches = shards.train_batches(seed=0)
    trainer.run_phase(batches, WARMUP_STEPS)
    print(READY, flush=True)
    sys.stdin.readline()  # every sibling is ready: they time their steps together
    print(trainer.run_phase(batches, steps).compute_s / steps, flush=True)


def step_seconds(config_values: dict[str, Any], trainers: int, steps: int = 20, timeout_s: float = 300.0) -> float:
    """Median seconds per inner step over `trainers` processes training `config_values`'s model at once. (Plain
    subprocesses: multiprocessing's would start its resource tracker, a process that outlives the call.)"""
    if trainers < 1 or steps < 1:
        raise ValueError("trainers and steps must be >= 1")
    deadline = time.monotonic() + timeout_s
    children = [subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(config_values), str(i), str(steps)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                for i in range(trainers)]
    try:
        for child in children:
            if _line(child, deadline) != READY:
                raise RuntimeError("step timing: a trainer process failed before it was ready")
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        return statistics.median(float(_line(child, deadline)) for child in children)
    finally:
        for child in children:
            child.kill()
            child.wait()


def _line(child: subprocess.Popen, deadline: float) -> str:
    """The child's next line of output; a child that died (its output ends) or a deadline passed is an error."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], max(0.0, deadline - time.monotonic()))
    line = child.stdout.readline() if ready else None
    if line is None:
        raise TimeoutError("step timing: the trainers did not report in time")
    if not line:
        raise RuntimeError(f"step timing: a trainer process failed (exit code {child.wait()})")
    return line.strip()
