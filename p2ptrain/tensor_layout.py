"""Checks that a list of tensors has the layout we expect, before any of it is used, and the norms of tensor lists
(ground floor: shared by the maths wing, which compares tensor lists, and the network wing, which validates what
peers send)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from p2ptrain.errors import StateMismatchError

TensorLayout = list[tuple[str, tuple[int, ...], str]]  # (name, shape, dtype) per tensor, in order


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
    """‖x‖ over all tensors taken together, accumulated in fp64; inf if any entry is not finite."""
    if not tensors:
        return 0.0
    per_tensor = torch.stack([torch.linalg.vector_norm(t.detach(), dtype=torch.float64) for t in tensors])
    value = float(torch.linalg.vector_norm(per_tensor))
    return value if math.isfinite(value) else math.inf


def distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """‖a − b‖ over all tensors taken together; inf if either holds a non-finite value."""
    check_alike(a, b, "compared state")
    return norm([x.float() - y.float() for x, y in zip(a, b, strict=True)])
