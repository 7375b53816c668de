"""The gossip exchange: one push-pull call over hivemind P2P in which two peers swap payloads, then both commit.

Protocol, all in one bidirectional stream of `DownloadData` messages (JSON metadata + tensor chunks):
1. the initiator sends an offer header (run id, model fingerprint, kind, round, codec, tensor count, bytes) with
   its payload;
2. the responder refuses at once (busy, wrong run, wrong model) or reads the whole payload, decodes and validates
   it, and answers with its own header and payload; an offer for a round the responder is a moment from reaching
   may first be held, its payload unread, for at most the offer's `hold_s` (the handler's `hold`): the responder
   then says 'held' at once, so an initiator that hears nothing within its deadline still knows its partner gone
   (a 'held' for an offer granted no hold is `UngrantedHold`: an offence);
3. the initiator reads and validates that payload and sends `commit`; the responder applies its mix and acks;
4. the initiator applies its mix when the ack arrives.
The last message can be lost where the first three were not (the partner applied, its ack did not come): the
initiator then holds a partner's payload it validated and committed to, and the partner may or may not have mixed.
`push_pull` raises `UnconfirmedMix` with that payload; a caller whose mix is judged later by both sides (an
all-reduce's members confirm what they reduced) may keep it; every other caller applies nothing.
Anything else (a timeout, a refusal, a truncated or invalid payload, a dropped stream) applies nothing on either
side. What is mixed and how is decided by the peer's side through `ExchangeHandler` (this module moves bytes).

Initiators are untrusted (docs/threat-model.md). Without reading an offer, the responder refuses banned peers and
offers beyond its `ResponderLimits` (per peer, in all); it drops an exchange at deadlines that follow from the bytes
at stake (not from the initiator's word) and frees its slot, and reports offences to the `Reputation` of the peer id
libp2p authenticated.
"""

# No `from __future__ import annotations`: hivemind's ServicerBase reads the rpc_* annotations at runtime.
import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, AsyncIterator, Protocol  # noqa: UP035  (ServicerBase recognises typing.AsyncIterator)

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2

from p2ptrain.net import frame_cap, stream_bytes  # noqa: F401  (importing them caps and counts stream frames)
from p2ptrain.net.inbound_exchange import InboundExchange
from p2ptrain.net.relay import RelayEntry, open_relayed
from p2ptrain.net.remote_hosts import RemoteHosts
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.responder_limits import ResponderLimits, Slots
from p2ptrain.net.routes import Route
from p2ptrain.net.wire import (
    MAX_MESSAGE_BYTES,
    WireError,
    WireOversize,
    WireTimeout,
    WireTruncated,
    decode_metadata,
    drain,
    encode_metadata,
    metadata_message,
    payload_bytes,
    read_tensors,
    refusal,
    stream_parts,
)

logger = logging.getLogger(__name__)

Payload = list[runtime_pb2.Tensor]
HELD = "held"  # the responder holds our offer until it reaches our round; its answer follows
Apply = Callable[[], None]


class ExchangeRefused(Exception):
    """The partner said no at once (busy, another run or model, or it found our payload invalid)."""


class UngrantedHold(WireError):
    """The responder said it holds an offer we gave no `hold_s`: no honest peer does (its `hold` holds only what it
    was granted), and one that does then keeps us waiting for nothing."""


class UnconfirmedMix(WireError):
    """We committed to the partner's validated payload, and its ack did not come (the stream ended, failed or ran
    out of time): the partner may have mixed or not. `outcome` holds what we validated, not yet applied."""

    def __init__(self, why: str, outcome: "ExchangeOutcome", timed_out: bool = False):
        super().__init__(why)
        self.outcome, self.timed_out = outcome, timed_out  # timed_out: the exchange's deadline passed meanwhile


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

    @property
    def reputation(self) -> Reputation: ...  # the peer's one record of offences, shared by all its transports

    def hold(self, header: dict[str, Any]) -> Awaitable[Any] | None:
        """None to judge the offer at once; or a wait (bounded by the handler) that ends when the round the offer
        is for, a moment away, begins (sync/round_gate.py). Its payload is not read meanwhile."""
        ...

    def open(self, header: dict[str, Any]) -> "OpenExchange | str":
        """Accept an offer (returns the open exchange) or refuse it (returns the reason)."""
        ...


