"""The outer step: the anchor θ_r, the outer gradient Δ = θ_r − θ_r', and DiLoCo's Nesterov update on mean Δ.

The anchor and the outer momentum (the outer state) live where `outer.state_device` puts them: by default in host
memory when the model trains on an accelerator, so the device holds only what plain training holds (model, AdamW's
moments, gradients). The outer step runs on the state's device: Δ is formed there from a copy of the parameters,
the Nesterov step updates the anchor in place, and the new anchor is copied back into the parameters (from pinned
memory, asynchronously, on CUDA)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from p2ptrain.choices import STATE_DEVICES
from p2ptrain.errors import ConfigError
from p2ptrain.tensor_layout import check_alike

# the names of the outer momentum's tensors in a state or checkpoint (`momentum:0`, ...), kept only when γ > 0
MOMENTUM_PREFIX = "momentum:"


@dataclasses.dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer: SGD on the averaged outer gradient, with Nesterov momentum when γ > 0 (DiLoCo)."""

    # γ 0 and η 1, plain averaging of the inner trajectories: DiLoCo's γ 0.9 / η 0.7 moved θ 4-6× as far as the
    # inner phases did and trained 5-15 % worse at H 5 to 50 (benchmarks/outer_step.py, docs/algorithms.md §1)
    lr: float = 1.0  # η
    momentum: float = 0.0  # γ, Nesterov's
    nesterov: bool = True
    # where the anchor and the outer momentum live: auto (host memory when training on an accelerator, beside the
    # model on CPU) | host | device (beside the model: 2 fp32 copies of the model more on the accelerator)
    state_device: str = "auto"

    def __post_init__(self) -> None:
        if not 0 < self.lr <= 2:
            raise ConfigError(f"outer.lr must be in (0, 2], got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer.momentum must be in [0, 1), got {self.momentum}")
        if self.state_device not in STATE_DEVICES:
            raise ConfigError(f"outer.state_device must be one of {', '.join(STATE_DEVICES)}, got "
                              f"{self.state_device!r}")


def state_device_for(model_device: torch.device, choice: str) -> torch.device:
    """Where the outer state lives for a model on `model_device` (`outer.state_device`)."""
    if choice == "device" or (choice == "auto" and model_device.type == "cpu"):
        return model_device
    return torch.device("cpu")


class OuterOptimizer:
    """Holds the anchor (the parameters the inner phase started from) and the outer momentum.

    A round is: `outer_gradient()` after the inner phase, then `step_(mean_delta)` which applies the Nesterov step
    to the anchor and puts the parameters at the result, the next round's anchor.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], config: OuterConfig):
        self.params = list(params)
        self.config = config
        model_device = self.params[0].device if self.params else torch.device("cpu")
        self.state_device = state_device_for(model_device, config.state_device)
        self._pinned = self.state_device.type == "cpu" and model_device.type == "cuda"
        self.anchor = [self._state_copy(p) for p in self.params]
        self._copy_done: torch.cuda.Event | None = None  # the last asynchronous anchor → parameters copy
        # the anchor tensors are the outer SGD's own parameters: its step is the outer step, on the state's device
        self.optimizer = torch.optim.SGD(
            self.anchor, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov and config.momentum > 0
        )

    def _state_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.detach().to(self.state_device, copy=True)
        return copy.pin_memory() if self._pinned else copy

    def _wait_for_copies(self) -> None:
        """The anchor is about to change: the copy from it into the parameters must have ended."""
        if self._copy_done is not None:
            self._copy_done.synchronize()
            self._copy_done = None

    @torch.no_grad()
    def outer_gradient(self) -> list[torch.Tensor]:
        """Δ = anchor − current parameters (DiLoCo's pseudo-gradient), as new float32 tensors on the state's
        device."""
        return [(a - p.detach().to(a.device)).float() for a, p in zip(self.anchor, self.params, strict=True)]

    @torch.no_grad()
    def restore_anchor_(self) -> None:
        """Put the parameters back at the anchor (undoing the inner phase)."""
        for p, a in zip(self.params, self.anchor, strict=True):
            p.copy_(a, non_blocking=self._pinned)
        if self._pinned:
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()

    def step_(self, mean_delta: Sequence[torch.Tensor]) -> None:
        """anchor ← Nesterov-SGD(anchor, grad = mean Δ), and the parameters ← the new anchor."""
        if len(mean_delta) != len(self.params):
            raise ValueError(f"expected {len(self.params)} outer-gradient tensors, got {len(mean_delta)}")
        self._wait_for_copies()
        for a, d in zip(self.anchor, mean_delta, strict=True):
            a.grad = d.to(device=a.device, dtype=a.dtype).clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.restore_anchor_()

    @torch.no_grad()
    def reset_anchor_(self) -> None:
        """Make the current parameters the anchor (after a checkpoint load into the model)."""
        self._wait_for_copies()
        for a, p in zip(self.anchor, self.params, strict=True):
            a.copy_(p.detach())

    @torch.no_grad()
    def set_params_(self, values: Sequence[torch.Tensor]) -> None:
        """Write new parameters (a mixed or downloaded state) and make them the anchor of the next round."""
        check_alike(self.params, values, "new parameters")
        self._wait_for_copies()
        for a, v in zip(self.anchor, values, strict=True):
            a.copy_(v.to(device=a.device, dtype=a.dtype))
        self.restore_anchor_()

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The momentum buffer of every parameter (zeros before the first step), on the state's device."""
        buffers = []
        for a in self.anchor:
            buffer = self.optimizer.state.get(a, {}).get("momentum_buffer")
            buffers.append(buffer if buffer is not None else torch.zeros_like(a))
        return buffers

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The outer momentum by name: what a joiner downloads and a checkpoint keeps. None with γ 0: the buffers
        would be zeros, a model's worth of bytes in every state download and checkpoint."""
        if not self.config.momentum:
            return []
        return [(f"{MOMENTUM_PREFIX}{i}", b) for i, b in enumerate(self.momentum_buffers())]

    @torch.no_grad()
    def load_state_tensors_(self, buffers: Sequence[torch.Tensor]) -> None:
        """Load one momentum buffer per parameter, in the order of `state_tensors()` (none with γ 0); a count or
        shape that does not fit changes nothing (StateMismatchError)."""
        if not self.config.momentum:
            check_alike([], buffers, "outer momentum (none with outer.momentum 0)")
            return
        check_alike(self.params, buffers, "outer momentum")
        for a, b in zip(self.anchor, buffers, strict=True):
            self.optimizer.state[a]["momentum_buffer"] = b.to(device=a.device, dtype=a.dtype).clone()
