"""Data stage: config checks, byte tokenizer, document-level split, reproducible batches, local files, errors."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path

import pytest
import torch

from p2ptrain.data import (
    VALIDATION_SPLIT,
    ByteTokenizer,
    DataConfig,
    Document,
    TextShards,
    assign_splits,
    build_tokenizer,
    load_documents,
    shard_for_peer,
)
from p2ptrain.errors import ConfigError, UserError

SMALL_STDLIB = DataConfig(max_corpus_bytes=300_000, num_shards=4, val_fraction=0.1, seq_len=32, batch_size=4)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach the hub: env vars for subprocesses, module flags for libraries already imported."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


@pytest.fixture(scope="module")
def stdlib_shards() -> dict[int, TextShards]:
    tokenizer = build_tokenizer(SMALL_STDLIB)
    return {i: TextShards(SMALL_STDLIB, tokenizer, i) for i in range(SMALL_STDLIB.num_shards)}


def texts(documents: list[Document]) -> set[str]:
    return {d.text for d in documents}


def contains_window(stream: torch.Tensor, row: torch.Tensor) -> bool:
    windows = stream.unfold(0, row.numel(), 1)
    return bool((windows == row).all(dim=1).any())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seq_len", 1),
        ("seq_len", 2.5),
        ("batch_size", 0),
        ("batch_size", True),
        ("max_corpus_bytes", 0),
        ("val_fraction", 0.0),
        ("val_fraction", 1.0),
        ("val_fraction", "0.1"),
        ("val_batches", -1),
        ("num_shards", 0),
        ("dataset", ""),
        ("dataset", "hf:"),
        ("text_field", " "),
        ("tokenizer", ""),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        DataConfig(**{field: value})  # type: ignore[arg-type]


def test_config_defaults_are_valid_and_frozen() -> None:
    cfg = DataConfig()
    assert (cfg.dataset, cfg.tokenizer, cfg.seq_len, cfg.batch_size, cfg.num_shards) == ("stdlib", "bytes", 128, 8, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seq_len = 3  # type: ignore[misc]


def test_byte_tokenizer_round_trip() -> None:
    tokenizer = ByteTokenizer()
    text = "def f(x):\n    return 'héllo → 世界'\n"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert tokenizer.decode(ids) == text
    assert (tokenizer.vocab_size, tokenizer.eos_token_id) == (257, 256)
    assert tokenizer.decode([104, 105, 256, 106]) == "hi\nj"
    assert isinstance(build_tokenizer(DataConfig()), ByteTokenizer)


def test_split_is_sha1_of_text_and_partitions_documents() -> None:
    documents = [Document(f"d{i}", f"document number {i}\n") for i in range(200)]
    splits = assign_splits(documents, val_fraction=0.1, num_shards=7)
    for document, split in zip(documents, splits, strict=True):
        digest = hashlib.sha1(document.text.encode()).digest()
        if int.from_bytes(digest[:8], "big") < 0.1 * 2**64:
            assert split == VALIDATION_SPLIT
        else:
            assert split == int.from_bytes(digest[8:16], "big") % 7
    assert 5 <= splits.count(VALIDATION_SPLIT) <= 40
    # the assignment does not depend on order or on the other documents
    assert assign_splits(documents[::-1], 0.1, 7) == splits[::-1]
    subset = [splits.index(VALIDATION_SPLIT)] + list(range(50, 60))
    assert assign_splits([documents[i] for i in subset], 0.1, 7) == [splits[i] for i in subset]


def test_tiny_corpus_still_gets_one_validation_document() -> None:
    documents = [Document("a", "alpha"), Document("b", "beta"), Document("c", "gamma")]
    splits = assign_splits(documents, val_fraction=1e-9, num_shards=1)
    assert splits.count(VALIDATION_SPLIT) == 1
    scores = [int.from_bytes(hashlib.sha1(d.text.encode()).digest()[:8], "big") for d in documents]
    assert splits[scores.index(min(scores))] == VALIDATION_SPLIT


def test_stdlib_shards_are_disjoint_and_validation_is_shared(stdlib_shards: dict[int, TextShards]) -> None:
    corpus = texts(load_documents(SMALL_STDLIB))
    validation = texts(stdlib_shards[0].validation_documents)
    assert validation, "the validation split is empty"
    union = set(validation)
    for index, shards in stdlib_shards.items():
        assert texts(shards.validation_documents) == validation
        train = texts(shards.train_documents)
        assert train and not train & validation
        assert not train & union, f"shard {index} shares documents with another split"
        union |= train
    assert union == corpus
    assert all(d.name.startswith("stdlib/") and d.name.endswith(".py") for d in stdlib_shards[1].train_documents)


def test_corpus_is_capped_at_max_corpus_bytes() -> None:
    documents = load_documents(dataclasses.replace(SMALL_STDLIB, max_corpus_bytes=10_000))
    assert sum(len(d.text.encode()) for d in documents) in range(10_000 - 3, 10_001)
    names = [d.name for d in documents]
    assert names == sorted(names)


def test_train_batches_shape_dtype_and_values(stdlib_shards: dict[int, TextShards]) -> None:
    shards = stdlib_shards[2]
    stream = shards.train_stream()
    expected = torch.tensor(ByteTokenizer().encode(shards.train_documents[0].text) + [256])
    assert torch.equal(stream[: expected.numel()], expected)
    batches = shards.train_batches(seed=0)
    for _ in range(3):
        batch = next(batches)
        assert batch.shape == (4, 32) and batch.dtype == torch.long
        assert int(batch.min()) >= 0 and int(batch.max()) < 257
        assert all(contains_window(stream, row) for row in batch)


def test_same_seed_same_batches_other_seed_other_batches(stdlib_shards: dict[int, TextShards]) -> None:
    shards = stdlib_shards[0]
    first = list(itertools.islice(shards.train_batches(seed=7), 5))
    again = list(itertools.islice(shards.train_batches(seed=7), 5))
    other = list(itertools.islice(shards.train_batches(seed=8), 5))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    assert not torch.equal(first[0], first[1])


def test_validation_batches_are_fixed_and_come_from_validation(stdlib_shards: dict[int, TextShards]) -> None:
    fresh = TextShards(SMALL_STDLIB, ByteTokenizer(), 3)
    batches = fresh.validation_batches()
    assert len(batches) == SMALL_STDLIB.val_batches
    assert all(b.shape == (4, 32) and b.dtype == torch.long for b in batches)
    assert all(torch.equal(a, b) for a, b in zip(batches, stdlib_shards[1].validation_batches(), strict=True))
    stream = torch.tensor([t for d in fresh.validation_documents for t in ByteTokenizer().encode(d.text) + [256]])
    assert all(contains_window(stream, row) for batch in batches for row in batch)
    assert len({tuple(row.tolist()) for batch in batches for row in batch}) > 1


def test_shard_for_peer_is_stable_sha1() -> None:
    expected = int.from_bytes(hashlib.sha1(b"peer-abc").digest()[:8], "big") % 64
    assert shard_for_peer("peer-abc", 64) == expected
    assert {shard_for_peer(f"peer-{i}", 5) for i in range(100)} == set(range(5))
    with pytest.raises(UserError):
        shard_for_peer("", 4)


def local_cfg(path: Path, **overrides: object) -> DataConfig:
    base = dict(dataset=str(path), num_shards=1, seq_len=16, batch_size=2, val_batches=2, val_fraction=0.2)
    return DataConfig(**{**base, **overrides})  # type: ignore[arg-type]


def check_loads(cfg: DataConfig, written: set[str]) -> None:
    shards = TextShards(cfg, build_tokenizer(cfg), 0)
    assert texts(shards.train_documents) | texts(shards.validation_documents) == written
    assert not texts(shards.train_documents) & texts(shards.validation_documents)
    batch = next(shards.train_batches(seed=1))
    assert batch.shape == (2, 16) and batch.dtype == torch.long and int(batch.max()) < 257
    assert [b.shape for b in shards.validation_batches()] == [(2, 16), (2, 16)]


def test_local_txt_directory_one_document_per_file(tmp_path: Path) -> None:
    written = {f"text file {i}\nwith two lines\n" for i in range(6)}
    for i, text in enumerate(sorted(written)):
        (tmp_path / f"f{i}.txt").write_text(text)
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    check_loads(local_cfg(tmp_path), written)


def test_local_jsonl_file_with_custom_field(tmp_path: Path) -> None:
    written = {f"record {i} body" for i in range(8)}
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(sorted(written))))
    check_loads(local_cfg(path, text_field="body"), written)
    with pytest.raises(UserError, match="no field 'text'"):
        TextShards(local_cfg(path), ByteTokenizer(), 0)


def test_local_parquet_file(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    written = {f"parquet row {i} " * 3 for i in range(8)}
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": sorted(written)}), path)
    check_loads(local_cfg(path), written)


def test_missing_path_is_a_one_line_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist") as info:
        TextShards(local_cfg(tmp_path / "nope"), ByteTokenizer(), 0)
    assert "\n" not in str(info.value)
    (tmp_path / "only.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="no .txt"):
        TextShards(local_cfg(tmp_path), ByteTokenizer(), 0)


def test_empty_shard_and_bad_index_are_user_errors(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("only one training document, maybe")
    (tmp_path / "b.txt").write_text("and one more")
    cfg = local_cfg(tmp_path, num_shards=64)
    with pytest.raises(UserError, match="lower data.num_shards"):
        for index in range(64):
            TextShards(cfg, ByteTokenizer(), index)
    with pytest.raises(UserError, match="shard index"):
        TextShards(cfg, ByteTokenizer(), 64)


@pytest.mark.parametrize("name", ["/no/such/tokenizer", "./missing-tokenizer-dir", "no-such-org/no-such-tokenizer"])
def test_bad_tokenizer_is_a_one_line_user_error(name: str) -> None:
    with pytest.raises(UserError, match="cannot load tokenizer") as info:
        build_tokenizer(DataConfig(tokenizer=name))
    assert "\n" not in str(info.value) and "bytes" in str(info.value)


def test_empty_tokenizer_directory_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot load tokenizer"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path)))


def test_local_pretrained_tokenizer_is_wrapped(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, "def": 2, "return": 3, "x": 4}
    raw = RawTokenizer(WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="</s>").save_pretrained(tmp_path)
    tokenizer = build_tokenizer(DataConfig(tokenizer=str(tmp_path)))
    assert (tokenizer.vocab_size, tokenizer.eos_token_id) == (5, 1)
    assert tokenizer.encode("def x return y") == [2, 4, 3, 0]
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"{i}.txt").write_text("def x return x " * (i + 1))
    cfg = local_cfg(docs, tokenizer=str(tmp_path), seq_len=4)
    batch = next(TextShards(cfg, tokenizer, 0).train_batches(seed=0))
    assert batch.shape == (2, 4) and int(batch.max()) < 5 and int(batch.min()) >= 1
