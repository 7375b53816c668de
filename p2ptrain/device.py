"""Which torch device a peer trains on: `run.device` ("auto", "cpu", "cuda[:n]", "mps"), checked before anything
starts, so a device this machine lacks fails in one line; and at what CPU priority it trains (`run.training_priority`).
"""

from __future__ import annotations

import os

import torch

from p2ptrain.errors import UserError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine (try --device cpu)")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device mps: MPS is not available on this machine (try --device cpu)")
    return torch.device(name)


def train_at_idle_priority() -> bool:
    """Put the calling thread, the one that trains, under SCHED_IDLE: it then runs only when nothing else on the
    machine wants a core, so the peer's network (its DHT and p2pd processes, its event-loop thread, all started
    before) answers at once on a machine shared by many peers. Threads it starts later inherit the policy. Linux
    only: False where the policy does not exist."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return True
