"""Checkpoints: round trip, `latest` and retention, corrupt parts refused untouched, and exact resumption."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from p2ptrain.checkpoint import (
    FORMAT_VERSION,
    KEEP_LAST,
    TrainingCheckpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from p2ptrain.config import PeerConfig, build_config
from p2ptrain.errors import CheckpointError
from p2ptrain.maths.inner import InnerTrainer
from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.models import build_model, model_fingerprint
from p2ptrain.peer_checkpoint import load_sync_state_
from p2ptrain.peer_state import PeerState

VOCAB = 257
CONFIG = build_config({
    "run": {"run_id": "ckpt-test", "device": "cpu"},
    "model": {"name": "tiny", "max_seq_len": 32},
    "inner": {"steps": 3, "lr": 5e-3, "warmup_steps": 2, "total_steps": 50},
    "outer": {"lr": 0.7, "momentum": 0.9},
})


@dataclasses.dataclass
class Setup:
    """The objects a peer trains with, built the way peer.py builds them."""

    model: torch.nn.Module
    named_params: list[tuple[str, torch.nn.Parameter]]
    inner: InnerTrainer
    outer: OuterOptimizer
    round: int = 0

    @classmethod
    def build(cls, config: PeerConfig, seed: int) -> Setup:
        model = build_model(config.model, VOCAB, seed)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return cls(model, named, InnerTrainer(model, config.inner, torch.device("cpu")),
                   OuterOptimizer([p for _, p in named], config.outer))

    def run_round(self, batches: list[torch.Tensor]) -> None:
        """Inner phase on `batches`, then the outer step with this peer's own Δ as the mean."""
        self.inner.run_phase(iter(batches), len(batches))
        self.outer.step_(self.outer.outer_gradient())
        self.round += 1

    def checkpoint(self, config: PeerConfig) -> TrainingCheckpoint:
        model = {n: a for (n, _), a in zip(self.named_params, self.outer.anchor, strict=True)}
        sync_state = {"mode": config.sync.mode, "tensors": [t.clone() for _, t in self.outer.state_tensors()]}
        return TrainingCheckpoint(self.round, model, self.inner.state_dict(), sync_state,
                                  config.to_dict(), model_fingerprint(self.model))

    def load_(self, checkpoint: TrainingCheckpoint) -> None:
        """What TrainingPeer._resume_from_checkpoint does, minus the network."""
        with torch.no_grad():
            for n, p in self.named_params:
                p.copy_(checkpoint.model[n])
        self.inner.load_state_dict(checkpoint.inner)
        self.outer.reset_anchor_()
        self.outer.load_state_tensors_(checkpoint.sync_state["tensors"])
        self.round = checkpoint.round


def round_batches(round_: int, steps: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + round_)
    return [torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(steps)]


@pytest.fixture(scope="module")
def trained() -> Setup:
    setup = Setup.build(CONFIG, seed=0)
    setup.run_round(round_batches(0))
    return setup


