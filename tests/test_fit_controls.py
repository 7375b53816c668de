"""The knobs that fit a peer to its hardware: micro-batches, activation checkpointing, 16-bit autocast with fp16's
loss scale, and the outer state kept off the training device (in host memory)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from p2ptrain.config import build_config
from p2ptrain.errors import ConfigError
from p2ptrain.maths.inner import InnerConfig, InnerTrainer, autocast_dtype
from p2ptrain.maths.outer_optimizer import OuterConfig, OuterOptimizer, state_device_for
from p2ptrain.models import ModelConfig, build_model

VOCAB = 257


def tiny_trainer(config: InnerConfig) -> InnerTrainer:
    model = build_model(ModelConfig(name="tiny", max_seq_len=64), VOCAB, seed=0)
    return InnerTrainer(model, config, torch.device("cpu"))


def batch_of(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, 32), generator=torch.Generator().manual_seed(seed))


def gradients_of_one_step(config: InnerConfig, batch: torch.Tensor) -> tuple[list[torch.Tensor], float]:
    """The gradients AdamW's first step sees (after clipping) and the step's loss."""
    trainer = tiny_trainer(config)
    seen: list[torch.Tensor] = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.extend(p.grad.clone() for p in trainer.model.parameters()))
    loss = trainer.train_step(batch)
    return seen, loss


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float, atol: float) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("parts", [2, 3, 8])
def test_micro_batches_give_the_whole_batchs_gradients(parts: int) -> None:
    """8 samples in 2, 3 (3 + 3 + 2) or 8 parts: each part's loss weighted by its share of the batch."""
    batch = batch_of(8)
    whole, whole_loss = gradients_of_one_step(InnerConfig(grad_clip=0.0), batch)
    split, split_loss = gradients_of_one_step(InnerConfig(grad_clip=0.0, micro_batches=parts), batch)
    assert_close(split, whole, rtol=1e-4, atol=1e-6)
    assert split_loss == pytest.approx(whole_loss, rel=1e-5)


def test_micro_batches_clip_the_accumulated_gradient() -> None:
    """Clipping acts on the step's gradient, not on each part's: the clipped gradients agree too."""
    batch = batch_of(8, seed=1)
    whole, _ = gradients_of_one_step(InnerConfig(grad_clip=0.05), batch)
    split, _ = gradients_of_one_step(InnerConfig(grad_clip=0.05, micro_batches=4), batch)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in whole))
    assert norm == pytest.approx(0.05, rel=1e-3)  # the clip really acted
    assert_close(split, whole, rtol=1e-4, atol=1e-6)


def test_activation_checkpointing_recomputes_the_same_gradients() -> None:
    batch = batch_of(4, seed=2)
    plain, plain_loss = gradients_of_one_step(InnerConfig(grad_clip=0.0), batch)
    trainer = tiny_trainer(InnerConfig(activation_checkpointing=True))
    assert any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())
    recomputed, loss = gradients_of_one_step(InnerConfig(grad_clip=0.0, activation_checkpointing=True), batch)
    assert_close(recomputed, plain, rtol=1e-4, atol=1e-6)
    assert loss == pytest.approx(plain_loss, rel=1e-6)


@pytest.mark.parametrize(("precision", "device", "expected"), [
    ("auto", "cuda", torch.bfloat16), ("auto", "cpu", None), ("auto", "mps", None), ("fp32", "cuda", None),
    ("bf16", "cpu", torch.bfloat16), ("fp16", "cuda", torch.float16)])
def test_precision_picks_the_autocast_dtype(precision: str, device: str, expected: torch.dtype | None) -> None:
    assert autocast_dtype(precision, torch.device(device)) == expected


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_autocast_trains_with_fp32_master_weights(precision: str) -> None:
    trainer = tiny_trainer(InnerConfig(lr=1e-2, warmup_steps=1, precision=precision))
    dtypes: list[torch.dtype] = []
    trainer.model.model.layers[0].mlp.register_forward_hook(  # type: ignore[union-attr]
        lambda _m, _i, out: dtypes.append(out.dtype))
    batch = batch_of(4, seed=3)
    before = trainer.evaluate([batch])
    losses = [trainer.train_step(batch) for _ in range(12)]
    assert set(dtypes) == {autocast_dtype(precision, torch.device("cpu"))}  # the forward ran in 16 bits
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(math.isfinite(x) for x in losses) and trainer.evaluate([batch]) < before - 0.5
    assert trainer.scaler.is_enabled() == (precision == "fp16")  # a loss scale only where fp16 needs one


