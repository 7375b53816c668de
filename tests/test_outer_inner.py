"""Outer step against hand-computed Nesterov updates; the inner phase's schedule, learning, and stopping rules."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import p2ptrain.maths.inner as inner_module
from p2ptrain.config import build_config
from p2ptrain.errors import ConfigError, StateMismatchError
from p2ptrain.maths.inner import InnerConfig, InnerTrainer, lr_multiplier
from p2ptrain.maths.outer_optimizer import OuterConfig, OuterOptimizer
from p2ptrain.models import ModelConfig, build_model

GAMMA, ETA = 0.9, 0.7
ANCHOR = [[1.0, -2.0, 0.5], [0.25]]  # θ_0: two parameters of 3 and 1 elements
DELTAS = [  # the mean outer gradient Δ of rounds 1, 2, 3
    [[0.1, 0.3, -0.4], [0.2]],
    [[-0.2, 0.1, 0.0], [-0.5]],
    [[0.05, -0.1, 0.2], [0.1]],
]


def make_params(values: list[list[float]]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.tensor(v, dtype=torch.float32)) for v in values]


def nesterov_reference(anchor: list[float], deltas: list[list[float]], gamma: float, eta: float) -> list[list[float]]:
    """DiLoCo's outer step in plain Python floats, per coordinate:
    b ← γ b + Δ ;  θ ← anchor − η (Δ + γ b) ;  the new θ is the next round's anchor."""
    theta, b, history = list(anchor), [0.0] * len(anchor), []
    for delta in deltas:
        b = [gamma * bi + di for bi, di in zip(b, delta, strict=True)]
        theta = [t - eta * (di + gamma * bi) for t, di, bi in zip(theta, delta, b, strict=True)]
        history.append(list(theta))
    return history


def flat(tensors: list[torch.Tensor]) -> list[float]:
    return [float(x) for t in tensors for x in t.detach().flatten()]


def run_outer_rounds(config: OuterConfig, local_moves: float = 0.37) -> tuple[list[list[float]], list[list[float]]]:
    """Apply DELTAS as the mean Δ for 3 rounds (after a fake inner phase that moved the parameters);
    return the parameters and the momentum buffers after each round."""
    params = make_params(ANCHOR)
    outer = OuterOptimizer(params, config)
    thetas, buffers = [], []
    for delta in DELTAS:
        with torch.no_grad():  # the inner phase moved the parameters away from the anchor
            for p in params:
                p.add_(local_moves)
        outer.step_([torch.tensor(d) for d in delta])
        thetas.append(flat(list(params)))
        buffers.append(flat(outer.momentum_buffers()))
    return thetas, buffers


def test_nesterov_step_matches_hand_computed_values() -> None:
    thetas, buffers = run_outer_rounds(OuterConfig(lr=ETA, momentum=GAMMA, nesterov=True))
    # first coordinate, worked by hand (θ_0 = 1.0, Δ = 0.1, -0.2, 0.05):
    # r1: b = 0.1;                     θ = 1.0    − 0.7 (0.1  + 0.9·0.1)    = 0.867
    # r2: b = 0.9·0.1 − 0.2 = −0.11;   θ = 0.867  − 0.7 (−0.2 + 0.9·(−0.11)) = 1.0763
    # r3: b = 0.9·(−0.11) + 0.05 = −0.049; θ = 1.0763 − 0.7 (0.05 + 0.9·(−0.049)) = 1.07217
    assert [t[0] for t in thetas] == pytest.approx([0.867, 1.0763, 1.07217], abs=1e-6)
    assert [b[0] for b in buffers] == pytest.approx([0.1, -0.11, -0.049], abs=1e-6)
    # every coordinate against the formula
    reference = nesterov_reference(sum(ANCHOR, []), [sum(d, []) for d in DELTAS], GAMMA, ETA)
    for got, want in zip(thetas, reference, strict=True):
        assert got == pytest.approx(want, abs=1e-6)


