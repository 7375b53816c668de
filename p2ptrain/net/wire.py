"""Tensors on the wire: split serialized tensors into bounded chunks and reassemble them, refusing oversize streams.

Every byte here comes from an untrusted peer: reassembly stops at a byte limit and a per-chunk deadline, and a
stream that ends mid-tensor is an error, never a half tensor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar

from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

CHUNK_BYTES = 2**20  # bytes of tensor data per stream message
MAX_METADATA_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = CHUNK_BYTES + MAX_METADATA_BYTES  # our largest stream message (its protobuf envelope aside)

M = TypeVar("M")


class WireError(ValueError):
    """A peer's stream was malformed, oversize, truncated or late."""


class WireTimeout(WireError):
    """A peer sent nothing within the deadline: it stalled, or its link is slower than we serve."""


class WireOversize(WireError):
    """A peer sent, or announced, more bytes than it may."""


class WireTruncated(WireError):
    """A peer's stream ended before the bytes it announced (honest initiators do this when they give up)."""


def stream_parts(
    serialized: Sequence[runtime_pb2.Tensor], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[runtime_pb2.Tensor]:
    """Chunks of every serialized tensor in order; the first chunk of each tensor carries its dtype."""
    for tensor in serialized:
        yield from split_for_streaming(tensor, chunk_bytes)


def payload_bytes(payload: Sequence[runtime_pb2.Tensor]) -> int:
    """The tensor data a payload carries, in bytes (what a codec produced, its own headers included): the one
    measure of what peers send, which offers announce, reassembly counts, and deadlines, link speeds and metrics
    use. The protobuf envelope around each chunk is not counted."""
    return sum(len(t.buffer) for t in payload)


async def read_tensors(
    messages: AsyncIterator[M],
    get_part: Callable[[M], runtime_pb2.Tensor | None],
    max_bytes: int,
    chunk_timeout_s: float,
    *,
    first: M | None = None,
    exact_bytes: int | None = None,
    on_message: Callable[[M], None] | None = None,
) -> list[runtime_pb2.Tensor]:
    """Reassemble serialized tensors from a peer's stream of messages, each carrying at most one tensor chunk.

    The one loop that reads tensors from a peer. `first` is a message already taken from the stream. With
    `exact_bytes` (what the peer announced, already checked against our limit) reading stops once that much tensor
    data has arrived, since the stream goes on with other messages, and a stream that ends earlier is an error;
    without it, reading goes to the end of the stream. More tensor data than `max_bytes` (or than announced), or
    `chunk_timeout_s` without a message, is a WireError: nothing is allocated past the limit.
    """
    limit = max_bytes if exact_bytes is None else min(exact_bytes, max_bytes)
    tensors: list[runtime_pb2.Tensor] = []
    parts: list[runtime_pb2.Tensor] = []
    received = 0
    message = first
    while True:
        if message is not None:
            if on_message is not None:
                on_message(message)
            part = get_part(message)
            if part is not None and part.ByteSize():
                received += len(part.buffer)
                if received > limit:
                    raise WireOversize(f"peer sent more than the {limit} bytes expected")
                if part.dtype and parts:
                    tensors.append(combine_from_streaming(parts))
                    parts = []
                parts.append(part)
        if exact_bytes is not None and received == exact_bytes:
            break
        try:
            message = await asyncio.wait_for(messages.__anext__(), timeout=chunk_timeout_s)
        except StopAsyncIteration:
            if exact_bytes is not None:
                raise WireTruncated(f"stream ended after {received} of {exact_bytes} bytes") from None
            break
        except asyncio.TimeoutError:
            raise WireTimeout(f"peer sent nothing for {chunk_timeout_s:.1f} s") from None
    if parts:
        tensors.append(combine_from_streaming(parts))
    return tensors


async def drain(messages: AsyncIterator[Any], timeout_s: float) -> None:
    """Read (and drop) what a peer still sends until it ends its side of the stream, for at most `timeout_s`.

    Why: when a handler returns, hivemind closes our end of the stream; if the peer's data still arrives then
    (the rest of a payload we refused, its end-of-stream after the commit), p2pd resets the stream and our last
    message in flight (the refusal, the ack) is lost.
    """
    async def read_to_end() -> None:
        async for _ in messages:
            pass

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(read_to_end(), timeout_s)


def encode_metadata(metadata: dict[str, Any]) -> bytes:
    return json.dumps(metadata, sort_keys=True).encode()


def metadata_message(metadata: dict[str, Any]) -> averaging_pb2.DownloadData:
    """A stream message that carries metadata alone (a refusal, a notice, a commit)."""
    return averaging_pb2.DownloadData(metadata=encode_metadata(metadata))


def refusal(reason: str) -> averaging_pb2.DownloadData:
    """The one way any of our services says no to a stream (exchange, relay, state sketches)."""
    return metadata_message({"status": "refused", "reason": reason})


def decode_metadata(raw: bytes) -> dict[str, Any]:
    """Metadata is JSON (never pickle: peers are untrusted) and small."""
    if len(raw) > MAX_METADATA_BYTES:
        raise WireOversize(f"metadata of {len(raw)} bytes exceeds {MAX_METADATA_BYTES}")
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"metadata is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise WireError("metadata is not a JSON object")
    return value
