"""Joining a running swarm: a live peer serves a snapshot of its round-start state; a newcomer downloads it.

The snapshot is taken at the start of a round (the anchor θ_r, the outer-optimizer state, the round number), so
a newcomer that applies it can take part in that very round's averaging. A download is checked against the
newcomer's own layout (names, shapes, dtypes, finite values) and expected metadata (run, model, a plausible round)
before anything is applied: never half-applied.

A downloaded state is then corroborated by other peers (joining.py) through `rpc_state_sketch`: a peer answers
with a sketch of its own snapshot's parameters under a seed the asker drew after the download (SKETCH_SIZE
Rademacher projections, float64) and their norm, so a donor cannot shape a lie to match what honest peers will
answer. Banned peers are served neither snapshots nor sketches, each peer only so many a second, and snapshots
only a few at a time, each within a deadline.
"""

# No `from __future__ import annotations` here: hivemind's ServicerBase reads the rpc_* annotations at runtime
# and recognises streams only by `typing.AsyncIterator`.
import asyncio
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, AsyncIterator, TypeGuard  # noqa: UP035  (ServicerBase recognises typing.AsyncIterator only)

import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2

from p2ptrain.errors import StateMismatchError
from p2ptrain.net import frame_cap, stream_bytes  # noqa: F401  (importing them caps and counts stream frames)
from p2ptrain.net.relay import RelayEntry, open_relayed
from p2ptrain.net.responder_limits import RateLimit
from p2ptrain.net.routes import Route
from p2ptrain.net.wire import WireError, decode_metadata, encode_metadata, read_tensors, refusal, stream_parts
from p2ptrain.tensor_layout import TensorLayout, check_tensors, layout_of
from p2ptrain.timing import SLOWEST_LINK_BYTES_PER_S, TRANSFER_PATIENCE_S, transfer_s

logger = logging.getLogger(__name__)

SKETCHED_PREFIX = "param:"  # the snapshot tensors a sketch's `values` cover: the model parameters
# the outer state, sketched apart (`Sketch.outer`): taken unchecked, a donor's honest parameters with a poisoned
# outer momentum (or GASLoC's previous iterate) passed every check and threw the joiner's next outer step anywhere
OUTER_PREFIX = "sync:"
# projections per sketch: ‖sketch(a) − sketch(b)‖ / √SKETCH_SIZE estimates ‖a − b‖ within ×0.47..×1.61 (99.9 %)
SKETCH_SIZE = 16
SKETCH_BLOCK = 2**16  # elements projected at a time: SKETCH_SIZE × this × 8 bytes of signs (4 MiB) at most
MAX_SEED = 2**64  # seeds are 64-bit (PCG64)
# sketch requests one peer may make: a joiner asks each witness once per candidate state (a few per join, a join per
# round at most); beyond the bucket a request is refused and is an offence ("too_many_requests")
SKETCHES_PER_S = 2.0
SKETCH_BURST = 8
# sketch requests waiting (or computing) at once, from every peer together; beyond, refused as busy: a flood from
# many identities, each within its rate, would make an honest joiner's request wait behind it, late enough to count as
# a stalled witness (joining.py waits a few times as long as the first witness took)
SKETCHES_QUEUED = 4
# snapshots served: at most DOWNLOADS_AT_ONCE at a time (a request beyond is refused: the joiner tries another
# donor), one per peer (a second at once: "too_many_opens"), each within its `download_deadline_s` and each message
# read within `transfer_s` of its bytes (a reader too slow or idle is cut off, "slow_send"), and to each peer at
# most DOWNLOADS_PER_S (bursts of DOWNLOAD_BURST; beyond, "too_many_requests"). Served without bound, concurrent
# requests (from any number of identities) each held a serialized copy of the whole state in memory; with slots but
# no per-peer bound and no offence, one identity held both slots of 3 donors for 85 s, and a joiner trained alone
DOWNLOADS_AT_ONCE = 2
# and one at a time to each host (the address a peer's connection comes from, net/remote_hosts.py): two identities of
# one machine would hold both slots. Not an offence: the peers of one home share their address
DOWNLOADS_PER_HOST = 1
DOWNLOADS_PER_S = 0.5
DOWNLOAD_BURST = 8


