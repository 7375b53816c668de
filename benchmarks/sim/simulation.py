"""The simulated peers of the algorithm benchmark: inner phases, the exchange of each row, and training a row.

N peers, each with its own model replica, training shard (``TextShards(..., shard_index=i)``) and ``InnerTrainer``,
run rounds of H inner AdamW steps. No network: exchanges go through the codecs of ``p2ptrain.maths.codecs`` on
local copies, bytes are counted from the real payloads, and the outer steps are production's: every row but
GASLoC steps with ``OuterOptimizer`` (one per peer, over its own parameters), Mix1 and the gossip rows mix with
``p2ptrain.maths.mixing.pull_toward_`` and ``benchmarks.sim.graphs.mix_``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from benchmarks.scale.model import butterfly_payloads
from benchmarks.sim.graphs import Neighbours, complete_graph, mix_, mixing_weights, random_cycle_graph, random_matching
from benchmarks.sim.rows import Algorithm, Settings
from p2ptrain.config import PeerConfig, build_config
from p2ptrain.data import TextShards, build_tokenizer
from p2ptrain.maths.codecs import (
    ErrorFeedback,
    compress_all,
    decode_all,
    get_codec,
    relative_decode,
    relative_encode,
)
from p2ptrain.maths.inner import InnerTrainer
from p2ptrain.maths.mixing import exact_average, pull_toward_
from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.maths.outer_rules import DelayedOuterGradient, GaslocState, propose
from p2ptrain.models import build_model
from p2ptrain.net.wire import payload_bytes

Tensors = list[torch.Tensor]
Graphs = tuple[list[Neighbours], list[Neighbours]]  # per round: (GASLoC's graph or Mix1's matching, Mix2's cycle)


# ---- the shared workbench and the simulated peers ---------------------------------------------------------------


@dataclasses.dataclass
class Bench:
    """What every row shares: settings, data shards, validation batches, θ_0 and the model used for evaluation."""

    settings: Settings
    config: PeerConfig
    shards: list[TextShards]
    validation: list[torch.Tensor]
    vocab_size: int
    theta0: Tensors
    eval_trainer: InnerTrainer
    model_bytes: int  # fp32 bytes of the model's parameters


def build_bench(s: Settings) -> Bench:
    total_steps = s.rounds * s.inner_steps
    config = build_config({
        "run": {"device": "cpu", "seed": s.seed},
        "model": {"name": s.model, "max_seq_len": max(512, s.seq_len)},
        "data": {"seq_len": s.seq_len, "batch_size": s.batch_size, "val_batches": s.val_batches,
                 "max_corpus_bytes": s.max_corpus_bytes, "num_shards": s.peers},
        "inner": {"steps": s.inner_steps, "total_steps": total_steps, "warmup_steps": min(20, total_steps // 10)},
    })
    tokenizer = build_tokenizer(config.data)
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
    outer: OuterOptimizer | None = None  # every row but GASLoC: the production outer optimizer over ``params``
    gasloc: GaslocState | None = None
    delayed: DelayedOuterGradient | None = None
    feedback: ErrorFeedback | None = None  # topk rows
    compute_s: float = 0.0
    steps: int = 0
    bytes_sent: float = 0.0


def make_peers(row: Algorithm, bench: Bench) -> list[SimPeer]:
    cfg, peers = bench.config, []
    momentum = cfg.outer.momentum if row.kind == "factored" and row.mix2_overlap == "none" else row.momentum
    for i in range(bench.settings.peers):
        model = build_model(cfg.model, bench.vocab_size, cfg.run.seed)  # the same θ_0 on every peer
        params = list(model.parameters())
        batches = bench.shards[i].train_batches(seed=1000 * cfg.run.seed + i)  # the same batches in every row
        peer = SimPeer(i, params, InnerTrainer(model, cfg.inner, torch.device("cpu")), batches, _clone(params))
        if row.kind == "gasloc":
            peer.gasloc = GaslocState(peer.theta, momentum)
        else:
            peer.outer = OuterOptimizer(params, dataclasses.replace(cfg.outer, momentum=momentum))
        if row.kind == "delayed" or row.mix2_overlap != "none":
            peer.delayed = DelayedOuterGradient(row.eager or row.mix2_overlap == "eager")
        if row.codec == "topk":
            peer.feedback = ErrorFeedback(get_codec("topk", density=row.density), peer.theta)
        peers.append(peer)
    return peers


def _clone(tensors: Sequence[torch.Tensor]) -> Tensors:
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
    peer.theta = _clone(peer.params)


# ---- exchanges: what each row does after the inner phase (bytes sent per peer returned) -------------------------


def send_parameters(codec: str, tensors: Tensors, reference: Tensors) -> tuple[Tensors, int]:
    """What a partner decodes, and the payload bytes: exact fp32, or codec(θ − reference) (ALGORITHMS.md §5)."""
    if codec == "none":
        msgs = compress_all(get_codec("none"), tensors)
        return decode_all("none", msgs, like=tensors), payload_bytes(msgs)
    msgs = relative_encode(tensors, reference, codec)
    return relative_decode(msgs, reference, codec), payload_bytes(msgs)


def allreduce_factor(row: Algorithm, n: int) -> float:
    """Payloads a peer sends per round: all-gather of sparse top-k (SparseLoCo) n−1, butterfly 2(n−1)/n."""
    return float(n - 1) if row.codec == "topk" else butterfly_payloads(n)


def average_deltas(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors]) -> tuple[Tensors, dict]:
    """The all-reduced Δ through the row's codec, and the bytes each peer sends."""
    factor = allreduce_factor(row, len(peers))
    if row.codec == "topk":  # error feedback: e ← e + Δ; send topk(e); e ← e − sent
        sent, nbytes = [], {}
        for peer in peers:
            assert peer.feedback is not None
            msgs, decoded = peer.feedback.prepare(deltas[peer.index])
            peer.feedback.commit_(decoded)
            sent.append(decoded)
            nbytes[peer.index] = factor * payload_bytes(msgs)
        return exact_average(sent), nbytes
    codec = get_codec(row.codec)
    encoded = {peer.index: compress_all(codec, deltas[peer.index]) for peer in peers}
    mean = exact_average([decode_all(row.codec, msgs, like=deltas[i]) for i, msgs in encoded.items()])
    if row.codec != "none":  # the butterfly's all-gather phase sends the averaged parts through the codec again
        mean = decode_all(row.codec, compress_all(codec, mean), like=mean)
    return mean, {i: factor * payload_bytes(msgs) for i, msgs in encoded.items()}


