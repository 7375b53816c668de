"""The outer-sync stage's configuration (`sync` section): which strategy, and the knobs of its transports."""

from __future__ import annotations

import dataclasses

from p2ptrain.choices import SYNC_MODES
from p2ptrain.errors import ConfigError
from p2ptrain.maths.codecs import MAX_CHUNK_SIZE
from p2ptrain.maths.sparse_codec import MAX_BITS as MAX_SPARSE_BITS
from p2ptrain.timing import TRANSFER_PATIENCE_S

OVERLAP_MODES = ("none", "delayed", "eager", "local")
PARAM_CODECS = ("fp16", "none", "int8", "adaptive")
GRAD_CODECS = ("none", "fp16", "topk", "sparse")
SPARSE_GRAD_CODECS = ("topk", "sparse")  # kept entries only: sent with error feedback
MIX2_TRANSPORTS = ("allreduce", "gossip")
ALLREDUCE_TRANSPORTS = ("exchange", "scatter", "hivemind")
SCATTER_GRAD_CODECS = ("none", "fp16")  # a scatter owner's mean of sparse chunks is dense: it would not shrink
# the most γ a one-round-late outer gradient takes: 0.9 diverges, delayed trains best with none and eager with 0.5
# (benchmarks/algorithms.py; figures in docs/algorithms.md §4)
OVERLAP_MOMENTUM = {"delayed": 0.0, "eager": 0.5, "local": 0.0}
# GASLoC's γ (momentum on the mixed iterates). 0.9 re-injects 0.9 × the last round's disagreement after every pair
# average, so peers drift apart and the loss spikes; γ = 0 trains smoothly to a lower loss (docs/algorithms.md §2,
# docs/benchmarks.md)
GASLOC_MOMENTUM = 0.0


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """The outer-sync stage. Outer lr η and momentum γ are `outer.lr` and `outer.momentum` in every mode."""

    # gasloc | diloco | factored. GASLoC trained to the lowest loss at equal wall clock on home links at 8 and 16
    # peers, 2 of 2 runs, at 7-13x DiLoCo's utilisation (benchmarks/swarm_scale.py); diloco is the exact reference
    mode: str = "gasloc"
    # diloco, and factored's Mix2: an all-reduce among the peers of the round
    matchmaking_s: float = 3.0  # how long a peer waits at most for the others of its round (late ones: left out)
    # exchange: every member swaps Δ with every other and takes their CenteredClip mean (robust, attributable;
    # (n−1)·S bytes each); scatter: each member reduces one chunk for all, whose means every member checks
    # (2·S·(n−1)/n bytes; a failed check falls back to exchange in the same round); hivemind: its butterfly
    # averager (2·S·(n−1)/n bytes, but any member sets the mean)
    allreduce_transport: str = "exchange"
    # an all-reduce (or one gossip Mix2 exchange) that takes longer is abandoned
    allreduce_timeout_s: float = TRANSFER_PATIENCE_S
    # diloco's all-reduce, factored's Mix2: none | delayed (DiLoCoX one-step delay) | eager (own Δ/M now, others
    # late) | local (all of own Δ now, swapped for the group's mean a round late: local SGD whose average lands a
    # round late; γ 0); gasloc: none | delayed (the exchanges it starts run during the next inner phase, their pull
    # applied then)
    overlap: str = "none"
    overlap_momentum: float | None = None  # γ with overlap; default OVERLAP_MOMENTUM (outer.momentum diverges)
    gasloc_momentum: float | None = None  # γ of gasloc (momentum on mixed iterates); default GASLOC_MOMENTUM
    # outer gradients (DiLoCo's and Factored's exchanges): none (fp32) | fp16 | topk (8-bit values) | sparse (sync.
    # sparse_bits-bit values, Elias-Fano indices); topk and sparse keep sync.topk_density of each chunk and send the
    # rest later (error feedback); not with allreduce_transport hivemind, whose butterfly sums dense parts
    grad_codec: str = "none"
    # gasloc, and factored's Mix1: push-pull gossip with random live peers
    gossip_peers: int = 1  # partners per round: 1 = pair averaging (weight 1/2), 2 = weights 1/3
    # parameters travel as codec(θ − θ_0): fp16 | none | int8 | adaptive (fp16 where it fits the inner phase on the
    # partner's link, else int8: on swarm12 the 2.84 Mbit/s peer's exchanges took 1.9 s against 4-6 s in fp16, and
    # the farthest peer from the mean went from 0.15-0.22 to 0.04)
    param_codec: str = "adaptive"
    exchange_safety_factor: float = 4.0  # deadline = factor × payload bytes / measured link throughput
    max_partner_distance: float = 10.0  # refuse a partner farther than this × ‖ours‖ (garbage, not disagreement)
    # defences against hostile peers (maths/robust.py): clip what a partner moves us by to a multiple of the
    # typical honest distance, and check an all-reduce's mean against our own Δ. false: the plain mean, only to
    # measure what the defences cost (benchmarks/robustness.py)
    robust: bool = True
    # outer gradients (gossip Mix2, CenteredClip of an all-reduce): honest peers' Δ differ by about their norm
    clip_multiplier: float = 2.0
    # parameters (GASLoC's y, Mix1): honest partners lie well within our own step, and each round an attacker is
    # a partner it pulls us back by up to w × this × our step, which the outer momentum carries on. 1.0 is where
    # a clean run does not pay yet and attackers cost least (docs/benchmarks.md, Robustness)
    param_clip_multiplier: float = 1.0
    # factored
    mix2_every: int = 1  # K: blocking Mix2 of outer gradients every K rounds
    # Mix1 (parameter gossip, a whole model in sync.param_codec) starts every this many rounds; in the others a peer
    # only answers partners' offers. With a compressed gossip Mix2, Mix1 carries most of the bytes
    mix1_every: int = 1
    # peers per Mix2 group (2 partners + self = the "2-peer" graph; gossip: weights 1/3); an all-reduce draws about
    # n / this many groups by hash, so a group holds 1 to twice this many
    mix2_group_size: int = 3
    mix2_transport: str = "allreduce"  # allreduce (exact mean of the group) | gossip (push-pull, grad_gossip.py)
    # gossip Mix2: a partner's outer gradient may be of a round up to this many from ours (0: of ours only). Peers
    # on different links drift rounds apart; a gap lets them keep mixing (docs/algorithms.md §3)
    mix2_round_gap: int = 0
    topk_density: float = 1 / 32  # grad_codec topk and sparse: fraction of each chunk's entries sent
    topk_chunk_size: int = 4096  # grad_codec topk and sparse: elements per chunk (64×64), each with its own scale
    sparse_bits: int = 2  # grad_codec sparse: bits per kept value (sign included): 2 at 2 % is 1/148 of fp32 bytes
    error_feedback_decay: float = 1.0  # β in e ← β·e + Δ for outer gradients (1: what was not sent is sent later)
    # all modes
    adapt_inner_steps: bool = False  # a peer on a slow link takes fewer inner steps (GASLoC pacing)
    # gossip modes (each peer's rounds its own): a peer whose steps are slower than the swarm's takes fewer of them,
    # down to half, so its rounds keep the swarm's pace (maths/pacing.py `inner_steps_for_pace`); DiLoCo: no effect
    keep_pace: bool = True
    state_download_timeout_s: float = TRANSFER_PATIENCE_S  # per-chunk deadline when a joiner downloads state
    # joining (joining.py): whose state a newcomer, or a peer that fell behind, may adopt (peers are untrusted)
    join_max_round_lead: int = 2  # rounds a donor may be ahead of the swarm's median round; further: suspect
    join_loss_tolerance: float = 0.1  # refuse a state whose val loss exceeds the swarm's by this fraction (+0.05)
    join_gossip_max_distance: float = 0.5  # gossip modes: refuse a state farther than this × ‖θ‖ from most peers'

    def __post_init__(self) -> None:
        choices = (("mode", SYNC_MODES), ("overlap", OVERLAP_MODES), ("param_codec", PARAM_CODECS),
                   ("grad_codec", GRAD_CODECS), ("mix2_transport", MIX2_TRANSPORTS),
                   ("allreduce_transport", ALLREDUCE_TRANSPORTS))
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ConfigError(f"sync.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.own_delta_first and self.mode == "gasloc":
            raise ConfigError(f"sync.overlap {self.overlap} applies to sync.mode diloco and factored (gasloc: none or "
                              f"delayed)")
        if self.overlap == "local" and self.overlap_momentum:
            raise ConfigError("sync.overlap local takes no sync.overlap_momentum: its own Δ is applied now and "
                              "replaced by the group's mean a round later, which adds up only without momentum")
        if self.overlap_momentum is not None and (self.overlap == "none" or self.mode == "gasloc"
                                                  or not 0 <= self.overlap_momentum < 1):
            raise ConfigError("sync.overlap_momentum applies with sync.overlap delayed or eager (diloco, factored; "
                              "gasloc's is sync.gasloc_momentum) and must be in [0, 1)")
        if self.gasloc_momentum is not None and (self.mode != "gasloc" or not 0 <= self.gasloc_momentum < 1):
            raise ConfigError("sync.gasloc_momentum applies with sync.mode gasloc and must be in [0, 1)")
        if self.gossip_peers not in (1, 2):
            raise ConfigError(f"sync.gossip_peers must be 1 or 2, got {self.gossip_peers}")
        if min(self.matchmaking_s, self.allreduce_timeout_s, self.state_download_timeout_s) <= 0:
            raise ConfigError("sync.matchmaking_s, sync.allreduce_timeout_s and sync.state_download_timeout_s "
                              "must be > 0 seconds")
        if self.clip_multiplier <= 0 or self.param_clip_multiplier <= 0:
            raise ConfigError(f"sync.clip_multiplier and sync.param_clip_multiplier must be > 0, got "
                              f"{self.clip_multiplier}, {self.param_clip_multiplier}")
        if self.exchange_safety_factor < 1 or self.max_partner_distance <= 0:
            raise ConfigError("sync.exchange_safety_factor must be >= 1 and sync.max_partner_distance > 0")
        if self.mix2_every < 1 or self.mix1_every < 1 or self.mix2_group_size < 2:
            raise ConfigError("sync.mix2_every and sync.mix1_every must be >= 1 round and sync.mix2_group_size >= 2 "
                              "peers")
        self._check_gossip_mix2()
        self._check_join()

    def _check_gossip_mix2(self) -> None:
        if self.mix2_transport == "gossip" and self.mode != "factored":
            raise ConfigError("sync.mix2_transport gossip applies to sync.mode factored only")
        if self.mix2_round_gap < 0 or (self.mix2_round_gap > 0 and self.mix2_transport != "gossip"):
            raise ConfigError(f"sync.mix2_round_gap must be >= 0 rounds, and applies to sync.mix2_transport gossip "
                              f"only (an all-reduce's group is of one round), got {self.mix2_round_gap}")
        if self.grad_codec in SPARSE_GRAD_CODECS:
            if self.mode == "gasloc":
                raise ConfigError(f"sync.grad_codec {self.grad_codec} compresses outer gradients, which gasloc does "
                                  f"not send (its parameters travel as sync.param_codec)")
            if self.allreduce_transport == "hivemind" and not (self.mode == "factored"
                                                               and self.mix2_transport == "gossip"):
                raise ConfigError(f"sync.grad_codec {self.grad_codec} needs sync.allreduce_transport exchange "
                                  f"(hivemind's butterfly all-reduce sums dense parts)")
        if self.allreduce_transport == "scatter" and self.grad_codec not in SCATTER_GRAD_CODECS:
            raise ConfigError(f"sync.allreduce_transport scatter sends sync.grad_codec none or fp16, got "
                              f"{self.grad_codec} (a mean of sparse chunks is dense; use exchange)")
        if not 1 <= self.sparse_bits <= MAX_SPARSE_BITS:
            raise ConfigError(f"sync.sparse_bits must be in [1, {MAX_SPARSE_BITS}], got {self.sparse_bits}")
        if not 0 < self.topk_density <= 1:
            raise ConfigError(f"sync.topk_density must be in (0, 1], got {self.topk_density}")
        if not 1 <= self.topk_chunk_size <= MAX_CHUNK_SIZE:
            raise ConfigError(f"sync.topk_chunk_size must be in [1, {MAX_CHUNK_SIZE}], "
                              f"got {self.topk_chunk_size}")
        if not 0 <= self.error_feedback_decay <= 1:
            raise ConfigError(f"sync.error_feedback_decay must be in [0, 1], got {self.error_feedback_decay}")

    def _check_join(self) -> None:
        if self.join_max_round_lead < 0:
            raise ConfigError(f"sync.join_max_round_lead must be >= 0 rounds, got {self.join_max_round_lead}")
        if self.join_loss_tolerance < 0 or self.join_gossip_max_distance <= 0:
            raise ConfigError("sync.join_loss_tolerance must be >= 0 and sync.join_gossip_max_distance > 0 (relative)")

    def outer_momentum(self, configured: float) -> float:
        """The γ the outer optimizer runs with: `outer.momentum`, except with overlap, where momentum on a stale
        gradient overshoots (at most OVERLAP_MOMENTUM, or `sync.overlap_momentum` when set), and in gasloc, where it
        amplifies disagreement (GASLOC_MOMENTUM, or `sync.gasloc_momentum` when set)."""
        if self.mode == "gasloc":
            return self.gasloc_momentum if self.gasloc_momentum is not None else GASLOC_MOMENTUM
        if self.overlap == "none":
            return configured
        if self.overlap_momentum is not None:
            return self.overlap_momentum
        return min(configured, OVERLAP_MOMENTUM[self.overlap])  # a cap: overlap adds no momentum the run has not

    @property
    def own_delta_first(self) -> bool:
        """Whether an overlapped peer applies its own Δ at once, before the group's mean arrives (eager, local):
        peers of one round then hold different parameters until that mean lands."""
        return self.overlap in ("eager", "local")

    def own_weight(self, group_size: int) -> float:
        """The weight of a peer's own Δ in what it applies at once (maths/outer_rules.DelayedOuterGradient):
        local applies all of it and lets the group's mean correct it a round late; eager applies its share, 1/M."""
        return 1.0 if self.overlap == "local" else 1.0 / max(1, group_size)
