"""Outer steps against production: OuterOptimizer by hand and against torch SGD, GASLoC and Factored Gossip
DiLoCo against DiLoCo (production outer optimizer plus the graph mixing of benchmarks/sim/graphs.py), delayed outer
gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks.sim.graphs import Neighbours, complete_graph, mix_, mixing_weights  # noqa: E402
from benchmarks.sim.simulation import mix1_pull  # noqa: E402
from p2ptrain.errors import StateMismatchError  # noqa: E402
from p2ptrain.maths.mixing import exact_average  # noqa: E402
from p2ptrain.maths.outer_optimizer import OuterConfig, OuterOptimizer  # noqa: E402
from p2ptrain.maths.outer_rules import DelayedOuterGradient, GaslocState, propose  # noqa: E402

SHAPES = [(4, 3), (5,)]
LR = 0.7
ROUNDS = 6
Tensors = list[torch.Tensor]


def _initial(seed: int) -> Tensors:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _fake_inner_phase(theta: Tensors, peer: int, round_index: int) -> Tensors:
    """Δ_i = θ − θ_i' for a fake inner phase that pulls θ towards a peer-specific target, plus round noise."""
    generator = torch.Generator().manual_seed(1000 * peer + round_index)
    return [
        0.3 * (t - (peer + 1) * 0.5)
        + 0.05 * torch.randn(t.shape, generator=generator)
        + 0.1 * torch.sin(t * (peer + 1))
        for t in theta
    ]


def _outer(theta: Tensors, momentum: float) -> OuterOptimizer:
    """A production outer optimizer over its own copy of ``theta``."""
    return OuterOptimizer([torch.nn.Parameter(t.clone()) for t in theta], OuterConfig(lr=LR, momentum=momentum))


def _params(outer: OuterOptimizer) -> Tensors:
    return [p.detach().clone() for p in outer.params]


def _diloco_reference(theta0: Tensors, n_peers: int, momentum: float) -> list[Tensors]:
    """DiLoCo with the production outer optimizer: step_(mean Δ) after each round. Returns θ after each round."""
    outer, history = _outer(theta0, momentum), []
    for r in range(ROUNDS):
        theta = _params(outer)
        outer.step_(exact_average([_fake_inner_phase(theta, i, r) for i in range(n_peers)]))
        history.append(_params(outer))
    return history


def _graph_mix(own: Tensors, others: list[Tensors], graph: Neighbours, i: int) -> Tensors:
    """Peer i's row of one gossip round on ``graph`` (others[j] is peer j's tensors), as a new list."""
    mixed = [t.clone() for t in own]
    mix_(mixed, [others[j] for j in graph[i]], mixing_weights(graph, i))
    return mixed


def _mix1_shift(frozen: list[Tensors], graph: Neighbours, i: int) -> Tensors:
    """Mix1's correction Σ_j W_ij θ_j − θ_i from the round's frozen parameters."""
    return [m - t for m, t in zip(_graph_mix(frozen[i], frozen, graph, i), frozen[i], strict=True)]


def _factored_step(outer: OuterOptimizer, theta: Tensors, correction: Tensors, mixed_delta: Tensors) -> Tensors:
    """θ⁺ = OuterStep(θ, mixed Δ) + c, in the order of p2ptrain/sync/factored.py."""
    outer.set_params_(theta)
    outer.step_(mixed_delta)
    return [p + c for p, c in zip(_params(outer), correction, strict=True)]


def _assert_all_close(actual: Tensors, expected: Tensors) -> None:
    for mine, reference in zip(actual, expected, strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)


# ---- DiLoCo's outer step: OuterOptimizer ---------------------------------------------------------------------------


def test_outer_optimizer_step_hand_computed() -> None:
    """lr 0.5, γ 0.9, Nesterov: buf ← γ·buf + g (buf = g at first), θ ← anchor − lr·(g + γ·buf)."""
    param = torch.nn.Parameter(torch.tensor([1.0]))
    outer = OuterOptimizer([param], OuterConfig(lr=0.5, momentum=0.9))
    with torch.no_grad():
        param.fill_(0.0)  # the inner phase ends at 0: Δ = 1 − 0 = 1
    assert outer.outer_gradient()[0].item() == pytest.approx(1.0)
    outer.step_([torch.tensor([1.0])])  # buf = 1; θ = 1 − 0.5·(1 + 0.9·1) = 0.05
    assert param.item() == pytest.approx(0.05) and outer.anchor[0].item() == pytest.approx(0.05)
    assert outer.momentum_buffers()[0].item() == pytest.approx(1.0)
    with torch.no_grad():
        param.fill_(7.0)  # wherever the next inner phase ends, the step starts from the anchor
    outer.step_([torch.tensor([2.0])])  # buf = 0.9·1 + 2 = 2.9; θ = 0.05 − 0.5·(2 + 0.9·2.9) = 0.05 − 2.305
    assert outer.momentum_buffers()[0].item() == pytest.approx(2.9)
    assert param.item() == pytest.approx(-2.255) and outer.anchor[0].item() == pytest.approx(-2.255)


