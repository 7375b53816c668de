"""Models: presets, seeded initialisation, fingerprints, name checks, and local model directories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from p2ptrain.config import build_config
from p2ptrain.errors import ConfigError, UserError
from p2ptrain.models import PRESETS, ModelConfig, build_model, count_parameters, model_fingerprint

VOCAB = 257  # the byte tokenizer's vocabulary


@pytest.fixture(scope="module")
def tiny_models() -> dict[str, torch.nn.Module]:
    config = ModelConfig(name="tiny", max_seq_len=64)
    return {
        "seed0": build_model(config, VOCAB, seed=0),
        "seed0_again": build_model(config, VOCAB, seed=0),
        "seed1": build_model(config, VOCAB, seed=1),
    }


def tensors_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_with_the_given_vocab(name: str) -> None:
    vocab = 300
    model = build_model(ModelConfig(name=name, max_seq_len=32), vocab, seed=0)
    shape = PRESETS[name]
    assert model.config.vocab_size == vocab
    assert model.get_input_embeddings().weight.shape == (vocab, shape["hidden_size"])
    assert model.get_output_embeddings().weight.shape == (vocab, shape["hidden_size"])
    assert model.config.num_hidden_layers == shape["num_hidden_layers"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, vocab, (1, 8))).logits
    assert logits.shape == (1, 8, vocab) and torch.isfinite(logits).all()


def test_presets_grow_in_size() -> None:
    sizes = [count_parameters(build_model(ModelConfig(name=n, max_seq_len=16), VOCAB, 0)) for n in ("tiny", "small")]
    assert sizes[0] < sizes[1]


def test_same_seed_gives_identical_parameters(tiny_models: dict[str, torch.nn.Module]) -> None:
    assert tensors_equal(tiny_models["seed0"], tiny_models["seed0_again"])


def test_different_seed_gives_different_parameters(tiny_models: dict[str, torch.nn.Module]) -> None:
    a, b = tiny_models["seed0"].state_dict(), tiny_models["seed1"].state_dict()
    # every randomly initialised matrix differs (norm weights are all ones in both)
    random_keys = [k for k in a if a[k].dim() == 2]
    assert random_keys and all(not torch.equal(a[k], b[k]) for k in random_keys)


def test_fingerprint_same_preset_equal_across_seeds(tiny_models: dict[str, torch.nn.Module]) -> None:
    fingerprints = {model_fingerprint(m) for m in tiny_models.values()}
    assert len(fingerprints) == 1 and len(next(iter(fingerprints))) == 16


def test_fingerprint_differs_across_presets_and_vocab(tiny_models: dict[str, torch.nn.Module]) -> None:
    tiny = model_fingerprint(tiny_models["seed0"])
    small = model_fingerprint(build_model(ModelConfig(name="small", max_seq_len=64), VOCAB, 0))
    other_vocab = model_fingerprint(build_model(ModelConfig(name="tiny", max_seq_len=64), VOCAB + 1, 0))
    assert len({tiny, small, other_vocab}) == 3


def test_fingerprint_sees_dtype(tiny_models: dict[str, torch.nn.Module]) -> None:
    model = build_model(ModelConfig(name="tiny", max_seq_len=64), VOCAB, 0)
    assert model_fingerprint(model.bfloat16()) != model_fingerprint(tiny_models["seed0"])


def test_unknown_preset_is_rejected_at_config_time() -> None:
    with pytest.raises(UserError) as info:
        ModelConfig(name="nope")
    assert "nope" in str(info.value) and "tiny" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UserError):
        build_config({"model": {"name": "nope"}})


def test_empty_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        ModelConfig(name="")


def test_missing_path_is_a_user_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(UserError) as info:
        ModelConfig(name=str(missing))
    assert str(missing) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UserError):
        ModelConfig(name="./no-such-model-dir", pretrained=True)


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=True))
    directory = tmp_path_factory.mktemp("local-llama")
    model.save_pretrained(directory)
    return directory, model


def test_local_directory_builds_from_its_config_only(saved_llama: tuple[Path, LlamaForCausalLM]) -> None:
    directory, saved = saved_llama
    config = ModelConfig(name=str(directory))
    a, b = build_model(config, VOCAB, seed=0), build_model(config, VOCAB, seed=0)
    assert model_fingerprint(a) == model_fingerprint(saved)  # the same architecture ...
    assert not tensors_equal(a, saved)  # ... with fresh weights, not the saved ones
    assert tensors_equal(a, b)  # seeded: every peer gets the same θ_0


def test_local_directory_pretrained_loads_the_saved_weights(saved_llama: tuple[Path, LlamaForCausalLM]) -> None:
    directory, saved = saved_llama
    model = build_model(ModelConfig(name=str(directory), pretrained=True), VOCAB, seed=0)
    assert tensors_equal(model, saved)


def test_local_directory_without_config_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "empty-model").mkdir()
    for pretrained in (False, True):
        with pytest.raises(UserError) as info:
            build_model(ModelConfig(name=str(tmp_path / "empty-model"), pretrained=pretrained), VOCAB, seed=0)
        assert "\n" not in str(info.value)


def test_local_model_with_a_smaller_vocab_than_the_tokenizer_is_a_user_error(
        saved_llama: tuple[Path, LlamaForCausalLM]) -> None:
    """A model whose embedding has fewer rows than the tokenizer has ids would crash deep in torch at the first
    batch; build_model is given the tokenizer's vocab size and refuses."""
    directory, _ = saved_llama
    with pytest.raises(UserError):
        build_model(ModelConfig(name=str(directory)), VOCAB + 100, seed=0)
