"""Outer steps: DiLoCo Nesterov vs torch SGD, GASLoC and Factored Gossip DiLoCo vs DiLoCo, delayed outer gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks.sim.graphs import complete_graph, mix_, mixing_weights  # noqa: E402
from p2ptrain.errors import StateMismatchError  # noqa: E402
from p2ptrain.maths.mixing import exact_average  # noqa: E402
from p2ptrain.maths.outer_rules import (  # noqa: E402
    DelayedOuterGradient,
    GaslocState,
    NesterovState,
    factored_step_,
    mix1_correction,
    nesterov_update,
    propose,
)

SHAPES = [(4, 3), (5,)]
LR = 0.7
ROUNDS = 6


def _initial(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _fake_inner_phase(theta: list[torch.Tensor], peer: int, round_index: int) -> list[torch.Tensor]:
    """Δ_i = θ − θ_i' for a fake inner phase that pulls θ towards a peer-specific target, plus round noise."""
    generator = torch.Generator().manual_seed(1000 * peer + round_index)
    return [
        0.3 * (t - (peer + 1) * 0.5)
        + 0.05 * torch.randn(t.shape, generator=generator)
        + 0.1 * torch.sin(t * (peer + 1))
        for t in theta
    ]


def _diloco_reference(theta0: list[torch.Tensor], n_peers: int, momentum: float) -> list[list[torch.Tensor]]:
    """DiLoCo with torch's own optimizer: p.grad = mean Δ; SGD(nesterov).step(). Returns θ after each round."""
    params = [torch.nn.Parameter(t.clone()) for t in theta0]
    optimizer = torch.optim.SGD(params, lr=LR, momentum=momentum, nesterov=momentum > 0)
    history = []
    for r in range(ROUNDS):
        theta = [p.detach().clone() for p in params]
        deltas = [_fake_inner_phase(theta, i, r) for i in range(n_peers)]
        for p, g in zip(params, exact_average(deltas), strict=True):
            p.grad = g
        optimizer.step()
        history.append([p.detach().clone() for p in params])
    return history


def test_nesterov_update_matches_torch_sgd() -> None:
    params = [torch.nn.Parameter(t.clone()) for t in _initial(0)]
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9, nesterov=True)
    theta, outer = _initial(0), NesterovState(lr=LR, momentum=0.9)
    for r in range(ROUNDS):
        grad = _fake_inner_phase(theta, 0, r)
        for p, g in zip(params, grad, strict=True):
            p.grad = g.clone()
        optimizer.step()
        outer.step_(theta, grad)
        for mine, reference in zip(theta, params, strict=True):
            torch.testing.assert_close(mine, reference.detach(), rtol=1e-6, atol=1e-6)


def test_nesterov_update_hand_computed() -> None:
    update, buf = nesterov_update([torch.tensor([1.0])], None, lr=0.5, momentum=0.9)
    assert buf[0].item() == pytest.approx(1.0) and update[0].item() == pytest.approx(-0.5 * (1 + 0.9))
    update, buf = nesterov_update([torch.tensor([2.0])], buf, lr=0.5, momentum=0.9)
    assert buf[0].item() == pytest.approx(2.9) and update[0].item() == pytest.approx(-0.5 * (2 + 0.9 * 2.9))


def test_gasloc_one_round_hand_computed() -> None:
    state = GaslocState([torch.tensor([1.0])], momentum=0.9)
    y = propose([torch.tensor([1.0])], [torch.tensor([0.5])], lr=0.7)
    assert y[0].item() == pytest.approx(0.65)
    theta_next = state.momentum_step(y)  # no partner: x_new = y
    assert theta_next[0].item() == pytest.approx(0.65 + 0.9 * (0.65 - 1.0))
    assert state.x_prev[0].item() == pytest.approx(0.65)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("n_peers", [3, 4])
def test_gasloc_on_complete_graph_reproduces_diloco(momentum: float, n_peers: int) -> None:
    theta0 = _initial(1)
    reference = _diloco_reference(theta0, n_peers, momentum)
    thetas = [[t.clone() for t in theta0] for _ in range(n_peers)]
    states = [GaslocState(theta0, momentum) for _ in range(n_peers)]
    graph = complete_graph(n_peers)
    for r in range(ROUNDS):
        proposals = [propose(thetas[i], _fake_inner_phase(thetas[i], i, r), LR) for i in range(n_peers)]
        for i in range(n_peers):
            x_new = [t.clone() for t in proposals[i]]
            mix_(x_new, [proposals[j] for j in graph[i]], mixing_weights(graph, i))
            thetas[i] = states[i].momentum_step(x_new)
        for theta in thetas:
            for mine, expected in zip(theta, reference[r], strict=True):
                torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-5)
    moved = sum(float((a - b).abs().sum()) for a, b in zip(reference[-1], theta0, strict=True))
    assert moved > 1.0  # the comparison is not vacuous


