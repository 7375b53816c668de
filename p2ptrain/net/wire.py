"""Tensors on the wire: split serialized tensors into bounded chunks and reassemble them, refusing oversize streams.

Every byte here comes from an untrusted peer: reassembly stops at a byte limit and a per-chunk deadline, and a
stream that ends mid-tensor is an error, never a half tensor.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar

from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

CHUNK_BYTES = 2**20  # bytes of tensor data per stream message
MAX_METADATA_BYTES = 64 * 1024

M = TypeVar("M")


class WireError(ValueError):
    """A peer's stream was malformed, oversize, truncated or late."""


def stream_parts(
    serialized: Sequence[runtime_pb2.Tensor], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[runtime_pb2.Tensor]:
    """Chunks of every serialized tensor in order; the first chunk of each tensor carries its dtype."""
    for tensor in serialized:
        yield from split_for_streaming(tensor, chunk_bytes)


async def collect_serialized(
    messages: AsyncIterator[M],
    get_part: Callable[[M], runtime_pb2.Tensor | None],
    max_total_bytes: int,
    chunk_timeout_s: float,
    on_message: Callable[[M], None] | None = None,
) -> list[runtime_pb2.Tensor]:
    """Reassemble serialized tensors from a stream of messages; each message may carry one tensor chunk."""
    tensors: list[runtime_pb2.Tensor] = []
    parts: list[runtime_pb2.Tensor] = []
    total_bytes = 0
    try:
        async for message in aiter_with_timeout(messages, timeout=chunk_timeout_s):
            if on_message is not None:
                on_message(message)
            part = get_part(message)
            if part is None or not part.ByteSize():
                continue
            total_bytes += len(part.buffer)
            if total_bytes > max_total_bytes:
                raise WireError(f"peer sent more than the {max_total_bytes} bytes expected")
            if part.dtype and parts:
                tensors.append(combine_from_streaming(parts))
                parts = []
            parts.append(part)
    except TimeoutError:
        raise WireError(f"peer sent nothing for {chunk_timeout_s:.1f} s") from None
    if parts:
        tensors.append(combine_from_streaming(parts))
    return tensors


def encode_metadata(metadata: dict[str, Any]) -> bytes:
    return json.dumps(metadata, sort_keys=True).encode()


def decode_metadata(raw: bytes) -> dict[str, Any]:
    """Metadata is JSON (never pickle: peers are untrusted) and small."""
    if len(raw) > MAX_METADATA_BYTES:
        raise WireError(f"metadata of {len(raw)} bytes exceeds {MAX_METADATA_BYTES}")
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"metadata is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise WireError("metadata is not a JSON object")
    return value
