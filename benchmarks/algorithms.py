"""Algorithm benchmark: DiLoCo, GASLoC, Factored Gossip DiLoCo, DiLoCoX overlap and codecs, in one process.

N simulated peers, each with its own model replica, training shard (``TextShards(..., shard_index=i)``) and
``InnerTrainer``, run R rounds of H inner AdamW steps; rows differ only in what is exchanged between inner phases.
No network: exchanges go through the codecs of ``p2ptrain.maths.codecs`` and the outer-step maths of
``p2ptrain.maths.outer_rules`` / ``p2ptrain.maths.outer_optimizer`` on local copies, and bytes are counted
from the real payloads.

Table 1, equal tokens: every peer runs R·H steps; validation loss of the peers' average model.
Table 2, equal simulated wall clock: inner steps take the measured mean step time; fast peers have bandwidth B,
the last peer B·straggler_fraction; a transfer takes bytes / bandwidth of the slower end. DiLoCo and codec rows
all-reduce (everyone waits for the slowest member, then bytes/B_min); gossip exchanges wait only for the partners
involved; the one-step-delay rows and Factored's Mix1 overlap the inner phase. GASLoC's straggler takes fewer inner
steps (``pacing.inner_steps_for_link``). The budget is DiLoCo's time for ``budget_rounds`` rounds; a peer's state
at the budget is its last completed round.

    python benchmarks/algorithms.py            # default run (tiny model, 4 peers, 16 rounds x 20 steps)
    python benchmarks/algorithms.py --quick    # CI size, under a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.sim.graphs import (  # noqa: E402
    Neighbours,
    complete_graph,
    mix_,
    mixing_weights,
    random_cycle_graph,
    random_matching,
)
from p2ptrain.config import PeerConfig, build_config  # noqa: E402
from p2ptrain.data import TextShards, build_tokenizer  # noqa: E402
from p2ptrain.errors import ConfigError  # noqa: E402
from p2ptrain.maths.codecs import (  # noqa: E402
    ErrorFeedback,
    compress_all,
    decode_all,
    get_codec,
    payload_bytes,
    relative_decode,
    relative_encode,
)
from p2ptrain.maths.inner import InnerTrainer  # noqa: E402
from p2ptrain.maths.mixing import consensus_distance, exact_average  # noqa: E402
from p2ptrain.maths.outer_optimizer import OuterOptimizer  # noqa: E402
from p2ptrain.maths.outer_rules import (  # noqa: E402
    DelayedOuterGradient,
    GaslocState,
    NesterovState,
    factored_step_,
    mix1_correction,
    propose,
)
from p2ptrain.maths.pacing import inner_steps_for_link  # noqa: E402
from p2ptrain.models import build_model  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results"
Tensors = list[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Settings:
    """One benchmark run; the defaults are the full run (about 15 minutes on 2 CPU cores)."""

    peers: int = 4
    rounds: int = 16  # R, outer rounds at equal tokens
    inner_steps: int = 20  # H, inner steps per round
    model: str = "tiny"
    seq_len: int = 64
    batch_size: int = 8
    seed: int = 0
    threads: int = 1  # torch intra-op threads (1 or 2); 1 is robust when other processes share the cores
    val_batches: int = 16
    max_corpus_bytes: int = 8_000_000
    bandwidth_bytes_per_s: float = 0.0  # fast peers' link; 0 = fp32 model bytes / measured inner-phase time
    straggler_fraction: float = 0.1  # the last peer's bandwidth as a fraction of the fast peers'
    budget_rounds: int = 0  # wall-clock budget = DiLoCo's time for this many rounds with the straggler; 0 = rounds
    max_rounds_factor: float = 4.0  # table 2 stops a row at this factor x budget_rounds (marked "capped")

    def __post_init__(self) -> None:
        if self.peers < 2 or self.rounds < 1 or self.inner_steps < 1 or self.budget_rounds < 0:
            raise ConfigError("need --peers >= 2, --rounds >= 1, --inner-steps >= 1, --budget-rounds >= 0")
        if self.threads not in (1, 2):
            raise ConfigError(f"--threads must be 1 or 2, got {self.threads}")
        if not 0 < self.straggler_fraction <= 1 or self.bandwidth_bytes_per_s < 0 or self.max_rounds_factor < 1:
            raise ConfigError("need 0 < --straggler-fraction <= 1, --bandwidth >= 0, --max-rounds-factor >= 1")


QUICK = dict(rounds=4, inner_steps=3, seq_len=16, batch_size=2, val_batches=2, max_corpus_bytes=400_000,
             max_rounds_factor=2.0)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One row: an algorithm configuration."""

    name: str
    kind: str  # diloco | gasloc | factored | delayed
    codec: str = "none"  # diloco: codec of the exchanged Δ (none = exact fp32 mean)
    density: float = 1.0  # topk only
    graph: str = "complete"  # gasloc: complete | matching (1-peer) | cycle (2-peer)
    momentum: float = 0.9  # γ of gasloc, delayed and diloco rows (factored uses outer.momentum, 0.9)
    param_codec: str = "fp16"  # parameters (GASLoC's y, Mix1's θ) travel as codec(θ − θ_0); none = exact fp32
    mix2_every: int = 1  # factored: K
    eager: bool = False  # delayed: the eager variant
    sanity: bool = False  # a hidden check (not a table row)


