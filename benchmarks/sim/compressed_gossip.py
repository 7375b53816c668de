"""Compressed gossip rows: what a gossip swarm could send instead of 16-bit parameters (issue 12, item 4).

- ``gradgossip``: gossip of compressed Δ only. Each peer sends s_i = codec(β·e_i + Δ_i) with error feedback (as
  production's gradient gossip, sync/grad_gossip.py: its own s_i mixed with its partners' s_j, the outer step on
  the mix). Nothing pulls the parameters together: peers apply different mixes, so they drift apart like a random
  walk (the row's consensus distance says how far). With ``overlap`` the exchange of round r runs during round r + 1
  and its mix is applied at that round's end (production's DelayedOuterGradient, plain delay, as sync.overlap).
- ``choco``: CHOCO-Gossip (Koloskova, Stich, Jaggi 2019) on GASLoC's proposals y = θ − ηΔ, over a fixed overlay
  (each peer keeps the same neighbours every round: the public estimates need it). Every peer i holds public
  estimates ŷ_j of itself and its neighbours (all start at θ_0, which every peer has); a round sends
  q_i = codec(y_i − ŷ_i) to every neighbour, everyone who holds ŷ_i adds q_i, then
  x_i = y_i + γ_c Σ_j w_ij (ŷ_j − ŷ_i) (w = the overlay's Metropolis weights) and θ_i ← x_i (γ = 0). The public
  estimate is the error feedback: what q_i left out stays in y_i − ŷ_i for the next round. With ``overlap`` the
  round's q travel during the next inner phase: the mix uses the estimates as they were before them (one round
  late), so no peer waits for a transfer unless it outlasts an inner phase.
"""

from __future__ import annotations

from benchmarks.sim.exchanges import partners_of, send_with_feedback
from benchmarks.sim.graphs import Graphs, mix_
from benchmarks.sim.peers import Bench, SimPeer, Tensors, clone, outer_step_, row_codec
from benchmarks.sim.rows import Algorithm
from p2ptrain.maths.codecs import compress_all, decode_all
from p2ptrain.maths.mixing import pull_toward_
from p2ptrain.maths.outer_rules import propose
from p2ptrain.net.wire import payload_bytes


def exchange_gradgossip(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors], r: int, graphs: Graphs,
                        bench: Bench, carry: dict) -> dict:
    """Mix s_i with the round's partners' s_j; a peer without partners applies its exact Δ and keeps e."""
    present, graph = {p.index: p for p in peers}, graphs[0][r]
    partners = {i: partners_of(graph, i, present) for i in present}
    sent = {i: send_with_feedback(p, deltas[i]) for i, p in present.items() if partners[i][0]}
    pending: dict[int, Tensors | None] = carry.setdefault("pending", {})
    for i, peer in present.items():
        mixed = clone(sent[i][0]) if i in sent else deltas[i]
        if i in sent:
            mix_(mixed, [sent[j][0] for j in partners[i][0]], partners[i][1])
        if peer.delayed is None:
            outer_step_(peer, mixed)
            continue
        applied = peer.delayed.outer_gradient_(sent[i][0] if i in sent else deltas[i], pending.get(i), 1.0)
        pending[i] = mixed
        if applied is not None:
            outer_step_(peer, applied)
    return {i: len(partners[i][0]) * sent[i][1] if i in sent else 0 for i in present}


def exchange_choco(row: Algorithm, peers: list[SimPeer], deltas: dict[int, Tensors], r: int, graphs: Graphs,
                   bench: Bench, carry: dict) -> dict:
    """One CHOCO-Gossip round on y over the fixed overlay ``graphs[0][r]``; ``carry`` holds the public estimates."""
    present, graph, codec = {p.index: p for p in peers}, graphs[0][r], row_codec(row)
    public: dict[int, Tensors] = carry.setdefault("public", {i: clone(bench.theta0) for i in present})
    proposals = {i: propose(p.theta, deltas[i], bench.config.outer.lr) for i, p in present.items()}
    corrections, nbytes = {}, {}
    for i in present:
        difference = [y - estimate for y, estimate in zip(proposals[i], public[i], strict=True)]
        msgs = compress_all(codec, difference)
        corrections[i] = decode_all(row.codec, msgs, like=difference)
        nbytes[i] = len(graph[i]) * payload_bytes(msgs)
    if not row.overlap:
        _add_corrections_(public, corrections)
    for i, peer in present.items():
        x = proposals[i]
        for j, weight in zip(*partners_of(graph, i, present), strict=True):
            pull_toward_(x, public[j], public[i], row.consensus_step * weight)
        assert peer.gasloc is not None
        peer.theta = peer.gasloc.momentum_step(x)
    if row.overlap:
        _add_corrections_(public, corrections)
    return nbytes


def _add_corrections_(public: dict[int, Tensors], corrections: dict[int, Tensors]) -> None:
    """ŷ_i += q_i, at i and at each of its neighbours alike (one shared copy here)."""
    for i, correction in corrections.items():
        for estimate, q in zip(public[i], correction, strict=True):
            estimate.add_(q)