def test_outer_optimizer_without_momentum_at_lr_1_lands_on_the_mean_inner_endpoint() -> None:
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    outer = OuterOptimizer([param], OuterConfig(lr=1.0, momentum=0.0))
    outer.step_([torch.tensor([0.25, -0.5])])  # θ = anchor − 1·Δ̄
    torch.testing.assert_close(param.detach(), torch.tensor([0.75, -1.5]))


def test_outer_optimizer_matches_torch_sgd_across_inner_phases() -> None:
    reference = [torch.nn.Parameter(t.clone()) for t in _initial(0)]
    sgd = torch.optim.SGD(reference, lr=LR, momentum=0.9, nesterov=True)
    outer = _outer(_initial(0), 0.9)
    for r in range(ROUNDS):
        grad = _fake_inner_phase(_params(outer), 0, r)
        with torch.no_grad():
            for p, g in zip(outer.params, grad, strict=True):
                p.sub_(g)  # the inner phase ends at θ − Δ
        _assert_all_close(outer.outer_gradient(), grad)
        for p, g in zip(reference, grad, strict=True):
            p.grad = g.clone()
        sgd.step()
        outer.step_(grad)
        for mine, expected in zip(outer.params, reference, strict=True):
            torch.testing.assert_close(mine.detach(), expected.detach(), rtol=1e-6, atol=1e-6)
        _assert_all_close(outer.anchor, _params(outer))


# ---- GASLoC (§2) ---------------------------------------------------------------------------------------------------


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
        thetas = [states[i].momentum_step(_graph_mix(proposals[i], proposals, graph, i)) for i in range(n_peers)]
        for theta in thetas:
            _assert_all_close(theta, reference[r])
    moved = sum(float((a - b).abs().sum()) for a, b in zip(reference[-1], theta0, strict=True))
    assert moved > 1.0  # the comparison is not vacuous