ROWS = (
    Algorithm("diloco", "diloco"),
    Algorithm("gasloc-complete", "gasloc", graph="complete", param_codec="none", sanity=True),
    Algorithm("gasloc-1peer-g0", "gasloc", graph="matching", momentum=0.0),
    Algorithm("gasloc-1peer-g0.9", "gasloc", graph="matching", momentum=0.9),
    Algorithm("gasloc-2peer-g0", "gasloc", graph="cycle", momentum=0.0),
    Algorithm("gasloc-2peer-g0.9", "gasloc", graph="cycle", momentum=0.9),
    Algorithm("factored-K1", "factored", mix2_every=1),
    Algorithm("factored-K4", "factored", mix2_every=4),
    Algorithm("diloco-delay1", "delayed"),
    Algorithm("diloco-delay1-g0.5", "delayed", momentum=0.5),
    Algorithm("diloco-delay1-g0", "delayed", momentum=0.0),
    Algorithm("diloco-eager", "delayed", eager=True),
    Algorithm("diloco-eager-g0.5", "delayed", eager=True, momentum=0.5),
    Algorithm("diloco-fp16", "diloco", codec="fp16"),
    Algorithm("diloco-int8", "diloco", codec="int8"),
    Algorithm("diloco-topk-1/128+EF", "diloco", codec="topk", density=1 / 128),
    Algorithm("diloco-topk-1/32+EF", "diloco", codec="topk", density=1 / 32),
    # error feedback delays what top-k leaves out, like the overlap rows: momentum 0.5 instead of 0.9
    Algorithm("diloco-topk-1/128+EF-g0.5", "diloco", codec="topk", density=1 / 128, momentum=0.5),
    Algorithm("diloco-topk-1/32+EF-g0.5", "diloco", codec="topk", density=1 / 32, momentum=0.5),
    Algorithm("diloco-g0", "diloco", momentum=0.0),  # is DiLoCo's γ = 0.9 tuned for this run? (a reference)
)


# ---- the shared workbench and the simulated peers ---------------------------------------------------------------


@dataclasses.dataclass
class Bench:
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
    index: int
    params: list[torch.nn.Parameter]
    trainer: InnerTrainer
    batches: Iterator[torch.Tensor]
    theta: Tensors  # the point the next inner phase starts from
    outer: OuterOptimizer | None = None  # diloco rows: the production outer optimizer
    nesterov: NesterovState | None = None  # factored, delayed
    gasloc: GaslocState | None = None
    delayed: DelayedOuterGradient | None = None
    feedback: ErrorFeedback | None = None  # topk rows
    compute_s: float = 0.0
    steps: int = 0
    bytes_sent: float = 0.0


