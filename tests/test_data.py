"""Data stage: config checks, tokenizers, pieces of local files, the shared validation set, batches read one piece
at a time, the pieces a shard reads, errors."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path

import pytest
import torch

from p2ptrain.corpus import MIN_PIECE_BYTES, CorpusSource, piece_table, read_piece
from p2ptrain.data import (
    ByteTokenizer,
    DataConfig,
    Document,
    StridedPieces,
    TextShards,
    build_tokenizer,
    choose_validation,
    shard_for_peer,
    tokenize_stream,
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


def texts(documents: list[Document]) -> list[str]:
    return sorted(d.text for d in documents)


def contains_window(stream: torch.Tensor, row: torch.Tensor) -> bool:
    windows = stream.unfold(0, row.numel(), 1)
    return bool((windows == row).all(dim=1).any())


def all_documents(shards: TextShards) -> list[Document]:
    return [d for piece in shards.pieces for d in read_piece(piece, shards.cfg.text_field)]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seq_len", 1),
        ("seq_len", 2.5),
        ("batch_size", 0),
        ("batch_size", True),
        ("max_corpus_bytes", -1),
        ("piece_bytes", 0),
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
    assert (cfg.max_corpus_bytes, cfg.piece_bytes) == (0, 4_000_000)  # no cap: the whole dataset, a piece at a time
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


def test_validation_is_the_sha1_of_each_text_alone() -> None:
    documents = [Document(f"d{i}", f"document number {i}\n") for i in range(200)]
    chosen = choose_validation(documents, val_fraction=0.1)
    expected = [d for d in documents if int.from_bytes(hashlib.sha1(d.text.encode()).digest()[:8], "big") < 0.1 * 2**64]
    assert chosen == expected and 5 <= len(chosen) <= 40
    # the choice does not depend on order or on the other documents
    assert choose_validation(documents[::-1], 0.1) == chosen[::-1]
    assert choose_validation(documents[50:60] + chosen[:1], 0.1)[-1] == chosen[0]


def test_tiny_piece_still_gets_one_validation_document() -> None:
    documents = [Document("a", "alpha"), Document("b", "beta"), Document("c", "gamma")]
    chosen = choose_validation(documents, val_fraction=1e-9)
    scores = [int.from_bytes(hashlib.sha1(d.text.encode()).digest()[:8], "big") for d in documents]
    assert chosen == [documents[scores.index(min(scores))]]


def test_shards_read_disjoint_pieces_that_cover_the_corpus(stdlib_shards: dict[int, TextShards]) -> None:
    first = stdlib_shards[0]
    validation = texts(first.validation_documents)
    assert validation, "the validation set is empty"
    read: list[str] = []
    for index, shards in stdlib_shards.items():
        assert texts(shards.validation_documents) == validation
        own = shards.order_of(len(shards.pieces)).pieces  # type: ignore[attr-defined]
        assert own == list(range(index, len(shards.pieces), SMALL_STDLIB.num_shards))
        for piece in own:
            documents = shards.piece_documents(piece)
            assert not set(texts(documents)) & set(validation)
            read += texts(documents)
    # every document once, in exactly one shard, validation aside
    assert sorted(read + validation) == texts(all_documents(first))
    assert all(d.name.startswith(str(Path(first.pieces[0].sources[0]).parent)) for d in first.validation_documents)


def test_the_cap_takes_the_first_bytes_and_pieces_stay_small() -> None:
    pieces = piece_table(CorpusSource("stdlib", "text", 10_000, 4_000_000, min_pieces=1))
    assert sum(p.nbytes for p in pieces) == 10_000
    assert all(p.nbytes <= max(MIN_PIECE_BYTES, 10_000) for p in pieces)
    whole = piece_table(CorpusSource("stdlib", "text", 0, 4_000_000, min_pieces=128))
    assert len(whole) >= 100 and sum(p.nbytes for p in whole) > 10_000_000  # the whole stdlib, not a cap
    assert max(p.nbytes for p in whole) < 2 * sum(p.nbytes for p in whole) / 100


def test_train_batches_use_each_window_of_a_piece_once(stdlib_shards: dict[int, TextShards]) -> None:
    shards = TextShards(SMALL_STDLIB, ByteTokenizer(), 2)
    batches = shards.train_batches(seed=0)
    first = next(batches)
    assert shards.pieces_read == [2]
    stream = tokenize_stream(shards.piece_documents(2), ByteTokenizer())
    windows = stream.numel() // SMALL_STDLIB.seq_len
    rows = [first] + [next(batches) for _ in range(windows // SMALL_STDLIB.batch_size - 1)]
    assert shards.pieces_read == [2]  # still the first piece
    for batch in rows[:3]:
        assert batch.shape == (4, 32) and batch.dtype == torch.long
        assert int(batch.min()) >= 0 and int(batch.max()) < 257
        assert all(contains_window(stream, row) for row in batch)
    distinct = {tuple(row.tolist()) for batch in rows for row in batch}
    assert len(distinct) >= 0.95 * len(rows) * SMALL_STDLIB.batch_size  # no window twice (some texts repeat)
    for _ in range(windows):  # past the piece: the shard's next one
        next(batches)
    assert shards.pieces_read[:2] == [2, 6]


def test_same_seed_same_batches_other_seed_other_batches() -> None:
    def batches(seed: int) -> list[torch.Tensor]:
        return list(itertools.islice(TextShards(SMALL_STDLIB, ByteTokenizer(), 0).train_batches(seed=seed), 5))

    first, again, other = batches(7), batches(7), batches(8)
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


def check_loads(cfg: DataConfig, written: list[str]) -> TextShards:
    shards = TextShards(cfg, build_tokenizer(cfg), 0)
    training = [d for piece in range(len(shards.pieces)) for d in shards.piece_documents(piece)]
    assert sorted(texts(training) + texts(shards.validation_documents)) == sorted(written)
    batch = next(shards.train_batches(seed=1))
    assert batch.shape == (2, 16) and batch.dtype == torch.long and int(batch.max()) < 257
    assert [b.shape for b in shards.validation_batches()] == [(2, 16), (2, 16)]
    return shards


def test_a_txt_file_splits_at_blank_lines(tmp_path: Path) -> None:
    written = [f"paragraph {i}\nwith two lines" for i in range(6)]
    (tmp_path / "book.txt").write_text("\n\n".join(written) + "\n\n\n")
    (tmp_path / "more.txt").write_text("\n".join(["", "second file", "", "", "its second paragraph", ""]))
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    check_loads(local_cfg(tmp_path), written + ["second file", "its second paragraph"])


def test_a_jsonl_file_in_byte_ranges_gives_every_line_once(tmp_path: Path) -> None:
    written = [f"record {i} body " + "x" * (i % 50) for i in range(5000)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(written)))
    shards = check_loads(local_cfg(path, text_field="body", num_shards=4), written)
    assert len(shards.pieces) >= 8 and {p.kind for p in shards.pieces} == {"lines"}
    with pytest.raises(UserError, match="no field 'text'"):
        TextShards(local_cfg(path), ByteTokenizer(), 0)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(UserError, match="bad.jsonl' at byte 17 is not a JSON line"):
        TextShards(local_cfg(tmp_path / "bad.jsonl"), ByteTokenizer(), 0)


def test_local_parquet_and_json_files(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    written = [f"parquet row {i} " * 3 for i in range(8)]
    pq.write_table(pa.table({"text": written}), tmp_path / "data.parquet", row_group_size=2)
    shards = check_loads(local_cfg(tmp_path / "data.parquet"), written)
    assert {p.kind for p in shards.pieces} == {"parquet"}
    rows = [f"json record {i}" for i in range(5)]
    (tmp_path / "rows.json").write_text(json.dumps([{"text": t} for t in rows]))
    check_loads(local_cfg(tmp_path / "rows.json"), rows)


def test_missing_path_is_a_one_line_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist") as info:
        TextShards(local_cfg(tmp_path / "nope"), ByteTokenizer(), 0)
    assert "\n" not in str(info.value)
    (tmp_path / "only.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="no .txt"):
        TextShards(local_cfg(tmp_path), ByteTokenizer(), 0)
    (tmp_path / "one.txt").write_text("a single paragraph, so a single document\n")
    with pytest.raises(UserError, match="all of them validation"):
        TextShards(local_cfg(tmp_path / "one.txt"), ByteTokenizer(), 0)


def test_empty_shard_and_bad_index_are_user_errors(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("only one training document, maybe\n\nand one more")
    cfg = local_cfg(tmp_path, num_shards=64)
    with pytest.raises(UserError, match="lower data.num_shards"):
        TextShards(cfg, ByteTokenizer(), 1)
    with pytest.raises(UserError, match="shard index"):
        TextShards(cfg, ByteTokenizer(), 64)
    assert StridedPieces(5, 1, 2).pieces == [1, 3]


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


def test_a_hub_dataset_is_read_by_file_shard_and_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed dataset of 3 file shards, cut in parts by row so that there are 2 × num_shards pieces at least:
    every row is in exactly one piece (datasets' own IterableDataset, made offline)."""
    import datasets

    import p2ptrain.corpus

    def rows(files: list[int]):  # type: ignore[no-untyped-def]
        for file in files:
            for row in range(10):
                yield {"text": f"file {file} row {row}"}

    def fake_stream(label: str) -> datasets.IterableDataset:
        assert label == "hf:some/dataset"
        return datasets.IterableDataset.from_generator(rows, gen_kwargs={"files": [0, 1, 2]})

    monkeypatch.setattr(p2ptrain.corpus, "_hub_stream", fake_stream)
    cfg = DataConfig(dataset="hf:some/dataset", num_shards=4, val_fraction=0.1, seq_len=8, batch_size=2)
    shards = TextShards(cfg, ByteTokenizer(), 1)
    assert len(shards.pieces) == 9 and {(p.start, p.stop, p.parts) for p in shards.pieces} >= {(2, 3, 3)}
    everything = texts(all_documents(shards))
    assert everything == sorted(f"file {f} row {r}" for f in range(3) for r in range(10))
    assert next(shards.train_batches(seed=0)).shape == (2, 8)


