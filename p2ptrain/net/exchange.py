"""The gossip exchange: one push-pull call over hivemind P2P in which two peers swap payloads, then both commit.

Protocol, all in one bidirectional stream of `DownloadData` messages (JSON metadata + tensor chunks):
1. the initiator sends an offer header (run id, model fingerprint, kind, round, codec, tensor count, bytes) with
   its payload;
2. the responder refuses at once (busy, wrong run, wrong model) or reads the whole payload, decodes and validates
   it, and answers with its own header and payload;
3. the initiator reads and validates that payload and sends `commit`; the responder applies its mix and acks;
4. the initiator applies its mix when the ack arrives.
Anything else (a timeout, a refusal, a truncated or invalid payload, a dropped stream) applies nothing on either
side. What is mixed and how is decided by the peer's side through `ExchangeHandler` (this module moves bytes).
"""

# No `from __future__ import annotations`: hivemind's ServicerBase reads the rpc_* annotations at runtime.
import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, AsyncIterator, Protocol  # noqa: UP035  (ServicerBase recognises typing.AsyncIterator)

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2

from p2ptrain.net.wire import (
    WireError,
    decode_metadata,
    encode_metadata,
    payload_bytes,
    read_tensors,
    stream_parts,
)

logger = logging.getLogger(__name__)

Payload = list[runtime_pb2.Tensor]
Apply = Callable[[], None]


class ExchangeRefused(Exception):
    """The partner said no at once (busy, another run or model, or it found our payload invalid)."""


class OpenExchange(Protocol):
    """The responder's side of one accepted exchange."""

    header: dict[str, Any]  # our answer header (codec, kind, round, ...)
    payload: Payload  # what we send back

    def validate(self, partner_header: dict[str, Any], partner_payload: Payload) -> Apply:
        """Decode and check the partner's payload (raise ValueError if unfit); return the mix to apply on commit."""
        ...

    def close(self) -> None:
        """Release the exchange (committed or not)."""
        ...


class ExchangeHandler(Protocol):
    """One kind of exchange a peer answers (parameter gossip, gradient gossip), under its own namespace."""

    @property
    def namespace(self) -> str: ...

    @property
    def max_payload_bytes(self) -> int: ...

    @property
    def chunk_timeout_s(self) -> float: ...

    def open(self, header: dict[str, Any]) -> "OpenExchange | str":
        """Accept an offer (returns the open exchange) or refuse it (returns the reason)."""
        ...


@dataclasses.dataclass
class ExchangeOutcome:
    apply: Apply  # applies the mix on our side; call it at once
    partner_header: dict[str, Any]
    bytes_sent: int
    bytes_received: int
    seconds: float


async def read_payload(
    messages: AsyncIterator[averaging_pb2.DownloadData],
    first: averaging_pb2.DownloadData,
    nbytes: int,
    chunk_timeout_s: float,
) -> Payload:
    """Read exactly `nbytes` of tensor data (the first chunk is in `first`); more or less is a WireError."""
    return await read_tensors(messages, lambda m: m.tensor_part, nbytes, chunk_timeout_s, first=first,
                              exact_bytes=nbytes)


def _messages(header: dict[str, Any], payload: Payload) -> list[averaging_pb2.DownloadData]:
    """Header and payload as stream messages; the header rides on the first one."""
    parts = list(stream_parts(payload)) or [runtime_pb2.Tensor()]
    messages = [averaging_pb2.DownloadData(tensor_part=parts[0], metadata=encode_metadata(header))]
    messages += [averaging_pb2.DownloadData(tensor_part=part) for part in parts[1:]]
    return messages


async def _drain(requests: AsyncIterator[averaging_pb2.DownloadData], timeout_s: float) -> None:
    """Read (and drop) what the initiator still sends until it ends its side of the stream, for at most
    `timeout_s`.

    Why: when a handler returns, hivemind closes our end of the stream; if the initiator's data is still arriving
    then (the rest of a payload we refused, or its end-of-stream after the commit), p2pd resets the stream and
    our last message in flight (the refusal, or the ack) is lost: the initiator waits out its deadline, and after
    an ack it does not apply the mix we already applied. Measured before this: about 1 exchange in 25 on loopback.
    """
    async def read_to_end() -> None:
        async for _ in requests:
            pass

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(read_to_end(), timeout_s)


def _refusal(reason: str) -> averaging_pb2.DownloadData:
    return averaging_pb2.DownloadData(metadata=encode_metadata({"status": "refused", "reason": reason}))


