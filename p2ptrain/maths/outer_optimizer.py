"""The outer step: the anchor θ_r, the outer gradient Δ = θ_r − θ_r', and DiLoCo's Nesterov update on mean Δ."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from p2ptrain.errors import ConfigError
from p2ptrain.tensor_layout import check_alike


@dataclasses.dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer: SGD with Nesterov momentum on the averaged outer gradient (DiLoCo)."""

    lr: float = 0.7  # η
    momentum: float = 0.9  # γ; 0 = plain averaging of the inner trajectories
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.lr <= 2:
            raise ConfigError(f"outer.lr must be in (0, 2], got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer.momentum must be in [0, 1), got {self.momentum}")


class OuterOptimizer:
    """Holds the anchor (the parameters the inner phase started from) and the outer momentum.

    A round is: `outer_gradient()` after the inner phase, then `step_(mean_delta)` which puts the parameters back
    at the anchor, applies the Nesterov step, and makes the result the next anchor.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], config: OuterConfig):
        self.params = list(params)
        self.config = config
        self.anchor = [p.detach().clone() for p in self.params]
        self.optimizer = torch.optim.SGD(
            self.params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov and config.momentum > 0
        )

    @torch.no_grad()
    def outer_gradient(self) -> list[torch.Tensor]:
        """Δ = anchor − current parameters (DiLoCo's pseudo-gradient), as new float32 tensors."""
        return [(a - p.detach()).float() for a, p in zip(self.anchor, self.params, strict=True)]

    @torch.no_grad()
    def restore_anchor_(self) -> None:
        """Put the parameters back at the anchor (undoing the inner phase)."""
        for p, a in zip(self.params, self.anchor, strict=True):
            p.copy_(a)

    def step_(self, mean_delta: Sequence[torch.Tensor]) -> None:
        """θ ← Nesterov-SGD(anchor, grad = mean Δ); the result becomes the new anchor."""
        if len(mean_delta) != len(self.params):
            raise ValueError(f"expected {len(self.params)} outer-gradient tensors, got {len(mean_delta)}")
        self.restore_anchor_()
        for p, d in zip(self.params, mean_delta, strict=True):
            p.grad = d.to(device=p.device, dtype=p.dtype).clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.reset_anchor_()

    @torch.no_grad()
    def reset_anchor_(self) -> None:
        """Make the current parameters the anchor (after a step, a state download or a checkpoint load)."""
        for a, p in zip(self.anchor, self.params, strict=True):
            a.copy_(p.detach())

    @torch.no_grad()
    def set_params_(self, values: Sequence[torch.Tensor]) -> None:
        """Write new parameters (a mixed or downloaded state) and make them the anchor of the next round."""
        check_alike(self.params, values, "new parameters")
        for p, v in zip(self.params, values, strict=True):
            p.copy_(v.to(device=p.device, dtype=p.dtype))
        self.reset_anchor_()

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The momentum buffer of every parameter (zeros before the first step)."""
        buffers = []
        for p in self.params:
            buffer = self.optimizer.state.get(p, {}).get("momentum_buffer")
            buffers.append(buffer if buffer is not None else torch.zeros_like(p))
        return buffers

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The outer momentum by name: what a joiner downloads and a checkpoint keeps."""
        return [(f"momentum:{i}", b) for i, b in enumerate(self.momentum_buffers())]

    @torch.no_grad()
    def load_state_tensors_(self, buffers: Sequence[torch.Tensor]) -> None:
        """Load one momentum buffer per parameter, in the order of `state_tensors()`; a count or shape that does
        not fit changes nothing (StateMismatchError)."""
        check_alike(self.params, buffers, "outer momentum")
        for p, b in zip(self.params, buffers, strict=True):
            self.optimizer.state[p]["momentum_buffer"] = b.to(device=p.device, dtype=p.dtype).clone()