def download_deadline_s(nbytes: int, chunk_timeout_s: float) -> float:
    """How long a state download of `nbytes` may take, for the joiner and the donor alike: a chunk's deadline, then
    the bytes at the slowest link we serve; at most 4 chunk deadlines. The rate keeps a donor from trickling each
    chunk just inside its own deadline (it would hold a joiner's training for 4 of them, and rank first again)."""
    return min(4 * chunk_timeout_s, transfer_s(nbytes, SLOWEST_LINK_BYTES_PER_S, chunk_timeout_s))


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

    @property
    def round(self) -> int:
        return int(self.metadata["round"])

    def sketch(self, seed: int) -> "Sketch":
        """The sketch of this snapshot under `seed` (what `rpc_state_sketch` answers): of its parameters, and
        apart, of its outer state (under the next seed)."""
        params = [t for n, t in zip(self.names, self.tensors, strict=True) if n.startswith(SKETCHED_PREFIX)]
        outer = [t for n, t in zip(self.names, self.tensors, strict=True) if n.startswith(OUTER_PREFIX)]
        return Sketch(self.round, parameter_sketch(params, seed), parameter_norm(params),
                      parameter_sketch(outer, (seed + 1) % MAX_SEED), parameter_norm(outer))


@dataclasses.dataclass(frozen=True)
class Sketch:
    """A state's sketch under one seed: the round of the snapshot, its parameters' projections and exact norm, and
    those of its outer state (`OUTER_PREFIX`: the outer momentum, GASLoC's previous iterate; zeros when it has none)."""

    round: int
    values: list[float]
    norm: float
    outer: list[float] = dataclasses.field(default_factory=lambda: [0.0] * SKETCH_SIZE)
    outer_norm: float = 0.0

    def distance(self, other: "Sketch") -> float:
        """‖a − b‖ / min(‖a‖, ‖b‖) of the parameters, estimated from the projections; a scaled-up state cannot look
        near by inflating its own norm."""
        return relative_distance(self.values, self.norm, other.values, other.norm)

    def outer_distance(self, other: "Sketch") -> float:
        """The same of the outer states (0 when both have none)."""
        return relative_distance(self.outer, self.outer_norm, other.outer, other.outer_norm)


def relative_distance(a: Sequence[float], a_norm: float, b: Sequence[float], b_norm: float) -> float:
    """‖a − b‖ / min(‖a‖, ‖b‖) from two sketches and the exact norms of what they sketch."""
    difference = math.dist(a, b) / math.sqrt(SKETCH_SIZE)
    smaller = min(a_norm, b_norm)
    if difference == 0:
        return 0.0
    return difference / smaller if smaller > 0 else math.inf


def parameter_sketch(tensors: Sequence[torch.Tensor], seed: int) -> list[float]:
    """SKETCH_SIZE Rademacher projections ⟨s_k, x⟩ of the tensors flattened end to end, summed in float64.

    The signs are the raw bits of a PCG64 stream seeded with `seed` (numpy keeps bit generators' streams fixed
    across versions and platforms), consumed SKETCH_BLOCK elements at a time: memory stays bounded, and two
    peers holding tensors of one layout draw the same signs. E‖sketch(x)‖² = SKETCH_SIZE · ‖x‖², so
    ‖sketch(a) − sketch(b)‖ / √SKETCH_SIZE estimates ‖a − b‖ (a χ with SKETCH_SIZE degrees of freedom).
    """
    bits = np.random.PCG64(seed)
    total = torch.zeros(SKETCH_SIZE, dtype=torch.float64)
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), SKETCH_BLOCK):
            block = flat[start:start + SKETCH_BLOCK].to("cpu", torch.float64)
            total += _signs(bits, block.numel()) @ block
    return total.tolist()


def parameter_norm(tensors: Sequence[torch.Tensor]) -> float:
    """‖x‖ of the tensors flattened end to end, in float64."""
    return math.sqrt(sum(float(t.detach().to(torch.float64).pow(2).sum()) for t in tensors))


