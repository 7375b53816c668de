"""Limits a responder puts on untrusted initiators (issue 9), on real hivemind P2P over loopback: stream frames are
capped before they are allocated, exchanges are dropped at deadlines derived from their bytes and free their slot,
concurrent offers are capped per peer and in all, banned peers are refused at once, and every offence is reported
under the peer id libp2p authenticated."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psutil
import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2, runtime_pb2

from p2ptrain.net import exchange
from p2ptrain.net.frame_cap import MAX_FRAME_BYTES, FrameTooLarge, receive_bounded
from p2ptrain.net.remote_hosts import RemoteHosts
from p2ptrain.net.reputation import ROUNDS_PER_BAN, Reputation, ReputationConfig
from p2ptrain.net.responder_limits import ResponderLimits
from p2ptrain.net.wire import decode_metadata, encode_metadata, payload_bytes, stream_parts

NS = "limits.gossip"
OPTIONS = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False)
Message = averaging_pb2.DownloadData


def tensors(n: int) -> list[runtime_pb2.Tensor]:
    return [serialize_torch_tensor(torch.zeros(n))]


class Exchange:
    """The responder's side of an accepted exchange: poisoned payloads fail validation."""

    def __init__(self, handler: Handler, answer_values: int):
        self.handler, self.header, self.payload = handler, {"codec": "none"}, tensors(answer_values)

    def validate(self, partner_header: dict[str, Any], partner_payload: list[runtime_pb2.Tensor]) -> Any:
        if partner_header.get("poison"):
            raise ValueError("poisoned payload")
        return lambda: self.handler.applied.append(partner_header["sender"])

    def close(self) -> None:
        self.handler.open_now -= 1
        self.handler.closed.set()


class Handler(exchange.JudgedAtOnce):
    """An ExchangeHandler that accepts `capacity` exchanges at once and records what happens to them."""

    namespace, max_payload_bytes, chunk_timeout_s = NS, 2**22, 60.0  # 60 s: SyncConfig.state_download_timeout_s

    def __init__(self, capacity: int = 100, answer_values: int = 16):
        self.capacity, self.answer_values = capacity, answer_values
        self.reputation = Reputation()
        self.opened: list[str] = []
        self.applied: list[str] = []
        self.open_now = 0
        self.closed = asyncio.Event()

    def open(self, header: dict[str, Any]) -> Exchange | str:
        if self.open_now >= self.capacity:
            return "busy"
        self.open_now += 1
        self.opened.append(header["sender"])
        return Exchange(self, self.answer_values)


@contextlib.asynccontextmanager
async def swarm(n: int) -> AsyncIterator[list[P2P]]:
    """`n` P2P daemons on loopback; the first is the responder, the others initiators (distinct peer ids)."""
    p2ps = [await P2P.create(**OPTIONS)]
    try:
        for _ in range(n - 1):
            p2ps.append(await P2P.create(initial_peers=await p2ps[0].get_visible_maddrs(), **OPTIONS))
        yield p2ps
    finally:
        for p2p in p2ps:
            await p2p.shutdown()


async def serve(p2p: P2P, handler: Handler, limits: ResponderLimits = ResponderLimits(),
                host_caps: bool = False) -> exchange.GossipServicer:
    servicer = exchange.GossipServicer(handler, handler.max_payload_bytes, handler.chunk_timeout_s,
                                       reputation=handler.reputation, limits=limits,
                                       host_of=RemoteHosts.of(p2p).host_of if host_caps else None)
    await servicer.add_p2p_handlers(p2p, namespace=NS)
    return servicer


def offer(payload: list[runtime_pb2.Tensor], **header: Any) -> list[Message]:
    """An offer's messages; `nbytes` defaults to what the payload holds."""
    header.setdefault("nbytes", payload_bytes(payload))
    parts = list(stream_parts(payload))
    return [Message(tensor_part=parts[0], metadata=encode_metadata(header))] + [Message(tensor_part=p)
                                                                              for p in parts[1:]]


