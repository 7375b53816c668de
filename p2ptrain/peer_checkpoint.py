"""A training peer's checkpoint: what it writes (the peer's state: the round and its anchor, the outer sync's state;
and the inner optimiser's) and how it resumes from one, every part checked against the model before any of it is
applied (checkpoint.py: the file itself)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from p2ptrain.checkpoint import TrainingCheckpoint, load_checkpoint, save_checkpoint
from p2ptrain.config import PeerConfig
from p2ptrain.errors import CheckpointError, StateMismatchError, UserError
from p2ptrain.maths.inner import InnerTrainer
from p2ptrain.maths.outer_optimizer import MOMENTUM_PREFIX, OuterOptimizer
from p2ptrain.maths.outer_rules import X_PREV_PREFIX
from p2ptrain.peer_state import PeerState
from p2ptrain.tensor_layout import check_tensors, layout_of

logger = logging.getLogger(__name__)

# the outer step's momentum (DiLoCo's buffers, GASLoC's previous iterate): in a state only when outer.momentum > 0
MOMENTUM_PREFIXES = (MOMENTUM_PREFIX, X_PREV_PREFIX)


def save_peer_checkpoint(state: PeerState, inner: InnerTrainer, config: PeerConfig, fingerprint: str,
                         directory: str | Path | None = None) -> Path:
    """Write the round's anchor, the inner optimiser's state and the outer sync's state to `directory` (default
    run.checkpoint_dir); returns the checkpoint's directory."""
    model = dict(zip(state.names, state.outer.anchor, strict=True))
    named = state.sync.state_tensors()
    sync_state = {"mode": config.sync.mode, "names": [n for n, _ in named],
                  "tensors": [t.detach().cpu().clone() for _, t in named]}
    path = save_checkpoint(directory or config.run.checkpoint_dir, TrainingCheckpoint(
        state.round, model, inner.state_dict(), sync_state, config.to_dict(), fingerprint))
    logger.info(f"checkpoint written to {path}")
    return path


def default_checkpoint_dir(run_id: str, peer_id: str) -> Path:
    """Where a peer run without a checkpoint directory keeps its model when it ends: the user's data directory
    (XDG_DATA_HOME, else ~/.local/share), one directory per run and peer, so peers on one machine never share it."""
    data_home = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return data_home / "p2ptrain" / "checkpoints" / _safe_name(run_id) / _safe_name(peer_id)


def _safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text).lstrip(".") or "_"


def load_peer_checkpoint(config: PeerConfig, fingerprint: str, named_params: Sequence[tuple[str, torch.Tensor]],
                         outer: OuterOptimizer, inner: InnerTrainer) -> TrainingCheckpoint:
    """Load the checkpoint and apply its model and inner state (before the network starts, so a bad file fails
    fast); its round and outer-sync state go to the peer's state once the sync exists (`load_sync_state_`)."""
    if not config.run.checkpoint_dir:
        raise UserError("--resume needs a checkpoint directory (run.checkpoint_dir or --checkpoint-dir)")
    checkpoint = load_checkpoint(config.run.checkpoint_dir)
    if checkpoint.fingerprint != fingerprint:
        raise CheckpointError(f"checkpoint in {config.run.checkpoint_dir} is for another model "
                              f"(fingerprint {checkpoint.fingerprint}, this model {fingerprint})")
    names = [n for n, _ in named_params]
    if sorted(checkpoint.model) != sorted(names):
        raise CheckpointError(f"checkpoint in {config.run.checkpoint_dir} has other parameter names")
    expected = layout_of(names, [p.detach().cpu() for _, p in named_params])
    try:
        check_tensors(expected, [checkpoint.model[n] for n in names], what="checkpoint")
        outer.set_params_([checkpoint.model[n] for n in names])
        inner.load_state_dict(checkpoint.inner)
    except (StateMismatchError, KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint in {config.run.checkpoint_dir} does not fit: {e}") from None
    if checkpoint.sync_state.get("mode") != config.sync.mode:
        raise CheckpointError(f"checkpoint in {config.run.checkpoint_dir} was written with sync.mode "
                              f"{checkpoint.sync_state.get('mode')!r}, not {config.sync.mode!r}")
    return checkpoint


def load_sync_state_(state: PeerState, checkpoint: TrainingCheckpoint, checkpoint_dir: str) -> None:
    """The outer sync's state from `checkpoint`, once the sync exists (after the network starts); a misfit is a
    CheckpointError, and nothing is loaded. The outer step's momentum is kept only when γ > 0: a checkpoint
    written with another γ has it or lacks it, and resumes (without it, the momentum starts again from zero)."""
    named = state.sync.state_tensors()
    stored = checkpoint.sync_state.get("tensors")
    stored = stored if isinstance(stored, list) else []
    names = checkpoint.sync_state.get("names")
    try:
        if not isinstance(names, list):  # written before the names were kept: ours, or after one momentum buffer
            names = ([f"{MOMENTUM_PREFIX}{i}" for i in range(len(state.names))]  # per parameter (zeros with γ 0)
                     if len(stored) == len(named) + len(state.names) else []) + [n for n, _ in named]
        tensors = _fit_sync_tensors(named, names, stored)
        check_tensors(layout_of([n for n, _ in named], [t.detach().cpu() for _, t in named]), tensors,
                      what="checkpoint outer state")
    except StateMismatchError as e:
        raise CheckpointError(f"checkpoint in {checkpoint_dir} does not fit: {e}") from None
    state.sync.load_state_tensors_(tensors)


def _fit_sync_tensors(named: Sequence[tuple[str, torch.Tensor]], names: Sequence[object],
                      stored: Sequence[object]) -> list[torch.Tensor]:
    """The stored tensors (`names`) in the order of `named`. The outer momentum may be missing from the checkpoint
    (ours, fresh, is kept) or left over (dropped); every other tensor must be there, and nothing else."""
    if not all(isinstance(n, str) for n in names) or not all(isinstance(t, torch.Tensor) for t in stored) or \
            len(names) != len(stored) or len(set(names)) != len(names):
        raise StateMismatchError(f"its outer state holds {len(stored)} tensors and {len(names)} names")
    by_name: dict[str, torch.Tensor] = dict(zip(names, stored, strict=True))  # type: ignore[arg-type]
    ours = [n for n, _ in named]
    missing = [n for n in ours if n not in by_name]
    left = [n for n in by_name if n not in ours]
    if any(not n.startswith(MOMENTUM_PREFIXES) for n in missing + left):
        raise StateMismatchError(f"its outer state holds {', '.join(sorted(by_name)[:4]) or 'nothing'}; this run's: "
                                 f"{', '.join(ours[:4]) or 'nothing'}")
    if any(bool(by_name[n].count_nonzero()) for n in left):
        logger.info("the checkpoint's outer momentum is dropped: this run's outer.momentum is 0")
    if missing:
        logger.info("the checkpoint holds no outer momentum (written with outer.momentum 0): it starts from zero")
    current = dict(named)
    return [by_name.get(n, current[n]) for n in ours]
