"""How peers combine their outer gradients: the swappable averaging stage and its configuration.

An `OuterGradientAverager` takes this peer's outer gradient for a round and returns the gradient to apply (the
group mean for DiLoCo). A peer with no partners gets its own gradient back through the same call: there is no
separate solo code path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from p2ptrain.errors import ConfigError

SYNC_MODES = ("diloco",)


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """The averaging stage. `diloco`: exact all-reduce of Δ over every live peer of the round (blocking)."""

    mode: str = "diloco"
    matchmaking_s: float = 3.0  # how long a peer waits for the others of its round to form a group
    allreduce_timeout_s: float = 60.0  # an all-reduce that takes longer is abandoned (own Δ is applied)
    state_download_timeout_s: float = 60.0  # per-chunk deadline when a joiner downloads state

    def __post_init__(self) -> None:
        if self.mode not in SYNC_MODES:
            raise ConfigError(f"sync.mode must be one of {', '.join(SYNC_MODES)}, got {self.mode!r}")
        if self.matchmaking_s <= 0 or self.allreduce_timeout_s <= 0 or self.state_download_timeout_s <= 0:
            raise ConfigError("sync.matchmaking_s, sync.allreduce_timeout_s and sync.state_download_timeout_s "
                              "must be > 0 seconds")


@dataclasses.dataclass
class AveragingResult:
    """The gradient to apply and what it cost."""

    delta: list[torch.Tensor]
    group_size: int  # peers whose gradients were averaged, ourselves included
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


class OuterGradientAverager(Protocol):
    def average(self, delta: Sequence[torch.Tensor], round_: int, weight: float, partners: int) -> AveragingResult:
        """Combine `delta` (this peer's Δ for `round_`, weighted by `weight`) with up to `partners` other peers."""
        ...

    def shutdown(self) -> None: ...


def weighted_mean(deltas: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """Σ w_i Δ_i / Σ w_i, tensor by tensor (the exact average the all-reduce computes)."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    return [sum(w * d[k] for w, d in zip(weights, deltas, strict=True)) / total for k in range(len(deltas[0]))]  # type: ignore[misc]
