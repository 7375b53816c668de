"""Data stage: a corpus split by document into one shared validation split and disjoint training shards.

Every peer reads the same capped corpus in the same order and assigns each document by the sha1 of its text,
so the validation split is identical on all peers and no document is in two places. A peer trains on one
shard (an explicit index, or `shard_for_peer` of its key) and tokenizes only that shard and the validation
split, lazily, caching the tokens in memory. Nothing here touches the network unless `dataset` is `hf:...`
or `tokenizer` names a hub model.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from p2ptrain.errors import ConfigError, UserError, one_line

STDLIB_DATASET = "stdlib"
HUB_PREFIX = "hf:"
BYTE_TOKENIZER = "bytes"
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from, how it is tokenized, and how it is cut into samples and shards."""

    dataset: str = STDLIB_DATASET  # "stdlib" (this Python's .py sources), a local file/dir, or "hf:<name>[:<config>]"
    text_field: str = "text"  # column holding the document text in .jsonl/.json/.parquet and hub datasets
    tokenizer: str = BYTE_TOKENIZER  # "bytes" (no download), else a hub id or local path for AutoTokenizer
    seq_len: int = 128  # tokens per sample
    batch_size: int = 8  # samples per inner step
    max_corpus_bytes: int = 8_000_000  # UTF-8 bytes of text read from the dataset, in its order, before splitting
    val_fraction: float = 0.02  # expected fraction of documents in the shared validation split, in (0, 1)
    val_batches: int = 4  # batches returned by validation_batches(); 0 disables validation
    num_shards: int = 64  # disjoint training shards, split by document

    def __post_init__(self) -> None:
        for name in ("dataset", "text_field", "tokenizer"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"data.{name} must be a non-empty string, got {value!r}")
        if self.dataset.startswith(HUB_PREFIX) and not self.dataset[len(HUB_PREFIX) :].split(":")[0]:
            raise ConfigError(f"data.dataset {self.dataset!r} names no hub dataset; write 'hf:<name>[:<config>]'")
        _require_int("seq_len", self.seq_len, 2)
        _require_int("batch_size", self.batch_size, 1)
        _require_int("max_corpus_bytes", self.max_corpus_bytes, 1)
        _require_int("val_batches", self.val_batches, 0)
        _require_int("num_shards", self.num_shards, 1)
        fraction = self.val_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 < fraction < 1.0:
            raise ConfigError(
                f"data.val_fraction must be a number strictly between 0 and 1 (e.g. 0.02), got {fraction}"
            )


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"data.{name} must be an integer >= {minimum}, got {value!r}")


# ----------------------------------------------------------------------------------------------- tokenizers


