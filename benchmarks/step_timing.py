"""Seconds per inner step when several trainers share this machine, one process and one torch thread each.

That is how the netns testnet's peers run, so a benchmark can size H to give an inner phase of a chosen length on
whatever machine it runs on, instead of a fixed H whose phase is 3 times longer on a slow morning than on a fast one.

    python benchmarks/step_timing.py [--trainers 6] [--steps 20] [--model tiny]
"""

from __future__ import annotations

import argparse
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

from p2ptrain.config import build_config  # noqa: E402
from p2ptrain.errors import UserError  # noqa: E402

WARMUP_STEPS = 3
READY = "ready"  # a child's first line: its model is built and warm
CHILD = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import json; from benchmarks.step_timing import _time_steps; "
         "_time_steps(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))")


def _time_steps(config_values: dict[str, Any], shard: int, steps: int) -> None:
    """In a child process: build the peer's model and batches, say so, wait for the word, time `steps` steps."""
    import torch

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Seconds per inner step with several trainer processes at once "
                                                 "(one torch thread each), as the netns testnet's peers train")
    parser.add_argument("--trainers", type=int, default=6, help="processes training at once")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per process (after a warm-up)")
    parser.add_argument("--model", default="tiny", help="a model preset")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    if min(args.trainers, args.steps, args.seq_len, args.batch_size) < 1:
        parser.error("--trainers, --steps, --seq-len and --batch-size must be >= 1")
    config = {"model": {"name": args.model, "max_seq_len": args.seq_len},
              "data": {"seq_len": args.seq_len, "batch_size": args.batch_size, "max_corpus_bytes": 2_000_000}}
    try:
        build_config(config)  # a bad value is one line here, not a child's traceback
        seconds = step_seconds(config, args.trainers, args.steps)
    except (UserError, RuntimeError, TimeoutError) as e:
        print(f"step_timing: {e}", file=sys.stderr)
        return 1
    print(f"{args.trainers} trainers at once: {seconds * 1e3:.1f} ms a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