def _partners(graph: Neighbours, i: int, present: dict[int, SimPeer]) -> tuple[list[int], list[float]]:
    pairs = [(j, w) for j, w in zip(graph[i], mixing_weights(graph, i), strict=True) if j in present]
    return [j for j, _ in pairs], [w for _, w in pairs]


def mix1_pull(theta: Tensors, partner_thetas: Sequence[Tensors], weights: Sequence[float]) -> Tensors:
    """Mix1's correction ``c = Σ_j w_j (θ_j − θ_i)``, one edge at a time as the live mix does (0 with no partner)."""
    correction = [torch.zeros_like(t) for t in theta]
    for partner, weight in zip(partner_thetas, weights, strict=True):
        pull_toward_(correction, partner, theta, weight)
    return correction


def exchange_diloco(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors], r: int, graphs: Graphs,
                    bench: Bench, carry: dict) -> dict:
    mean, nbytes = average_deltas(row, peers, deltas)
    for peer in peers:
        outer_step_(peer, mean)
    return nbytes


def exchange_gasloc(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors], r: int, graphs: Graphs,
                    bench: Bench, carry: dict) -> dict:
    present, graph = {p.index: p for p in peers}, graphs[0][r]
    proposals = {i: propose(p.theta, deltas[i], bench.config.outer.lr) for i, p in present.items()}
    received = {i: send_parameters(row.param_codec, y, bench.theta0) for i, y in proposals.items()}
    for i, peer in present.items():
        partners, weights = _partners(graph, i, present)
        mixed = _clone(proposals[i])
        mix_(mixed, [received[j][0] for j in partners], weights)
        assert peer.gasloc is not None
        peer.theta = peer.gasloc.momentum_step(mixed)
    return {i: len(graph[i]) * received[i][1] for i in present}