def test_gasloc_state_dict_round_trip() -> None:
    state = GaslocState(_initial(0), momentum=0.9)
    state.momentum_step(_initial(1))
    restored = GaslocState(_initial(2), momentum=0.9)
    restored.load_state_dict(state.state_dict())
    x_new = _initial(3)
    for a, b in zip(state.momentum_step(x_new), restored.momentum_step(x_new), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(StateMismatchError):
        restored.load_state_dict({"momentum": 0.9, "x_prev": [torch.zeros(2)]})


def test_gasloc_without_momentum_holds_no_previous_iterate() -> None:
    """With γ 0, θ_next = x_new: the previous iterate is never read, and not kept (nor downloaded, nor saved)."""
    state = GaslocState(_initial(0), momentum=0.0)
    x_new = _initial(1)
    theta_next = state.momentum_step(x_new)
    assert state.x_prev == [] and state.state_dict()["x_prev"] == []
    for theta, x in zip(theta_next, x_new, strict=True):
        assert torch.equal(theta, x) and theta is not x
    state.load_state_dict({"momentum": 0.0, "x_prev": []})
    with pytest.raises(StateMismatchError):  # another run's previous iterate does not fit
        state.load_state_dict({"momentum": 0.0, "x_prev": _initial(2)})


def test_outer_optimizer_without_momentum_has_no_outer_state() -> None:
    """γ 0 keeps no momentum buffers: a state download and a checkpoint carry the anchor alone."""
    outer = _outer(_initial(0), 0.0)
    outer.step_(_fake_inner_phase(_params(outer), 0, 0))
    assert outer.state_tensors() == []
    assert all(s.get("momentum_buffer") is None for s in outer.optimizer.state.values())
    outer.load_state_tensors_([])
    with pytest.raises(StateMismatchError):
        outer.load_state_tensors_([torch.zeros_like(t) for t in outer.anchor])
    with_momentum = _outer(_initial(0), 0.9)
    assert [n for n, _ in with_momentum.state_tensors()] == [f"momentum:{i}" for i in range(len(_initial(0)))]


# ---- Factored Gossip DiLoCo (§3) -----------------------------------------------------------------------------------


def test_mix1_pull_hand_computed() -> None:
    """c = Σ_j w_j (θ_j − θ_i): the simulator's edge-by-edge pull and the graph mix agree; no partner gives 0."""
    own, partner = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 2.0])]
    torch.testing.assert_close(mix1_pull(own, [partner], [0.5])[0], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(_mix1_shift([own, partner], [[1], [0]], 0)[0], torch.tensor([1.0, 0.0]))
    assert torch.equal(mix1_pull([torch.tensor([1.0])], [], [])[0], torch.zeros(1))
    assert torch.equal(_mix1_shift([[torch.tensor([1.0])]], [[]], 0)[0], torch.zeros(1))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_factored_with_exact_mixing_equals_diloco(momentum: float) -> None:
    """Equal θ_0, exact Mix1 (c = 0) and an exact Mix2 (the complete graph) every round: Factored = DiLoCo."""
    n_peers, theta0 = 3, _initial(4)
    reference = _diloco_reference(theta0, n_peers, momentum)
    thetas = [[t.clone() for t in theta0] for _ in range(n_peers)]
    outers = [_outer(theta0, momentum) for _ in range(n_peers)]
    graph = complete_graph(n_peers)
    for r in range(ROUNDS):
        frozen = [[t.clone() for t in theta] for theta in thetas]
        deltas = [_fake_inner_phase(frozen[i], i, r) for i in range(n_peers)]
        for i in range(n_peers):
            mixed_delta = _graph_mix(deltas[i], deltas, graph, i)
            thetas[i] = _factored_step(outers[i], frozen[i], _mix1_shift(frozen, graph, i), mixed_delta)
            _assert_all_close(thetas[i], reference[r])


def test_factored_mix1_pulls_different_starts_to_the_diloco_trajectory_of_their_mean() -> None:
    """With Δ independent of θ, exact Mix1 from different θ_i gives DiLoCo started from mean θ after one round."""
    n_peers, momentum = 4, 0.9
    thetas = [_initial(10 + i) for i in range(n_peers)]
    generator = torch.Generator().manual_seed(5)
    deltas = [[[torch.randn(s, generator=generator) for s in SHAPES] for _ in range(n_peers)] for _ in range(ROUNDS)]
    reference_outer = _outer(exact_average(thetas), momentum)
    outers = [_outer(theta, momentum) for theta in thetas]
    graph = complete_graph(n_peers)
    for r in range(ROUNDS):
        frozen = [[t.clone() for t in theta] for theta in thetas]
        mixed_delta = exact_average(deltas[r])
        thetas = [_factored_step(outers[i], frozen[i], _mix1_shift(frozen, graph, i), mixed_delta)
                  for i in range(n_peers)]
        reference_outer.step_(mixed_delta)
        for theta in thetas:
            _assert_all_close(theta, _params(reference_outer))


# ---- DiLoCoX one-step delay (§4) -----------------------------------------------------------------------------------


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


@pytest.mark.parametrize("weights", [[1.0, 1 / 3, 1 / 3, 0.5, 1.0, 1 / 4], [1.0] * 6])
def test_eager_bookkeeping_applies_every_mean_once_whatever_the_weights(weights: list[float]) -> None:
    """Σ_t Δ̃_t = Σ_{t<T} Δ̄_t + w_T·Δ_T however w moves between rounds (groups of changing size, the first round's
    1, a failed exchange in round 3): what a round applied of its own Δ ahead of the mean is taken back when the mean
    arrives, never applied twice (w = 1 throughout: `sync.overlap: local`)."""
    rounds, failed = len(weights), 3
    generator = torch.Generator().manual_seed(1)
    deltas = [torch.randn(5, generator=generator) for _ in range(rounds)]
    means = [d + torch.randn(5, generator=generator) for d in deltas]  # our Δ mixed with others'
    means[failed - 1] = deltas[failed - 1]  # the exchange of round 2 failed: counted as mixing with nobody
    delayed = DelayedOuterGradient(eager=True)
    total = torch.zeros(5)
    for t, w in enumerate(weights):
        mixed = [means[t - 1]] if t and t != failed else None
        applied = delayed.outer_gradient_([deltas[t]], mixed, own_weight=w)
        assert applied is not None
        total += applied[0]
    expected = torch.stack(means[:-1]).sum(dim=0) + weights[-1] * deltas[-1]
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
    unsettled = delayed.unsettled()
    assert unsettled is not None
    torch.testing.assert_close(unsettled[0], weights[-1] * deltas[-1])


def test_local_overlap_applies_its_whole_delta_in_the_first_round() -> None:
    """No round is lost to the delay: round 0 steps by Δ_0 itself; round 1 swaps it for the mean that holds it."""
    local = DelayedOuterGradient(eager=True)
    first = local.outer_gradient_([torch.tensor([2.0])], None, own_weight=1.0)
    assert first is not None and first[0].item() == 2.0
    second = local.outer_gradient_([torch.tensor([5.0])], [torch.tensor([3.0])], own_weight=1.0)
    assert second is not None and second[0].item() == pytest.approx(3.0 - 2.0 + 5.0)  # Δ̄_0 − Δ_0 + Δ_1
    assert DelayedOuterGradient(eager=False).unsettled() is None