def _signs(bits: np.random.PCG64, count: int) -> torch.Tensor:
    """A [SKETCH_SIZE, count] matrix of ±1 from the next SKETCH_SIZE × count bits of the stream (the rest of the
    last 64-bit word is dropped)."""
    words = bits.random_raw(-(-SKETCH_SIZE * count // 64)).astype("<u8")
    unpacked = np.unpackbits(words.view(np.uint8), bitorder="little")[: SKETCH_SIZE * count]
    return torch.from_numpy(unpacked.reshape(SKETCH_SIZE, count)).to(torch.float64).mul_(2).sub_(1)


@dataclasses.dataclass(frozen=True)
class SnapshotExpectation:
    """What a snapshot's metadata must say before its tensors are looked at: our run, our model, a round in
    [min_round, max_round] (the donor's announced round or later, never past what the swarm supports)."""

    run_id: str
    fingerprint: str
    min_round: int
    max_round: int


class SnapshotRefused(ValueError):
    """A snapshot's metadata is of the wrong types (`offence` "malformed") or says what we did not expect."""

    def __init__(self, message: str, offence: str | None = None):
        super().__init__(message)
        self.offence = offence  # a Reputation offence to report, or None for a mismatch an honest peer can cause


def check_snapshot_metadata(metadata: dict[str, Any], expected: SnapshotExpectation) -> None:
    """Raise SnapshotRefused unless the metadata's round is an int in the expected range and its run id and
    fingerprint are strings equal to ours (JSON from an untrusted peer: no coercion, `true` is no int)."""
    round_ = metadata.get("round")
    for key in ("run_id", "fingerprint"):
        if not isinstance(metadata.get(key), str):
            raise SnapshotRefused(f"snapshot metadata {key} is {metadata.get(key)!r}, not a string", "malformed")
    if not _is_int(round_):
        raise SnapshotRefused(f"snapshot metadata round is {round_!r}, not an integer", "malformed")
    if metadata["run_id"] != expected.run_id or metadata["fingerprint"] != expected.fingerprint:
        raise SnapshotRefused(f"snapshot is of run {metadata['run_id']!r}, model {metadata['fingerprint']!r}")
    if not expected.min_round <= round_ <= expected.max_round:
        raise SnapshotRefused(f"snapshot is of round {round_}, expected {expected.min_round}..{expected.max_round}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


class StateServer(ServicerBase):
    """Serves the latest snapshot (`rpc_download_state`) and sketches of it (`rpc_state_sketch`) to any peer
    that `refuses` does not name (banned or not admitted; libp2p-authenticated peer ids, base58). Snapshots are
    served DOWNLOADS_AT_ONCE at a time, one serialized tensor at a time, each within its deadline; sketches one at
    a time. A peer asking for more than DOWNLOADS_PER_S or SKETCHES_PER_S (in bursts) is refused and reported to
    `penalise` (peer, offence, detail), usually `Reputation.penalise`."""

    def __init__(self, get_snapshot: Callable[[], StateSnapshot | None],
                 refuses: Callable[[str, object], bool] = lambda _peer, _ticket: False,
                 penalise: Callable[[str, str, str], object] = lambda _peer, _offence, _detail: None,
                 chunk_timeout_s: float = TRANSFER_PATIENCE_S,
                 host_of: Callable[[str], Awaitable[str | None]] | None = None):
        """`host_of`: the host a peer connects from (`RemoteHosts.host_of`); None: no cap per host."""
        self.get_snapshot = get_snapshot
        self.refuses, self.penalise, self.chunk_timeout_s = refuses, penalise, chunk_timeout_s
        self.host_of = host_of
        self._sketching = asyncio.Lock()  # one sketch at a time: a flood of requests cannot take every core
        self._sketches_waiting = 0  # requests computing or waiting for the lock
        self.sketch_limit = RateLimit(SKETCHES_PER_S, SKETCH_BURST)
        self.download_limit = RateLimit(DOWNLOADS_PER_S, DOWNLOAD_BURST)
        # the downloads being served: stream handler task -> (peer, its host or None)
        self._serving: dict[asyncio.Task[Any], tuple[str, str | None]] = {}

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Request metadata {"ticket": str} in a signed run (admits a peer whose record we have not read), or
        none."""
        peer = context.remote_id.to_base58()
        host = await self.host_of(peer) if self.host_of is not None else None
        snapshot = self.get_snapshot()
        why_not = ("no snapshot yet" if snapshot is None
                   else "not served here" if self.refuses(peer, _asked(request).get("ticket", ""))
                   else self._why_no_download(peer, host))
        if why_not is not None:  # the caller logs why and tries another peer
            yield averaging_pb2.DownloadData(metadata=refusal(why_not).metadata)
            return
        assert snapshot is not None
        task = asyncio.current_task()  # the handler's: cancelled at the deadline, even while a write waits on a reader
        assert task is not None
        loop, cut = asyncio.get_running_loop(), False

        def cut_off(why: str) -> None:
            nonlocal cut
            if not cut:  # one offence per download, whichever deadline fires first
                cut = True
                self.penalise(peer, "slow_send", why)
                task.cancel()

        total_s = download_deadline_s(snapshot.nbytes, self.chunk_timeout_s)
        deadline = loop.call_later(total_s, cut_off, f"a state download took longer than {total_s:.0f} s")
        idle: asyncio.TimerHandle | None = None
        self._serving[task] = (peer, host)
        try:
            metadata: bytes | None = encode_metadata(snapshot.metadata)
            for tensor in snapshot.tensors:  # serialized one at a time: one tensor's copy in memory, not the state's
                for part in stream_parts([serialize_torch_tensor(tensor, runtime_pb2.CompressionType.NONE)]):
                    # the generator resumes once the previous message is written: a reader that stops reading
                    # holds this slot only as long as one message takes at the slowest link we serve
                    part_s = min(total_s, transfer_s(len(part.buffer)))
                    idle = loop.call_later(part_s, cut_off, f"a state download's reader took no message for "
                                                            f"{part_s:.0f} s")
                    yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata or b"")
                    idle.cancel()
                    metadata = None
        finally:
            deadline.cancel()
            if idle is not None:
                idle.cancel()
            self._serving.pop(task, None)

    def _why_no_download(self, peer: str, host: str | None) -> str | None:
        """Why `peer` (connecting from `host`) is not served a snapshot now (beyond its rate, a second at once, its
        host's share taken, no slot free), or None."""
        if not self.download_limit.take(peer):
            why = f"more than {DOWNLOAD_BURST:g} state downloads at once or {DOWNLOADS_PER_S:g} a second"
            self.penalise(peer, "too_many_requests", why)
            return why
        self._serving = {t: served for t, served in self._serving.items() if not t.done()}
        if any(served_peer == peer for served_peer, _ in self._serving.values()):
            self.penalise(peer, "too_many_opens", "a second state download while its first is served")
            return "a second state download while its first is served"
        if host is not None and [h for _, h in self._serving.values()].count(host) >= DOWNLOADS_PER_HOST:
            return f"busy: {DOWNLOADS_PER_HOST} state download to its host served already"
        if len(self._serving) >= DOWNLOADS_AT_ONCE:
            return f"busy: {DOWNLOADS_AT_ONCE} state downloads served already"
        return None

    async def rpc_state_sketch(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """Request metadata {"seed": int in [0, 2**64), "ticket": str (signed runs)}; answer {"round": int,
        "sketch": [SKETCH_SIZE floats], "norm": float, "outer": [SKETCH_SIZE floats], "outer_norm": float} or
        {"status": "refused", "reason": str}."""
        snapshot = self.get_snapshot()
        asked = _asked(request)
        seed = asked.get("seed")
        peer = context.remote_id.to_base58()
        if snapshot is None or self.refuses(peer, asked.get("ticket", "")):
            return refusal("no snapshot to sketch")
        if not self.sketch_limit.take(peer):
            self.penalise(peer, "too_many_requests", f"more than {SKETCH_BURST:g} sketch requests at once or "
                                                     f"{SKETCHES_PER_S:g} a second")
            return refusal(f"at most {SKETCHES_PER_S:g} sketch requests a second")
        if not _is_int(seed) or not 0 <= seed < MAX_SEED:
            return refusal("the seed must be an integer in [0, 2**64)")
        if self._sketches_waiting >= SKETCHES_QUEUED:  # a queue that long answers late: a refusal costs nothing
            return refusal("busy: too many sketch requests waiting")
        self._sketches_waiting += 1
        try:
            async with self._sketching:
                sketch = await asyncio.get_running_loop().run_in_executor(None, snapshot.sketch, seed)
        finally:
            self._sketches_waiting -= 1
        answer = {"round": sketch.round, "sketch": sketch.values, "norm": sketch.norm, "outer": sketch.outer,
                  "outer_norm": sketch.outer_norm}
        return averaging_pb2.DownloadData(metadata=encode_metadata(answer))


    def serve_relayed(self, entry: RelayEntry, namespace: str) -> None:
        """Serve snapshots and sketches to peers that reach us through a relay, too."""
        async def state(requests: AsyncIterator[averaging_pb2.DownloadData],
                        context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
            # a relayed stream that ends before its request asks as one that carries nothing
            async for message in self.rpc_download_state(await anext(requests, averaging_pb2.DownloadData()),
                                                         context):
                yield message

        async def sketch(requests: AsyncIterator[averaging_pb2.DownloadData],
                         context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
            yield await self.rpc_state_sketch(await anext(requests, averaging_pb2.DownloadData()), context)

        entry.add_service(f"state:{namespace}", state)
        entry.add_service(f"sketch:{namespace}", sketch)


async def _call(p2p: P2P, peer_id: PeerID, namespace: str, method: str, request: averaging_pb2.DownloadData,
                route: Route | None) -> AsyncIterator[averaging_pb2.DownloadData]:
    """The answers of `method` (state | sketch) of `peer_id`'s state server, directly or through `route`'s relay."""
    if route is not None:
        return await open_relayed(p2p, route, peer_id, f"{method}:{namespace}", _once(request))
    stub = StateServer.get_stub(p2p, peer_id, namespace=namespace)
    if method == "state":
        return await stub.rpc_download_state(request)
    return _once(await stub.rpc_state_sketch(request))


def _asked(request: averaging_pb2.DownloadData) -> dict[str, Any]:
    """A request's metadata (empty if it has none, or if it is malformed)."""
    try:
        return decode_metadata(request.metadata) if request.metadata else {}
    except WireError:
        return {}


def _with_ticket(metadata: dict[str, Any], ticket: str) -> averaging_pb2.DownloadData:
    """A request of `metadata`, carrying our `ticket` in a signed run."""
    return averaging_pb2.DownloadData(metadata=encode_metadata({**metadata, **({"ticket": ticket} if ticket else {})}))


async def _once(message: averaging_pb2.DownloadData) -> AsyncIterator[averaging_pb2.DownloadData]:
    yield message


async def download_state(
    p2p: P2P, peer_id: PeerID, namespace: str, expected: TensorLayout, max_bytes: int, chunk_timeout_s: float,
    expected_metadata: SnapshotExpectation, route: Route | None = None, ticket: str = "",
) -> StateSnapshot:
    """Download (directly or through `route`'s relay) and fully validate a peer's snapshot; raises WireError /
    StateMismatchError / SnapshotRefused on anything wrong (the metadata is checked before any tensor is decoded).
    `ticket`: ours, in a signed run."""
    metadata_parts: list[bytes] = []

    def keep_metadata(message: averaging_pb2.DownloadData) -> None:
        if message.metadata:
            metadata_parts.append(message.metadata)

    stream = await _call(p2p, peer_id, namespace, "state", _with_ticket({}, ticket), route)
    serialized = await read_tensors(stream, lambda m: m.tensor_part, max_bytes, chunk_timeout_s,
                                    on_message=keep_metadata)
    if len(metadata_parts) != 1:
        raise WireError(f"peer {peer_id} sent {len(metadata_parts)} metadata blocks instead of one")
    metadata = decode_metadata(metadata_parts[0])
    if metadata.get("status") == "refused":  # before any tensor: a refusal carries none
        raise SnapshotRefused(f"peer {peer_id} refused the download: {str(metadata.get('reason'))[:200]}")
    check_snapshot_metadata(metadata, expected_metadata)
    if [list(x) for x in metadata.get("layout", [])] != [[n, list(s), d] for n, s, d in expected]:
        raise StateMismatchError(f"peer {peer_id} serves a state of another layout (a different model or config)")
    # the layout matched: a stream that ends early was cut (the donor's deadline, a link dropped), not corrupt
    if len(serialized) < len(expected):
        raise WireError(f"the state download from {peer_id} ended after {len(serialized)} of {len(expected)} "
                        f"tensors: cut off")
    if serialized and len(serialized) == len(expected) and ends_inside(serialized[-1], expected[-1]):
        raise WireError(f"the state download from {peer_id} ended inside tensor {len(expected)} of {len(expected)}: "
                        f"cut off")
    try:
        tensors = [deserialize_torch_tensor(t) for t in serialized]
    except Exception as e:  # corrupt buffers surface as assorted numpy/torch errors
        raise WireError(f"peer {peer_id} sent an undecodable tensor: {e}") from None
    check_tensors(expected, tensors, what=f"state from {peer_id}")
    names = tuple(name for name, _, _ in expected)
    return StateSnapshot(metadata, names, tuple(tensors))


def ends_inside(tensor: runtime_pb2.Tensor, layout: tuple[str, tuple[int, ...], str]) -> bool:
    """Whether an uncompressed serialized tensor (what a donor serves) holds fewer bytes than its layout needs: the
    stream ended inside it. Other compressions are left to deserialization to judge."""
    _, shape, dtype = layout
    element = getattr(torch, dtype.removeprefix("torch."), None)
    if tensor.compression != runtime_pb2.CompressionType.NONE or not isinstance(element, torch.dtype):
        return False
    return len(tensor.buffer) < math.prod(shape) * element.itemsize


class MalformedSketch(WireError):
    """A witness answered a sketch request with something that is not a sketch (an offence, unlike a refusal)."""


async def request_sketch(p2p: P2P, peer_id: PeerID, namespace: str, seed: int, timeout_s: float,
                         route: Route | None = None, ticket: str = "") -> Sketch:
    """Ask `peer_id` (directly or through `route`'s relay) for the sketch of its snapshot under `seed`; raises
    WireError on a refusal or a malformed answer, and P2P errors or TimeoutError when it does not answer.
    `ticket`: ours, in a signed run."""
    request = _with_ticket({"seed": seed}, ticket)
    answers = await asyncio.wait_for(_call(p2p, peer_id, namespace, "sketch", request, route), timeout_s)
    try:
        answer = decode_metadata((await asyncio.wait_for(answers.__anext__(), timeout_s)).metadata)
    except StopAsyncIteration:
        raise WireError(f"peer {peer_id} closed the stream without a sketch") from None
    finally:
        await answers.aclose()  # type: ignore[attr-defined]
    round_ = answer.get("round")
    if answer.get("status") == "refused":
        raise WireError(f"peer {peer_id} refused a sketch: {str(answer.get('reason'))[:200]}")
    if not _is_int(round_) or round_ < 0:
        raise MalformedSketch(f"peer {peer_id} sent a malformed sketch answer")
    values, norm = _projections(answer.get("sketch"), answer.get("norm"), peer_id)
    outer, outer_norm = _projections(answer.get("outer"), answer.get("outer_norm"), peer_id)
    return Sketch(round_, values, norm, outer, outer_norm)


def _projections(values: object, norm: object, peer_id: PeerID) -> tuple[list[float], float]:
    """SKETCH_SIZE finite numbers and a norm ≥ 0 from a sketch answer; MalformedSketch otherwise."""
    if not isinstance(values, list) or len(values) != SKETCH_SIZE:
        raise MalformedSketch(f"peer {peer_id} sent a malformed sketch answer")
    if not all(_is_number(v) for v in values) or not _is_number(norm) or norm < 0:
        raise MalformedSketch(f"peer {peer_id} sent a sketch with non-numbers or a negative norm")
    return [float(v) for v in values], float(norm)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