def test_gasloc_state_dict_round_trip() -> None:
    state = GaslocState(_initial(0), momentum=0.9)
    state.momentum_step(_initial(1))
    restored = GaslocState(_initial(2), momentum=0.0)
    restored.load_state_dict(state.state_dict())
    x_new = _initial(3)
    for a, b in zip(state.momentum_step(x_new), restored.momentum_step(x_new), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(StateMismatchError):
        restored.load_state_dict({"momentum": 0.9, "x_prev": [torch.zeros(2)]})


def test_mix1_correction_hand_computed() -> None:
    correction = mix1_correction([torch.tensor([1.0, 2.0])], [[torch.tensor([3.0, 2.0])]], [0.5])
    torch.testing.assert_close(correction[0], torch.tensor([1.0, 0.0]))
    assert torch.equal(mix1_correction([torch.tensor([1.0])], [], [])[0], torch.zeros(1))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_factored_with_exact_mixing_equals_diloco(momentum: float) -> None:
    """Equal θ_0, exact Mix1 (c = 0) and exact all-reduce Mix2 every round: Factored = DiLoCo."""
    n_peers, theta0 = 3, _initial(4)
    reference = _diloco_reference(theta0, n_peers, momentum)
    thetas = [[t.clone() for t in theta0] for _ in range(n_peers)]
    outers = [NesterovState(LR, momentum) for _ in range(n_peers)]
    graph = complete_graph(n_peers)
    for r in range(ROUNDS):
        frozen = [[t.clone() for t in theta] for theta in thetas]
        corrections = [
            mix1_correction(frozen[i], [frozen[j] for j in graph[i]], mixing_weights(graph, i)) for i in range(n_peers)
        ]
        mixed_delta = exact_average([_fake_inner_phase(frozen[i], i, r) for i in range(n_peers)])
        for i in range(n_peers):
            factored_step_(thetas[i], corrections[i], mixed_delta, outers[i])
            for mine, expected in zip(thetas[i], reference[r], strict=True):
                torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-5)


def test_factored_mix1_pulls_different_starts_to_the_diloco_trajectory_of_their_mean() -> None:
    """With Δ independent of θ, exact Mix1 from different θ_i gives DiLoCo started from mean θ after one round."""
    n_peers, momentum = 4, 0.9
    thetas = [_initial(10 + i) for i in range(n_peers)]
    generator = torch.Generator().manual_seed(5)
    deltas = [[[torch.randn(s, generator=generator) for s in SHAPES] for _ in range(n_peers)] for _ in range(ROUNDS)]
    reference, reference_outer = exact_average(thetas), NesterovState(LR, momentum)
    outers = [NesterovState(LR, momentum) for _ in range(n_peers)]
    graph = complete_graph(n_peers)
    for r in range(ROUNDS):
        frozen = [[t.clone() for t in theta] for theta in thetas]
        mixed_delta = exact_average(deltas[r])
        for i in range(n_peers):
            correction = mix1_correction(frozen[i], [frozen[j] for j in graph[i]], mixing_weights(graph, i))
            factored_step_(thetas[i], correction, mixed_delta, outers[i])
        reference_outer.step_(reference, mixed_delta)
        for theta in thetas:
            for mine, expected in zip(theta, reference, strict=True):
                torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-5)


def test_delayed_outer_gradient_plain() -> None:
    delayed = DelayedOuterGradient(eager=False)
    assert delayed.outer_gradient_([torch.tensor([2.0])], None, own_weight=0.5) is None  # first round: nothing yet
    applied = delayed.outer_gradient_([torch.tensor([4.0])], [torch.tensor([3.0])], own_weight=0.5)
    assert applied is not None and applied[0].item() == 3.0  # Δ̄_0 arrives one round late
    applied = delayed.outer_gradient_([torch.tensor([6.0])], None, own_weight=0.5)  # exchange of Δ_1 failed
    assert applied is not None and applied[0].item() == 4.0  # falls back to own Δ_1 (mixing with nobody)


def test_delayed_outer_gradient_eager_hand_computed() -> None:
    delayed = DelayedOuterGradient(eager=True)
    first = delayed.outer_gradient_([torch.tensor([2.0])], None, own_weight=0.5)
    assert first is not None and first[0].item() == pytest.approx(1.0)  # w·Δ_0
    # the other peer's Δ_0 was 4: Δ̄_0 = 3; Δ̃_1 = Δ̄_0 + w (Δ_1 − Δ_0) = 3 + 0.5 (4 − 2)
    second = delayed.outer_gradient_([torch.tensor([4.0])], [torch.tensor([3.0])], own_weight=0.5)
    assert second is not None and second[0].item() == pytest.approx(4.0)


def test_eager_bookkeeping_applies_every_delta_with_its_mixing_weight() -> None:
    """Σ_t Δ̃_t = Σ_{t<T} Δ̄_t + w·Δ_T when every all-reduce succeeds (M peers, w = 1/M)."""
    n_peers, rounds = 3, 8
    generator = torch.Generator().manual_seed(0)
    deltas = [[torch.randn(5, generator=generator) for _ in range(n_peers)] for _ in range(rounds)]
    means = [torch.stack(per_round).mean(dim=0) for per_round in deltas]
    delayed = DelayedOuterGradient(eager=True)
    total = torch.zeros(5)
    for t in range(rounds):
        applied = delayed.outer_gradient_([deltas[t][0]], [means[t - 1]] if t else None, own_weight=1 / n_peers)
        assert applied is not None
        total += applied[0]
    expected = torch.stack(means[:-1]).sum(dim=0) + deltas[-1][0] / n_peers
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