def make_peers(row: Algorithm, bench: Bench) -> list[SimPeer]:
    cfg, peers = bench.config, []
    for i in range(bench.settings.peers):
        model = build_model(cfg.model, bench.vocab_size, cfg.run.seed)  # the same θ_0 on every peer
        params = list(model.parameters())
        batches = bench.shards[i].train_batches(seed=1000 * cfg.run.seed + i)  # the same batches in every row
        peer = SimPeer(i, params, InnerTrainer(model, cfg.inner, torch.device("cpu")), batches, _clone(params))
        if row.kind == "diloco":
            peer.outer = OuterOptimizer(params, dataclasses.replace(cfg.outer, momentum=row.momentum))
        elif row.kind == "gasloc":
            peer.gasloc = GaslocState(peer.theta, row.momentum)
        else:
            peer.nesterov = NesterovState(cfg.outer.lr, row.momentum if row.kind == "delayed" else cfg.outer.momentum)
        if row.kind == "delayed":
            peer.delayed = DelayedOuterGradient(row.eager)
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
    return float(n - 1) if row.codec == "topk" else 2 * (n - 1) / n


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


def exchange_diloco(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors], r: int,
                    graphs: tuple[list[Neighbours], list[Neighbours]], bench: Bench, carry: dict) -> dict:
    mean, nbytes = average_deltas(row, peers, deltas)
    for peer in peers:
        assert peer.outer is not None
        peer.outer.step_(mean)  # back to the anchor, p.grad = mean Δ, Nesterov SGD step
        peer.theta = _clone(peer.params)
    return nbytes


def exchange_gasloc(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors], r: int,
                    graphs: tuple[list[Neighbours], list[Neighbours]], bench: Bench, carry: dict) -> dict:
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


def exchange_factored(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors], r: int,
                      graphs: tuple[list[Neighbours], list[Neighbours]], bench: Bench, carry: dict) -> dict:
    present, matching, cycle = {p.index: p for p in peers}, graphs[0][r], graphs[1][r]
    frozen = {i: send_parameters(row.param_codec, p.theta, bench.theta0) for i, p in present.items()}
    mix2 = (r + 1) % row.mix2_every == 0
    nbytes = {}
    for i, peer in present.items():
        partners, weights = _partners(matching, i, present)
        correction = mix1_correction(peer.theta, [frozen[j][0] for j in partners], weights)
        mixed = _clone(deltas[i])
        nbytes[i] = float(len(matching[i]) * frozen[i][1])
        if mix2:  # blocking Mix2 of the (fp32) outer gradients on the round's 2-peer cycle
            neighbours, mix_w = _partners(cycle, i, present)
            mix_(mixed, [deltas[j] for j in neighbours], mix_w)
            nbytes[i] += len(cycle[i]) * payload_bytes(compress_all(get_codec("none"), deltas[i]))
        assert peer.nesterov is not None
        factored_step_(peer.theta, correction, mixed, peer.nesterov)
    return nbytes


def exchange_delayed(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors], r: int,
                     graphs: tuple[list[Neighbours], list[Neighbours]], bench: Bench, carry: dict) -> dict:
    mean, nbytes = average_deltas(row, peers, deltas)
    for peer in peers:  # the mean of round r−1 arrived during this inner phase
        assert peer.delayed is not None and peer.nesterov is not None
        grad = peer.delayed.outer_gradient_(deltas[peer.index], carry.get("pending"), 1 / len(peers))
        if grad is not None:
            peer.nesterov.step_(peer.theta, grad)
    carry["pending"] = mean
    return nbytes


EXCHANGES: dict[str, Callable[..., dict]] = {"diloco": exchange_diloco, "gasloc": exchange_gasloc,
                                             "factored": exchange_factored, "delayed": exchange_delayed}


def make_graphs(row: Algorithm, n: int, rounds: int, seed: int) -> tuple[list[Neighbours], list[Neighbours]]:
    """Per round: (GASLoC's graph or Factored's Mix1 matching, Factored's Mix2 cycle); the same in every row."""
    first, second = random.Random(seed), random.Random(seed + 1)
    draw: dict[str, Callable[[], Neighbours]] = {
        "complete": lambda: complete_graph(n), "matching": lambda: random_matching(n, first),
        "cycle": lambda: random_cycle_graph(n, first)}
    primary = "matching" if row.kind == "factored" else row.graph
    return [draw[primary]() for _ in range(rounds)], [random_cycle_graph(n, second) for _ in range(rounds)]


