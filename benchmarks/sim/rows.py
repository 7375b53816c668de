"""What the algorithm benchmark runs: the settings of one run and the table of rows (one algorithm configuration each).

Rows differ only in what is exchanged between inner phases; within a seed every row starts from the same θ_0 and
sees the same batches, so their losses compare side by side (and gaps are paired per seed).
"""

from __future__ import annotations

import dataclasses

from p2ptrain.errors import ConfigError

# The full run's model: the `small` preset's shape with 5 layers (1,022,464 parameters with the byte tokenizer).
MODEL_SHAPES = {"bench-1m": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=5, num_attention_heads=4)}


@dataclasses.dataclass(frozen=True)
class Settings:
    """One run of the simulator. The defaults are the small run benchmarks/robustness.py builds on; the algorithm
    benchmark's full run is FULL on top of them (about 82 minutes of CPU on one core; see benchmarks/algorithms.py)."""

    peers: int = 4
    rounds: int = 16  # R, outer rounds at equal tokens
    inner_steps: int = 20  # H, inner steps per round
    model: str = "tiny"  # a p2ptrain preset (tiny, small, base) or a name in MODEL_SHAPES
    seq_len: int = 64
    batch_size: int = 8
    seed: int = 0  # the first seed; seed i of the run uses seed + i for θ_0, data order and gossip graphs
    seeds: int = 1  # runs of every row; tables give mean ± sd over them
    threads: int = 1  # torch intra-op threads (1 or 2); 1 is robust when other processes share the cores
    val_batches: int = 16
    max_corpus_bytes: int = 8_000_000
    bandwidth_bytes_per_s: float = 0.0  # fast peers' link; 0 = fp32 model bytes / measured inner-phase time
    straggler_fraction: float = 0.1  # the last peer's bandwidth as a fraction of the fast peers'
    wallclock: bool = False  # also table 2 (equal simulated wall clock, first seed, mode rows): retrains rows
    budget_rounds: int = 0  # table 2's budget = DiLoCo's time for this many rounds with the straggler; 0 = rounds
    max_rounds_factor: float = 4.0  # table 2 stops a row at this factor x budget_rounds (marked "capped")
    sections: tuple[str, ...] = ()  # run only the rows of these sections (SECTIONS); () = all
    rows: tuple[str, ...] = ()  # run only the rows of these names (besides the fp32 DiLoCo references); () = all

    def __post_init__(self) -> None:
        if self.peers < 2 or self.rounds < 1 or self.inner_steps < 1 or self.budget_rounds < 0 or self.seeds < 1:
            raise ConfigError("need --peers >= 2, --rounds >= 1, --inner-steps >= 1, --seeds >= 1 and "
                              "--budget-rounds >= 0")
        if self.threads not in (1, 2):
            raise ConfigError(f"--threads must be 1 or 2, got {self.threads}")
        if not 0 < self.straggler_fraction <= 1 or self.bandwidth_bytes_per_s < 0 or self.max_rounds_factor < 1:
            raise ConfigError("need 0 < --straggler-fraction <= 1, --bandwidth >= 0, --max-rounds-factor >= 1")
        unknown = set(self.sections) - set(SECTIONS)
        if unknown:
            raise ConfigError(f"unknown section {sorted(unknown)[0]!r}: use {', '.join(SECTIONS)}")
        unknown = set(self.rows) - {row.name for row in ROWS}
        if unknown:
            raise ConfigError(f"unknown row {sorted(unknown)[0]!r}: the rows are in benchmarks/sim/rows.py")


QUICK = dict(rounds=4, inner_steps=2, seq_len=16, batch_size=2, val_batches=2, max_corpus_bytes=400_000,
             max_rounds_factor=2.0)
# the algorithm benchmark's full run: >= 1M parameters, 50 rounds, 3 seeds (issue 12)
FULL = dict(model="bench-1m", rounds=50, inner_steps=10, batch_size=4, seeds=3)