def assert_nested_equal(a: Any, b: Any, path: str = "") -> None:
    """Equal structure, and tensors bit-equal with the same dtype (tuples and lists are the same)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            assert_nested_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_nested_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_save_load_round_trip(tmp_path: Path, trained: Setup) -> None:
    checkpoint = trained.checkpoint(CONFIG)
    path = save_checkpoint(tmp_path, checkpoint)
    assert path == tmp_path / "round-000001" and latest_checkpoint(tmp_path) == path
    assert {p.name for p in path.iterdir()} == {"model.safetensors", "train_state.pt", "meta.json"}
    for loaded in (load_checkpoint(tmp_path), load_checkpoint(path)):  # the root (via `latest`) or the round dir
        assert loaded.round == 1 and loaded.fingerprint == checkpoint.fingerprint
        assert_nested_equal(loaded.model, checkpoint.model)
        assert_nested_equal(loaded.inner, checkpoint.inner)
        assert_nested_equal(loaded.sync_state, checkpoint.sync_state)
        assert build_config(loaded.config) == CONFIG
    # the anchor was saved, and here it equals the parameters after the outer step
    assert all(torch.equal(checkpoint.model[n], p) for n, p in trained.named_params)
    assert json.loads((path / "meta.json").read_text())["format"] == FORMAT_VERSION


def test_latest_points_to_the_newest_and_only_keep_last_are_kept(tmp_path: Path, trained: Setup) -> None:
    base = trained.checkpoint(CONFIG)
    rounds = list(range(1, KEEP_LAST + 3))
    for round_ in rounds:
        save_checkpoint(tmp_path, dataclasses.replace(base, round=round_))
        assert latest_checkpoint(tmp_path) == tmp_path / f"round-{round_:06d}"
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name != "latest")
    assert kept == [f"round-{r:06d}" for r in rounds[-KEEP_LAST:]]  # and no staging directory is left behind
    assert load_checkpoint(tmp_path).round == rounds[-1]


def test_no_checkpoint_yet(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "does-not-exist")


def truncate(name: str, keep: Callable[[int], int]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[:keep(len(data))])
    return damage


def write(name: str, data: bytes) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        (path / name).write_bytes(data)
    return damage


def edit_meta(**changes: Any) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        meta = json.loads((path / "meta.json").read_text())
        meta.update(changes)
        meta = {k: v for k, v in meta.items() if v is not None}
        (path / "meta.json").write_text(json.dumps(meta))
    return damage


def remove(name: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        (path / name).unlink()
    return damage


CORRUPTIONS = {
    "truncated model.safetensors": truncate("model.safetensors", lambda n: n // 2),
    "model.safetensors cut inside its header": truncate("model.safetensors", lambda n: 20),
    "empty model.safetensors": write("model.safetensors", b""),
    "garbage train_state.pt": write("train_state.pt", b"garbage" * 10),
    "other garbage train_state.pt": write("train_state.pt", b"this is not a torch file" * 10),
    "truncated train_state.pt": truncate("train_state.pt", lambda n: n // 2),
    "empty train_state.pt": write("train_state.pt", b""),  # EOFError with an empty message
    "missing train_state.pt": remove("train_state.pt"),
    "meta.json of another format": edit_meta(format=FORMAT_VERSION + 1),
    "meta.json without format": edit_meta(format=None),
    "meta.json not JSON": write("meta.json", b"{not json"),
    "meta.json a list": write("meta.json", b"[1, 2]"),
    "meta.json without round": edit_meta(round=None),
    "meta.json with a non-integer round": edit_meta(round="twelve"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_is_refused_and_left_untouched(tmp_path: Path, trained: Setup, corruption: str) -> None:
    path = save_checkpoint(tmp_path, trained.checkpoint(CONFIG))
    CORRUPTIONS[corruption](path)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for target in (tmp_path, path):
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(target)
        assert "\n" not in str(info.value) and str(path) in str(info.value)
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_latest_naming_a_missing_round_is_a_checkpoint_error(tmp_path: Path, trained: Setup) -> None:
    path = save_checkpoint(tmp_path, trained.checkpoint(CONFIG))
    (tmp_path / "latest").write_text("round-000099")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    assert "round-000099" in str(info.value) and "\n" not in str(info.value)
    assert path.is_dir()


def states_equal(a: Setup, b: Setup) -> None:
    for (name, pa), (_, pb) in zip(a.named_params, b.named_params, strict=True):
        assert torch.equal(pa, pb), name
    for xa, xb in zip(a.outer.anchor, b.outer.anchor, strict=True):
        assert torch.equal(xa, xb)
    assert_nested_equal(a.outer.state_tensors(), b.outer.state_tensors())
    assert_nested_equal(a.inner.optimizer.state_dict(), b.inner.optimizer.state_dict())
    assert a.inner.scheduler.last_epoch == b.inner.scheduler.last_epoch
    assert a.round == b.round


@pytest.mark.slow
def test_resumed_run_continues_with_identical_state(tmp_path: Path) -> None:
    run_a = Setup.build(CONFIG, seed=0)
    for round_ in range(2):
        run_a.run_round(round_batches(round_))
    save_checkpoint(tmp_path, run_a.checkpoint(CONFIG))
    run_a.run_round(round_batches(2))

    run_b = Setup.build(CONFIG, seed=12345)  # other initial weights: everything must come from the checkpoint
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.round == 2 and checkpoint.fingerprint == model_fingerprint(run_b.model)
    run_b.load_(checkpoint)
    run_b.run_round(round_batches(2))

    states_equal(run_a, run_b)
    assert run_a.inner.scheduler.last_epoch == 3 * CONFIG.inner.steps
    assert any(float(b.abs().max()) > 0 for b in run_b.outer.momentum_buffers())  # momentum was really carried


def test_resuming_without_the_outer_momentum_would_differ(tmp_path: Path) -> None:
    """The resumption test can fail: dropping the saved outer momentum changes round 3's result."""
    run_a = Setup.build(CONFIG, seed=0)
    for round_ in range(2):
        run_a.run_round(round_batches(round_))
    save_checkpoint(tmp_path, run_a.checkpoint(CONFIG))
    run_a.run_round(round_batches(2))

    run_b = Setup.build(CONFIG, seed=0)
    checkpoint = load_checkpoint(tmp_path)
    zero_momentum = {"mode": "diloco", "tensors": [torch.zeros_like(t) for t in checkpoint.sync_state["tensors"]]}
    run_b.load_(dataclasses.replace(checkpoint, sync_state=zero_momentum))
    run_b.run_round(round_batches(2))
    pairs = zip(run_a.named_params, run_b.named_params, strict=True)
    assert not all(torch.equal(pa, pb) for (_, pa), (_, pb) in pairs)


