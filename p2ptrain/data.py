"""Data stage: a shared, fixed validation set and a stream of training batches read one piece at a time.

The dataset is cut into pieces (corpus.py). Validation is a fixed share of the first piece's documents, chosen by
the sha1 of their text, so it is the same on every peer and never trained on. Training reads whole pieces in an
order a `PieceOrder` gives: with `run.shard_index`, the pieces whose index is that shard modulo `data.num_shards`;
otherwise the swarm's claims (net/data_claims.py), so that peers read pieces nobody has read yet. A piece's tokens
are cut into seq_len windows, each used once in a shuffled order, before the next piece is read: a peer holds one
piece (and the validation set), whatever the dataset's size.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from p2ptrain.corpus import HUB_PREFIX, STDLIB_DATASET, CorpusSource, Document, Piece, piece_table, read_piece
from p2ptrain.errors import ConfigError, UserError, one_line

logger = logging.getLogger(__name__)

BYTE_TOKENIZER = "bytes"


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from, how it is tokenized, and how it is cut into samples and pieces."""

    dataset: str = STDLIB_DATASET  # "stdlib" (this Python's .py sources), a local file/dir, or "hf:<name>[:<config>]"
    text_field: str = "text"  # column holding the document text in .jsonl/.json/.parquet and hub datasets
    tokenizer: str = BYTE_TOKENIZER  # "bytes" (no download), else a hub id or local path for AutoTokenizer
    seq_len: int = 128  # tokens per sample
    batch_size: int = 8  # samples per inner step
    max_corpus_bytes: int = 0  # local and stdlib datasets: use only their first this many bytes (0: all of them)
    piece_bytes: int = 4_000_000  # about this many bytes of text to a piece, the unit a peer claims and reads whole
    val_fraction: float = 0.02  # share of the first piece's documents held out as the shared validation set, (0, 1)
    val_batches: int = 4  # batches returned by validation_batches(); 0 disables validation
    num_shards: int = 64  # with run.shard_index s: the peer reads the pieces whose index is s modulo this

    def __post_init__(self) -> None:
        for name in ("dataset", "text_field", "tokenizer"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"data.{name} must be a non-empty string, got {value!r}")
        if self.dataset.startswith(HUB_PREFIX) and not self.dataset[len(HUB_PREFIX) :].split(":")[0]:
            raise ConfigError(f"data.dataset {self.dataset!r} names no hub dataset; write 'hf:<name>[:<config>]'")
        _require_int("seq_len", self.seq_len, 2)
        _require_int("batch_size", self.batch_size, 1)
        _require_int("max_corpus_bytes", self.max_corpus_bytes, 0)
        _require_int("piece_bytes", self.piece_bytes, 1)
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


# ----------------------------------------------------------------------------------------------- validation


def _digest(text: str) -> bytes:
    return hashlib.sha1(text.encode("utf-8")).digest()


def _validation_score(digest: bytes) -> float:
    """A uniform number in [0, 1) from the first 8 digest bytes; below val_fraction means validation."""
    return int.from_bytes(digest[:8], "big") / 2.0**64


