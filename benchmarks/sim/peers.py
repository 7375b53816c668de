"""The algorithm benchmark's workbench and simulated peers: data shards, θ_0, the model, inner phases, outer steps.

N peers, each with its own model replica, training shard (``TextShards(..., shard_index=i)``) and ``InnerTrainer``,
run rounds of H inner AdamW steps. Every row but GASLoC and CHOCO steps with production's ``OuterOptimizer`` (one per
peer, over its own parameters).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from transformers import LlamaConfig

from benchmarks.sim.rows import MODEL_SHAPES, Algorithm, Settings
from p2ptrain.config import PeerConfig, build_config
from p2ptrain.data import TextShards, build_tokenizer
from p2ptrain.maths.codecs import Codec, ErrorFeedback, get_codec
from p2ptrain.maths.inner import InnerTrainer
from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.maths.outer_rules import DelayedOuterGradient, GaslocState
from p2ptrain.models import build_model

Tensors = list[torch.Tensor]
PAPER_OUTER = {"lr": 0.7, "momentum": 0.9}


@dataclasses.dataclass
class Bench:
    """What every row of one seed shares: settings, data shards, validation batches, θ_0 and the evaluation model."""

    settings: Settings
    config: PeerConfig
    shards: list[TextShards]
    validation: list[torch.Tensor]
    vocab_size: int
    theta0: Tensors
    eval_trainer: InnerTrainer
    model_bytes: int  # fp32 bytes of the model's parameters


def model_name(name: str, vocab_size: int, max_seq_len: int) -> str:
    """A preset's name as it is, or a directory holding the Llama config of a MODEL_SHAPES entry (built from that
    directory by production's ``build_model``, as a volunteer's local model would be)."""
    if name not in MODEL_SHAPES:
        return name
    directory = Path(tempfile.gettempdir()) / "p2ptrain-benchmark-models" / f"{name}-v{vocab_size}-s{max_seq_len}"
    if not (directory / "config.json").exists():
        shape = MODEL_SHAPES[name]
        LlamaConfig(vocab_size=vocab_size, max_position_embeddings=max_seq_len, tie_word_embeddings=True,
                    num_key_value_heads=shape["num_attention_heads"], bos_token_id=None, eos_token_id=None,
                    pad_token_id=None, **shape).save_pretrained(directory)
    return str(directory)


def build_bench(s: Settings) -> Bench:
    total_steps = s.rounds * s.inner_steps
    values = {
        "run": {"device": "cpu", "seed": s.seed},
        "data": {"seq_len": s.seq_len, "batch_size": s.batch_size, "val_batches": s.val_batches,
                 "max_corpus_bytes": s.max_corpus_bytes, "num_shards": s.peers},
        "inner": {"steps": s.inner_steps, "total_steps": total_steps, "warmup_steps": min(20, total_steps // 10)},
        # DiLoCo's paper recipe, with which every published table of this workbench ran (rows set their own γ and
        # η); production's defaults are γ 0 and η 1 (benchmarks/outer_step.py)
        "outer": dict(PAPER_OUTER),
    }
    tokenizer = build_tokenizer(build_config(values).data)
    max_seq_len = max(512, s.seq_len)
    values["model"] = {"name": model_name(s.model, tokenizer.vocab_size, max_seq_len), "max_seq_len": max_seq_len}
    config = build_config(values)
    shards = [TextShards(config.data, tokenizer, shard_index=i) for i in range(s.peers)]
    eval_model = build_model(config.model, tokenizer.vocab_size, s.seed)
    theta0 = [p.detach().clone() for p in eval_model.parameters()]
    return Bench(s, config, shards, shards[0].validation_batches(), tokenizer.vocab_size, theta0,
                 InnerTrainer(eval_model, config.inner, torch.device("cpu")), 4 * sum(t.numel() for t in theta0))


@dataclasses.dataclass
class SimPeer:
    """One simulated peer: its replica, inner trainer and batches, θ, the row's outer state, and counters."""

    index: int
    params: list[torch.nn.Parameter]
    trainer: InnerTrainer
    batches: Iterator[torch.Tensor]
    theta: Tensors  # the point the next inner phase starts from
    outer: OuterOptimizer | None = None  # every row but GASLoC and CHOCO: the production outer optimizer
    gasloc: GaslocState | None = None
    delayed: DelayedOuterGradient | None = None
    feedback: ErrorFeedback | None = None  # rows with a sparse codec
    compute_s: float = 0.0
    steps: int = 0
    bytes_sent: float = 0.0


def row_codec(row: Algorithm) -> Codec:
    """The codec of what the row's peers exchange (Δ, or CHOCO's corrections)."""
    return get_codec(row.codec, **row.codec_options)


def make_peers(row: Algorithm, bench: Bench) -> list[SimPeer]:
    cfg, peers = bench.config, []
    momentum = cfg.outer.momentum if row.kind == "factored" and row.mix2_overlap == "none" else row.momentum
    outer_config = dataclasses.replace(cfg.outer, momentum=momentum, lr=row.outer_lr or cfg.outer.lr)
    for i in range(bench.settings.peers):
        model = build_model(cfg.model, bench.vocab_size, cfg.run.seed)  # the same θ_0 on every peer
        params = list(model.parameters())
        batches = bench.shards[i].train_batches(seed=1000 * cfg.run.seed + i)  # the same batches in every row
        peer = SimPeer(i, params, InnerTrainer(model, cfg.inner, torch.device("cpu")), batches, clone(params))
        if row.kind in ("gasloc", "choco"):
            peer.gasloc = GaslocState(peer.theta, momentum)
        else:
            peer.outer = OuterOptimizer(params, outer_config)
        if row.kind == "delayed" or row.mix2_overlap != "none" or (row.kind == "gradgossip" and row.overlap):
            peer.delayed = DelayedOuterGradient(row.eager or row.local or row.mix2_overlap in ("eager", "local"))
        if row.codec in ("topk", "sparse") and row.kind != "choco":
            peer.feedback = ErrorFeedback(row_codec(row), peer.theta, decay=row.ef_decay)
        peers.append(peer)
    return peers


def clone(tensors: Sequence[torch.Tensor]) -> Tensors:
    return [t.detach().clone() for t in tensors]


def inner_phase_(peer: SimPeer, steps: int) -> Tensors:
    """Run ``steps`` AdamW steps from θ; return the outer gradient Δ = θ − θ'."""
    with torch.no_grad():
        for param, start in zip(peer.params, peer.theta, strict=True):
            param.copy_(start)
    result = peer.trainer.run_phase(peer.batches, steps)
    peer.compute_s += result.compute_s
    peer.steps += result.steps
    return [start - param.detach() for start, param in zip(peer.theta, peer.params, strict=True)]


def outer_step_(peer: SimPeer, outer_gradient: Sequence[torch.Tensor]) -> None:
    """θ ← the production outer step (Nesterov SGD, the peer's momentum) from θ along ``outer_gradient``."""
    assert peer.outer is not None
    peer.outer.set_params_(peer.theta)  # θ is the anchor, whatever the inner phase left in the parameters
    peer.outer.step_(outer_gradient)
    peer.theta = clone(peer.params)


def validation_loss(bench: Bench, theta: Tensors) -> float:
    with torch.no_grad():
        for param, value in zip(bench.eval_trainer.model.parameters(), theta, strict=True):
            param.copy_(value)
    return bench.eval_trainer.evaluate(bench.validation)