class GossipServicer(ServicerBase):
    """Answers exchange offers for one run; `handler` decides what to send and how to mix."""

    def __init__(self, handler: ExchangeHandler, max_payload_bytes: int, chunk_timeout_s: float):
        self.handler = handler
        self.max_payload_bytes = max_payload_bytes
        self.chunk_timeout_s = chunk_timeout_s

    async def rpc_exchange(
        self, requests: AsyncIterator[averaging_pb2.DownloadData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in self._respond(requests, context.remote_id.to_base58()):
            yield message
        await _drain(requests, self.chunk_timeout_s)

    async def _respond(
        self, requests: AsyncIterator[averaging_pb2.DownloadData], remote_id: str
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        try:
            first = await asyncio.wait_for(requests.__anext__(), timeout=self.chunk_timeout_s)
            header = decode_metadata(first.metadata)
            header["sender"] = remote_id  # who offers is what libp2p authenticated, never what the offer claims
            nbytes = int(header.get("nbytes", -1))
        except (StopAsyncIteration, asyncio.TimeoutError, WireError, TypeError, ValueError):
            yield _refusal("malformed offer")
            return
        if not 0 <= nbytes <= self.max_payload_bytes:
            yield _refusal(f"payload of {nbytes} bytes is outside 0..{self.max_payload_bytes}")
            return
        opened = self.handler.open(header)
        if isinstance(opened, str):
            yield _refusal(opened)
            return
        try:
            async for message in self._answer(requests, first, header, nbytes, opened):
                yield message
        finally:
            opened.close()

    async def _answer(
        self, requests: AsyncIterator[averaging_pb2.DownloadData], first: averaging_pb2.DownloadData,
        header: dict[str, Any], nbytes: int, opened: OpenExchange,
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        try:
            partner_payload = await read_payload(requests, first, nbytes, self.chunk_timeout_s)
            apply = opened.validate(header, partner_payload)
        except (WireError, ValueError) as e:
            logger.info(f"refusing an exchange: {e}")
            yield _refusal(f"invalid payload: {e}")
            return
        answer = dict(opened.header, status="ok", nbytes=payload_bytes(opened.payload))
        for message in _messages(answer, opened.payload):
            yield message
        try:
            commit = await asyncio.wait_for(requests.__anext__(), timeout=self.chunk_timeout_s)
            committed = decode_metadata(commit.metadata).get("commit") is True
        except (StopAsyncIteration, asyncio.TimeoutError, WireError):
            committed = False
        if committed:
            apply()
            yield averaging_pb2.DownloadData(metadata=encode_metadata({"applied": True}))


async def push_pull(
    p2p: P2P, peer_id: PeerID, namespace: str, header: dict[str, Any], payload: Payload,
    validate: Callable[[dict[str, Any], Payload], Apply], max_payload_bytes: int, deadline_s: float,
) -> ExchangeOutcome:
    """Offer `payload` to `peer_id` and take its payload back; raises ExchangeRefused, WireError or TimeoutError.

    The returned outcome's `apply` mixes on our side; the partner mixes when it reads our commit.
    """
    started = time.monotonic()
    decision: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    offer = dict(header, nbytes=payload_bytes(payload))

    async def requests() -> AsyncIterator[averaging_pb2.DownloadData]:
        for message in _messages(offer, payload):
            yield message
        if await asyncio.shield(decision):  # shielded: closing this stream must not cancel the decision
            yield averaging_pb2.DownloadData(metadata=encode_metadata({"commit": True}))

    try:
        outcome = await asyncio.wait_for(
            _initiate(p2p, peer_id, namespace, requests(), decision, validate, max_payload_bytes, deadline_s),
            deadline_s)
    finally:
        if not decision.done():
            decision.set_result(False)
    outcome.bytes_sent = payload_bytes(payload)
    outcome.seconds = time.monotonic() - started
    return outcome


async def _initiate(
    p2p: P2P, peer_id: PeerID, namespace: str, requests: AsyncIterator[averaging_pb2.DownloadData],
    decision: "asyncio.Future[bool]", validate: Callable[[dict[str, Any], Payload], Apply], max_payload_bytes: int,
    chunk_timeout_s: float,
) -> ExchangeOutcome:
    stub = GossipServicer.get_stub(p2p, peer_id, namespace=namespace)
    responses = await stub.rpc_exchange(requests)
    try:
        first = await responses.__anext__()
    except StopAsyncIteration:
        raise WireError("partner closed the stream without an answer") from None
    answer = decode_metadata(first.metadata)
    if answer.get("status") != "ok":
        raise ExchangeRefused(str(answer.get("reason", "refused")))
    nbytes = int(answer.get("nbytes", -1))
    if not 0 <= nbytes <= max_payload_bytes:
        raise WireError(f"partner announced {nbytes} bytes, outside 0..{max_payload_bytes}")
    partner_payload = await read_payload(responses, first, nbytes, chunk_timeout_s)
    apply = validate(answer, partner_payload)
    decision.set_result(True)
    try:
        ack = await responses.__anext__()
    except StopAsyncIteration:
        raise WireError("partner closed the stream before confirming the mix") from None
    if decode_metadata(ack.metadata).get("applied") is not True:
        raise WireError("partner did not confirm the mix")
    return ExchangeOutcome(apply, answer, 0, payload_bytes(partner_payload), 0.0)


async def serve_exchanges(p2p: P2P, handler: ExchangeHandler) -> None:
    """Answer offers under `handler.namespace` on `p2p`: the one way a kind of exchange is registered."""
    servicer = GossipServicer(handler, handler.max_payload_bytes, chunk_timeout_s=handler.chunk_timeout_s)
    await servicer.add_p2p_handlers(p2p, namespace=handler.namespace)
