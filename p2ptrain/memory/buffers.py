"""What each outer-sync strategy holds in host memory, in model-sized fp32 copies (S = 4 bytes × parameters),
counted from the code of p2ptrain/sync/ and p2ptrain/net/state_sharing.py (the memory plan multiplies by S).

Kept between rounds, every mode: θ_0, the reference parameter payloads are encoded against (peer.py).
- diloco, `allreduce_transport: exchange`: the exchange's error-feedback residual (zeros: decay 0,
  exchange_allreduce.py); `hivemind`: the averager's own tensors (net/allreduce.py). With `overlap`: the previous
  round's own Δ (DelayedOuterGradient) and the copy of Δ the background all-reduce reads (PendingGather,
  sync/exchange_averager.py).
- gasloc: the gossip's reference, base and correction (param_gossip.py) and, with γ > 0, the previous mixed
  iterate x (GaslocState).
- factored: the Mix1 gossip's reference, base and correction, the round's frozen anchor (factored.py), Mix2's
  error-feedback residual (grad_gossip.py, or the exchange all-reduce's); with `overlap`, as diloco.

During one round's exchange (at most; freed when the round ends):
- an all-reduce of n members (exchange_allreduce.py): our Δ copied, its error-feedback sum, its payload, its
  decoded value and the round's mix (Mix2Round clones it), the other n − 1 members' payloads and decoded values,
  CenteredClip's n × d stack and the gaps it clips (centered_clip.py, when a member lies beyond τ), the mean:
  5 + c + (n − 1)(1 + c) + 2n copies, c the payload's share of fp32 bytes (sync.grad_codec);
- GASLoC (gasloc.py): proposal, y, each partner's payload and value, the mix, x, the next θ: 5 + k(1 + 2c);
- Factored: Mix1 during the inner phase (partner, payloads, mix, correction), then Mix1's result and correction
  kept while Mix2 runs (an all-reduce of `mix2_group_size`, or gossip: error-feedback sum, payload, s, the mix,
  D partners).

The snapshot joiners download (net/state_sharing.py: StateSnapshot.capture copies to the host): the anchor and
the strategy's state tensors (with γ > 0 the outer momentum, zeros before the first step, or GASLoC's x; Factored's
gossip Mix2 residual).
"""

from __future__ import annotations

import dataclasses

from p2ptrain.maths import sparse_codec
from p2ptrain.sync.allreduce_agreement import MAX_MEMBERS, largest_group
from p2ptrain.sync.config import SyncConfig

THETA_0 = 1.0  # the peer's θ_0 reference (peer.py `initial_params`)
GOSSIP_KEPT = 3.0  # ParamGossip: reference, base, correction


@dataclasses.dataclass(frozen=True)
class Buffers:
    """Model-sized fp32 copies on the host: kept between rounds, held in a round's exchange, in the snapshot."""

    kept: float
    round: float
    snapshot: float
    kept_note: str
    round_note: str


def payload_share(codec: str, density: float = 1 / 32, bits: int = 2, chunk_size: int = 4096) -> float:
    """Bytes of a payload per fp32 byte of the tensors it encodes (sync.grad_codec / sync.param_codec)."""
    if codec == "topk":
        return 3 * density / 4  # 3 bytes per kept entry (maths/codecs.py)
    if codec == "sparse":
        return sparse_codec.payload_share(density, bits, chunk_size)
    return {"none": 1.0, "fp16": 0.5, "adaptive": 0.5, "int8": 0.25}[codec]


def allreduce_round(members: int, share: float) -> float:
    """Copies one peer holds in an exchange all-reduce of `members` (alone: Δ, its sum, payload, value, mix)."""
    if members <= 1:
        return 4 + share
    return 5 + share + (members - 1) * (1 + share) + 2 * members


def sync_buffers(config: SyncConfig, peers: int, momentum: bool) -> Buffers:
    """The host buffers of `config.mode` with `peers` peers in a round (all-reduce groups cap at MAX_MEMBERS), with
    an outer momentum (γ > 0) or without."""
    if peers < 1:
        raise ValueError(f"peers must be >= 1, got {peers}")
    grad_share = payload_share(config.grad_codec, config.topk_density, config.sparse_bits, config.topk_chunk_size)
    param_share = payload_share(config.param_codec)
    overlap = 2.0 if config.overlap != "none" else 0.0
    outer_state = 1.0 if momentum else 0.0  # the momentum buffers, or GASLoC's x, in the snapshot
    if config.mode == "diloco":
        members = min(peers, MAX_MEMBERS)
        if config.allreduce_transport == "hivemind":
            round_, how = 3.0, "own Δ, hivemind's parts in and out (approximate)"
        else:
            round_, how = allreduce_round(members, grad_share), f"all-reduce of {members} peers' Δ, at most"
        return Buffers(THETA_0 + 1 + overlap, round_, 1 + outer_state,
                       "θ_0, all-reduce state" + (", delayed Δ" if overlap else ""),
                       how + (" (during the next inner phase)" if overlap else ""))
    if config.mode == "gasloc":
        k, x = config.gossip_peers, ", x" if momentum else ""
        mixing = 5 + k * (1 + 2 * param_share)
        if overlap:  # the proposal's mix runs during the next inner phase: it is held beside the training state
            return Buffers(THETA_0 + GOSSIP_KEPT + outer_state + mixing, 2, 1 + outer_state,
                           f"θ_0, gossip reference/base/correction{x}, the last proposal's mix",
                           f"proposal; its mix with {k} partner(s) during the next inner phase")
        return Buffers(THETA_0 + GOSSIP_KEPT + outer_state, mixing, 1 + outer_state,
                       f"θ_0, gossip reference/base/correction{x}", f"proposal, mix with {k} partner(s)")
    mix1 = 3 + 2 * param_share
    d = config.mix2_group_size - 1
    if config.mix2_transport == "gossip":
        mix2, residual, snapshot = 3 + grad_share + d * (1 + grad_share), 1.0, 2.0 + outer_state
    else:
        group = min(peers, largest_group(config.mix2_group_size))
        mix2, residual, snapshot = allreduce_round(group, grad_share), 1.0, 1.0 + outer_state
    return Buffers(THETA_0 + GOSSIP_KEPT + 1 + residual + overlap, max(mix1, 2 + mix2), snapshot,
                   "θ_0, Mix1 gossip state, frozen anchor, Mix2 residual" + (", delayed Δ" if overlap else ""),
                   f"Mix1, then Mix2 with {min(peers, largest_group(config.mix2_group_size))} peers at most"
                   + (" (during the next inner phase)" if overlap else ""))
