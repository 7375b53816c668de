"""Checkpoints: model weights (safetensors) + inner/outer optimizer state + round + resolved config.

Layout: `<dir>/round-000012/{model.safetensors,train_state.pt,meta.json}` and `<dir>/latest` naming the newest.
A checkpoint is written into a hidden temporary directory and renamed into place, then `latest` is replaced
atomically, so a crash mid-write never leaves a half checkpoint where `latest` points. Loading checks every
part before returning; a corrupt or mismatched checkpoint is a one-line CheckpointError and is left untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from p2ptrain.errors import CheckpointError, one_line

FORMAT_VERSION = 1
KEEP_LAST = 2


@dataclasses.dataclass
class TrainingCheckpoint:
    round: int
    model: dict[str, torch.Tensor]  # parameter name -> tensor (the anchor of `round`)
    inner: dict[str, Any]  # InnerTrainer.state_dict()
    # the outer sync's state: {"mode": sync.mode, "names": [its state tensors' names], "tensors": [those tensors]}
    # (written before the names were kept: no "names"; peer_checkpoint.load_sync_state_ reads both)
    sync_state: dict[str, Any]
    config: dict[str, Any]  # the resolved PeerConfig
    fingerprint: str  # model fingerprint (names, shapes, dtypes)


def save_checkpoint(directory: str | Path, checkpoint: TrainingCheckpoint) -> Path:
    """Write atomically; returns the checkpoint's directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"round-{checkpoint.round:06d}"
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=directory))
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in checkpoint.model.items()},
                  str(staging / "model.safetensors"))
        # the sync state is stored under "outer", as format 1 has always stored it
        torch.save({"inner": checkpoint.inner, "outer": checkpoint.sync_state}, staging / "train_state.pt")
        meta = {"format": FORMAT_VERSION, "round": checkpoint.round, "config": checkpoint.config,
                "fingerprint": checkpoint.fingerprint}
        (staging / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        _fsync_tree(staging)
        if final.exists():  # the same round again (Ctrl-C right after a periodic checkpoint): move the old aside
            os.replace(final, staging.with_name(staging.name + "-old"))
        os.replace(staging, final)
        shutil.rmtree(staging.with_name(staging.name + "-old"), ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _write_atomically(directory / "latest", final.name)
    _remove_old(directory, keep=final.name)
    return final


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The directory `latest` names, or None when there is no checkpoint yet."""
    pointer = Path(directory) / "latest"
    if not pointer.exists():
        return None
    target = Path(directory) / pointer.read_text().strip()
    if not target.is_dir():
        raise CheckpointError(f"{pointer} names {target.name}, which does not exist; the checkpoint dir is damaged")
    return target


def load_checkpoint(path: str | Path) -> TrainingCheckpoint:
    """Load and check a checkpoint directory (or a checkpoint root with a `latest` pointer)."""
    path = Path(path)
    if (path / "latest").exists():
        path = latest_checkpoint(path) or path
    if not (path / "meta.json").exists():
        raise CheckpointError(f"no checkpoint at {path} (expected meta.json, model.safetensors, train_state.pt)")
    try:
        meta = json.loads((path / "meta.json").read_text())
        model = load_file(str(path / "model.safetensors"))
        state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # an untrusted file fails in many ways (pickle, safetensors, torch, JSON): all mean corrupt
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated: {one_line(e)}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has an unknown format (expected version {FORMAT_VERSION})")
    if not (isinstance(meta.get("round"), int) and meta["round"] >= 0 and isinstance(meta.get("config"), dict)
            and isinstance(meta.get("fingerprint"), str)):
        raise CheckpointError(f"checkpoint {path} has a damaged meta.json (round, config or fingerprint)")
    if not isinstance(state, dict) or not {"inner", "outer"} <= state.keys():
        raise CheckpointError(f"checkpoint {path} lacks optimizer state")
    return TrainingCheckpoint(meta["round"], model, state["inner"], state["outer"], meta["config"],
                              meta["fingerprint"])


def _write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".tmp-", delete=False) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, path)


def _fsync_tree(directory: Path) -> None:
    for file in directory.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())


def _remove_old(directory: Path, keep: str) -> None:
    rounds = sorted(p for p in directory.glob("round-*") if p.is_dir())
    for old in rounds[:-KEEP_LAST]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)