class JudgedAtOnce:
    """An `ExchangeHandler` that holds no offer."""

    def hold(self, header: dict[str, Any]) -> Awaitable[Any] | None:
        return None


@dataclasses.dataclass
class ExchangeOutcome:
    apply: Apply  # applies the mix on our side; call it at once
    partner_header: dict[str, Any]
    bytes_sent: int
    bytes_received: int
    seconds: float
    confirmed: bool = True  # the partner acked its mix (False: carried by an `UnconfirmedMix`)


async def read_payload(messages: AsyncIterator[averaging_pb2.DownloadData], first: averaging_pb2.DownloadData,
                       nbytes: int, chunk_timeout_s: float) -> Payload:
    """Read exactly `nbytes` of tensor data (the first chunk is in `first`); more or less is a WireError."""
    return await read_tensors(messages, lambda m: m.tensor_part, nbytes, chunk_timeout_s, first=first,
                              exact_bytes=nbytes)


def _messages(header: dict[str, Any], payload: Payload) -> list[averaging_pb2.DownloadData]:
    """Header and payload as stream messages; the header rides on the first one."""
    parts = list(stream_parts(payload)) or [runtime_pb2.Tensor()]
    messages = [averaging_pb2.DownloadData(tensor_part=parts[0], metadata=encode_metadata(header))]
    messages += [averaging_pb2.DownloadData(tensor_part=part) for part in parts[1:]]
    return messages


