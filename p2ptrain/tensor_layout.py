"""Checks that a list of tensors has the layout we expect, before any of it is used, and the norms of tensor lists
(ground floor: shared by the maths wing, which compares tensor lists, and the network wing, which validates what
peers send)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from p2ptrain.errors import StateMismatchError

TensorLayout = list[tuple[str, tuple[int, ...], str]]  # (name, shape, dtype) per tensor, in order


NORM_BLOCK = 1 << 20  # values per fp64 block of `norm` (8 MiB)


def check_alike(own: Sequence[torch.Tensor], other: Sequence[torch.Tensor], what: str) -> None:
    """Raise StateMismatchError unless `other` has as many tensors as `own`, of the same shapes."""
    if len(other) != len(own):
        raise StateMismatchError(f"{what} holds {len(other)} tensors, expected {len(own)}")
    for index, (mine, theirs) in enumerate(zip(own, other, strict=True)):
        if theirs.shape != mine.shape:
            raise StateMismatchError(
                f"{what} tensor {index} has shape {tuple(theirs.shape)}, expected {tuple(mine.shape)}"
            )


def layout_of(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> TensorLayout:
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in zip(names, tensors, strict=True)]


def check_tensors(expected: TensorLayout, tensors: Sequence[torch.Tensor], what: str = "state") -> None:
    """Raise StateMismatchError unless `tensors` match `expected` exactly and are all finite."""
    if len(tensors) != len(expected):
        raise StateMismatchError(f"{what} has {len(tensors)} tensors, expected {len(expected)}")
    for (name, shape, dtype), tensor in zip(expected, tensors, strict=True):
        if tuple(tensor.shape) != tuple(shape) or str(tensor.dtype) != dtype:
            raise StateMismatchError(f"{what} tensor {name} is {tuple(tensor.shape)} {tensor.dtype}, expected "
                                     f"{tuple(shape)} {dtype}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise StateMismatchError(f"{what} tensor {name} holds NaN or infinite values")


def norm(tensors: Sequence[torch.Tensor]) -> float:
    """‖x‖ over all tensors taken together, accumulated in fp64 a block of NORM_BLOCK values at a time (a whole
    tensor in fp64 is twice its fp32 bytes: 8 GB more for a 1B model's Δ); inf if any entry is not finite."""
    squares = 0.0
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        for block in flat.split(NORM_BLOCK):
            squares += float(block.to(torch.float64).square().sum())
    return math.sqrt(squares) if math.isfinite(squares) else math.inf


def distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """‖a − b‖ over all tensors taken together; inf if either holds a non-finite value."""
    check_alike(a, b, "compared state")
    return norm([x.float() - y.float() for x, y in zip(a, b, strict=True)])
