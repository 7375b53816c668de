"""The inner phase: H steps of AdamW on local batches, with warmup + cosine, gradient clipping and bf16 on CUDA."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from p2ptrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class InnerConfig:
    """The local optimizer. DiLoCo's recipe: AdamW, betas (0.9, 0.95), wd 0.1, warmup + cosine."""

    steps: int = 20  # H: inner steps per round (a slow link or a late joiner may take fewer)
    min_steps: int = 1  # H_min: the fewest inner steps a round may take
    lr: float = 2e-3  # peak learning rate (tiny models tolerate more than the paper's 4e-4)
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    warmup_steps: int = 20  # linear warmup, in inner steps
    total_steps: int = 20_000  # cosine horizon, in inner steps
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0  # max global gradient norm; 0 = off

    def __post_init__(self) -> None:
        if self.steps < 1 or not 1 <= self.min_steps <= self.steps:
            raise ConfigError(f"inner.steps must be >= 1 and 1 <= inner.min_steps <= steps, got {self.steps}, "
                              f"{self.min_steps}")
        if not 0 < self.lr < 1:
            raise ConfigError(f"inner.lr must be in (0, 1), got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"inner.beta1 and inner.beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.weight_decay < 0 or self.grad_clip < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("inner.weight_decay and inner.grad_clip must be >= 0, inner.min_lr_ratio in [0, 1]")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ConfigError(f"inner.warmup_steps must be >= 0 and inner.total_steps >= 1, got "
                              f"{self.warmup_steps}, {self.total_steps}")


@dataclasses.dataclass
class PhaseResult:
    """What one inner phase did."""

    steps: int
    mean_loss: float
    tokens: int
    compute_s: float


def lr_multiplier(step: int, config: InnerConfig) -> float:
    """Linear warmup to 1, then cosine down to `min_lr_ratio` at `total_steps`, flat after."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.total_steps - config.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine


class InnerTrainer:
    """Runs inner steps on one model; keeps its AdamW state and step count across rounds."""

    def __init__(self, model: torch.nn.Module, config: InnerConfig, device: torch.device):
        self.model, self.config, self.device = model, config, device
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=(config.beta1, config.beta2), weight_decay=config.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_multiplier(step, config))

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, batch: torch.Tensor) -> float:
        """One AdamW step on a [batch, seq_len] token batch; returns the loss."""
        self.model.train()
        batch = batch.to(self.device, non_blocking=True)
        with self._autocast():
            loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def run_phase(
        self,
        batches: Iterator[torch.Tensor],
        max_steps: int,
        deadline: float = math.inf,
        on_step: Callable[[int, float], None] | None = None,
        stop: threading.Event | None = None,
    ) -> PhaseResult:
        """Up to `max_steps` steps, stopping early (after at least `min_steps`) when the next step would end
        past `deadline` (time.monotonic()); that is how a late joiner or a slow link takes fewer steps.
        A set `stop` event ends the phase after the current step."""
        losses: list[float] = []
        tokens, started = 0, time.monotonic()
        for step in range(max_steps):
            elapsed = time.monotonic() - started
            step_time_s = elapsed / step if step else 0.0
            if step >= self.config.min_steps and time.monotonic() + step_time_s > deadline:
                break
            if stop is not None and stop.is_set():
                break
            batch = next(batches)
            losses.append(self.train_step(batch))
            tokens += batch.numel()
            if on_step is not None:
                on_step(step + 1, losses[-1])
        compute_s = time.monotonic() - started
        return PhaseResult(len(losses), sum(losses) / max(1, len(losses)), tokens, compute_s)

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean loss over held-out batches."""
        self.model.eval()
        losses = []
        for batch in batches:
            batch = batch.to(self.device)
            with self._autocast():
                losses.append(float(self.model(input_ids=batch, labels=batch).loss))
        return sum(losses) / max(1, len(losses))

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