def choose_validation(documents: list[Document], val_fraction: float, min_chars: int = 0) -> list[Document]:
    """The documents scoring below `val_fraction`, by the sha1 of their text alone, then the next-lowest scoring
    ones while their text is shorter than `min_chars` (what the validation batches read), up to half of the
    documents; at least the lowest-scoring one. The same on every peer, in the documents' order."""
    if not documents:
        return []
    scores = [_validation_score(_digest(d.text)) for d in documents]
    ranked = sorted(range(len(documents)), key=scores.__getitem__)
    chosen: set[int] = set()
    chars = 0
    for rank, index in enumerate(ranked):
        enough = scores[index] >= val_fraction and (chars >= min_chars or rank >= len(documents) // 2)
        if chosen and enough:
            break
        chosen.add(index)
        chars += len(documents[index].text)
    return [d for i, d in enumerate(documents) if i in chosen]


def tokenize_stream(documents: Iterable[Document], tokenizer: Tokenizer,
                    dtype: torch.dtype = torch.long) -> torch.Tensor:
    """All documents' tokens concatenated, each followed by EOS, as a 1-D tensor. An empty document (an empty
    `__init__.py` of the stdlib corpus) holds nothing to learn and is left out."""
    parts: list[torch.Tensor] = []
    eos = torch.tensor([tokenizer.eos_token_id], dtype=dtype)
    for document in documents:
        if not document.text:
            continue
        if isinstance(tokenizer, ByteTokenizer):  # a fast path for the default: bytes are the ids
            parts.append(torch.frombuffer(bytearray(document.text.encode("utf-8")), dtype=torch.uint8).to(dtype))
        else:
            parts.append(torch.tensor(tokenizer.encode(document.text), dtype=dtype))
        parts.append(eos)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def _windows(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Rows stream[start : start + seq_len], wrapping around the end so a short stream still fills a row."""
    offsets = torch.arange(seq_len, dtype=torch.long)
    return stream[(starts.unsqueeze(1) + offsets) % stream.numel()]


# ----------------------------------------------------------------------------------------------- piece order


class PieceOrder(Protocol):
    """Which piece a peer reads next, out of `num_pieces`."""

    def next_piece(self) -> int: ...


class StridedPieces:
    """Pieces shard, shard + num_shards, shard + 2·num_shards, ..., then the same again: disjoint between shards."""

    def __init__(self, num_pieces: int, shard_index: int, num_shards: int) -> None:
        self.pieces = list(range(shard_index, num_pieces, num_shards))
        if not self.pieces:
            raise UserError(f"training shard {shard_index} of {num_shards} has no data: the dataset has only "
                            f"{num_pieces} pieces; lower data.num_shards or data.piece_bytes")
        self._next = 0

    def next_piece(self) -> int:
        piece = self.pieces[self._next % len(self.pieces)]
        self._next += 1
        return piece


def shard_for_peer(peer_key: str, num_shards: int) -> int:
    """A stable shard for a peer with no assigned index: sha1 of its key modulo num_shards."""
    if not isinstance(peer_key, str) or not peer_key:
        raise UserError(f"peer key must be a non-empty string to pick a data shard, got {peer_key!r}")
    _require_int("num_shards", num_shards, 1)
    return int.from_bytes(hashlib.sha1(peer_key.encode("utf-8")).digest()[:8], "big") % num_shards


# ----------------------------------------------------------------------------------------------- the stage


def corpus_source(cfg: DataConfig) -> CorpusSource:
    """The piece table's inputs: every peer of a run cuts the same pieces from the same files."""
    return CorpusSource(cfg.dataset, cfg.text_field, cfg.max_corpus_bytes, cfg.piece_bytes,
                        min_pieces=2 * cfg.num_shards)


class TextShards:
    """One peer's view of the data: the shared validation set and training batches, one piece in memory at a time."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, shard_index: int,
                 order_of: Callable[[int], PieceOrder] | None = None) -> None:
        """`order_of(number of pieces)`: the order to read pieces in, made anew by each `train_batches`; by default
        the pieces of `shard_index`."""
        if isinstance(shard_index, bool) or not isinstance(shard_index, int) or not 0 <= shard_index < cfg.num_shards:
            raise UserError(
                f"data shard index must be an integer in [0, {cfg.num_shards}), got {shard_index!r}; "
                "use a smaller index or raise data.num_shards"
            )
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.shard_index = shard_index
        self.pieces: list[Piece] = piece_table(corpus_source(cfg))
        first_piece = list(read_piece(self.pieces[0], cfg.text_field))
        self.validation_documents = choose_validation(first_piece, cfg.val_fraction,
                                                      min_chars=cfg.val_batches * cfg.batch_size * cfg.seq_len)
        self._held_out = {_digest(d.text) for d in self.validation_documents}
        if len(self.pieces) == 1 and len(first_piece) <= len(self.validation_documents):
            raise UserError(f"dataset {cfg.dataset!r} holds {len(first_piece)} document(s), all of them validation; "
                            "give it more documents (a .txt file splits at blank lines)")
        StridedPieces(len(self.pieces), shard_index, cfg.num_shards)  # a shard with no piece: refused now
        self.order_of: Callable[[int], PieceOrder] = order_of or functools.partial(
            StridedPieces, shard_index=shard_index, num_shards=cfg.num_shards)
        self.pieces_read: list[int] = []  # every piece this stage has read for training, in order
        self._validation: list[torch.Tensor] | None = None
        total = sum(p.nbytes for p in self.pieces)
        logger.info(f"data {cfg.dataset}: {len(self.pieces)} pieces, {total / 1e6:.1f} MB in all "
                    f"(~{total / len(self.pieces) / 1e6:.2f} MB a piece); validation: "
                    f"{len(self.validation_documents)} documents of the first piece")

    def piece_documents(self, index: int) -> list[Document]:
        """The training documents of piece `index`: its documents less the validation set."""
        return [d for d in read_piece(self.pieces[index], self.cfg.text_field) if _digest(d.text) not in self._held_out]

    def train_batches(self, seed: int) -> Iterator[torch.Tensor]:
        """Endless [batch_size, seq_len] int64 batches: each piece's seq_len windows once, shuffled, then the next
        piece. The same seed and the same piece order give the same batches."""
        cfg = self.cfg
        generator = torch.Generator().manual_seed(seed)
        order = self.order_of(len(self.pieces))
        carried = torch.zeros(0, cfg.seq_len, dtype=torch.int32)  # a piece's last rows, short of a batch
        while True:
            stream, starts = self._read_next_piece(order, generator)
            if carried.shape[0]:
                needed = cfg.batch_size - carried.shape[0]
                carried = torch.cat([carried, _windows(stream, starts[:needed], cfg.seq_len)])
                starts = starts[needed:]
                if carried.shape[0] == cfg.batch_size:
                    yield carried.long()
                    carried = carried[:0]
            whole = starts.numel() // cfg.batch_size * cfg.batch_size
            for first in range(0, whole, cfg.batch_size):
                yield _windows(stream, starts[first:first + cfg.batch_size], cfg.seq_len).long()
            carried = torch.cat([carried, _windows(stream, starts[whole:], cfg.seq_len)])
            del stream, starts  # one piece in memory at a time: this one goes before the next is read

    def _read_next_piece(self, order: PieceOrder, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The next piece's int32 tokens and the starts of its seq_len windows, shuffled."""
        seq_len = self.cfg.seq_len
        for _ in range(len(self.pieces) + 1):  # a piece with no training text (all validation): take another
            index = order.next_piece()
            documents = self.piece_documents(index)
            self.pieces_read.append(index)
            if documents:
                break
        else:
            raise UserError(f"dataset {self.cfg.dataset!r} has no training text outside its validation set")
        stream = tokenize_stream(documents, self.tokenizer, dtype=torch.int32)  # ids < 2**31: half of int64
        del documents
        logger.info(f"data: reading piece {index} of {len(self.pieces)} ({stream.numel():,} tokens)")
        count = max(stream.numel() // seq_len, 1)
        offset = int(torch.randint(0, max(stream.numel() - count * seq_len, 0) + 1, (1,), generator=generator))
        return stream, offset + torch.randperm(count, generator=generator) * seq_len

    def validation_batches(self) -> list[torch.Tensor]:
        """`val_batches` fixed batches of windows spread evenly over the validation set, the same on every peer."""
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