def test_zero_momentum_is_anchor_minus_eta_delta() -> None:
    thetas, _ = run_outer_rounds(OuterConfig(lr=ETA, momentum=0.0))
    theta = sum(ANCHOR, [])
    for got, delta in zip(thetas, DELTAS, strict=True):
        theta = [t - ETA * d for t, d in zip(theta, sum(delta, []), strict=True)]
        assert got == pytest.approx(theta, abs=1e-6)
    assert thetas[0][0] == pytest.approx(1.0 - 0.7 * 0.1, abs=1e-7)


def test_heavy_ball_without_nesterov() -> None:
    """nesterov=False: b ← γ b + Δ ; θ ← anchor − η b."""
    thetas, _ = run_outer_rounds(OuterConfig(lr=ETA, momentum=GAMMA, nesterov=False))
    theta, b = sum(ANCHOR, []), [0.0] * 4
    for got, delta in zip(thetas, DELTAS, strict=True):
        b = [GAMMA * bi + di for bi, di in zip(b, sum(delta, []), strict=True)]
        theta = [t - ETA * bi for t, bi in zip(theta, b, strict=True)]
        assert got == pytest.approx(theta, abs=1e-6)


def test_outer_gradient_is_anchor_minus_params_and_a_copy() -> None:
    params = make_params(ANCHOR)
    outer = OuterOptimizer(params, OuterConfig())
    with torch.no_grad():
        params[0].copy_(torch.tensor([0.5, -1.0, 2.0]))
        params[1].copy_(torch.tensor([1.25]))
    delta = outer.outer_gradient()
    assert flat(delta) == pytest.approx([0.5, -1.0, -1.5, -1.0])
    delta[0].zero_()  # a new tensor: changing it touches neither the anchor nor the parameters
    assert flat(outer.anchor) == pytest.approx(sum(ANCHOR, []))
    assert flat(outer.outer_gradient())[:3] == pytest.approx([0.5, -1.0, -1.5])


def test_step_makes_the_result_the_new_anchor() -> None:
    params = make_params(ANCHOR)
    outer = OuterOptimizer(params, OuterConfig(lr=ETA, momentum=GAMMA))
    with torch.no_grad():
        params[0].sub_(0.3)
    outer.step_(outer.outer_gradient())
    assert flat(outer.anchor) == flat(list(params))
    assert flat(outer.outer_gradient()) == [0.0] * 4
    assert all(p.grad is None for p in params)  # no outer gradient is left behind for the inner optimizer


def test_step_rejects_a_wrong_number_of_tensors() -> None:
    outer = OuterOptimizer(make_params(ANCHOR), OuterConfig())
    with pytest.raises(ValueError):
        outer.step_([torch.zeros(3)])


def test_restore_anchor_undoes_the_inner_phase() -> None:
    params = make_params(ANCHOR)
    outer = OuterOptimizer(params, OuterConfig())
    with torch.no_grad():
        params[1].mul_(7)
    outer.restore_anchor_()
    assert flat(list(params)) == sum(ANCHOR, [])


def test_momentum_round_trips_through_state_tensors() -> None:
    config = OuterConfig(lr=ETA, momentum=GAMMA)
    params_a = make_params(ANCHOR)
    outer_a = OuterOptimizer(params_a, config)
    for delta in DELTAS[:2]:
        outer_a.step_([torch.tensor(d) for d in delta])
    state = outer_a.state_tensors()
    assert [name for name, _ in state] == ["momentum:0", "momentum:1"]
    assert flat([t for _, t in state]) == flat(outer_a.momentum_buffers())

    params_b = make_params([[9.0, 9.0, 9.0], [9.0]])
    outer_b = OuterOptimizer(params_b, config)
    with torch.no_grad():
        for pb, pa in zip(params_b, params_a, strict=True):
            pb.copy_(pa)
    outer_b.reset_anchor_()  # as a resumed peer does after loading its parameters
    outer_b.load_state_tensors_([t for _, t in state])
    assert flat(outer_b.anchor) == flat(list(params_a))

    for outer, params in ((outer_a, params_a), (outer_b, params_b)):
        with torch.no_grad():
            params[0].add_(0.1)
        outer.step_([torch.tensor(d) for d in DELTAS[2]])
    assert flat(list(params_b)) == flat(list(params_a))
    assert flat(outer_b.momentum_buffers()) == flat(outer_a.momentum_buffers())