# ---- training a row ---------------------------------------------------------------------------------------------


def _needed_partners(row: Algorithm, graphs: tuple[list[Neighbours], list[Neighbours]], r: int, i: int,
                     n: int) -> set[int]:
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


@dataclasses.dataclass
class RowResult:
    name: str
    val_loss: float  # of the peers' average model
    mean_peer_val_loss: float
    max_consensus_distance: float  # max over peers of ‖θ_i − θ̄‖ / ‖θ̄‖
    bytes_per_round_vs_model: float  # bytes sent per peer per completed round / fp32 model bytes
    rounds: list[int]  # completed rounds per peer
    inner_steps: list[int]  # inner steps per round per peer
    wall_s: float
    utilisation: float | None = None  # table 2: compute time within the budget / budget, mean over peers
    capped: bool = False  # table 2: the row hit max_rounds before the budget ran out
    reused_from_table1: bool = False
    average: Tensors = dataclasses.field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields.pop("average")
        return fields


def summarize(name: str, bench: Bench, peers: list[SimPeer], rounds: list[int], steps: list[int],
              wall_s: float) -> RowResult:
    thetas = [p.theta for p in peers]
    average = exact_average(thetas)
    completed = sum(rounds)
    return RowResult(
        name=name,
        val_loss=validation_loss(bench, average),
        mean_peer_val_loss=sum(validation_loss(bench, t) for t in thetas) / len(thetas),
        max_consensus_distance=max(consensus_distance(average, t) for t in thetas),
        bytes_per_round_vs_model=sum(p.bytes_sent for p in peers) / max(1, completed) / bench.model_bytes,
        rounds=list(rounds), inner_steps=list(steps), wall_s=wall_s, average=average)


def run_equal_tokens(bench: Bench) -> tuple[list[RowResult], float]:
    """Table 1; returns the rows and the measured mean inner step time in seconds."""
    s = bench.settings
    rows, compute_s, steps_done = [], 0.0, 0
    for row in ROWS:
        started = time.perf_counter()
        peers = train_row(row, bench, [s.inner_steps] * s.peers, [s.rounds] * s.peers)
        result = summarize(row.name, bench, peers, [s.rounds] * s.peers, [s.inner_steps] * s.peers,
                           time.perf_counter() - started)
        compute_s += sum(p.compute_s for p in peers)
        steps_done += sum(p.steps for p in peers)
        rows.append(result)
        print(f"[equal tokens] {row.name:<24} val loss {result.val_loss:.4f}  ({result.wall_s:.0f} s)", flush=True)
    return rows, compute_s / steps_done


# ---- the wall-clock model ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Units:
    delta_bytes: int  # one peer's Δ payload with the row's codec (fp32 for Factored's Mix2)
    param_bytes: int  # one peer's parameter payload (GASLoC's y, Factored's Mix1 θ)


def exchange_units(row: Algorithm, bench: Bench) -> Units:
    """Payload sizes from the codecs themselves (our formats have a size fixed by the shapes)."""
    codec = get_codec("topk", density=row.density) if row.codec == "topk" else get_codec(row.codec)
    delta_bytes = payload_bytes(compress_all(codec, bench.theta0))
    return Units(delta_bytes, send_parameters(row.param_codec, bench.theta0, bench.theta0)[1])


@dataclasses.dataclass
class Clock:
    starts: list[list[float]] = dataclasses.field(default_factory=list)  # [round][peer], seconds
    compute_ends: list[list[float]] = dataclasses.field(default_factory=list)
    ends: list[list[float]] = dataclasses.field(default_factory=list)


def _link_s(nbytes: float, bandwidth: Sequence[float], i: int, j: int) -> float:
    return nbytes / min(bandwidth[i], bandwidth[j])


def _wait_then_send(ready: Sequence[float], graph: Neighbours, nbytes: float, bandwidth: Sequence[float]) -> list:
    """Each peer waits for its own partners only, then sends to each in turn over the slower end of the link."""
    return [max(ready[j] for j in [i, *graph[i]]) + sum(_link_s(nbytes, bandwidth, i, j) for j in graph[i])
            for i in range(len(ready))]