async def initiate(p2p: P2P, responder: P2P, messages: list[Message], then: Callable[[], Awaitable[Any]] | None = None,
                   gate: Callable[[], Awaitable[Any]] | None = None) -> AsyncIterator[Message]:
    """Open an exchange by hand: send the first of `messages`, wait for `gate`, send the rest, then wait for `then`
    (the stream stays open meanwhile); returns the responses. (libp2p opens a stream with its first message.) `gate`
    and `then` are called only when reached: a stream closed before leaves no coroutine never awaited."""
    async def requests() -> AsyncIterator[Message]:
        for i, message in enumerate(messages):
            if i == 1 and gate is not None:
                await gate()
            yield message
        if then is not None:
            await then()

    stub = exchange.GossipServicer.get_stub(p2p, responder.peer_id, namespace=NS)
    return await stub.rpc_exchange(requests())


async def answer_of(responses: AsyncIterator[Message]) -> dict[str, Any]:
    return decode_metadata((await asyncio.wait_for(responses.__anext__(), timeout=10)).metadata)


def offences(handler: Handler, p2p: P2P) -> dict[str, int]:
    return handler.reputation.offences().get(p2p.peer_id.to_base58(), {})


# ---- 1. stream frames are capped before allocation -------------------------------------------------------------------

def test_a_frame_longer_than_the_cap_is_refused_before_its_body_is_read() -> None:
    async def scenario() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data((MAX_FRAME_BYTES + 1).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"x" * 100)
        with pytest.raises(FrameTooLarge, match=str(MAX_FRAME_BYTES + 1)):
            await receive_bounded(reader)
        reader.feed_data(b"x" * 100)  # 200 bytes buffered: nothing was read past the length
        assert len(await reader.readexactly(200)) == 200
        reader.feed_data(MAX_FRAME_BYTES.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"y" * MAX_FRAME_BYTES)
        assert await receive_bounded(reader) == b"y" * MAX_FRAME_BYTES  # a frame at the cap is read whole

    asyncio.run(scenario())
    assert P2P.receive_raw_data is receive_bounded  # importing p2ptrain.net.exchange installed it


