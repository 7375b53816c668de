"""tensor_layout.norm: exact in fp64 over tensor lists, block by block, and inf for anything not finite."""

from __future__ import annotations

import math

import pytest
import torch

from p2ptrain import tensor_layout
from p2ptrain.tensor_layout import norm


@pytest.mark.parametrize("block", [3, 1 << 20])
def test_the_norm_is_the_fp64_length_of_the_tensors_end_to_end_whatever_the_block(block: int,
                                                                                   monkeypatch) -> None:
    monkeypatch.setattr(tensor_layout, "NORM_BLOCK", block)
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 7, generator=generator), torch.randn(11, generator=generator).half(), torch.ones(())]
    exact = math.sqrt(sum(float(t.double().square().sum()) for t in tensors))
    assert math.isclose(norm(tensors), exact, rel_tol=1e-12)
    assert norm([]) == 0.0 and norm([torch.tensor([3.0]), torch.tensor([[4.0]])]) == 5.0


def test_a_value_that_is_not_finite_makes_the_norm_inf() -> None:
    for bad in (math.nan, math.inf, -math.inf):
        assert norm([torch.ones(4), torch.tensor([1.0, bad])]) == math.inf
    assert norm([torch.full((4,), 3e38)]) == pytest.approx(6e38)  # fp32's squares overflow nowhere in fp64