def round_end_times(row: Algorithm, units: Units, r: int, start: list[float], compute_end: list[float],
                    bandwidth: Sequence[float], graphs: tuple[list[Neighbours], list[Neighbours]],
                    carry: dict[str, float]) -> list[float]:
    n = len(start)
    allreduce_s = allreduce_factor(row, n) * units.delta_bytes / min(bandwidth)  # bottleneck: the slowest peer
    if row.kind == "diloco":  # blocking: everyone waits for the slowest member
        return [max(compute_end) + allreduce_s] * n
    if row.kind == "delayed":  # Δ_r travels during round r+1; its mean is applied at the end of round r+1
        ends = [max(c, carry.get("arrival_s", 0.0)) for c in compute_end]
        carry["arrival_s"] = max(max(compute_end), carry.get("arrival_s", 0.0)) + allreduce_s
        return ends
    if row.kind == "gasloc":
        return _wait_then_send(compute_end, graphs[0][r], units.param_bytes, bandwidth)
    mix1_done = _wait_then_send(start, graphs[0][r], units.param_bytes, bandwidth)  # overlaps the inner phase
    ready = [max(c, m) for c, m in zip(compute_end, mix1_done, strict=True)]
    if (r + 1) % row.mix2_every:
        return ready
    return _wait_then_send(ready, graphs[1][r], units.delta_bytes, bandwidth)


def simulate_clock(row: Algorithm, units: Units, steps: list[int], step_s: float, bandwidth: Sequence[float],
                   graphs: tuple[list[Neighbours], list[Neighbours]], budget_s: float, max_rounds: int) -> Clock:
    clock, start, carry = Clock(), [0.0] * len(steps), dict[str, float]()
    for r in range(max_rounds):
        if min(start) >= budget_s:
            break
        compute_end = [s + h * step_s for s, h in zip(start, steps, strict=True)]
        end = round_end_times(row, units, r, start, compute_end, bandwidth, graphs, carry)
        clock.starts.append(start)
        clock.compute_ends.append(compute_end)
        clock.ends.append(end)
        start = end
    return clock


def paced_steps(row: Algorithm, units: Units, step_s: float, bandwidth: Sequence[float], steps: int) -> list[int]:
    """GASLoC's pacing (ALGORITHMS.md §2): a slow peer takes fewer steps so its round ends with the fast peers'."""
    if row.kind != "gasloc":
        return [steps] * len(bandwidth)
    degree = {"matching": 1, "cycle": 2}.get(row.graph, len(bandwidth) - 1)
    round_s = steps * step_s + degree * units.param_bytes / max(bandwidth)
    return [steps if b == max(bandwidth) else inner_steps_for_link(round_s, step_s, degree * units.param_bytes / b, 1,
                                                                   steps) for b in bandwidth]


def clock_stats(clock: Clock, budget_s: float) -> tuple[list[int], float]:
    """Completed rounds per peer within the budget, and mean compute utilisation within it."""
    n, limit = len(clock.starts[0]), budget_s * (1 + 1e-9)
    rounds = [sum(1 for end in clock.ends if end[i] <= limit) for i in range(n)]
    busy = [sum(max(0.0, min(c[i], budget_s) - min(s[i], budget_s))
                for s, c in zip(clock.starts, clock.compute_ends, strict=True)) for i in range(n)]
    return rounds, sum(busy) / n / budget_s


@dataclasses.dataclass(frozen=True)
class WallClock:
    step_s: float
    bandwidth_bytes_per_s: list[float]
    budget_s: float
    budget_rounds: int
    max_rounds: int


def make_wallclock(bench: Bench, step_s: float) -> WallClock:
    s = bench.settings
    fast = s.bandwidth_bytes_per_s or bench.model_bytes / (s.inner_steps * step_s)
    bandwidth = [fast] * (s.peers - 1) + [fast * s.straggler_fraction]
    budget_rounds = s.budget_rounds or s.rounds
    diloco = ROWS[0]
    graphs = make_graphs(diloco, s.peers, budget_rounds, s.seed)
    clock = simulate_clock(diloco, exchange_units(diloco, bench), [s.inner_steps] * s.peers, step_s, bandwidth,
                           graphs, math.inf, budget_rounds)
    return WallClock(step_s, bandwidth, clock.ends[-1][0], budget_rounds,
                     math.ceil(s.max_rounds_factor * budget_rounds))