@pytest.mark.network
def test_a_stream_announcing_a_terabyte_is_cut_off_with_bounded_memory() -> None:
    """The measured attack: one stream announces 2^40 bytes and sends on; unbounded, the victim buffered it all."""
    attack_bytes, chunk = 256 * 2**20, bytes(2**20)

    async def scenario() -> None:
        async with swarm(2) as (victim, attacker):
            received: list[Any] = []

            async def handler(requests: AsyncIterator[Message], _context: Any) -> AsyncIterator[Message]:
                async for request in requests:
                    received.append(request)
                    yield Message()

            await victim.add_protobuf_handler("victim", handler, Message, stream_input=True, stream_output=True)
            rss_before = psutil.Process().memory_info().rss  # attacker and victim both: the bound covers the two
            _info, _reader, writer = await attacker.call_binary_stream_handler(victim.peer_id, "victim")
            writer.write(P2P.MESSAGE_MARKER + (2**40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            sent, peak = 0, rss_before
            with contextlib.suppress(ConnectionError):
                while sent < attack_bytes:
                    writer.write(chunk)
                    await asyncio.wait_for(writer.drain(), timeout=10)
                    sent += len(chunk)
                    peak = max(peak, psutil.Process().memory_info().rss)
            writer.close()
            growth_mb = (peak - rss_before) / 2**20
            print(f"attacker sent {sent / 2**20:.0f} MiB before the victim closed; RSS grew {growth_mb:.1f} MB")
            assert growth_mb < 64 and received == []
            assert sent < attack_bytes, "the victim kept the stream open"

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


# ---- 2. deadlines derived from the bytes at stake --------------------------------------------------------------------

@pytest.mark.network
@pytest.mark.slow
def test_an_offer_that_stalls_before_its_last_byte_is_dropped_at_its_deadline_and_frees_the_slot() -> None:
    """Default limits, and the handler's 60 s chunk timeout: the stalled offer holds the responder's only slot for
    floor_s + announced bytes / min_bytes_per_s (≈ 5 s), not 60 s; then an honest offer is served."""
    payload = tensors(1024)
    nbytes = payload_bytes(payload) + 100  # announces 100 bytes it never sends

    async def scenario() -> None:
        async with swarm(3) as (responder, stalling, honest):
            handler = Handler(capacity=1)
            servicer = await serve(responder, handler)
            never = asyncio.Event()
            started = time.monotonic()
            stalled = await initiate(stalling, responder, offer(payload, nbytes=nbytes), then=never.wait)
            await asyncio.wait_for(handler.closed.wait(), timeout=30)
            held_s = time.monotonic() - started
            print(f"a stalled offer held the responder's slot for {held_s:.1f} s")
            assert ResponderLimits().transfer_s(nbytes) - 0.5 < held_s < ResponderLimits().transfer_s(nbytes) + 2
            assert offences(handler, stalling) == {"slow_send": 1}
            assert servicer.slots.held == {} and handler.applied == []
            ok = await initiate(honest, responder, offer(payload), then=lambda: asyncio.sleep(0))
            assert (await answer_of(ok))["status"] == "ok" and handler.opened[-1] == honest.peer_id.to_base58()
            never.set()
            del stalled  # held until here: hivemind closes a stream whose responses are dropped

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


@pytest.mark.network
def test_an_initiator_that_takes_our_payload_and_never_commits_is_dropped() -> None:
    """It neither reads our (large) answer nor commits: our send may block, the commit never comes; the exchange is
    dropped once our payload had time to arrive at the slowest rate we serve, and nothing is applied."""
    limits = ResponderLimits(min_bytes_per_s=16 * 2**20, floor_s=1.0)

    async def scenario() -> None:
        async with swarm(2) as (responder, initiator):
            handler = Handler(answer_values=2**21)  # 8 MiB answer
            servicer = await serve(responder, handler, limits)
            never = asyncio.Event()
            started = time.monotonic()
            await initiate(initiator, responder, offer(tensors(16)), then=never.wait)
            await asyncio.wait_for(handler.closed.wait(), timeout=30)
            held_s = time.monotonic() - started
            print(f"an initiator that never committed held the slot for {held_s:.1f} s")
            assert held_s < limits.transfer_s(8 * 2**20) + 2
            assert offences(handler, initiator) == {"uncommitted": 1} and handler.applied == []
            assert servicer.slots.held == {}
            never.set()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


# ---- 3. concurrent offers ----------------------------------------------------------------------------------------

@pytest.mark.network
def test_offers_beyond_the_per_peer_and_total_caps_are_refused_without_reading_them() -> None:
    limits = ResponderLimits(per_peer=2, total=3)

    async def scenario() -> None:
        async with swarm(4) as (responder, greedy, other, late):
            handler = Handler()
            await serve(responder, handler, limits)
            hold, held = asyncio.Event(), []  # (a stream whose responses are dropped is closed)
            for p2p in (greedy, greedy, other):  # three exchanges held open (accepted, never committed)
                held.append(await initiate(p2p, responder, offer(tensors(16)), then=hold.wait))
                assert (await answer_of(held[-1]))["status"] == "ok"
            for p2p, reason in ((greedy, "more than 2 exchanges at once"), (late, "busy")):
                answered = asyncio.Event()  # the payload's second chunk is sent only after the refusal came
                refused = await initiate(p2p, responder, offer(tensors(2**19)), gate=answered.wait)
                assert await answer_of(refused) == {"status": "refused", "reason": reason}
                answered.set()
            assert len(handler.opened) == 3
            assert offences(handler, greedy) == {"too_many_opens": 1} and offences(handler, late) == {}
            hold.set()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


@pytest.mark.network
def test_the_peers_of_one_host_share_its_exchanges_and_its_share_taken_is_no_offence() -> None:
    """Identities are free: beyond `per_host` exchanges at once from one host (127.0.0.2 here; 127.0.0.1 is this
    machine's own and has no cap), another of its identities is refused as busy, with no offence (the peers of one
    home share its address), while a peer of another host is served."""
    limits = ResponderLimits(per_peer=2, per_host=2)

    async def scenario() -> None:
        responder = await P2P.create(**OPTIONS)
        options = {**OPTIONS, "initial_peers": await responder.get_visible_maddrs()}
        one_host = [await P2P.create(**{**options, "host_maddrs": ["/ip4/127.0.0.2/tcp/0"]}) for _ in range(2)]
        other_host = await P2P.create(**{**options, "host_maddrs": ["/ip4/127.0.0.3/tcp/0"]})
        try:
            handler = Handler()
            servicer = await serve(responder, handler, limits, host_caps=True)
            hold, held = asyncio.Event(), []
            for p2p in (one_host[0], one_host[0]):  # the host's share, held open by one of its identities
                held.append(await initiate(p2p, responder, offer(tensors(16)), then=hold.wait))
                assert (await answer_of(held[-1]))["status"] == "ok"
            answered = asyncio.Event()
            refused = await initiate(one_host[1], responder, offer(tensors(2**19)), gate=answered.wait)
            busy = {"status": "refused", "reason": "busy: 2 exchanges with its host at once"}
            assert await answer_of(refused) == busy
            answered.set()
            served = await initiate(other_host, responder, offer(tensors(16)), then=hold.wait)
            assert (await answer_of(served))["status"] == "ok"
            assert servicer.slots.held_by_host == {"127.0.0.2": 2, "127.0.0.3": 1}
            assert offences(handler, one_host[1]) == {} and len(handler.opened) == 3
            hold.set()
        finally:
            for p2p in (other_host, *one_host, responder):
                await p2p.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


# ---- 4. reputation ----------------------------------------------------------------------------------------------

def malformed(payload: list[runtime_pb2.Tensor]) -> list[Message]:
    messages = offer(payload)
    messages[0].metadata = b"\x80 not json"
    return messages


OFFENCES: dict[str, Callable[[list[runtime_pb2.Tensor]], list[Message]]] = {
    "malformed": malformed,
    "oversize": lambda payload: offer(payload, nbytes=Handler.max_payload_bytes + 1),
    "invalid_payload": lambda payload: offer(payload, poison=True),
}


@pytest.mark.network
@pytest.mark.parametrize("offence", list(OFFENCES))
def test_a_bad_offer_is_refused_and_reported_under_the_authenticated_peer_id(offence: str) -> None:
    async def scenario() -> None:
        async with swarm(2) as (responder, initiator):
            handler = Handler()
            await serve(responder, handler)
            responses = await initiate(initiator, responder, OFFENCES[offence](tensors(16)))
            assert (await answer_of(responses))["status"] == "refused"
            assert handler.reputation.offences() == {initiator.peer_id.to_base58(): {offence: 1}}
            assert handler.applied == []

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


@pytest.mark.network
def test_a_banned_peer_is_refused_at_once_and_others_are_served() -> None:
    async def scenario() -> None:
        async with swarm(3) as (responder, banned, honest):
            handler = Handler()
            await serve(responder, handler)
            handler.reputation.penalise(banned.peer_id.to_base58(), "wrong_state", "a lying snapshot")
            answered = asyncio.Event()
            refused = await initiate(banned, responder, offer(tensors(2**19)), gate=answered.wait)
            assert await answer_of(refused) == {"status": "refused", "reason": "banned or not admitted"}
            answered.set()
            outcome = await exchange.push_pull(honest, responder.peer_id, NS, {}, tensors(16),
                                               lambda h, p: lambda: None, 2**22, deadline_s=20)
            assert outcome.partner_header["status"] == "ok"
            assert handler.opened == [honest.peer_id.to_base58()] == handler.applied

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


@pytest.mark.parametrize("round_s", [1.0, 300.0])
def test_an_offence_once_a_round_ends_in_a_ban_that_outlasts_the_next_round(round_s: float) -> None:
    """One hard clip a round (weight 1 of the ban score 4): on a swarm of 5-minute rounds, with bans and scores
    in seconds alone (60 s; halving every 120 s), the score settled at 1.2 and the attacker was never banned. Bans
    and scores now last at least ROUNDS_PER_BAN of our rounds."""
    now = [0.0]
    reputation = Reputation(clock=lambda: now[0])
    for _ in range(3):
        reputation.note_round_s(round_s)
    rounds_to_ban = None
    for round_ in range(1, 9):
        now[0] += round_s
        if reputation.penalise("attacker", "clipped", f"round {round_}"):
            rounds_to_ban = round_
            break
    assert rounds_to_ban is not None and rounds_to_ban <= 5, reputation.score("attacker")
    now[0] += round_s
    assert reputation.is_banned("attacker")  # still out of its next round
    left = reputation.banned()["attacker"]
    assert left == pytest.approx(max(ReputationConfig().ban_s, ROUNDS_PER_BAN * round_s) - round_s)
    reputation.note_round_s(float("nan"))  # a length that is not one changes nothing
    assert reputation.round_s == pytest.approx(round_s)
