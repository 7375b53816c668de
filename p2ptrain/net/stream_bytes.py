"""The bytes each node's libp2p streams carried, counted frame by frame as hivemind writes and reads them.

A round's metrics report these counts, not payload sizes or a formula: they include what the payloads leave out
(headers, refused and retried offers, 'held' notices, commits, digests, state downloads, relay legs, hivemind's
matchmaking) and they measure what a transport sends, where a formula (2·S·(n − 1)/n for an all-reduce) only says
what it should. hivemind writes each protobuf message of a stream as a marker byte, an 8-byte length and the
message (`P2P.send_protobuf`), and closes a request stream with an empty end-of-stream frame; this module counts
exactly those bytes on the two paths every stream takes:
- streams this node opens: `P2P._iterate_protobuf_stream_handler` (requests sent, responses received);
- streams it serves: the handler `P2P._add_protobuf_stream_handler` runs (requests received, responses sent).
Both are replaced once, at import (as net/frame_cap.py replaces the frame reader), and count into the counter of
the P2P's own peer id, so peers that share a process (tests) keep separate counts. Not counted: libp2p's own
framing under a stream (noise, yamux: a few % more on the wire, which `benchmarks/wire_bytes.py` measures from the
sockets), and the DHT's unary requests (they run in hivemind's DHT process).

Counters are in shared memory: hivemind's averager runs in a process forked from the peer's, on a replica of the
peer's P2P (same peer id), so its all-reduce traffic counts into the peer's counter when `counter_of` made that
counter before the fork (TrainingPeer does, first thing after its P2P starts).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import AsyncIterator, Callable
from typing import Any

from hivemind.p2p import P2P, P2PContext

FRAME_OVERHEAD = len(P2P.MESSAGE_MARKER) + P2P.HEADER_LEN  # before each message: its marker and its length
END_OF_STREAM_BYTES = FRAME_OVERHEAD + P2P.END_OF_STREAM.ByteSize()  # after a request stream's last message
SENT, RECEIVED = 0, 1


class StreamBytes:
    """Bytes sent and received on one node's streams since it started (shared with processes forked after)."""

    def __init__(self) -> None:
        self._counts = multiprocessing.Array("q", 2)  # with a lock: the averager's process adds to it too

    def add_(self, direction: int, nbytes: int) -> None:
        with self._counts.get_lock():
            self._counts[direction] += nbytes

    def totals(self) -> tuple[int, int]:
        with self._counts.get_lock():
            return self._counts[SENT], self._counts[RECEIVED]


@dataclasses.dataclass
class Traffic:
    """One node's stream bytes between two reads: `take_` returns (sent, received) since the last `take_`."""

    counter: StreamBytes
    _last: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        self._last = self.counter.totals()

    def take_(self) -> tuple[int, int]:
        now = self.counter.totals()
        sent, received = now[SENT] - self._last[SENT], now[RECEIVED] - self._last[RECEIVED]
        self._last = now
        return sent, received


_COUNTERS: dict[str, StreamBytes] = {}  # base58 peer id → its counter


def counter_of(peer_id: Any) -> StreamBytes:
    """The counter of the node with `peer_id` (a PeerID or its base58), made on first use."""
    key = peer_id if isinstance(peer_id, str) else peer_id.to_base58()
    if key not in _COUNTERS:
        _COUNTERS[key] = StreamBytes()
    return _COUNTERS[key]


def frame_bytes(message: Any) -> int:
    return FRAME_OVERHEAD + message.ByteSize()


async def counted(messages: AsyncIterator[Any], counter: StreamBytes, direction: int,
                  end_of_stream: int = 0) -> AsyncIterator[Any]:
    """`messages`, each counted as the frame it travels in; `end_of_stream` bytes more once they end. Closing this
    closes `messages` (a handler's `finally` runs at once, not when the collector finds it)."""
    try:
        async for message in messages:
            counter.add_(direction, frame_bytes(message))
            yield message
        if end_of_stream:
            counter.add_(direction, end_of_stream)
    finally:
        close = getattr(messages, "aclose", None)
        if close is not None:
            await close()


_opened = P2P._iterate_protobuf_stream_handler
_served = P2P._add_protobuf_stream_handler


async def _iterate_counted(self: P2P, peer_id: Any, name: str, requests: AsyncIterator[Any],
                           output_protobuf_type: Any) -> AsyncIterator[Any]:
    counter = counter_of(self.peer_id)
    responses = await _opened(self, peer_id, name, counted(requests, counter, SENT, END_OF_STREAM_BYTES),
                              output_protobuf_type)
    return counted(responses, counter, RECEIVED)


async def _add_counted(self: P2P, name: str, handler: Callable[[AsyncIterator[Any], P2PContext], AsyncIterator[Any]],
                       *args: Any, **kwargs: Any) -> None:
    counter = counter_of(self.peer_id)

    def counted_handler(requests: AsyncIterator[Any], context: P2PContext) -> AsyncIterator[Any]:
        inbound = counted(requests, counter, RECEIVED, END_OF_STREAM_BYTES)  # hivemind turns its end into None
        return counted(handler(inbound, context), counter, SENT)

    await _served(self, name, counted_handler, *args, **kwargs)


def install() -> None:
    """Count every stream of every P2P in this process (idempotent; also covers P2Ps made earlier)."""
    P2P._iterate_protobuf_stream_handler = _iterate_counted  # type: ignore[method-assign]
    P2P._add_protobuf_stream_handler = _add_counted  # type: ignore[method-assign]


install()