def run_equal_wallclock(bench: Bench, wall: WallClock, table1: list[RowResult]) -> list[RowResult]:
    """Table 2: each row trains exactly what its peers complete within the simulated budget."""
    s, by_name, rows = bench.settings, {r.name: r for r in table1}, []
    for row in (r for r in ROWS if not r.sanity):
        started = time.perf_counter()
        units = exchange_units(row, bench)
        steps = paced_steps(row, units, wall.step_s, wall.bandwidth_bytes_per_s, s.inner_steps)
        graphs = make_graphs(row, s.peers, wall.max_rounds, s.seed)
        clock = simulate_clock(row, units, steps, wall.step_s, wall.bandwidth_bytes_per_s, graphs, wall.budget_s,
                               wall.max_rounds)
        rounds, utilisation = clock_stats(clock, wall.budget_s)
        if rounds == [s.rounds] * s.peers and steps == [s.inner_steps] * s.peers:  # same training as table 1
            result = dataclasses.replace(by_name[row.name], reused_from_table1=True, wall_s=0.0)
        else:
            peers = train_row(row, bench, steps, rounds) if max(rounds) else make_peers(row, bench)
            result = summarize(row.name, bench, peers, rounds, steps, time.perf_counter() - started)
        result.utilisation, result.capped = utilisation, max(rounds) >= wall.max_rounds
        rows.append(result)
        print(f"[wall clock]   {row.name:<24} val loss {result.val_loss:.4f}  rounds {rounds}  "
              f"({result.wall_s:.0f} s)", flush=True)
    return rows


# ---- targets and reports ----------------------------------------------------------------------------------------


def gap_percent(loss: float, reference: float) -> float:
    return 100.0 * (loss - reference) / reference


def _target(what: str, row: str, figure: str, passed: bool) -> dict[str, Any]:
    return {"target": what, "row": row, "figure": figure, "verdict": "PASS" if passed else "MISS"}


def evaluate_targets(table1: list[RowResult], table2: list[RowResult]) -> list[dict[str, Any]]:
    """The team's targets; the codec target compares bytes with DiLoCo's fp32 all-reduce (same exchange)."""
    d1, d2 = table1[0], table2[0]
    targets = []
    for row in table1:
        gap = gap_percent(row.val_loss, d1.val_loss)
        for prefix, limit in (("gasloc-1peer", 2.0), ("gasloc-2peer", 1.0)):
            if row.name.startswith(prefix):
                targets.append(_target(f"equal tokens: {prefix} within {limit:g} % of DiLoCo", row.name,
                                       f"{gap:+.2f} %", gap <= limit))
    for row in table2:
        if row.name.startswith("gasloc"):
            targets.append(_target("equal wall clock, straggler: GASLoC below DiLoCo", row.name,
                                   f"{row.val_loss:.4f} vs {d2.val_loss:.4f}", row.val_loss < d2.val_loss))
    small = [r for r in table1 if r.name.startswith("diloco-") and r.name not in ("diloco-delay1", "diloco-eager")
             and r.bytes_per_round_vs_model <= d1.bytes_per_round_vs_model / 32]
    for row in small:
        gap = gap_percent(row.val_loss, d1.val_loss)
        ratio = d1.bytes_per_round_vs_model / row.bytes_per_round_vs_model
        targets.append(_target("codec at <= 1/32 of fp32 bytes costs <= 1 % loss", row.name,
                               f"1/{ratio:.0f} of the bytes, {gap:+.2f} %", gap <= 1.0))
    if not small:
        targets.append(_target("codec at <= 1/32 of fp32 bytes costs <= 1 % loss", "-", "no codec row <= 1/32", False))
    return targets