@pytest.mark.parametrize(
    "buffers",
    [
        [torch.zeros(3)],  # one buffer short
        [torch.zeros(3), torch.zeros(1), torch.zeros(1)],  # one too many
        [torch.zeros(3), torch.zeros(2)],  # a wrong shape
    ],
    ids=["too few", "too many", "wrong shape"],
)
def test_momentum_that_does_not_fit_is_refused_on_load(buffers: list[torch.Tensor]) -> None:
    """A bad checkpoint or peer payload must not be half-loaded (it would crash later, deep in torch, at the next
    outer step)."""
    params = make_params(ANCHOR)
    outer = OuterOptimizer(params, OuterConfig())
    with pytest.raises((ValueError, StateMismatchError)):
        outer.load_state_tensors_(buffers)
    assert flat(outer.momentum_buffers()) == [0.0] * 4  # nothing was loaded


def test_momentum_buffers_are_zero_before_the_first_step() -> None:
    outer = OuterOptimizer(make_params(ANCHOR), OuterConfig())
    assert flat(outer.momentum_buffers()) == [0.0] * 4


# ---- learning-rate schedule --------------------------------------------------------------------------------------

SCHEDULE = InnerConfig(steps=4, warmup_steps=4, total_steps=24, min_lr_ratio=0.1)


def test_warmup_is_linear_up_to_the_peak() -> None:
    assert [lr_multiplier(s, SCHEDULE) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_multiplier(4, SCHEDULE) == pytest.approx(1.0)  # the peak, where the cosine starts
    assert max(lr_multiplier(s, SCHEDULE) for s in range(100)) == pytest.approx(1.0)


def test_cosine_decays_to_min_lr_ratio_and_stays() -> None:
    assert lr_multiplier(14, SCHEDULE) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: cos(π/2) = 0
    assert lr_multiplier(9, SCHEDULE) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_multiplier(24, SCHEDULE) == pytest.approx(0.1)
    assert lr_multiplier(1000, SCHEDULE) == pytest.approx(0.1)
    values = [lr_multiplier(s, SCHEDULE) for s in range(4, 30)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))  # never rises after the peak


def test_no_warmup_starts_at_the_peak() -> None:
    assert lr_multiplier(0, InnerConfig(warmup_steps=0, total_steps=10)) == pytest.approx(1.0)


# ---- the inner trainer -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_state() -> dict[str, torch.Tensor]:
    return build_model(ModelConfig(name="tiny", max_seq_len=64), 257, seed=0).state_dict()


def tiny_trainer(state: dict[str, torch.Tensor], config: InnerConfig) -> InnerTrainer:
    model = build_model(ModelConfig(name="tiny", max_seq_len=64), 257, seed=0)
    model.load_state_dict(state)
    return InnerTrainer(model, config, torch.device("cpu"))


def repeat(batch: torch.Tensor) -> Iterator[torch.Tensor]:
    while True:
        yield batch


def test_trainer_follows_the_schedule(tiny_model_state: dict[str, torch.Tensor]) -> None:
    config = InnerConfig(steps=6, lr=1e-2, warmup_steps=4, total_steps=24, min_lr_ratio=0.1)
    trainer = tiny_trainer(tiny_model_state, config)
    batch = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    for step in range(6):
        # the lr that step `step` uses
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * lr_multiplier(step, config))
        trainer.train_step(batch)