SECTIONS = ("modes", "momentum", "mix2", "codecs", "gossip-codecs")


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One row: an algorithm configuration."""

    name: str
    kind: str  # diloco | gasloc | factored | delayed | gradgossip | choco
    section: str = "modes"  # one of SECTIONS: which table the row answers
    codec: str = "none"  # diloco, gradgossip, choco: codec of what travels (none = exact fp32)
    density: float = 1.0  # topk and sparse
    bits: int = 2  # sparse only
    ef_decay: float = 1.0  # β of error feedback (topk, sparse): e ← β·e + Δ
    graph: str = "complete"  # gasloc: complete | matching (1-peer) | cycle (2-peer); choco: ring (fixed)
    momentum: float = 0.9  # γ (blocking factored uses the workbench's, 0.9)
    outer_lr: float = 0.0  # η; 0 = the workbench's (0.7, benchmarks/sim/peers.py: PAPER_OUTER)
    param_codec: str = "fp16"  # parameters (GASLoC's y, Mix1's θ) travel as codec(θ − θ_0); none = exact fp32
    mix2_every: int = 1  # factored: K
    mix1_every: int = 1  # factored: Mix1 every this many rounds (sync.mix1_every)
    mix2_overlap: str = "none"  # factored: Mix2 one round late (sync.overlap: delayed | eager | local), momentum as set
    eager: bool = False  # delayed: the eager variant
    local: bool = False  # delayed: the local variant (sync.overlap local: all of own Δ now, the mean a round late)
    consensus_step: float = 1.0  # choco: γ_c, the step towards the neighbours' public estimates
    overlap: bool = False  # choco, gradgossip: a round's payloads travel during the next inner phase, mixed or
    # applied one round late (gradgossip: production's DelayedOuterGradient, as sync.overlap delayed)

    @property
    def codec_options(self) -> dict[str, float]:
        """Options of ``get_codec(self.codec, ...)``."""
        if self.codec == "sparse":
            return {"density": self.density, "bits": self.bits}
        return {"density": self.density} if self.codec == "topk" else {}


# SparseLoCo's recipe for the codec rows: no outer momentum (the error-feedback buffer, decayed by β, plays its part)
# and a larger outer lr. Tuned on seed 100 (not one of the table's seeds), 2-bit 2 %: (γ 0, β 0.9, η 0.7) 2.274,
# (0, 1, 0.7) 2.227, (0, 1, 1.0) 2.147, (0, 0.95, 1.0) 2.126; fp32 DiLoCo (0.9, -, 0.7) 2.474, (0, -, 0.7) 2.164,
# (0, -, 1.0) 2.207. CHOCO's γ_c on the same seed: 0.1 2.400, 0.25 2.366, 0.5 2.459, 1.0 2.710.
CODEC_RECIPE = dict(momentum=0.0, ef_decay=0.95, outer_lr=1.0)

ROWS = (
    Algorithm("diloco", "diloco"),
    Algorithm("gasloc-1peer", "gasloc", graph="matching", momentum=0.0),  # production's γ (GASLOC_MOMENTUM)
    Algorithm("gasloc-2peer", "gasloc", graph="cycle", momentum=0.0),
    Algorithm("factored-K1", "factored", mix2_every=1),
    Algorithm("diloco-delay1", "delayed", momentum=0.0),  # production's γ with overlap (OVERLAP_MOMENTUM)
    Algorithm("diloco-eager", "delayed", eager=True, momentum=0.5),
    Algorithm("diloco-local", "delayed", local=True, momentum=0.0),
    Algorithm("factored-local", "factored", mix2_every=1, mix2_overlap="local", momentum=0.0),
    Algorithm("diloco-g0", "diloco", section="momentum", momentum=0.0),
    Algorithm("gasloc-1peer-g0.9", "gasloc", section="momentum", graph="matching", momentum=0.9),
    Algorithm("factored-K2", "factored", section="mix2", mix2_every=2),
    Algorithm("factored-K4", "factored", section="mix2", mix2_every=4),
    Algorithm("topk8-1/32", "diloco", section="codecs", codec="topk", density=1 / 32, **CODEC_RECIPE),
    Algorithm("topk8-1/128", "diloco", section="codecs", codec="topk", density=1 / 128, **CODEC_RECIPE),
    Algorithm("sparse2-3%", "diloco", section="codecs", codec="sparse", density=0.03, bits=2, **CODEC_RECIPE),
    Algorithm("sparse2-2%", "diloco", section="codecs", codec="sparse", density=0.02, bits=2, **CODEC_RECIPE),
    Algorithm("sparse2-1%", "diloco", section="codecs", codec="sparse", density=0.01, bits=2, **CODEC_RECIPE),
    Algorithm("sparse4-2%", "diloco", section="codecs", codec="sparse", density=0.02, bits=4, **CODEC_RECIPE),
    Algorithm("sparse4-1%", "diloco", section="codecs", codec="sparse", density=0.01, bits=4, **CODEC_RECIPE),
    Algorithm("gradgossip-sparse2-2%", "gradgossip", section="gossip-codecs", codec="sparse", density=0.02,
              graph="matching", **CODEC_RECIPE),
    Algorithm("gradgossip-sparse2-2%-delay1", "gradgossip", section="gossip-codecs", codec="sparse", density=0.02,
              graph="matching", overlap=True, **CODEC_RECIPE),
    Algorithm("gradgossip-sparse2-2%-local", "gradgossip", section="gossip-codecs", codec="sparse", density=0.02,
              graph="matching", overlap=True, local=True, **CODEC_RECIPE),
    Algorithm("factored-local-sparse2-2%", "factored", section="gossip-codecs", codec="sparse", density=0.02,
              mix2_overlap="local", **CODEC_RECIPE),
    Algorithm("factored-local-sparse2-2%-mix1x4", "factored", section="gossip-codecs", codec="sparse",
              density=0.02, mix2_overlap="local", mix1_every=4, **CODEC_RECIPE),
    Algorithm("choco-sparse2-2%", "choco", section="gossip-codecs", codec="sparse", density=0.02, graph="ring",
              momentum=0.0, consensus_step=0.25),
)
# fp32 DiLoCo with production's γ (0.9) and with γ 0: every gap is also given against the better of the two
REFERENCES = ("diloco", "diloco-g0")

# GASLoC on the complete graph with exact averaging must reproduce DiLoCo (docs/algorithms.md §2): checked, not a row
SANITY_ROW = Algorithm("gasloc-complete", "gasloc", graph="complete", param_codec="none")