def test_fp16_skips_a_step_whose_gradients_overflow_and_halves_the_scale() -> None:
    trainer = tiny_trainer(InnerConfig(precision="fp16", fp16_initial_scale=1024.0))
    batch = batch_of(2, seed=4)
    trainer.train_step(batch)
    assert trainer.scaler.get_scale() == 1024.0
    before = [p.detach().clone() for p in trainer.model.parameters()]
    first = next(trainer.model.parameters())
    first.register_hook(lambda g: torch.full_like(g, math.inf))  # this step's gradient overflows
    trainer.train_step(batch)
    assert trainer.scaler.get_scale() == 512.0
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before, strict=True))


def test_fp16_loss_scale_round_trips_through_the_inner_state() -> None:
    a = tiny_trainer(InnerConfig(precision="fp16", fp16_initial_scale=256.0))
    a.train_step(batch_of(2, seed=5))
    a.scaler.update(100.0)  # a scale no fresh trainer starts from
    b = tiny_trainer(InnerConfig(precision="fp16"))
    b.load_state_dict(a.state_dict())
    assert b.scaler.get_scale() == 100.0
    c = tiny_trainer(InnerConfig())  # an fp32 trainer takes an fp16 checkpoint's state and ignores its scale
    c.load_state_dict(a.state_dict())
    assert not c.scaler.is_enabled()


@pytest.mark.parametrize(("values", "match"), [
    ({"inner": {"micro_batches": 0}}, "micro_batches"),
    ({"inner": {"precision": "fp8"}}, "inner.precision"),
    ({"inner": {"fp16_initial_scale": 0.5}}, "fp16_initial_scale"),
    ({"inner": {"micro_batches": 9}, "data": {"batch_size": 8}}, "must not exceed data.batch_size"),
    ({"outer": {"state_device": "gpu"}}, "outer.state_device"),
])
def test_fit_controls_are_validated(values: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_config(values)


# ---- the outer state's place ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("model_device", "choice", "expected"), [
    ("cuda", "auto", "cpu"), ("cuda:1", "host", "cpu"), ("cuda:1", "device", "cuda:1"), ("mps", "auto", "cpu"),
    ("cpu", "auto", "cpu"), ("cpu", "host", "cpu")])
def test_the_outer_state_goes_to_the_host_beside_an_accelerator(model_device: str, choice: str,
                                                                 expected: str) -> None:
    assert state_device_for(torch.device(model_device), choice) == torch.device(expected)


def storages(tensors: list[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_outer_state_is_apart_from_what_training_holds() -> None:
    """After inner steps and outer steps, the tensors training holds are exactly the model's parameters, AdamW's
    state and the gradients; the anchor and outer momentum are separate tensors on the state's device (here the
    host: the training device of this test is the CPU too; CUDA resolves to the host, tested above)."""
    trainer = tiny_trainer(InnerConfig(lr=1e-2, warmup_steps=1))
    params = list(trainer.model.parameters())
    outer = OuterOptimizer(params, OuterConfig(momentum=0.9, state_device="host"))
    for _ in range(2):
        trainer.run_phase(iter([batch_of(2, seed=6)] * 3), 3)
        outer.step_(outer.outer_gradient())
    trainer.train_step(batch_of(2, seed=7))  # grads set to None after the step
    adam = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert len(adam) == 3 * len(params)  # exp_avg, exp_avg_sq, step per parameter: nothing else
    momentum = [s["momentum_buffer"] for s in outer.optimizer.state.values()]
    state = outer.anchor + momentum
    assert len(state) == 2 * len(params) and all(t.device == outer.state_device for t in state)
    assert not storages(state) & storages(params + adam)  # no outer tensor shares the training tensors' memory
    assert all(p.grad is None for p in params)  # the outer step leaves no gradient behind on the model


def test_a_host_anchor_gives_the_same_outer_steps_as_a_device_one() -> None:
    results = []
    for place in ("device", "host"):
        params = [torch.nn.Parameter(torch.arange(4.0))]
        outer = OuterOptimizer(params, OuterConfig(lr=0.7, momentum=0.9, state_device=place))
        for k in range(3):
            with torch.no_grad():
                params[0].add_(0.1 * (k + 1))
            outer.step_(outer.outer_gradient())
        results.append(params[0].detach().clone())
    assert torch.equal(results[0], results[1])