@pytest.mark.slow
def test_trainer_lowers_the_loss_on_a_repeated_batch(tiny_model_state: dict[str, torch.Tensor]) -> None:
    config = InnerConfig(steps=30, lr=1e-2, warmup_steps=3, total_steps=1000)
    trainer = tiny_trainer(tiny_model_state, config)
    batch = torch.randint(0, 257, (4, 32), generator=torch.Generator().manual_seed(1))
    before = trainer.evaluate([batch])
    assert before == pytest.approx(math.log(257), abs=0.3)  # a fresh model is near uniform over the bytes
    losses: list[float] = []
    result = trainer.run_phase(repeat(batch), 30, on_step=lambda step, loss: losses.append(loss))
    after = trainer.evaluate([batch])
    assert result.steps == 30 and result.tokens == 30 * batch.numel()
    assert result.mean_loss == pytest.approx(sum(losses) / 30)
    assert after < before - 1.5 and losses[-1] < losses[0] - 1.0


def test_run_phase_honours_max_steps(tiny_model_state: dict[str, torch.Tensor]) -> None:
    trainer = tiny_trainer(tiny_model_state, InnerConfig(steps=10))
    batch = torch.randint(0, 257, (2, 8), generator=torch.Generator().manual_seed(2))
    seen: list[int] = []
    result = trainer.run_phase(repeat(batch), 3, on_step=lambda step, loss: seen.append(step))
    assert result.steps == 3 and seen == [1, 2, 3] and result.tokens == 3 * 16
    assert trainer.scheduler.last_epoch == 3


def test_run_phase_past_deadline_takes_exactly_min_steps(tiny_model_state: dict[str, torch.Tensor]) -> None:
    trainer = tiny_trainer(tiny_model_state, InnerConfig(steps=10, min_steps=2))
    batch = torch.randint(0, 257, (2, 8), generator=torch.Generator().manual_seed(3))
    result = trainer.run_phase(repeat(batch), 10, deadline=0.0)  # time.monotonic() is far past 0
    assert result.steps == 2


