"""What the algorithm benchmark runs: the settings of one run and the table of rows (one algorithm configuration each).

Rows differ only in what is exchanged between inner phases; every row starts from the same θ_0 and sees the same
batches, so their losses compare side by side.
"""

from __future__ import annotations

import dataclasses

from p2ptrain.errors import ConfigError


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
    mix2_overlap: str = "none"  # factored: Mix2 one round late (sync.overlap: delayed | eager), momentum as set
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
    # sync.overlap with factored: Mix2 runs during the next inner phase; γ = production's OVERLAP_MOMENTUM
    Algorithm("factored-K1-delay1", "factored", mix2_overlap="delayed", momentum=0.0),
    Algorithm("factored-K1-eager", "factored", mix2_overlap="eager", momentum=0.5),
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