def test_validation_holds_at_least_the_text_its_batches_read() -> None:
    documents = [Document(f"d{i}", f"document {i} " * 10) for i in range(100)]
    scores = [int.from_bytes(hashlib.sha1(d.text.encode()).digest()[:8], "big") for d in documents]
    by_score = [documents[i] for i in sorted(range(100), key=scores.__getitem__)]
    chosen = choose_validation(documents, val_fraction=1e-9, min_chars=1000)
    assert sum(len(d.text) for d in chosen) >= 1000 and set(map(id, chosen)) == set(map(id, by_score[:len(chosen)]))
    assert len(choose_validation(documents, 1e-9, min_chars=10**9)) == 50  # never more than half
    assert choose_validation(documents[:1], 0.5, min_chars=10**9) == documents[:1]


def test_an_empty_document_is_left_out_of_the_token_stream() -> None:
    """The stdlib corpus holds empty files (`__init__.py`): a piece of them once crashed a node's worker."""
    documents = [Document("a", "ab"), Document("empty", ""), Document("b", "c")]
    eos = ByteTokenizer().eos_token_id
    assert tokenize_stream(documents, ByteTokenizer()).tolist() == [97, 98, eos, 99, eos]
    assert tokenize_stream([Document("empty", "")], ByteTokenizer()).numel() == 0
