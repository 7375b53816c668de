"""Each row's exchange after the inner phase, on local copies through production's codecs, mixing and outer step.

No network: what a partner would decode is decoded here, bytes are counted from the real payloads
(``p2ptrain.net.wire.payload_bytes``), Mix1 and the gossip rows mix with ``p2ptrain.maths.mixing.pull_toward_`` and
``benchmarks.sim.graphs.mix_``. Every exchange returns the bytes each peer sent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from benchmarks.scale.model import butterfly_payloads
from benchmarks.sim.graphs import Graphs, Neighbours, mix_, mixing_weights
from benchmarks.sim.peers import Bench, SimPeer, Tensors, clone, outer_step_, row_codec
from benchmarks.sim.rows import Algorithm
from p2ptrain.maths.codecs import compress_all, decode_all, get_codec, relative_decode, relative_encode
from p2ptrain.maths.mixing import exact_average, pull_toward_
from p2ptrain.maths.outer_rules import propose
from p2ptrain.net.wire import payload_bytes


def send_parameters(codec: str, tensors: Tensors, reference: Tensors) -> tuple[Tensors, int]:
    """What a partner decodes, and the payload bytes: exact fp32, or codec(θ − reference) (docs/algorithms.md §5)."""
    if codec == "none":
        msgs = compress_all(get_codec("none"), tensors)
        return decode_all("none", msgs, like=tensors), payload_bytes(msgs)
    msgs = relative_encode(tensors, reference, codec)
    return relative_decode(msgs, reference, codec), payload_bytes(msgs)


SPARSE_CODECS = ("topk", "sparse")  # sent with error feedback; an all-reduce of them is an all-gather


def allreduce_factor(row: Algorithm, n: int) -> float:
    """Payloads a peer sends per round: all-gather of sparse payloads (SparseLoCo) n−1, butterfly 2(n−1)/n."""
    return float(n - 1) if row.codec in SPARSE_CODECS else butterfly_payloads(n)


def send_with_feedback(peer: SimPeer, delta: Tensors) -> tuple[Tensors, int]:
    """What partners decode of ``e ← β·e + Δ`` through the peer's codec (then ``e ← e − sent``), and its bytes."""
    assert peer.feedback is not None
    msgs, decoded = peer.feedback.prepare(delta)
    peer.feedback.commit_(decoded)
    return decoded, payload_bytes(msgs)


def average_deltas(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors]) -> tuple[Tensors, dict]:
    """The all-reduced Δ through the row's codec, and the bytes each peer sends."""
    factor = allreduce_factor(row, len(peers))
    if row.codec in SPARSE_CODECS:
        sent = {peer.index: send_with_feedback(peer, deltas[peer.index]) for peer in peers}
        return exact_average([s for s, _ in sent.values()]), {i: factor * n for i, (_, n) in sent.items()}
    codec = row_codec(row)
    encoded = {peer.index: compress_all(codec, deltas[peer.index]) for peer in peers}
    mean = exact_average([decode_all(row.codec, msgs, like=deltas[i]) for i, msgs in encoded.items()])
    if row.codec != "none":  # the butterfly's all-gather phase sends the averaged parts through the codec again
        mean = decode_all(row.codec, compress_all(codec, mean), like=mean)
    return mean, {i: factor * payload_bytes(msgs) for i, msgs in encoded.items()}


def partners_of(graph: Neighbours, i: int, present: dict[int, SimPeer]) -> tuple[list[int], list[float]]:
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
        partners, weights = partners_of(graph, i, present)
        mixed = clone(proposals[i])
        mix_(mixed, [received[j][0] for j in partners], weights)
        assert peer.gasloc is not None
        peer.theta = peer.gasloc.momentum_step(mixed)
    return {i: len(graph[i]) * received[i][1] for i in present}


def exchange_factored(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors], r: int, graphs: Graphs,
                      bench: Bench, carry: dict) -> dict:
    """θ⁺ = OuterStep(θ, mixed Δ) + Mix1's correction, in the order of p2ptrain/sync/factored.py; with
    `mix2_overlap`, the step takes the Mix2 result of the round before (DelayedOuterGradient, as FactoredSync)."""
    present, matching, cycle = {p.index: p for p in peers}, graphs[0][r], graphs[1][r]
    public = {i: public_point(p) for i, p in present.items()}
    frozen = {i: send_parameters(row.param_codec, public[i], bench.theta0) for i in present}
    mix2, mix1 = (r + 1) % row.mix2_every == 0, r % row.mix1_every == 0
    pending: dict[int, tuple[Tensors, float] | None] = carry.setdefault("pending", {})
    sent = {i: send_with_feedback(p, deltas[i]) for i, p in present.items()} \
        if mix2 and row.codec in SPARSE_CODECS else {}
    nbytes = {}
    for i, peer in present.items():
        partners, weights = partners_of(matching, i, present) if mix1 else ([], [])
        correction = mix1_pull(public[i], [frozen[j][0] for j in partners], weights)
        mixed, own_weight = clone(deltas[i]), 1.0
        nbytes[i] = float(len(matching[i]) * frozen[i][1]) if mix1 else 0.0
        if mix2 and sent:  # Mix2 as compressed gossip on the round's 2-peer cycle
            neighbours, mix_w = partners_of(cycle, i, present)
            mixed = clone(sent[i][0])
            for j, weight in zip(neighbours, mix_w, strict=True):
                pull_toward_(mixed, sent[j][0], sent[i][0], weight)
            own_weight -= sum(mix_w)
            nbytes[i] += len(cycle[i]) * sent[i][1]
        elif mix2:  # Mix2 of the (fp32) outer gradients on the round's 2-peer cycle
            neighbours, mix_w = partners_of(cycle, i, present)
            mix_(mixed, [deltas[j] for j in neighbours], mix_w)
            own_weight -= sum(mix_w)
            nbytes[i] += len(cycle[i]) * payload_bytes(compress_all(get_codec("none"), deltas[i]))
        if peer.delayed is None:
            outer_step_(peer, mixed)
        else:
            previous = pending.get(i)
            # a compressed Mix2's own share is s_i (what its partners mix), not Δ_i: as FactoredSync
            own = sent[i][0] if i in sent else deltas[i]
            applied = peer.delayed.outer_gradient_(own, previous[0] if previous else None,
                                                   previous[1] if previous else 1.0)
            pending[i] = (mixed, 1.0 if row.mix2_overlap == "local" else own_weight) if mix2 else None
            if applied is not None:
                outer_step_(peer, applied)
        peer.theta = [t + c for t, c in zip(peer.theta, correction, strict=True)]
    return nbytes


def public_point(peer: SimPeer) -> Tensors:
    """What Mix1 gossips, as FactoredSync._public_point: θ, less the own Δ an eager or local peer applied ahead of
    its Mix2 mean (without outer momentum)."""
    unsettled = peer.delayed.unsettled() if peer.delayed is not None else None
    if unsettled is None or peer.outer is None or peer.outer.config.momentum > 0:
        return peer.theta
    return [t + peer.outer.config.lr * u for t, u in zip(peer.theta, unsettled, strict=True)]


def exchange_delayed(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors], r: int, graphs: Graphs,
                     bench: Bench, carry: dict) -> dict:
    mean, nbytes = average_deltas(row, peers, deltas)
    for peer in peers:  # the mean of round r−1 arrived during this inner phase
        assert peer.delayed is not None
        grad = peer.delayed.outer_gradient_(deltas[peer.index], carry.get("pending"),
                                            1.0 if row.local else 1 / len(peers))
        if grad is not None:
            outer_step_(peer, grad)
    carry["pending"] = mean
    return nbytes


