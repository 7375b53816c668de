"""A training peer's checkpoint: what it writes (the round's anchor, the inner optimiser, the outer sync's state)
and how it resumes from one, every part checked against the model before any of it is applied (checkpoint.py: the
file itself)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from p2ptrain.checkpoint import TrainingCheckpoint, load_checkpoint, save_checkpoint
from p2ptrain.errors import CheckpointError, StateMismatchError, UserError
from p2ptrain.tensor_layout import check_tensors, layout_of

if TYPE_CHECKING:
    from p2ptrain.peer import TrainingPeer

logger = logging.getLogger(__name__)


def save_peer_checkpoint(peer: TrainingPeer) -> None:
    """Write the round's anchor, the inner optimiser's state and the outer sync's state to run.checkpoint_dir."""
    model = {n: a for (n, _), a in zip(peer.named_params, peer.outer.anchor, strict=True)}
    sync_state = {"mode": peer.config.sync.mode,
                  "tensors": [t.detach().cpu().clone() for _, t in peer.sync.state_tensors()]}
    path = save_checkpoint(peer.config.run.checkpoint_dir, TrainingCheckpoint(
        peer.round, model, peer.inner.state_dict(), sync_state, peer.config.to_dict(), peer.fingerprint))
    logger.info(f"checkpoint written to {path}")


def load_peer_checkpoint(peer: TrainingPeer) -> TrainingCheckpoint:
    """Load and apply the model and inner state (before the network starts, so a bad file fails fast)."""
    if not peer.config.run.checkpoint_dir:
        raise UserError("--resume needs a checkpoint directory (run.checkpoint_dir or --checkpoint-dir)")
    checkpoint = load_checkpoint(peer.config.run.checkpoint_dir)
    if checkpoint.fingerprint != peer.fingerprint:
        raise CheckpointError(f"checkpoint in {peer.config.run.checkpoint_dir} is for another model "
                              f"(fingerprint {checkpoint.fingerprint}, this model {peer.fingerprint})")
    names = [n for n, _ in peer.named_params]
    if sorted(checkpoint.model) != sorted(names):
        raise CheckpointError(f"checkpoint in {peer.config.run.checkpoint_dir} has other parameter names")
    expected = layout_of(names, [p.detach().cpu() for p in peer.params])
    try:
        check_tensors(expected, [checkpoint.model[n] for n in names], what="checkpoint")
        peer.outer.set_params_([checkpoint.model[n] for n in names])
        peer.inner.load_state_dict(checkpoint.inner)
    except (StateMismatchError, KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint in {peer.config.run.checkpoint_dir} does not fit: {e}") from None
    if checkpoint.sync_state.get("mode") != peer.config.sync.mode:
        raise CheckpointError(f"checkpoint in {peer.config.run.checkpoint_dir} was written with sync.mode "
                              f"{checkpoint.sync_state.get('mode')!r}, not {peer.config.sync.mode!r}")
    peer.round, peer.joined_ever = checkpoint.round, False
    return checkpoint


def apply_sync_state(peer: TrainingPeer, checkpoint: TrainingCheckpoint) -> None:
    """The outer sync's state from `checkpoint`, once the sync exists (after the network starts); a misfit shuts
    the peer down and is a CheckpointError."""
    expected = layout_of([n for n, _ in peer.sync.state_tensors()],
                         [t.detach().cpu() for _, t in peer.sync.state_tensors()])
    tensors = checkpoint.sync_state.get("tensors")
    try:
        check_tensors(expected, tensors if isinstance(tensors, list) else [], what="checkpoint outer state")
    except StateMismatchError as e:
        peer.shutdown()
        raise CheckpointError(f"checkpoint in {peer.config.run.checkpoint_dir} does not fit: {e}") from None
    peer.sync.load_state_tensors_(tensors)  # type: ignore[arg-type]
