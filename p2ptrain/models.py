"""The model a run trains: a transformers causal LM from a named preset, a local path, or a hub id."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from p2ptrain.errors import ConfigError, UserError, one_line

if TYPE_CHECKING:  # transformers takes ~4 s to import: only building a model needs it, not `status` or a config
    from transformers import LlamaConfig, PreTrainedModel

# Llama-family shapes. `tiny` keeps tests fast on 2 CPU cores; `small` is the demo's default.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4),
    "small": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4),
    "base": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which model to build. Every peer of a run must use the same one (checked through the fingerprint)."""

    name: str = "small"  # a preset (tiny, small, base), a local directory with config.json, or a hub model id
    max_seq_len: int = 512  # position embeddings of presets (>= data.seq_len)
    pretrained: bool = False  # for a path/hub id: load its weights (True) or only its architecture (False)

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError(f"model.name must be a preset ({', '.join(PRESETS)}), a local path or a hub id")
        if self.name not in PRESETS:
            _check_name(self.name)
        if self.max_seq_len < 8:
            raise ConfigError(f"model.max_seq_len must be >= 8 tokens, got {self.max_seq_len}")


def build_model(config: ModelConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """Build the model with weights seeded by `seed`, so that every peer of a run starts from the same θ_0."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(seed)
    if config.name in PRESETS:
        model: PreTrainedModel = LlamaForCausalLM(_preset_config(config, vocab_size))
    elif config.pretrained:
        model = _from_pretrained(AutoModelForCausalLM, config.name, "model")
    else:
        model = AutoModelForCausalLM.from_config(_from_pretrained(AutoConfig, config.name, "model config"))
    embeddings = int(model.get_input_embeddings().weight.shape[0])  # type: ignore[index]
    if embeddings < vocab_size:
        raise UserError(f"model {config.name!r} has {embeddings} token embeddings but the tokenizer has {vocab_size} "
                        f"ids: use a matching tokenizer (data.tokenizer)")
    return model.float()


def _preset_config(config: ModelConfig, vocab_size: int) -> LlamaConfig:
    from transformers import LlamaConfig

    shape = PRESETS[config.name]
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=config.max_seq_len,
        num_key_value_heads=shape["num_attention_heads"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **shape,
    )


def _from_pretrained(auto_class: Any, name: str, what: str) -> Any:
    """`auto_class.from_pretrained(name)` for a local path or hub id; failures are a one-line UserError."""
    _check_name(name)
    try:
        return auto_class.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load {what} {name!r}: {one_line(e)}") from None


def _check_name(name: str) -> None:
    looks_like_path = name.startswith((".", "/", "~")) or os.sep in name.strip("/").split("/", 1)[-1]
    if looks_like_path and not Path(name).expanduser().exists():
        raise UserError(f"model {name!r} is not a preset ({', '.join(PRESETS)}) and no such directory exists")
    if "/" not in name and not Path(name).exists():
        raise UserError(f"unknown model preset {name!r}: use one of {', '.join(PRESETS)}, a local path or a hub id")


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short digest of parameter names, shapes and dtypes: peers refuse state from a different architecture."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return digest.hexdigest()[:16]


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
