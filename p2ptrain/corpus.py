"""Where the text comes from: a dataset cut into pieces that a peer reads one at a time, never whole.

A piece is the unit peers claim and read (data.py orders them): a byte range of a .jsonl or .txt file (the lines
that start in it), a run of parquet row groups, a run of whole files (stdlib sources smaller than a piece, .json
files), a byte range of a larger stdlib source, or one of a hub dataset's file shards. The table of pieces is
made from file sizes and metadata alone, the same on every peer that has the same files, so a piece index means
the same text everywhere. Reading a piece streams its documents; memory is one piece's text at most.

Documents: a .jsonl line or parquet row is one (its `text_field`), a stdlib .py file is one (the part of it in a
piece, for one cut in parts), and a .txt file splits at blank lines: a run of non-blank lines is one document (a
piece's edge cuts a document in two).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2ptrain.errors import UserError, one_line

STDLIB_DATASET = "stdlib"
HUB_PREFIX = "hf:"
LINE_SUFFIXES = {".txt": "text", ".jsonl": "jsonl"}
WHOLE_FILE_SUFFIXES = {".json"}
PARQUET_SUFFIX = ".parquet"
SUPPORTED_SUFFIXES = (*LINE_SUFFIXES, *WHOLE_FILE_SUFFIXES, PARQUET_SUFFIX)
MIN_PIECE_BYTES = 16 * 1024  # below this a piece is mostly per-piece overhead (a DHT claim, a shuffle)
MAX_PIECES = 65_536  # pieces of one run: bounds the claim keys (net/data_claims.py) and the table
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "__pycache__"}
DIGEST_SAMPLED_FILES = 1024  # corpus_digest reads windows of this many files at most (spread over the list)
DIGEST_WINDOW_BYTES = 16 * 1024  # ... each file's first, middle and last window of the bytes its pieces read


@dataclass(frozen=True)
class Document:
    """One unit of text: a .jsonl line, a parquet row, a stdlib file, a paragraph run of a .txt file."""

    name: str  # where it came from, for messages only
    text: str


@dataclass(frozen=True)
class Piece:
    """A part of the dataset read as a whole: `kind` says how `start`/`stop` index into `sources`."""

    kind: str  # "lines" (byte range of one file), "parquet" (row groups), "files" (whole files), "hub" (a file shard)
    sources: tuple[str, ...]  # the files it reads (a hub piece: the dataset's label)
    start: int  # lines: first byte; parquet: first row group; hub: shard index; files: 0
    stop: int  # lines: byte after the last; parquet: row group after the last; hub: the number of shards
    nbytes: int  # its size on disk, about the text it holds (hub: unknown, 0)
    part: int = 0  # hub: of a shard's rows, those whose index is `part` modulo `parts`
    parts: int = 1


@dataclass(frozen=True)
class CorpusSource:
    """What the piece table needs of the data config (data.DataConfig carries these)."""

    dataset: str
    text_field: str
    max_corpus_bytes: int  # 0: the whole dataset
    piece_bytes: int
    min_pieces: int  # cut pieces small enough that there are at least this many (when the data allows)


def piece_table(source: CorpusSource) -> list[Piece]:
    """The dataset's pieces in its order, after the byte cap; a UserError when it holds nothing readable."""
    if source.dataset.startswith(HUB_PREFIX):
        pieces = _hub_pieces(source)
    else:
        files = _stdlib_files() if source.dataset == STDLIB_DATASET else _local_files(source.dataset)
        sizes = [(path, path.stat().st_size) for path in files]
        total = sum(size for _, size in sizes)
        if source.max_corpus_bytes:
            total = min(total, source.max_corpus_bytes)
        target = max(MIN_PIECE_BYTES, math.ceil(total / MAX_PIECES),
                     min(source.piece_bytes, total // max(source.min_pieces, 1)))
        pieces = _file_pieces(sizes, target, total, whole_files=source.dataset == STDLIB_DATASET)
    if not pieces:
        raise UserError(f"dataset {source.dataset!r} holds no text; point data.dataset at text files")
    return pieces


def corpus_digest(source: CorpusSource) -> str:
    """What identifies this copy of the dataset's text, "" for a hub dataset (the hub names it). Two copies with one
    digest have one piece table (files by their path under the dataset, byte ranges, sizes), so a piece index means
    the same text on both. Content is sampled, not read whole (a peer's start would read a large dataset): three
    windows of every file up to DIGEST_SAMPLED_FILES, within the bytes its pieces read, so an edit that keeps every
    size is caught where it falls in a window."""
    if source.dataset.startswith(HUB_PREFIX):
        return ""
    root = Path(sysconfig.get_paths()["stdlib"]) if source.dataset == STDLIB_DATASET else Path(source.dataset)
    digest = hashlib.sha256(b"p2ptrain-corpus-v1")
    read_up_to: dict[str, int] = {}  # each file: the end of the bytes its pieces read
    for piece in piece_table(source):
        names = [Path(name).relative_to(root.expanduser()).as_posix() for name in piece.sources]
        digest.update(json.dumps([piece.kind, names, piece.start, piece.stop, piece.nbytes]).encode())
        for name in piece.sources:
            end = piece.stop if piece.kind == "lines" else os.path.getsize(name)
            read_up_to[name] = max(read_up_to.get(name, 0), end)
    files = list(read_up_to)
    step = max(1.0, len(files) / DIGEST_SAMPLED_FILES)
    for name in dict.fromkeys(files[int(i * step)] for i in range(min(len(files), DIGEST_SAMPLED_FILES))):
        end = read_up_to[name]
        with open(name, "rb") as f:
            for offset in sorted({0, max(0, end // 2 - DIGEST_WINDOW_BYTES // 2), max(0, end - DIGEST_WINDOW_BYTES)}):
                f.seek(offset)
                digest.update(f.read(min(DIGEST_WINDOW_BYTES, end - offset)))
    return digest.hexdigest()[:32]


def _file_pieces(sizes: list[tuple[Path, int]], target: int, budget: int, whole_files: bool) -> list[Piece]:
    pieces: list[Piece] = []
    group: list[str] = []
    group_bytes = 0

    def close_group() -> None:
        nonlocal group, group_bytes
        if group:
            pieces.append(Piece("files", tuple(group), 0, 0, group_bytes))
            group, group_bytes = [], 0

    for path, size in sizes:
        if budget <= 0:
            break
        suffix, whole_size = path.suffix.lower(), size
        size = size if suffix in WHOLE_FILE_SUFFIXES else min(size, budget)  # a .json file counts whole
        if suffix == PARQUET_SUFFIX:
            close_group()
            pieces.extend(_parquet_pieces(path, target, size))
        elif suffix in WHOLE_FILE_SUFFIXES or (whole_files and size == whole_size and size < target):
            group.append(str(path))
            group_bytes += size
            if group_bytes >= target:
                close_group()
        else:  # a .jsonl or .txt file, or a stdlib file too large for one piece (or cut by the cap): byte ranges
            close_group()
            pieces.extend(Piece("lines", (str(path),), start, min(start + target, size), min(target, size - start))
                          for start in range(0, size, target))
        budget -= size
    close_group()
    return pieces


def _parquet_pieces(path: Path, target: int, budget: int) -> list[Piece]:
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise UserError(f"cannot read parquet file '{path}': {one_line(exc)}") from exc
    pieces: list[Piece] = []
    first, group_bytes = 0, 0
    for index in range(metadata.num_row_groups):
        if budget <= 0:
            break
        size = metadata.row_group(index).total_byte_size
        group_bytes += size
        budget -= size
        if group_bytes >= target or budget <= 0 or index + 1 == metadata.num_row_groups:
            pieces.append(Piece("parquet", (str(path),), first, index + 1, group_bytes))
            first, group_bytes = index + 1, 0
    return pieces


def _hub_pieces(source: CorpusSource) -> list[Piece]:
    """A piece per file shard of the dataset; a dataset of fewer shards than `min_pieces` has each cut in parts by
    row index (a reader of one part streams its whole shard, and keeps its part)."""
    stream = _hub_stream(source.dataset)
    shards = min(max(int(getattr(stream, "n_shards", 1) or 1), 1), MAX_PIECES)
    parts = max(1, min(math.ceil(source.min_pieces / shards), MAX_PIECES // shards))
    return [Piece("hub", (source.dataset,), index, shards, 0, part, parts)
            for index in range(shards) for part in range(parts)]


def _hub_stream(label: str) -> Any:
    name, _, config = label[len(HUB_PREFIX):].partition(":")
    try:
        import datasets

        return datasets.load_dataset(name, config or None, split="train", streaming=True)
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, ConnectionError, ...
        raise UserError(f"cannot read dataset {label!r}: {one_line(exc)}; check its name and config") from exc


def _stdlib_files() -> list[Path]:
    """This interpreter's standard-library .py files, by sorted relative path (other Pythons give other text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    relative_paths: list[str] = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _SKIPPED_STDLIB_DIRS]
        relative_dir = Path(directory).relative_to(root)
        relative_paths.extend((relative_dir / f).as_posix() for f in files if f.endswith(".py"))
    return [root / relative_path for relative_path in sorted(relative_paths)]


def _local_files(dataset: str) -> list[Path]:
    path = Path(dataset).expanduser()
    if not path.exists():
        raise UserError(f"dataset path '{path}' does not exist; use '{STDLIB_DATASET}', 'hf:<name>[:<config>]', "
                        "or an existing .txt/.jsonl/.json/.parquet file or directory")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    supported = [p for p in files if p.suffix.lower() in SUPPORTED_SUFFIXES]
    if not supported:
        raise UserError(f"no .txt/.jsonl/.json/.parquet files at '{path}'; point data.dataset at such files")
    return supported


# ----------------------------------------------------------------------------------------------- reading


def read_piece(piece: Piece, text_field: str) -> Iterator[Document]:
    """The piece's non-empty documents, streamed; malformed input is a one-line UserError naming the file."""
    if piece.kind == "lines":
        path = piece.sources[0]
        if path.lower().endswith(".txt"):
            yield from _text_documents(path, piece.start, piece.stop)
        elif path.lower().endswith(".jsonl"):
            yield from _jsonl_documents(path, piece.start, piece.stop, text_field)
        else:  # a part of a stdlib source file: one document
            text = b"".join(line for _, line in _lines(path, piece.start, piece.stop)).decode("utf-8", "replace")
            if text:
                yield Document(f"{path}@{piece.start}", text)
    elif piece.kind == "parquet":
        yield from _parquet_documents(piece.sources[0], piece.start, piece.stop, text_field)
    elif piece.kind == "hub":
        stream = _hub_stream(piece.sources[0]).shard(num_shards=piece.stop, index=piece.start)
        rows = (row for index, row in enumerate(_guarded(stream, piece.sources[0]))
                if index % piece.parts == piece.part)
        yield from _row_documents(rows, text_field, piece.sources[0])
    else:
        for path in piece.sources:
            yield from _whole_file_documents(Path(path), text_field)


def _lines(path: str, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) for every line of the file that starts in [start, stop)."""
    try:
        with open(path, "rb") as file:
            if start > 0:
                file.seek(start - 1)
                file.readline()  # the line under way at `start` belongs to the piece before
            offset = file.tell()
            while offset < stop:
                line = file.readline()
                if not line:
                    return
                yield offset, line
                offset += len(line)
    except OSError as exc:
        raise UserError(f"cannot read '{path}': {one_line(exc)}") from exc


def _text_documents(path: str, start: int, stop: int) -> Iterator[Document]:
    paragraph: list[bytes] = []
    first = start
    for offset, line in _lines(path, start, stop):
        if line.strip():
            if not paragraph:
                first = offset
            paragraph.append(line)
        elif paragraph:
            yield Document(f"{path}@{first}", b"".join(paragraph).decode("utf-8", errors="replace").strip("\n"))
            paragraph = []
    if paragraph:
        yield Document(f"{path}@{first}", b"".join(paragraph).decode("utf-8", errors="replace").strip("\n"))


def _jsonl_documents(path: str, start: int, stop: int, text_field: str) -> Iterator[Document]:
    for offset, line in _lines(path, start, stop):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise UserError(f"'{path}' at byte {offset} is not a JSON line: {one_line(exc)}") from exc
        yield from _row_documents([row] if isinstance(row, dict) else [{}], text_field, f"{path}@{offset}")


def _parquet_documents(path: str, first: int, stop: int, text_field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        if text_field not in file.schema_arrow.names:
            raise UserError(f"dataset '{path}' has no field {text_field!r} (fields: {sorted(file.schema_arrow.names)});"
                            " set data.text_field")
        for batch in file.iter_batches(row_groups=list(range(first, stop)), columns=[text_field], batch_size=1024):
            yield from _row_documents(batch.to_pylist(), text_field, path)
    except UserError:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise UserError(f"cannot read parquet file '{path}': {one_line(exc)}") from exc


def _whole_file_documents(path: Path, text_field: str) -> Iterator[Document]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read '{path}': {one_line(exc)}") from exc
    if path.suffix.lower() != ".json":
        yield Document(str(path), raw.decode("utf-8", errors="replace"))
        return
    try:
        rows = json.loads(raw)
    except ValueError as exc:
        raise UserError(f"'{path}' is not JSON: {one_line(exc)}") from exc
    if isinstance(rows, dict):  # {"data": [...]} or {"text": [...]} shapes: the first list of rows or of texts
        lists = [value for value in rows.values() if isinstance(value, list)]
        rows = lists[0] if lists else [rows]
        if rows and all(isinstance(row, str) for row in rows):
            rows = [{text_field: row} for row in rows]
    if not isinstance(rows, list):
        raise UserError(f"'{path}' holds no list of records; write one JSON object per line (.jsonl)")
    yield from _row_documents((row if isinstance(row, dict) else {} for row in rows), text_field, str(path))


def _guarded(rows: Any, label: str) -> Iterator[dict[str, Any]]:
    try:
        yield from rows
    except Exception as exc:  # datasets raises ConnectionError, arrow errors, ...
        raise UserError(f"cannot read dataset {label!r}: {one_line(exc)}; check its name, path and format") from exc


def _row_documents(rows: Any, field: str, label: str) -> Iterator[Document]:
    for index, row in enumerate(rows):
        if field not in row:
            raise UserError(f"dataset {label!r} has no field {field!r} (fields: {sorted(row)}); set data.text_field")
        text = row[field]
        if not isinstance(text, str):
            raise UserError(f"dataset {label!r} field {field!r} holds {type(text).__name__}, not text; "
                            "set data.text_field to a string column")
        if text:
            yield Document(f"{label}#{index}", text)