class Tokenizer(Protocol):
    """What the data stage needs from a tokenizer: ids in [0, vocab_size), one of them ending documents."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus id 256 marking the end of a document."""

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eos_token_id(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; EOS ids become newlines, invalid UTF-8 becomes U+FFFD."""
        data = bytes(10 if i == self.eos_token_id else i for i in ids)
        return data.decode("utf-8", errors="replace")


class PretrainedTokenizer:
    """A transformers tokenizer seen through the `Tokenizer` protocol (no special tokens added to documents)."""

    def __init__(self, name: str, inner: Any) -> None:
        eos = inner.eos_token_id if inner.eos_token_id is not None else inner.sep_token_id
        if eos is None:
            raise UserError(f"tokenizer {name!r} has neither an EOS nor a SEP token; pick a tokenizer that has one")
        self._inner = inner
        self._eos_token_id = int(eos)
        self._vocab_size = max(len(inner), self._eos_token_id + 1)

    @property
    def inner(self) -> Any:
        """The transformers tokenizer itself (what an exported model ships with)."""
        return self._inner

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._inner(text, add_special_tokens=False, verbose=False)["input_ids"])

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._inner.decode(list(ids)))


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The byte tokenizer, or `cfg.tokenizer` loaded with AutoTokenizer (a local path never touches the hub)."""
    if cfg.tokenizer == BYTE_TOKENIZER:
        return ByteTokenizer()
    local_path = Path(cfg.tokenizer).expanduser()
    looks_like_path = local_path.exists() or cfg.tokenizer.startswith(("/", ".", "~"))
    hint = f"use '{BYTE_TOKENIZER}', a local tokenizer directory, or a hub id"
    if looks_like_path and not local_path.exists():
        raise UserError(f"cannot load tokenizer {cfg.tokenizer!r}: no such path; {hint}")
    try:
        from transformers import AutoTokenizer

        inner = AutoTokenizer.from_pretrained(
            str(local_path) if looks_like_path else cfg.tokenizer, local_files_only=looks_like_path
        )
    except Exception as exc:  # transformers raises OSError, ValueError, HFValidationError, ...
        raise UserError(f"cannot load tokenizer {cfg.tokenizer!r}: {one_line(exc)}; {hint}") from exc
    return PretrainedTokenizer(cfg.tokenizer, inner)


# ----------------------------------------------------------------------------------------------- documents


@dataclass(frozen=True)
class Document:
    """One unit of the split: a source file, a JSON record, a parquet row."""

    name: str  # where it came from, for messages only
    text: str


def load_documents(cfg: DataConfig) -> list[Document]:
    """Non-empty documents of `cfg.dataset` in the source's order, truncated at `cfg.max_corpus_bytes` bytes."""
    documents: list[Document] = []
    remaining_bytes = cfg.max_corpus_bytes
    for document in _iter_documents(cfg):
        if not document.text:
            continue
        encoded = document.text.encode("utf-8")
        if len(encoded) > remaining_bytes:
            text = encoded[:remaining_bytes].decode("utf-8", errors="ignore")
            documents.append(Document(document.name, text))
            break
        documents.append(document)
        remaining_bytes -= len(encoded)
        if remaining_bytes == 0:
            break
    if not documents:
        raise UserError(
            f"dataset {cfg.dataset!r} holds no non-empty text in field {cfg.text_field!r}; "
            "point data.dataset at text or set data.text_field"
        )
    return documents


def _iter_documents(cfg: DataConfig) -> Iterator[Document]:
    if cfg.dataset == STDLIB_DATASET:
        return _iter_stdlib_documents()
    if cfg.dataset.startswith(HUB_PREFIX):
        return _iter_hub_documents(cfg)
    return _iter_local_documents(cfg)


def _iter_stdlib_documents() -> Iterator[Document]:
    """This interpreter's standard-library .py files, by sorted relative path (other Pythons give other text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    relative_paths: list[str] = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _SKIPPED_STDLIB_DIRS]
        relative_dir = Path(directory).relative_to(root)
        relative_paths.extend((relative_dir / f).as_posix() for f in files if f.endswith(".py"))
    for relative_path in sorted(relative_paths):
        text = (root / relative_path).read_bytes().decode("utf-8", errors="replace")
        yield Document(f"stdlib/{relative_path}", text)


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in LOCAL_BUILDERS)
    supported = [p for p in files if p.suffix.lower() in LOCAL_BUILDERS]
    if not supported:
        raise UserError(f"no .txt/.jsonl/.json/.parquet files at '{path}'; point data.dataset at such files")
    return supported


def _iter_local_documents(cfg: DataConfig) -> Iterator[Document]:
    """Files loaded with `datasets` (streamed, so no arrow cache is written); each .txt file is one document."""
    path = Path(cfg.dataset).expanduser()
    if not path.exists():
        raise UserError(
            f"dataset path '{path}' does not exist; use '{STDLIB_DATASET}', 'hf:<name>[:<config>]', "
            "or an existing .txt/.jsonl/.json/.parquet file or directory"
        )
    files_by_builder: dict[str, list[str]] = {}
    for file in _local_files(path):
        files_by_builder.setdefault(LOCAL_BUILDERS[file.suffix.lower()], []).append(str(file))
    for builder in sorted(files_by_builder):
        extra = {"sample_by": "document"} if builder == "text" else {}
        field = "text" if builder == "text" else cfg.text_field
        rows = _stream_dataset(cfg.dataset, builder, None, data_files=files_by_builder[builder], **extra)
        yield from _documents_from_rows(rows, field, f"{cfg.dataset}:{builder}")


def _iter_hub_documents(cfg: DataConfig) -> Iterator[Document]:
    name, _, config = cfg.dataset[len(HUB_PREFIX) :].partition(":")
    rows = _stream_dataset(cfg.dataset, name, config or None)
    yield from _documents_from_rows(rows, cfg.text_field, cfg.dataset)


def _stream_dataset(label: str, path: str, config: str | None, **kwargs: Any) -> Iterator[dict[str, Any]]:
    """Rows of the train split, streamed; loading and reading errors become one-line UserErrors."""
    try:
        import datasets

        stream = datasets.load_dataset(path, config, split="train", streaming=True, **kwargs)
        yield from stream
    except UserError:
        raise
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, ConnectionError, arrow errors, ...
        raise UserError(f"cannot read dataset {label!r}: {one_line(exc)}; check its name, path and format") from exc


def _documents_from_rows(rows: Iterable[dict[str, Any]], field: str, label: str) -> Iterator[Document]:
    for index, row in enumerate(rows):
        if field not in row:
            raise UserError(f"dataset {label!r} has no field {field!r} (fields: {sorted(row)}); set data.text_field")
        text = row[field]
        if not isinstance(text, str):
            raise UserError(
                f"dataset {label!r} field {field!r} holds {type(text).__name__}, not text; "
                "set data.text_field to a string column"
            )
        yield Document(f"{label}#{index}", text)


# ----------------------------------------------------------------------------------------------- splitting

VALIDATION_SPLIT = -1  # the split id of validation documents; training shards are 0..num_shards-1


def _digest(text: str) -> bytes:
    return hashlib.sha1(text.encode("utf-8")).digest()


def _validation_score(digest: bytes) -> float:
    """A uniform number in [0, 1) from the first 8 digest bytes; below val_fraction means validation."""
    return int.from_bytes(digest[:8], "big") / 2.0**64


def assign_splits(documents: list[Document], val_fraction: float, num_shards: int) -> list[int]:
    """Split id per document: VALIDATION_SPLIT or a training shard, from the sha1 of the text alone.

    If no document scores below `val_fraction` (a tiny corpus), the lowest-scoring one is validation, so
    validation is never empty while training keeps the rest; the choice is still the same on every peer.
    """
    digests = [_digest(d.text) for d in documents]
    scores = [_validation_score(d) for d in digests]
    splits = [int.from_bytes(d[8:16], "big") % num_shards for d in digests]
    validation = [i for i, score in enumerate(scores) if score < val_fraction]
    if not validation:
        validation = [min(range(len(scores)), key=scores.__getitem__)]
    for index in validation:
        splits[index] = VALIDATION_SPLIT
    return splits


def shard_for_peer(peer_key: str, num_shards: int) -> int:
    """A stable training shard for a volunteer with no assigned index: sha1 of its key modulo num_shards."""
    if not isinstance(peer_key, str) or not peer_key:
        raise UserError(f"peer key must be a non-empty string to pick a data shard, got {peer_key!r}")
    _require_int("num_shards", num_shards, 1)
    return int.from_bytes(hashlib.sha1(peer_key.encode("utf-8")).digest()[:8], "big") % num_shards


def tokenize_stream(documents: Iterable[Document], tokenizer: Tokenizer) -> torch.Tensor:
    """All documents' tokens concatenated, each followed by EOS, as a 1-D int64 tensor."""
    ids: list[int] = []
    for document in documents:
        ids.extend(tokenizer.encode(document.text))
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _windows(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Rows stream[start : start + seq_len], wrapping around the end so a short stream still fills a row."""
    offsets = torch.arange(seq_len, dtype=torch.long)
    return stream[(starts.unsqueeze(1) + offsets) % stream.numel()]


class TextShards:
    """One peer's view of the corpus: its training shard and the shared validation split."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, shard_index: int) -> None:
        if isinstance(shard_index, bool) or not isinstance(shard_index, int) or not 0 <= shard_index < cfg.num_shards:
            raise UserError(
                f"data shard index must be an integer in [0, {cfg.num_shards}), got {shard_index!r}; "
                "use a smaller index or raise data.num_shards"
            )
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.shard_index = shard_index
        documents = load_documents(cfg)
        splits = assign_splits(documents, cfg.val_fraction, cfg.num_shards)
        self.train_documents = [d for d, s in zip(documents, splits, strict=True) if s == shard_index]
        self.validation_documents = [d for d, s in zip(documents, splits, strict=True) if s == VALIDATION_SPLIT]
        num_training = len(documents) - len(self.validation_documents)
        if not self.train_documents:
            raise UserError(
                f"training shard {shard_index} of {cfg.num_shards} got no documents (the corpus has "
                f"{num_training} training documents); lower data.num_shards or raise max_corpus_bytes"
            )
        self._train_stream: torch.Tensor | None = None
        self._validation: list[torch.Tensor] | None = None

    def train_stream(self) -> torch.Tensor:
        """This shard's tokens (documents joined by EOS), tokenized on first use and cached in memory."""
        if self._train_stream is None:
            self._train_stream = tokenize_stream(self.train_documents, self.tokenizer)
        return self._train_stream

    def train_batches(self, seed: int) -> Iterator[torch.Tensor]:
        """Endless [batch_size, seq_len] int64 batches of windows at random offsets; the same seed, the same batches."""
        stream = self.train_stream()
        num_starts = max(stream.numel() - self.cfg.seq_len + 1, 1)
        generator = torch.Generator().manual_seed(seed)
        while True:
            starts = torch.randint(0, num_starts, (self.cfg.batch_size,), generator=generator)
            yield _windows(stream, starts, self.cfg.seq_len)

    def validation_batches(self) -> list[torch.Tensor]:
        """`val_batches` fixed batches of windows spread evenly over the validation split, the same on every peer."""
        if self._validation is None:
            self._validation = self._build_validation_batches()
        return self._validation

    def _build_validation_batches(self) -> list[torch.Tensor]:
        cfg = self.cfg
        if cfg.val_batches == 0:
            return []
        stream = tokenize_stream(self.validation_documents, self.tokenizer)
        num_windows = cfg.val_batches * cfg.batch_size
        last_start = max(stream.numel() - cfg.seq_len, 0)
        starts = torch.arange(num_windows, dtype=torch.long) * last_start // max(num_windows - 1, 1)
        return list(_windows(stream, starts, cfg.seq_len).split(cfg.batch_size))
