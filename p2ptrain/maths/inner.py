"""The inner phase: H steps of AdamW on local batches, with warmup + cosine and gradient clipping, and the knobs
that fit a step to the volunteer's device: micro-batches (gradient accumulation), activation checkpointing and
16-bit autocast (bf16, or fp16 with a dynamic loss scale). On a node of several processes the steps run
data-parallel (maths/data_parallel.py); a one-process node runs the same code."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from p2ptrain.choices import PRECISIONS
from p2ptrain.errors import ConfigError
from p2ptrain.maths.data_parallel import STOP, TRAIN, NodeGroup

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
    micro_batches: int = 1  # a step's batch runs in this many parts, gradients accumulated (<= data.batch_size)
    activation_checkpointing: bool = False  # keep each decoder layer's input only, recompute the rest (+1/3 compute)
    precision: str = "auto"  # forward in: auto (bf16 autocast on CUDA, fp32 elsewhere) | fp32 | bf16 | fp16
    fp16_initial_scale: float = 65536.0  # fp16 only: the dynamic loss scale's start (halved on overflow)

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
        if self.micro_batches < 1:
            raise ConfigError(f"inner.micro_batches must be >= 1 (1 = the whole batch at once), got "
                              f"{self.micro_batches}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"inner.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not 1 <= self.fp16_initial_scale <= 2.0**24:
            raise ConfigError(f"inner.fp16_initial_scale must be in [1, 2^24], got {self.fp16_initial_scale}")
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


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The 16-bit dtype the forward runs in (`inner.precision`), None for fp32."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return AUTOCAST_DTYPES.get(precision)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Checkpoint every decoder layer (transformers 5 calls it activation checkpointing, 4.x gradient
    checkpointing); a model without either is a config error."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)  # type: ignore[operator]
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]
    else:
        raise ConfigError(f"inner.activation_checkpointing: {type(model).__name__} does not support it; set it false")


class InnerTrainer:
    """Runs inner steps on one model; keeps its AdamW state, loss scale and step count across rounds."""

    def __init__(self, model: torch.nn.Module, config: InnerConfig, device: torch.device,
                 node: NodeGroup | None = None):
        self.model, self.config, self.device = model, config, device
        self.node = node or NodeGroup(device=device)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=(config.beta1, config.beta2), weight_decay=config.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_multiplier(step, config))
        self.dtype = autocast_dtype(config.precision, device)
        # fp16's narrow range needs a loss scale; with bf16 or fp32 the scaler passes everything through unchanged
        self.scaler = torch.amp.GradScaler(device.type, init_scale=config.fp16_initial_scale,
                                           enabled=self.dtype == torch.float16)
        if config.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.forward_model = self.node.wrap(model)  # DDP on a node of several processes
        self.last_eval_s = 0.0  # seconds of the latest `evaluate`

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def train_step(self, batch: torch.Tensor) -> float:
        """One AdamW step on this process's part of a [batch, seq_len] token batch, in `micro_batches` parts whose
        gradients add up to the whole part's; returns the loss."""
        self.model.train()
        batch = self.node.local_part(batch).to(self.device, non_blocking=True)
        parts = batch.chunk(self.config.micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        with self.node.guard("take an inner step"):
            for i, part in enumerate(parts):
                with self.node.no_sync(self.forward_model, sync=i == len(parts) - 1), self._autocast():
                    # the loss is a mean over the part's tokens: weighted by its share, the parts' gradients sum to
                    # the whole batch's (every sample has the same number of tokens)
                    loss = self.forward_model(input_ids=part, labels=part).loss * (part.shape[0] / batch.shape[0])
                self.scaler.scale(loss).backward()
                loss_sum += loss.detach().float()
            self._apply_gradients()
        return float(loss_sum)

    def _apply_gradients(self) -> None:
        """Clip (after unscaling), step AdamW (skipped by the scaler on an fp16 overflow) and the schedule."""
        if self.config.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

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
        A set `stop` event ends the phase after the current step. On a node, rank 0's choice of each next step
        holds for every rank."""
        losses: list[float] = []
        tokens, started = 0, time.monotonic()
        while self.node.command(TRAIN if self._wants_step(len(losses), max_steps, started, deadline, stop) else STOP):
            batch = next(batches)
            losses.append(self.train_step(batch))
            tokens += batch.numel()
            if on_step is not None:
                on_step(len(losses), losses[-1])
        compute_s = time.monotonic() - started
        return PhaseResult(len(losses), sum(losses) / max(1, len(losses)), tokens, compute_s)

    def _wants_step(self, step: int, max_steps: int, started: float, deadline: float,
                    stop: threading.Event | None) -> bool:
        """Whether step number `step` (0-based) of the phase is to run."""
        if step >= max_steps or (stop is not None and stop.is_set()):
            return False
        step_time_s = (time.monotonic() - started) / step if step else 0.0
        return step < self.config.min_steps or time.monotonic() + step_time_s <= deadline

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean loss over held-out batches; `last_eval_s` keeps how long it took."""
        started = time.monotonic()
        self.model.eval()
        losses = []
        for batch in batches:
            batch = batch.to(self.device)
            with self._autocast():
                losses.append(float(self.model(input_ids=batch, labels=batch).loss))
        self.last_eval_s = time.monotonic() - started
        return sum(losses) / max(1, len(losses))

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):  # fp16's loss scale (absent from older checkpoints and other precisions)
            self.scaler.load_state_dict(state["scaler"])
