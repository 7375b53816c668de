"""Inner-step overhead of a p2ptrain peer against a bare PyTorch training loop, on CPU, in one process.

A "peer":  the inner path a TrainingPeer runs between exchanges, built the way peer.py builds it: the byte
           tokenizer, `TextShards` (batches cut from the token stream at each step) and `InnerTrainer.train_step`
           (AdamW, LambdaLR warmup + cosine, gradient clipping, the loss read back as a float every step).
B "bare":  `torch.optim.AdamW` with the same hyper-parameters on the same model preset and the same batches,
           materialised before timing; forward, backward, step, zero_grad, nothing else.

No exchange, no averaging, no network: this measures what the library adds to an inner step. The two run
interleaved (A B A B ...), each repetition from the same initial weights with untimed warm-up steps, under the
same `torch.set_num_threads`. Prints a table and writes JSON to benchmarks/results/overhead.json.

    python benchmarks/overhead.py --model small --steps 30 --repeats 4 --threads 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from p2ptrain.config import PeerConfig, build_config  # noqa: E402
from p2ptrain.data import TextShards, build_tokenizer  # noqa: E402
from p2ptrain.maths.inner import InnerTrainer  # noqa: E402
from p2ptrain.models import build_model, count_parameters  # noqa: E402

RESULTS_PATH = REPO / "benchmarks" / "results" / "overhead.json"
TARGET_RATIO = 0.97
SHARD_INDEX = 0
DATA_SEED = 1234
WARMUP_STEPS = 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="model preset (tiny, small, base)")
    parser.add_argument("--steps", type=int, default=30, help="timed inner steps per repetition")
    parser.add_argument("--repeats", type=int, default=4, help="repetitions of each variant (interleaved)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = torch's default")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH, help="where to write the JSON results")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1 or args.threads < 0:
        parser.error("--steps and --repeats must be >= 1, --threads >= 0")
    return args


def peer_steps(config: PeerConfig, shards: TextShards, vocab_size: int) -> Callable[[int], float]:
    """Variant A: a fresh InnerTrainer fed live from TextShards, as TrainingPeer does."""
    model = build_model(config.model, vocab_size, config.run.seed)
    trainer = InnerTrainer(model, config.inner, torch.device("cpu"))
    batches = shards.train_batches(seed=DATA_SEED)

    def run(steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(next(batches))
        return time.perf_counter() - started

    return run


def bare_steps(config: PeerConfig, batches: list[torch.Tensor], vocab_size: int) -> Callable[[int], float]:
    """Variant B: plain AdamW on pre-materialised batches."""
    model = build_model(config.model, vocab_size, config.run.seed)
    model.train()
    inner = config.inner
    optimizer = torch.optim.AdamW(model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2),
                                  weight_decay=inner.weight_decay)
    source: Iterator[torch.Tensor] = iter(batches)

    def run(steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            batch = next(source)
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    return run


def measure(make_run: Callable[[], Callable[[int], float]], steps: int, tokens_per_step: int) -> float:
    """Tokens per second of `steps` timed steps after WARMUP_STEPS untimed ones."""
    run = make_run()
    run(WARMUP_STEPS)
    return steps * tokens_per_step / run(steps)


def benchmark(args: argparse.Namespace) -> dict[str, object]:
    config = build_config({"model": {"name": args.model}, "run": {"device": "cpu"}})
    tokenizer = build_tokenizer(config.data)
    shards = TextShards(config.data, tokenizer, SHARD_INDEX)
    total_steps = WARMUP_STEPS + args.steps
    same_batches = list(itertools.islice(shards.train_batches(seed=DATA_SEED), total_steps))
    tokens_per_step = config.data.batch_size * config.data.seq_len
    peer, bare = [], []
    for _ in range(args.repeats):  # interleaved A B A B ...
        peer.append(measure(lambda: peer_steps(config, shards, tokenizer.vocab_size), args.steps, tokens_per_step))
        bare.append(measure(lambda: bare_steps(config, same_batches, tokenizer.vocab_size), args.steps,
                            tokens_per_step))
    peer_median, bare_median = statistics.median(peer), statistics.median(bare)
    return {
        "model": args.model,
        "parameters": count_parameters(build_model(config.model, tokenizer.vocab_size, 0)),
        "batch_size": config.data.batch_size,
        "seq_len": config.data.seq_len,
        "grad_clip": config.inner.grad_clip,
        "steps": args.steps,
        "warmup_steps": WARMUP_STEPS,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "peer_tokens_per_s": peer,
        "bare_tokens_per_s": bare,
        "peer_median_tokens_per_s": peer_median,
        "bare_median_tokens_per_s": bare_median,
        "ratio": peer_median / bare_median,
        "pair_ratios": [a / b for a, b in zip(peer, bare, strict=True)],
        "target_ratio": TARGET_RATIO,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def print_table(result: dict[str, object]) -> None:
    peer, bare = result["peer_tokens_per_s"], result["bare_tokens_per_s"]
    assert isinstance(peer, list) and isinstance(bare, list)
    print(f"model {result['model']} ({result['parameters']:,} parameters), batch {result['batch_size']} x "
          f"{result['seq_len']} tokens, {result['steps']} timed steps x {result['repeats']} repeats, "
          f"{result['threads']} threads")
    print(f"{'variant':<34}{'median tok/s':>14}{'min':>10}{'max':>10}")
    print(f"{'A  p2ptrain inner path':<34}{statistics.median(peer):>14.0f}{min(peer):>10.0f}{max(peer):>10.0f}")
    print(f"{'B  bare torch AdamW loop':<34}{statistics.median(bare):>14.0f}{min(bare):>10.0f}{max(bare):>10.0f}")
    pairs = ", ".join(f"{r:.3f}" for r in result["pair_ratios"])  # type: ignore[attr-defined]
    verdict = "meets" if float(result["ratio"]) >= TARGET_RATIO else "BELOW"  # type: ignore[arg-type]
    print(f"ratio A/B (medians) {float(result['ratio']):.3f}  [per pair: {pairs}]  {verdict} target "  # type: ignore[arg-type]
          f">= {TARGET_RATIO}")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = benchmark(args)
    print_table(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
