"""What a memory plan needs to know of a model: its parameter tensors and its transformer shape, read without
allocating or downloading anything (the model is built on PyTorch's meta device from a preset, a local directory,
or a hub id whose config.json is already in the local Hugging Face cache)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from p2ptrain.errors import UserError
from p2ptrain.models import PRESETS, ModelConfig, build_model


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A causal LM's sizes, as the memory plan counts them (elements, not bytes)."""

    name: str
    architecture: str  # the transformers class, e.g. LlamaForCausalLM
    parameters: int  # trainable parameters (fp32 master weights: build_model returns float32)
    tensors: int  # parameter tensors (AdamW keeps a 4-byte step count for each)
    matmul_parameters: int  # parameters of 2-D weights: what 16-bit autocast copies for the forward and backward
    largest_tensor: int  # elements of the largest parameter tensor (the CPU AdamW step's temporaries)
    hidden: int  # hidden size h
    intermediate: int  # MLP width i
    layers: int  # decoder layers L
    heads: int  # attention heads
    kv_heads: int  # key/value heads (grouped-query attention: fewer than heads)
    vocab: int  # token embeddings V (the logits' width)
    eager_attention: bool  # attention probabilities materialised (heads × seq² per layer), not fused (sdpa)

    def __post_init__(self) -> None:
        if min(self.parameters, self.hidden, self.intermediate, self.layers, self.heads, self.kv_heads,
               self.vocab) < 1:
            raise UserError(f"model {self.name!r}: parameters and sizes must be >= 1, got {self}")

    @property
    def kv_hidden(self) -> int:
        """Width of the keys (and of the values): h · kv_heads / heads."""
        return self.hidden * self.kv_heads // self.heads


def model_shape(config: ModelConfig, vocab_size: int) -> ModelShape:
    """The shape of the model `config` names (a preset gets `vocab_size` embeddings, as in training), built on
    the meta device: no weights are allocated or downloaded. A hub id must have its config.json cached locally."""
    name = config.name
    if name not in PRESETS and not Path(name).expanduser().exists() and "/" in name:
        name = _cached_hub_dir(name)
    with torch.device("meta"):
        model = build_model(dataclasses.replace(config, name=name, pretrained=False), vocab_size, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    text = model.config.get_text_config()
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    heads = _first(text, "num_attention_heads", "n_head")
    return ModelShape(
        name=config.name,
        architecture=type(model).__name__,
        parameters=sum(p.numel() for p in params),
        tensors=len(params),
        matmul_parameters=sum(p.numel() for p in params if p.dim() == 2),
        largest_tensor=max(p.numel() for p in params),
        hidden=hidden,
        intermediate=_first(text, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
        layers=_first(text, "num_hidden_layers", "n_layer", "num_layers"),
        heads=heads,
        kv_heads=_first(text, "num_key_value_heads", default=heads),
        vocab=int(model.get_input_embeddings().weight.shape[0]),  # type: ignore[index]
        eager_attention=getattr(model.config, "_attn_implementation", "eager") == "eager",
    )


def _first(config: Any, *names: str, default: int | None = None) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    if default is None:
        raise UserError(f"model config {type(config).__name__} has none of {', '.join(names)}: the memory plan "
                        f"knows decoder-only transformers (Llama, Qwen, Mistral, GPT-2, ...)")
    return default


def _cached_hub_dir(repo_id: str) -> str:
    """The local snapshot directory holding `repo_id`'s config.json; never downloads."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError as e:  # not a valid repo id
        raise UserError(f"model {repo_id!r} is not a preset ({', '.join(PRESETS)}), a local directory or a valid "
                        f"hub id: {e}") from None
    if not isinstance(found, str):
        raise UserError(f"model {repo_id!r}: no config.json in the local Hugging Face cache, and the plan never "
                        f"downloads; fetch it first (huggingface-cli download {repo_id} config.json) or pass a local "
                        f"directory")
    return str(Path(found).parent)