def sanity_check(bench: Bench, table1: list[RowResult]) -> dict[str, Any]:
    """GASLoC on the complete graph with exact averaging must reproduce DiLoCo (ALGORITHMS.md §2).

    Checked on the final validation loss and on the parameters after one round. The final parameters are
    reported too: float rounding (~1e-7 after a round) is amplified by hundreds of AdamW steps.
    """
    by_name, s = {r.name: r for r in table1}, bench.settings
    diloco, complete = by_name["diloco"], by_name["gasloc-complete"]
    loss_rel = abs(complete.val_loss - diloco.val_loss) / diloco.val_loss
    one_round = [exact_average([p.theta for p in train_row(row, bench, [s.inner_steps] * s.peers, [1] * s.peers)])
                 for row in ROWS[:2]]
    first_rel = consensus_distance(one_round[0], one_round[1])
    return {"check": "gasloc-complete == diloco", "loss_relative_difference": loss_rel,
            "parameter_relative_distance_after_1_round": first_rel,
            "parameter_relative_distance_final": consensus_distance(diloco.average, complete.average),
            "tolerance": 1e-4, "verdict": "PASS" if max(loss_rel, first_rel) <= 1e-4 else "FAIL"}


def markdown(report: dict[str, Any]) -> str:
    t1, t2, wall = report["equal_tokens"], report["equal_wallclock"], report["wallclock_model"]
    d1, d2 = t1[0], t2[0]
    fast, slow = wall["bandwidth_bytes_per_s"][0], wall["bandwidth_bytes_per_s"][-1]
    lines = [f"# Algorithm benchmark\n\n`{report['command']}`  \n{report['settings_line']}\n",
             "## 1. Equal tokens\n",
             "| row | val loss (avg model) | gap vs DiLoCo | bytes/peer/round ÷ fp32 model | ÷ DiLoCo bytes "
             "| mean peer val loss | max consensus dist |", "|---|---|---|---|---|---|---|"]
    for r in (r for r in t1 if r["name"] != "gasloc-complete"):
        lines.append(f"| {r['name']} | {r['val_loss']:.4f} | {gap_percent(r['val_loss'], d1['val_loss']):+.2f} % "
                     f"| {r['bytes_per_round_vs_model']:.4f} "
                     f"| {r['bytes_per_round_vs_model'] / d1['bytes_per_round_vs_model']:.4f} "
                     f"| {r['mean_peer_val_loss']:.4f} | {r['max_consensus_distance']:.2e} |")
    sanity = report["sanity"]
    lines += [f"\nSanity: GASLoC on the complete graph, exact fp32 averaging, vs DiLoCo: final loss differs by "
              f"{sanity['loss_relative_difference']:.1e} (relative), parameters by "
              f"{sanity['parameter_relative_distance_after_1_round']:.1e} after one round: {sanity['verdict']} "
              f"(tolerance 1e-4); final parameters differ by {sanity['parameter_relative_distance_final']:.1e} "
              "(rounding amplified by the inner AdamW steps).\n",
              "## 2. Equal simulated wall clock, one straggler\n",
              f"Step time {wall['step_s'] * 1e3:.2f} ms (measured mean of table 1), fast links "
              f"{fast / 1e6:.3f} MB/s, straggler {slow / 1e6:.4f} MB/s; budget {wall['budget_s']:.2f} s = DiLoCo's "
              f"time for {wall['budget_rounds']} rounds; rows stop at {wall['max_rounds']} rounds (capped).\n",
              "| row | val loss at budget | gap vs DiLoCo | rounds completed (mean, min–max) | compute utilisation "
              "| inner steps/round (fast, straggler) | note |", "|---|---|---|---|---|---|---|"]
    for r in t2:
        rounds, note = r["rounds"], "capped" if r["capped"] else ""
        lines.append(f"| {r['name']} | {r['val_loss']:.4f} | {gap_percent(r['val_loss'], d2['val_loss']):+.2f} % "
                     f"| {sum(rounds) / len(rounds):.1f} ({min(rounds)}–{max(rounds)}) "
                     f"| {100 * r['utilisation']:.1f} % "
                     f"| {r['inner_steps'][0]}, {r['inner_steps'][-1]} | {note} |")
    lines += ["\n## Targets\n", "| target | row | figure | verdict |", "|---|---|---|---|"]
    lines += [f"| {t['target']} | {t['row']} | {t['figure']} | {t['verdict']} |" for t in report["targets"]]
    lines += ["", report["notes"]]
    return "\n".join(lines) + "\n"