class GossipServicer(ServicerBase):
    """Answers exchange offers for one run; `handler` decides what to send and how to mix, `reputation` (a private
    one if None) records offences, `limits` bound what initiators get."""

    def __init__(self, handler: ExchangeHandler, max_payload_bytes: int, chunk_timeout_s: float,
                 reputation: Reputation | None = None, limits: ResponderLimits = ResponderLimits(),
                 host_of: Callable[[str], Awaitable[str | None]] | None = None):
        """`host_of`: the host a peer connects from (`RemoteHosts.host_of`); None: no cap per host."""
        self.handler, self.max_payload_bytes, self.chunk_timeout_s = handler, max_payload_bytes, chunk_timeout_s
        self.reputation = reputation if reputation is not None else Reputation()
        self.limits, self.slots, self.host_of = limits, Slots(limits), host_of
        # how long an initiator may keep us waiting for a message: our largest one at the slowest rate we serve
        self.message_timeout_s = min(chunk_timeout_s, limits.transfer_s(MAX_MESSAGE_BYTES))

    async def rpc_exchange(
        self, requests: AsyncIterator[averaging_pb2.DownloadData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        peer = context.remote_id.to_base58()  # what libp2p authenticated, never what the offer claims
        host = await self.host_of(peer) if self.host_of is not None else None
        requests, why_not = await self._admitted(peer, requests)
        why_not = why_not or self._admit(peer, host)
        if why_not is not None:  # no slot: the offer is not read, the refusal is all we send
            yield refusal(why_not)
            await self._drain_refused(requests)
            return
        inbound = InboundExchange(peer, requests, self.slots, self.reputation, host)
        try:
            async for message in self._respond(inbound):
                yield message
            inbound.disarm()
            await drain(requests, self.limits.floor_s)  # an honest initiator ends its stream once it has our answer
        finally:
            inbound.release()

    async def _drain_refused(self, requests: AsyncIterator[averaging_pb2.DownloadData]) -> None:
        """Let a refusal reach its initiator (see `drain`), for `limits.total` refused streams at once at most:
        beyond, a refused stream ends at once (and its refusal may be lost)."""
        if self.slots.refused_draining < self.limits.total:
            self.slots.refused_draining += 1
            try:
                await drain(requests, self.limits.floor_s)
            finally:
                self.slots.refused_draining -= 1

    async def _admitted(self, peer: str, requests: AsyncIterator[averaging_pb2.DownloadData]
                        ) -> tuple[AsyncIterator[averaging_pb2.DownloadData], str | None]:
        """Why `peer` is refused (banned, or not admitted to a signed run), or None; and `requests` as they were.
        A peer whose record we have not read yet is admitted by the ticket its offer's header carries: its first
        message is read for it (a message at most, within `message_timeout_s`, one of the `limits.total` refused
        streams we read at once) and put back in front of the others."""
        refused = "banned or not admitted"
        if self.reputation.is_banned(peer):
            return requests, refused
        if not self.reputation.refuses(peer):
            return requests, None
        if self.slots.refused_draining >= self.limits.total:
            return requests, refused
        self.slots.refused_draining += 1
        try:
            first = await asyncio.wait_for(requests.__anext__(), timeout=self.message_timeout_s)
            ticket = decode_metadata(first.metadata).get("ticket", "")
        except (StopAsyncIteration, asyncio.TimeoutError, WireError):
            return requests, refused
        finally:
            self.slots.refused_draining -= 1
        if self.reputation.refuses(peer, ticket):
            return requests, refused
        return _ahead(first, requests), None

    def _admit(self, peer: str, host: str | None) -> str | None:
        """Take a slot for an offer from `peer` (connecting from `host`), or say why not (too many open exchanges:
        of this peer, an offence; in all or from its host, none)."""
        why_not = self.slots.take(peer, host)
        if why_not is not None and not why_not.startswith("busy"):
            self.reputation.penalise(peer, "too_many_opens", why_not)
        return why_not

    def _offence(self, peer: str, error: ValueError) -> None:
        """Penalise `peer` for what a failed read or validation of its offer or payload says about it."""
        if isinstance(error, WireTruncated):
            return  # an initiator that gives up at its own deadline ends its stream early
        offence = ("slow_send" if isinstance(error, WireTimeout) else "oversize" if isinstance(error, WireOversize)
                   else "malformed" if isinstance(error, WireError) else "invalid_payload")
        self.reputation.penalise(peer, offence, str(error))

    async def _respond(self, inbound: InboundExchange) -> AsyncIterator[averaging_pb2.DownloadData]:
        try:
            first, header, nbytes = await self._read_offer(inbound)
        except WireError as e:
            self._offence(inbound.peer, e)
            yield refusal(f"malformed offer: {e}")
            return
        wait = self.handler.hold(header)
        if wait is not None:
            held = asyncio.ensure_future(wait)  # a task: an initiator gone before our notice leaves no coroutine
            try:
                yield metadata_message({"status": HELD})
                await held
            finally:
                held.cancel()
            inbound.held_s, inbound.started = time.monotonic() - inbound.started, time.monotonic()
        opened = self.handler.open(header)
        if isinstance(opened, str):
            yield refusal(opened)
            return
        inbound.close_opened = opened.close
        async for message in self._answer(inbound, first, header, nbytes, opened):
            yield message

    async def _read_offer(self, inbound: InboundExchange) -> tuple[averaging_pb2.DownloadData, dict[str, Any], int]:
        """The offer's first message, its header (with the sender libp2p authenticated) and announced bytes."""
        try:
            first = await asyncio.wait_for(inbound.requests.__anext__(), timeout=self.message_timeout_s)
        except StopAsyncIteration:
            raise WireTruncated("stream ended before an offer") from None
        except asyncio.TimeoutError:
            raise WireTimeout(f"no offer within {self.message_timeout_s:.1f} s") from None
        header = decode_metadata(first.metadata)
        header["sender"] = inbound.peer
        nbytes = header.get("nbytes")
        if type(nbytes) is not int:
            raise WireError(f"offer announces {nbytes!r} bytes")
        if not 0 <= nbytes <= self.max_payload_bytes:
            raise WireOversize(f"payload of {nbytes} bytes is outside 0..{self.max_payload_bytes}")
        return first, header, nbytes

    async def _answer(
        self, inbound: InboundExchange, first: averaging_pb2.DownloadData, header: dict[str, Any], nbytes: int,
        opened: OpenExchange,
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        inbound.arm(self.limits.transfer_s(nbytes) - (time.monotonic() - inbound.started), "slow_send")
        try:
            partner_payload = await read_payload(inbound.requests, first, nbytes, self.message_timeout_s)
            apply = opened.validate(header, partner_payload)
        except (WireError, ValueError) as e:
            inbound.disarm()
            logger.info(f"refusing an exchange with {inbound.peer}: {e}")
            self._offence(inbound.peer, e)
            yield refusal(f"invalid payload: {e}")
            return
        answer = dict(opened.header, status="ok", nbytes=payload_bytes(opened.payload), held_s=inbound.held_s)
        # the initiator takes our payload, checks it and commits: as long as our payload takes to arrive
        inbound.arm(self.limits.transfer_s(answer["nbytes"]), "uncommitted")
        for message in _messages(answer, opened.payload):
            yield message
        inbound.payload_sent = True
        try:  # waited for until the exchange's deadline
            inbound.committed = decode_metadata((await inbound.requests.__anext__()).metadata).get("commit") is True
        except (StopAsyncIteration, WireError):
            inbound.committed = False
        if inbound.committed:
            inbound.disarm()
            apply()
            yield averaging_pb2.DownloadData(metadata=encode_metadata({"applied": True}))


async def _ahead(first: averaging_pb2.DownloadData, rest: AsyncIterator[averaging_pb2.DownloadData]
                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
    """`first`, then the messages of `rest`."""
    yield first
    async for message in rest:
        yield message


async def push_pull(
    p2p: P2P, peer_id: PeerID, namespace: str, header: dict[str, Any], payload: Payload,
    validate: Callable[[dict[str, Any], Payload], Apply], max_payload_bytes: int, deadline_s: float,
    route: Route | None = None, hold_s: float = 0.0, keep_unconfirmed: bool = False, ticket: str = "",
) -> ExchangeOutcome:
    """Offer `payload` to `peer_id` (directly, or through `route`'s relay) and take its payload back; raises
    ExchangeRefused, WireError or TimeoutError.

    `hold_s`: how long the partner may hold the offer before it judges it (while it has not reached our round),
    on top of the exchange's `deadline_s`. The returned outcome's `apply` mixes on our side; the partner mixes when
    it reads our commit. `keep_unconfirmed`: a payload we committed to whose ack did not come is returned (its
    outcome not `confirmed`) instead of raising `UnconfirmedMix`. `ticket`: ours, in a signed run (a partner that
    has not read our record yet admits us by it).
    """
    started = time.monotonic()
    decision: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    offer = dict(header, nbytes=payload_bytes(payload), hold_s=hold_s, **({"ticket": ticket} if ticket else {}))
    committed: list[ExchangeOutcome] = []  # what we validated, once we committed to it

    async def requests() -> AsyncIterator[averaging_pb2.DownloadData]:
        for message in _messages(offer, payload):
            yield message
        if await asyncio.shield(decision):  # shielded: closing this stream must not cancel the decision
            yield averaging_pb2.DownloadData(metadata=encode_metadata({"commit": True}))

    try:
        outcome = await asyncio.wait_for(
            _initiate(p2p, peer_id, namespace, requests(), decision, validate, max_payload_bytes, deadline_s, route,
                      committed, hold_s > 0),
            deadline_s + hold_s)
    except (asyncio.TimeoutError, TimeoutError, UnconfirmedMix) as e:
        if not committed:
            raise
        why = str(e) if isinstance(e, UnconfirmedMix) else f"no ack within {deadline_s + hold_s:.1f} s"
        if not keep_unconfirmed:
            raise UnconfirmedMix(why, committed[0], timed_out=not isinstance(e, UnconfirmedMix)) from e
        logger.info(f"exchange with {peer_id}: {why}; the payload we committed to is kept")
        outcome = committed[0]
    finally:
        if not decision.done():
            decision.set_result(False)
    outcome.bytes_sent = payload_bytes(payload)
    outcome.seconds = time.monotonic() - started
    return outcome


async def _initiate(
    p2p: P2P, peer_id: PeerID, namespace: str, requests: AsyncIterator[averaging_pb2.DownloadData],
    decision: "asyncio.Future[bool]", validate: Callable[[dict[str, Any], Payload], Apply], max_payload_bytes: int,
    chunk_timeout_s: float, route: Route | None, committed: list[ExchangeOutcome], hold_granted: bool,
) -> ExchangeOutcome:
    if route is None:
        stream = await GossipServicer.get_stub(p2p, peer_id, namespace=namespace).rpc_exchange(requests)
    else:
        stream = await open_relayed(p2p, route, peer_id, f"exchange:{namespace}", requests)
    # closed on the way out, whatever the outcome: hivemind would otherwise go on sending the rest of our payload
    # (to a partner that refused it) until the stream is garbage-collected, holding one of the partner's slots
    async with contextlib.aclosing(stream) as responses:
        return await _exchange(responses, decision, validate, max_payload_bytes, chunk_timeout_s, committed,
                               hold_granted)


async def _exchange(
    responses: AsyncIterator[averaging_pb2.DownloadData], decision: "asyncio.Future[bool]",
    validate: Callable[[dict[str, Any], Payload], Apply], max_payload_bytes: int, chunk_timeout_s: float,
    committed: list[ExchangeOutcome], hold_granted: bool,
) -> ExchangeOutcome:
    first, answer = await _answer_of(responses, chunk_timeout_s)
    if answer.get("status") == HELD:  # it is alive and will answer once in our round: `push_pull`'s deadline rules
        if not hold_granted:
            raise UngrantedHold("partner said it holds an offer we granted no hold")
        first, answer = await _answer_of(responses, None)
    if answer.get("status") != "ok":
        raise ExchangeRefused(str(answer.get("reason", "refused")))
    nbytes = int(answer.get("nbytes", -1))
    if not 0 <= nbytes <= max_payload_bytes:
        raise WireError(f"partner announced {nbytes} bytes, outside 0..{max_payload_bytes}")
    partner_payload = await read_payload(responses, first, nbytes, chunk_timeout_s)
    outcome = ExchangeOutcome(validate(answer, partner_payload), answer, 0, payload_bytes(partner_payload), 0.0)
    committed.append(dataclasses.replace(outcome, confirmed=False))
    decision.set_result(True)
    try:
        ack = await responses.__anext__()
    except StopAsyncIteration:
        raise UnconfirmedMix("partner closed the stream before confirming the mix", committed[0]) from None
    except Exception as e:  # the stream failed under the ack (a reset, a P2P error)
        raise UnconfirmedMix(f"the stream failed before the partner confirmed the mix: {e!r}", committed[0]) from e
    if decode_metadata(ack.metadata).get("applied") is not True:
        raise WireError("partner did not confirm the mix")
    return outcome


async def _answer_of(responses: AsyncIterator[averaging_pb2.DownloadData],
                     timeout_s: float | None) -> tuple[averaging_pb2.DownloadData, dict[str, Any]]:
    """The partner's next message and its header, within `timeout_s` (a partner that vanished says nothing)."""
    try:
        first = await asyncio.wait_for(responses.__anext__(), timeout_s)
    except StopAsyncIteration:
        raise WireError("partner closed the stream without an answer") from None
    return first, decode_metadata(first.metadata)


async def serve_exchanges(p2p: P2P, handler: ExchangeHandler, entry: RelayEntry | None = None) -> None:
    """Answer offers under `handler.namespace` on `p2p` (and through relays, at `entry`): the one way a kind of
    exchange is registered."""
    servicer = GossipServicer(handler, handler.max_payload_bytes, chunk_timeout_s=handler.chunk_timeout_s,
                              reputation=handler.reputation, host_of=RemoteHosts.of(p2p).host_of)
    await servicer.add_p2p_handlers(p2p, namespace=handler.namespace)
    if entry is not None:
        entry.add_service(f"exchange:{handler.namespace}", servicer.rpc_exchange)
