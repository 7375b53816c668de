"""Stream byte counters (net/stream_bytes.py): what a round's metrics report as bytes sent and received."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import AsyncIterator as Stream  # noqa: UP035  (ServicerBase recognises typing.AsyncIterator)

import pytest
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import averaging_pb2

from p2ptrain.net import stream_bytes
from p2ptrain.net.stream_bytes import END_OF_STREAM_BYTES, FRAME_OVERHEAD, RECEIVED, SENT, StreamBytes, Traffic

OPTIONS = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False)
Message = averaging_pb2.DownloadData


def frame(message: Message) -> int:
    """What hivemind writes for one message: a marker byte, an 8-byte length, the serialized message."""
    return len(P2P.MESSAGE_MARKER) + P2P.HEADER_LEN + len(message.SerializeToString())


async def aiter_of(messages: list[Message]) -> AsyncIterator[Message]:
    for message in messages:
        yield message


def test_counted_adds_each_frame_and_the_end_of_stream_and_closes_what_it_wraps() -> None:
    async def scenario() -> None:
        counter = StreamBytes()
        messages = [Message(metadata=b"x" * 10), Message(metadata=b"y" * 300)]
        assert [m async for m in stream_bytes.counted(aiter_of(messages), counter, SENT, END_OF_STREAM_BYTES)] \
            == messages
        assert counter.totals() == (sum(frame(m) for m in messages) + FRAME_OVERHEAD, 0)

        closed = asyncio.Event()

        async def endless() -> AsyncIterator[Message]:
            try:
                while True:
                    yield Message(metadata=b"z")
            finally:
                closed.set()

        wrapped = stream_bytes.counted(endless(), counter, RECEIVED)
        await wrapped.__anext__()
        await wrapped.aclose()  # (hivemind closes a handler's stream this way when its caller goes)
        assert closed.is_set() and counter.totals()[RECEIVED] == frame(Message(metadata=b"z"))

    asyncio.run(scenario())


def test_traffic_takes_what_was_counted_since_it_last_took() -> None:
    counter = StreamBytes()
    counter.add_(SENT, 5)
    traffic = Traffic(counter)  # what came before it is not its business
    counter.add_(SENT, 7)
    counter.add_(RECEIVED, 3)
    assert traffic.take_() == (7, 3) and traffic.take_() == (0, 0)


class Echo(ServicerBase):
    """Answers each request with a reply twice its size; stops reading after `stop_after` requests."""

    def __init__(self, stop_after: int | None = None):
        self.stop_after = stop_after

    async def rpc_echo(self, requests: Stream[Message], context: P2PContext) -> Stream[Message]:
        read = 0
        async for request in requests:
            yield Message(metadata=request.metadata * 2)
            read += 1
            if read == self.stop_after:
                return


@pytest.mark.network
@pytest.mark.parametrize("stop_after", [None, 1])
def test_both_ends_of_a_stream_count_the_same_bytes(stop_after: int | None) -> None:
    """An initiator's sent bytes are its responder's received bytes and the other way round, frame for frame; a
    responder that stops reading (as a refusal does) counts what it read, its initiator what it wrote."""
    async def scenario() -> None:
        responder = await P2P.create(**OPTIONS)
        initiator = await P2P.create(initial_peers=await responder.get_visible_maddrs(), **OPTIONS)
        try:
            await Echo(stop_after).add_p2p_handlers(responder, namespace="bytes")
            ours, theirs = stream_bytes.counter_of(initiator.peer_id), stream_bytes.counter_of(responder.peer_id)
            before_ours, before_theirs = ours.totals(), theirs.totals()
            requests = [Message(metadata=b"a" * 1000), Message(metadata=b"b" * 50_000)]
            first_reply = asyncio.Event()

            async def one_at_a_time() -> AsyncIterator[Message]:
                """The second request goes once the first reply is here: a responder that stops after one request
                closes its stream, and a reply still in flight when that close meets the second request is lost
                (libp2p resets the stream), which would leave the two ends' counts apart for a reason not theirs."""
                yield requests[0]
                await first_reply.wait()
                yield requests[1]

            stub = Echo.get_stub(initiator, responder.peer_id, namespace="bytes")
            replies = []
            try:
                async for reply in await stub.rpc_echo(one_at_a_time()):
                    replies.append(reply)
                    first_reply.set()
            except ConnectionError:  # our second request met the closed stream (reset or broken pipe): a refusal
                assert stop_after is not None
            await asyncio.sleep(0.5)  # the responder's side finishes counting after our last read
            sent = [ours.totals()[i] - before_ours[i] for i in (SENT, RECEIVED)]
            served = [theirs.totals()[i] - before_theirs[i] for i in (SENT, RECEIVED)]
            assert sent[RECEIVED] == served[SENT] == sum(frame(r) for r in replies) > 0
            read = requests if stop_after is None else requests[:stop_after]
            assert len(replies) == len(read)
            end = END_OF_STREAM_BYTES if stop_after is None else 0
            assert served[RECEIVED] == sum(frame(r) for r in read) + end
            assert sent[SENT] >= served[RECEIVED] and sent[SENT] <= sum(frame(r) for r in requests) + \
                END_OF_STREAM_BYTES
        finally:
            await initiator.shutdown()
            await responder.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))
