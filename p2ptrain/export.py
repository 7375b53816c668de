"""The model out of the swarm: a checkpoint becomes a Hugging Face model directory (config, safetensors weights,
tokenizer) that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load with nothing of
p2ptrain installed, and text sampled from it. The byte tokenizer is written as an equivalent fast tokenizer: each
UTF-8 byte its own token with the same id (256 ends a document), so the exported model reads what it was trained
on."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from p2ptrain.checkpoint import load_checkpoint
from p2ptrain.config import PeerConfig, build_config
from p2ptrain.data import ByteTokenizer, PretrainedTokenizer, build_tokenizer
from p2ptrain.errors import CheckpointError, ConfigError, StateMismatchError, UserError, one_line
from p2ptrain.manifest import RunManifest
from p2ptrain.models import build_model, model_fingerprint
from p2ptrain.peer import TrainingPeer
from p2ptrain.tensor_layout import check_tensors, layout_of

BYTE_EOS = "<|endoftext|>"  # the exported byte tokenizer's name for id 256
SWARM_WAIT_S = 60.0  # --from-swarm: how long to wait for the run's records before saying no peer is live


@dataclasses.dataclass
class ExportedModel:
    """A checkpoint's model with its weights and the tokenizer it was trained with, as transformers objects."""

    model: Any  # a transformers PreTrainedModel, in eval mode
    tokenizer: Any  # a transformers tokenizer
    round: int  # the checkpoint's round
    config: PeerConfig


def load_exportable(checkpoint_path: str | Path) -> ExportedModel:
    """The model of a checkpoint directory (or of a checkpoint root's `latest`), checked against its fingerprint."""
    checkpoint = load_checkpoint(checkpoint_path)
    try:
        config = build_config(checkpoint.config)
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {checkpoint_path} holds a config this version cannot read: {e}") from None
    tokenizer = build_tokenizer(config.data)
    model = build_model(config.model, tokenizer.vocab_size, config.run.seed)
    if model_fingerprint(model) != checkpoint.fingerprint:
        raise CheckpointError(f"checkpoint {checkpoint_path} does not match the model its config builds "
                              f"(fingerprint {checkpoint.fingerprint}, built {model_fingerprint(model)})")
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if sorted(trained) != sorted(checkpoint.model):
        raise CheckpointError(f"checkpoint {checkpoint_path} has other parameter names than its model")
    values = [checkpoint.model[name] for name in trained]
    try:  # the check a resumed peer makes of the same file (peer_checkpoint.load_peer_checkpoint)
        check_tensors(layout_of(list(trained), [p.detach() for p in trained.values()]), values, what="checkpoint")
    except StateMismatchError as e:
        raise CheckpointError(f"checkpoint {checkpoint_path} does not fit its model: {e}") from None
    with torch.no_grad():
        for parameter, value in zip(trained.values(), values, strict=True):
            parameter.copy_(value)
    return ExportedModel(model.eval(), transformers_tokenizer(tokenizer), checkpoint.round, config)


def transformers_tokenizer(tokenizer: object) -> Any:
    """The tokenizer a run trained with, as transformers saves and loads it."""
    if isinstance(tokenizer, PretrainedTokenizer):
        return tokenizer.inner
    if isinstance(tokenizer, ByteTokenizer):
        return byte_level_tokenizer()
    raise UserError(f"cannot export a {type(tokenizer).__name__}")


def byte_level_tokenizer() -> Any:
    """A fast tokenizer equal to `ByteTokenizer`: byte b is token b (through GPT-2's printable stand-ins for bytes,
    no merges), and BYTE_EOS is 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _printable_bytes().items()}
    vocab[BYTE_EOS] = ByteTokenizer().eos_token_id
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token=BYTE_EOS)


def _printable_bytes() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the alphabet of tokenizers' ByteLevel)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def export_checkpoint(checkpoint_path: str | Path, out_dir: str | Path) -> ExportedModel:
    """Write the checkpoint's model and tokenizer to `out_dir` (absent or empty: nothing is overwritten)."""
    out = _new_directory(out_dir)
    exported = load_exportable(checkpoint_path)
    _write(exported, out)
    return exported


def export_from_swarm(config: PeerConfig, initial_peers: list[str], out_dir: str | Path,
                      manifest: RunManifest | None = None, wait_s: float = SWARM_WAIT_S) -> tuple[ExportedModel, str]:
    """Write the swarm's current model to `out_dir`, taken from a live peer as a joiner takes it (downloaded,
    corroborated by other peers' sketches, loss-checked): a peer of the run that trains nothing and leaves. Returns
    the model and what was taken, in words."""
    out = _new_directory(out_dir)
    # on the CPU, reading shard 0 (it claims no data: only the validation batches are read), writing no files
    run = dataclasses.replace(config.run, device="cpu", shard_index=0, min_peers=1, checkpoint_dir="",
                              metrics_path="", tensorboard_dir="", wandb_project="", progress=False)
    config = dataclasses.replace(config, run=run)
    peer = TrainingPeer(config, initial_peers, manifest=manifest)
    try:
        taken = peer.take_swarm_state(wait_s)
        exported = ExportedModel(peer.model.eval(), transformers_tokenizer(peer.tokenizer), peer.state.round, config)
        _write(exported, out)
    finally:
        peer.shutdown()
    return exported, taken


def _new_directory(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty directory; export writes into a new one")
    return out


def _write(exported: ExportedModel, out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        exported.model.save_pretrained(out)
        exported.tokenizer.save_pretrained(out)
    except OSError as e:
        raise UserError(f"cannot write the model to {out}: {one_line(e)}") from None


def sample_text(exported: ExportedModel, prompt: str, new_tokens: int, temperature: float, seed: int) -> str:
    """The prompt and a continuation of `new_tokens` tokens: sampled at `temperature` (0: greedy), seeded."""
    if not prompt:
        raise UserError("--prompt must not be empty")
    if new_tokens < 1 or temperature < 0:
        raise UserError("--tokens must be >= 1 and --temperature >= 0")
    ids = exported.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    limit = exported.config.model.max_seq_len
    ids = ids[:, -max(1, limit - new_tokens):]  # the context the model has positions for
    torch.manual_seed(seed)
    with torch.no_grad():
        out = exported.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      do_sample=temperature > 0, temperature=temperature or None, top_k=None,
                                      pad_token_id=exported.tokenizer.eos_token_id)
    return str(exported.tokenizer.decode(out[0], skip_special_tokens=True))
