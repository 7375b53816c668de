"""Which torch device a peer trains on: `run.device` ("auto", "cpu", "cuda[:n]", "mps"), checked before anything
starts, so a device this machine lacks fails in one line."""

from __future__ import annotations

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