NOTES = """Notes: one seed, so differences of about 1 % between rows may be noise. Validation loss is on the shared
validation split (the same batches for every row). Parameters (GASLoC's y, Mix1's θ) travel as fp16 differences from
θ_0; each peer mixes its own exact y with its partners' decoded y. Outer gradients travel in fp32 except in the codec
rows: fp16 and int8 go through a butterfly all-reduce (each averaged part is encoded again), top-k through an
all-gather of the sparse payloads (n−1 payloads per peer) with error feedback. Factored's Mix2 uses fp32 Δ.
Encoding time is not in the wall-clock model. Bytes are payload bytes from compression.payload_bytes.
Table 2 models synchronous gossip rounds (a fresh random matching or cycle each round, each peer waiting only for
its partners); the asynchronous form of ALGORITHMS.md §2 (busy peers refuse, the initiator draws another) is not
modelled, so the straggler's delay still spreads through its partners. GASLoC's pacing uses the expected transfer
time. The inner cosine schedule spans R·H steps; peers that run longer in table 2 stay at its minimum LR. With the
default --bandwidth (0: one fp32 model per inner phase) the simulated outcome does not depend on the measured step
time, only the seconds shown do."""


def run(settings: Settings, output_dir: Path, command: str) -> dict[str, Any]:
    """Both tables, the targets, and the results files; returns the report (rows as RowResult under ``rows``)."""
    started, threads_before = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        bench = build_bench(settings)
        table1, step_s = run_equal_tokens(bench)
        wall = make_wallclock(bench, step_s)
        table2 = run_equal_wallclock(bench, wall, table1)
        sanity = sanity_check(bench, table1)
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads_before)
    s = settings
    report: dict[str, Any] = {
        "command": command,
        "settings": dataclasses.asdict(settings),
        "settings_line": f"{s.peers} peers, model {s.model} ({bench.model_bytes // 4:,} parameters), {s.rounds} rounds"
                         f" x {s.inner_steps} inner steps, batch {s.batch_size} x {s.seq_len} tokens, seed {s.seed}, "
                         f"{threads} torch thread(s)",
        "torch_threads": threads,
        "model_parameters": bench.model_bytes // 4,
        "rows_definition": [dataclasses.asdict(r) for r in ROWS],
        "equal_tokens": [r.to_json() for r in table1],
        "equal_wallclock": [r.to_json() for r in table2],
        "wallclock_model": dataclasses.asdict(wall),
        "sanity": sanity,
        "targets": evaluate_targets(table1, table2),
        "notes": NOTES.replace("\n", " "),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
    }
    report["wall_s"] = time.perf_counter() - started
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "algorithms.json").write_text(json.dumps(report, indent=1) + "\n")
    (output_dir / "algorithms.md").write_text(markdown(report) + f"\nTotal wall time {report['wall_s']:.0f} s.\n")
    report["rows"] = {"equal_tokens": table1, "equal_wallclock": table2}
    return report


def parse_args(argv: Sequence[str] | None = None) -> tuple[Settings, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    flags = {"peers": int, "rounds": int, "inner_steps": int, "model": str, "seq_len": int, "batch_size": int,
             "seed": int, "threads": int, "val_batches": int, "bandwidth": float, "straggler_fraction": float,
             "budget_rounds": int, "max_rounds_factor": float}
    for name, kind in flags.items():
        default = getattr(Settings, "bandwidth_bytes_per_s" if name == "bandwidth" else name)
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=f"default {default}")
    parser.add_argument("--quick", action="store_true", help=f"CI size: {QUICK}")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    for name in flags:
        if getattr(args, name) is not None:
            values["bandwidth_bytes_per_s" if name == "bandwidth" else name] = getattr(args, name)
    try:
        return Settings(**values), args.output_dir
    except ConfigError as error:
        parser.error(str(error))
        raise


def main() -> None:
    settings, output_dir = parse_args()
    report = run(settings, output_dir, "python " + " ".join(sys.argv))
    print(markdown(report))
    print(f"wall time {report['wall_s']:.0f} s; written to {output_dir}/algorithms.md and algorithms.json")


if __name__ == "__main__":
    main()