class OuterOnlySync:
    """The outer-state side of a sync (`OuterSync.state_tensors` and its loader): the outer momentum, and `extra`
    named tensors after it as Factored's gossip Mix2 keeps its error feedback."""

    def __init__(self, outer: OuterOptimizer, extra: int = 0):
        self.outer = outer
        self.extra = [(f"residual:{i}", torch.zeros_like(a)) for i, a in enumerate(outer.anchor[:extra])]

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self.outer.state_tensors() + self.extra

    def load_state_tensors_(self, tensors: list[torch.Tensor]) -> None:
        count = len(self.outer.state_tensors())
        self.outer.load_state_tensors_(tensors[:count])
        self.extra = [(n, t) for (n, _), t in zip(self.extra, tensors[count:], strict=True)]


def peer_state_with(momentum: float, extra: int = 0) -> PeerState:
    config = dataclasses.replace(CONFIG, outer=dataclasses.replace(CONFIG.outer, momentum=momentum))
    setup = Setup.build(config, seed=0)
    return PeerState([n for n, _ in setup.named_params], setup.outer, OuterOnlySync(setup.outer, extra))  # type: ignore[arg-type]


def written_by(state: PeerState, legacy: bool = False) -> TrainingCheckpoint:
    """A checkpoint of `state` after a round (names kept, or not: `legacy`, as before they were)."""
    state.outer.step_([torch.full_like(a, 0.01) for a in state.outer.anchor])
    named = state.sync.state_tensors()
    sync_state: dict[str, Any] = {"mode": "diloco", "tensors": [t.clone() for _, t in named]}
    if not legacy:
        sync_state["names"] = [n for n, _ in named]
    return TrainingCheckpoint(1, {}, {}, sync_state, {}, "")


@pytest.mark.parametrize("legacy", [False, True])
def test_a_checkpoint_with_outer_momentum_resumes_a_run_without_it_and_back(legacy: bool, caplog) -> None:
    """γ 0 keeps no momentum: a checkpoint written with γ 0.9 resumes at γ 0 (the momentum is dropped, said once),
    and one written at γ 0 resumes at γ 0.9 (the momentum starts from zero); other outer state still must fit."""
    caplog.set_level(logging.INFO, logger="p2ptrain")
    with_momentum, without = peer_state_with(0.9, extra=2), peer_state_with(0.0, extra=2)
    assert len(with_momentum.named_tensors()) == len(without.named_tensors()) + len(without.names)
    # what a joiner downloads: a model's worth less (DiLoCo's snapshot of the `base` preset: 97 MiB, was 194)
    assert with_momentum.nbytes() - without.nbytes() == sum(4 * a.numel() for a in without.outer.anchor)
    written = written_by(with_momentum, legacy)
    written.sync_state["tensors"][-1].fill_(3.0)  # the error feedback is carried either way
    load_sync_state_(without, written, "ckpt")
    assert without.outer.state_tensors() == []
    assert float(without.sync.extra[-1][1].max()) == 3.0  # type: ignore[attr-defined]
    assert "outer momentum is dropped" in caplog.text

    if not legacy:  # (before the names were kept, every checkpoint held a momentum, zeros with γ 0)
        back = peer_state_with(0.9, extra=2)
        load_sync_state_(back, written_by(peer_state_with(0.0, extra=2)), "ckpt")
        assert all(not b.any() for b in back.outer.momentum_buffers()) and "it starts from zero" in caplog.text

    same = peer_state_with(0.9, extra=2)
    load_sync_state_(same, written, "ckpt")  # the momentum itself, where both keep it
    for mine, saved in zip(same.outer.momentum_buffers(), written.sync_state["tensors"], strict=False):
        assert torch.equal(mine, saved) and saved.any()


@pytest.mark.parametrize("sync_state", [
    {"mode": "diloco", "names": ["residual:0"], "tensors": [torch.zeros(3)]},  # a tensor this run lacks
    {"mode": "diloco", "names": [["x"]], "tensors": [torch.zeros(3)]},  # a name that is no string
    {"mode": "diloco", "names": ["a", "a"], "tensors": [torch.zeros(3), torch.zeros(3)]},
    {"mode": "diloco", "names": ["momentum:0"], "tensors": ["not a tensor"]},
    {"mode": "diloco", "tensors": [torch.zeros(3)] * 3},  # old, and of no count that fits
])
def test_an_outer_state_that_does_not_fit_is_refused_and_nothing_loaded(sync_state: dict[str, Any]) -> None:
    state = peer_state_with(0.0, extra=1)
    before = [t.clone() for _, t in state.named_tensors()]
    with pytest.raises(CheckpointError, match="does not fit"):
        load_sync_state_(state, TrainingCheckpoint(1, {}, {}, sync_state, {}, ""), "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(before, [t for _, t in state.named_tensors()], strict=True))