def exchange_factored(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors], r: int, graphs: Graphs,
                      bench: Bench, carry: dict) -> dict:
    """θ⁺ = OuterStep(θ, mixed Δ) + Mix1's correction, in the order of p2ptrain/sync/factored.py; with
    `mix2_overlap`, the step takes the Mix2 result of the round before (DelayedOuterGradient, as FactoredSync)."""
    present, matching, cycle = {p.index: p for p in peers}, graphs[0][r], graphs[1][r]
    frozen = {i: send_parameters(row.param_codec, p.theta, bench.theta0) for i, p in present.items()}
    mix2 = (r + 1) % row.mix2_every == 0
    pending: dict[int, tuple[Tensors, float] | None] = carry.setdefault("pending", {})
    nbytes = {}
    for i, peer in present.items():
        partners, weights = _partners(matching, i, present)
        correction = mix1_pull(peer.theta, [frozen[j][0] for j in partners], weights)
        mixed, own_weight = _clone(deltas[i]), 1.0
        nbytes[i] = float(len(matching[i]) * frozen[i][1])
        if mix2:  # Mix2 of the (fp32) outer gradients on the round's 2-peer cycle
            neighbours, mix_w = _partners(cycle, i, present)
            mix_(mixed, [deltas[j] for j in neighbours], mix_w)
            own_weight -= sum(mix_w)
            nbytes[i] += len(cycle[i]) * payload_bytes(compress_all(get_codec("none"), deltas[i]))
        if peer.delayed is None:
            outer_step_(peer, mixed)
        else:
            previous = pending.get(i)
            applied = peer.delayed.outer_gradient_(deltas[i], previous[0] if previous else None,
                                                   previous[1] if previous else 1.0)
            pending[i] = (mixed, own_weight) if mix2 else None
            if applied is not None:
                outer_step_(peer, applied)
        peer.theta = [t + c for t, c in zip(peer.theta, correction, strict=True)]
    return nbytes


def exchange_delayed(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors], r: int, graphs: Graphs,
                     bench: Bench, carry: dict) -> dict:
    mean, nbytes = average_deltas(row, peers, deltas)
    for peer in peers:  # the mean of round r−1 arrived during this inner phase
        assert peer.delayed is not None
        grad = peer.delayed.outer_gradient_(deltas[peer.index], carry.get("pending"), 1 / len(peers))
        if grad is not None:
            outer_step_(peer, grad)
    carry["pending"] = mean
    return nbytes


EXCHANGES: dict[str, Callable[..., dict]] = {"diloco": exchange_diloco, "gasloc": exchange_gasloc,
                                             "factored": exchange_factored, "delayed": exchange_delayed}


def make_graphs(row: Algorithm, n: int, rounds: int, seed: int) -> Graphs:
    """Per round: (GASLoC's graph or Factored's Mix1 matching, Factored's Mix2 cycle); the same in every row."""
    first, second = random.Random(seed), random.Random(seed + 1)
    draw: dict[str, Callable[[], Neighbours]] = {
        "complete": lambda: complete_graph(n), "matching": lambda: random_matching(n, first),
        "cycle": lambda: random_cycle_graph(n, first)}
    primary = "matching" if row.kind == "factored" else row.graph
    return [draw[primary]() for _ in range(rounds)], [random_cycle_graph(n, second) for _ in range(rounds)]


# ---- training a row ---------------------------------------------------------------------------------------------


def _needed_partners(row: Algorithm, graphs: Graphs, r: int, i: int, n: int) -> set[int]:
    if row.kind == "gasloc":
        return set(graphs[0][r][i])
    if row.kind == "factored":
        return set(graphs[0][r][i]) | (set(graphs[1][r][i]) if (r + 1) % row.mix2_every == 0 else set())
    return set(range(n)) - {i}


def train_row(row: Algorithm, bench: Bench, steps: list[int], rounds_done: list[int]) -> list[SimPeer]:
    """Peer i runs ``steps[i]`` inner steps per round and completes ``rounds_done[i]`` rounds.

    A peer whose last round did not complete within the budget still runs that round's inner phase (a partner
    that completes may need its proposal) but keeps its previous state.
    """
    peers = make_peers(row, bench)
    graphs = make_graphs(row, len(peers), max(rounds_done), bench.settings.seed)
    carry: dict[str, Any] = {}
    for r in range(max(rounds_done)):
        present = [p for p in peers if rounds_done[p.index] >= r]
        finishing = {p.index for p in present if rounds_done[p.index] > r}
        for i in finishing:
            if not _needed_partners(row, graphs, r, i, len(peers)) <= {p.index for p in present}:
                raise RuntimeError(f"{row.name}: peer {i} completes round {r} without all of its partners")
        before = {p.index: _clone(p.theta) for p in present if p.index not in finishing}
        deltas = {p.index: inner_phase_(p, steps[p.index]) for p in present}
        nbytes = EXCHANGES[row.kind](row, present, deltas, r, graphs, bench, carry)
        for peer in present:
            if peer.index in finishing:
                peer.bytes_sent += nbytes[peer.index]
            else:
                peer.theta = before[peer.index]
    return peers


def validation_loss(bench: Bench, theta: Tensors) -> float:
    with torch.no_grad():
        for param, value in zip(bench.eval_trainer.model.parameters(), theta, strict=True):
            param.copy_(value)
    return bench.eval_trainer.evaluate(bench.validation)
