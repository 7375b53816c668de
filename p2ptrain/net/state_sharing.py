"""Joining a running swarm: a live peer serves a snapshot of its round-start state; a newcomer downloads it.

The snapshot is taken at the start of a round (the anchor θ_r, the outer-optimizer state, the round number), so
a newcomer that applies it can take part in that very round's averaging. A download is checked against the
newcomer's own layout (names, shapes, dtypes, finite values) before anything is applied: never half-applied.
"""

# No `from __future__ import annotations` here: hivemind's ServicerBase reads the rpc_* annotations at runtime
# and recognises streams only by `typing.AsyncIterator`.
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, AsyncIterator  # noqa: UP035  (ServicerBase recognises typing.AsyncIterator only)

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2

from p2ptrain.errors import StateMismatchError
from p2ptrain.net.wire import WireError, decode_metadata, encode_metadata, read_tensors, stream_parts
from p2ptrain.tensor_layout import TensorLayout, check_tensors, layout_of

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StateSnapshot:
    """Named tensors plus JSON-able metadata (round, fingerprint, ...), immutable once published."""

    metadata: dict[str, Any]
    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]

    @classmethod
    def capture(cls, metadata: dict[str, Any], named_tensors: Sequence[tuple[str, torch.Tensor]]) -> "StateSnapshot":
        names = tuple(name for name, _ in named_tensors)
        tensors = tuple(t.detach().to("cpu", copy=True) for _, t in named_tensors)
        return cls(dict(metadata, layout=layout_of(names, tensors)), names, tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class StateServer(ServicerBase):
    """Serves the latest snapshot to any peer that asks (`rpc_download_state`)."""

    def __init__(self, get_snapshot: Callable[[], StateSnapshot | None]):
        self.get_snapshot = get_snapshot

    async def rpc_download_state(
        self, _request: averaging_pb2.DownloadRequest, _context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        snapshot = self.get_snapshot()
        if snapshot is None:
            return  # nothing to share yet: the caller tries another peer
        metadata: bytes | None = encode_metadata(snapshot.metadata)
        serialized = [serialize_torch_tensor(t, runtime_pb2.CompressionType.NONE) for t in snapshot.tensors]
        for part in stream_parts(serialized):
            yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata or b"")
            metadata = None


async def download_state(
    p2p: P2P, peer_id: PeerID, namespace: str, expected: TensorLayout, max_bytes: int, chunk_timeout_s: float
) -> StateSnapshot:
    """Download and fully validate a peer's snapshot; raises WireError / StateMismatchError on anything wrong."""
    stub = StateServer.get_stub(p2p, peer_id, namespace=namespace)
    metadata_parts: list[bytes] = []

    def keep_metadata(message: averaging_pb2.DownloadData) -> None:
        if message.metadata:
            metadata_parts.append(message.metadata)

    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
    serialized = await read_tensors(stream, lambda m: m.tensor_part, max_bytes, chunk_timeout_s,
                                    on_message=keep_metadata)
    if len(metadata_parts) != 1:
        raise WireError(f"peer {peer_id} sent {len(metadata_parts)} metadata blocks instead of one")
    metadata = decode_metadata(metadata_parts[0])
    try:
        tensors = [deserialize_torch_tensor(t) for t in serialized]
    except Exception as e:  # corrupt buffers surface as assorted numpy/torch errors
        raise WireError(f"peer {peer_id} sent an undecodable tensor: {e}") from None
    if [list(x) for x in metadata.get("layout", [])] != [[n, list(s), d] for n, s, d in expected]:
        raise StateMismatchError(f"peer {peer_id} serves a state of another layout (a different model or config)")
    check_tensors(expected, tensors, what=f"state from {peer_id}")
    names = tuple(name for name, _, _ in expected)
    return StateSnapshot(metadata, names, tuple(tensors))