class FakeClock:
    """Stands in for the `time` module inside p2ptrain.maths.inner; each fake inner step takes `step_s` seconds."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 1000.0, step_s

    def monotonic(self) -> float:
        return self.now


def fake_timed_trainer(monkeypatch: pytest.MonkeyPatch, config: InnerConfig, clock: FakeClock) -> InnerTrainer:
    monkeypatch.setattr(inner_module, "time", clock)
    trainer = InnerTrainer(torch.nn.Linear(2, 2), config, torch.device("cpu"))

    def one_step(batch: torch.Tensor) -> float:
        clock.now += clock.step_s
        return 1.0

    monkeypatch.setattr(trainer, "train_step", one_step)
    return trainer


def test_run_phase_stops_before_a_step_that_would_end_past_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    # steps of 1 s from t = 1000, deadline 1005.5: before step k (0-based) the clock reads 1000 + k and the step
    # time estimate is 1 s, so steps 0..4 start (1000 + 4 + 1 <= 1005.5) and step 5 would end at 1006 > 1005.5
    clock = FakeClock(step_s=1.0)
    trainer = fake_timed_trainer(monkeypatch, InnerConfig(steps=20, min_steps=1), clock)
    result = trainer.run_phase(repeat(torch.zeros(1, 4, dtype=torch.long)), 20, deadline=1005.5)
    assert result.steps == 5 and clock.now == 1005.0


def test_run_phase_takes_min_steps_even_when_they_overrun_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(step_s=1.0)
    trainer = fake_timed_trainer(monkeypatch, InnerConfig(steps=20, min_steps=8), clock)
    result = trainer.run_phase(repeat(torch.zeros(1, 4, dtype=torch.long)), 20, deadline=1005.5)
    assert result.steps == 8


def test_run_phase_ends_after_the_step_that_sets_stop(tiny_model_state: dict[str, torch.Tensor]) -> None:
    trainer = tiny_trainer(tiny_model_state, InnerConfig(steps=10, min_steps=1))
    batch = torch.randint(0, 257, (2, 8), generator=torch.Generator().manual_seed(4))
    stop = threading.Event()

    def on_step(step: int, loss: float) -> None:
        if step == 3:
            stop.set()

    result = trainer.run_phase(repeat(batch), 10, on_step=on_step, stop=stop)
    assert result.steps == 3


def test_run_phase_with_stop_already_set_takes_no_step(tiny_model_state: dict[str, torch.Tensor]) -> None:
    trainer = tiny_trainer(tiny_model_state, InnerConfig(steps=10))
    stop = threading.Event()
    stop.set()
    result = trainer.run_phase(repeat(torch.zeros(1, 8, dtype=torch.long)), 10, stop=stop)
    assert result.steps == 0 and result.tokens == 0


def test_inner_state_round_trips(tiny_model_state: dict[str, torch.Tensor]) -> None:
    config = InnerConfig(steps=3, lr=1e-2, warmup_steps=5)
    a = tiny_trainer(tiny_model_state, config)
    batch = torch.randint(0, 257, (2, 8), generator=torch.Generator().manual_seed(5))
    a.run_phase(repeat(batch), 3)
    b = tiny_trainer(a.model.state_dict(), config)
    # a deep copy: torch's load_state_dict keeps the very tensors it is given, so B would share A's AdamW moments
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    a.train_step(batch)
    b.train_step(batch)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize(("overlap", "explicit", "expected"), [
    ("none", None, 0.9), ("delayed", None, 0.0), ("eager", None, 0.5), ("delayed", 0.3, 0.3), ("local", None, 0.0),
    ("local", 0.0, 0.0)])
def test_overlap_runs_the_outer_step_with_its_own_momentum(overlap: str, explicit: float | None,
                                                           expected: float) -> None:
    """A one-round-late gradient with γ = 0.9 diverged in benchmarks/algorithms.py: overlap gets its own γ."""
    sync = {"mode": "diloco", "overlap": overlap} | ({} if explicit is None else {"overlap_momentum": explicit})
    config = build_config({"sync": sync, "outer": {"momentum": 0.9}})
    assert config.sync.outer_momentum(config.outer.momentum) == expected


@pytest.mark.parametrize("overlap", ["delayed", "eager", "local"])
def test_overlap_adds_no_momentum_to_a_run_without_it(overlap: str) -> None:
    """The overlap's γ is a cap on the run's: eager's 0.5 does not apply when the run's outer step has none (the
    default, measured best at short rounds: benchmarks/outer_step.py)."""
    config = build_config({"sync": {"mode": "diloco", "overlap": overlap}})
    assert config.outer.momentum == 0.0 and config.sync.outer_momentum(config.outer.momentum) == 0.0
    eager = build_config({"sync": {"mode": "diloco", "overlap": "eager"}, "outer": {"momentum": 0.3}})
    assert eager.sync.outer_momentum(0.3) == 0.3


@pytest.mark.parametrize("sync", [{"overlap_momentum": 0.5}, {"overlap": "delayed", "overlap_momentum": 1.0},
                                  {"overlap": "local", "overlap_momentum": 0.5}])
def test_overlap_momentum_without_overlap_or_out_of_range_is_a_config_error(sync: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="overlap_momentum"):
        build_config({"sync": {"mode": "diloco"} | sync})


@pytest.mark.parametrize(("sync", "expected"), [
    ({"mode": "gasloc"}, 0.0), ({"mode": "gasloc", "gasloc_momentum": 0.9}, 0.9), ({"mode": "factored"}, 0.9)])
def test_gasloc_runs_with_its_own_momentum(sync: dict[str, Any], expected: float) -> None:
    """γ = 0.9 on mixed iterates re-injected disagreement and spiked the loss on the netns testnet: gasloc gets
    its own γ (0 unless set); factored's Nesterov step on mixed Δ keeps `outer.momentum`."""
    config = build_config({"sync": sync, "outer": {"momentum": 0.9}})
    assert config.sync.outer_momentum(config.outer.momentum) == expected


@pytest.mark.parametrize("sync", [{"mode": "diloco", "gasloc_momentum": 0.5}, {"gasloc_momentum": 1.0}])
def test_gasloc_momentum_outside_gasloc_or_out_of_range_is_a_config_error(sync: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="gasloc_momentum"):
        build_config({"sync": sync})
