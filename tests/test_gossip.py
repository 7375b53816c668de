"""The gossip exchange under faults, on real hivemind P2P over loopback: a partner that sends NaN, a wrong shape,
a wrong dtype, a truncated payload, dies mid-stream, stalls, or never confirms leaves the initiator unchanged."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator  # noqa: UP035  (ServicerBase recognises typing.AsyncIterator)

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2, runtime_pb2

from p2ptrain.maths.codecs import relative_encode
from p2ptrain.net import exchange
from p2ptrain.net.exchange import push_pull, serve_exchanges
from p2ptrain.net.wire import encode_metadata, stream_parts
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.interface import ExchangeRecord, RoundSync
from p2ptrain.sync.param_gossip import ParamGossip
from p2ptrain.timing import SETUP_FLOOR_S

pytestmark = [pytest.mark.network]

RUN, FINGERPRINT = "faults", "fp-1"
SHAPES = [(64, 32), (32,), (5, 7)]


def reference() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(s) for s in SHAPES]


def near(values: list[torch.Tensor], scale: float = 0.01) -> list[torch.Tensor]:
    return [v + scale * torch.randn_like(v) for v in values]


def moved(values: list[torch.Tensor], round_: int) -> list[torch.Tensor]:
    return [v + 1e-3 * round_ for v in values]


class GossipServicer(exchange.GossipServicer):  # same class name: hivemind routes calls by it
    """A partner that misbehaves in one chosen way."""

    def __init__(self, fault: str):
        super().__init__(handler=None, max_payload_bytes=10**8, chunk_timeout_s=5.0)  # type: ignore[arg-type]
        self.fault = fault

    def _payload(self) -> list[runtime_pb2.Tensor]:
        good = near(reference())
        if self.fault == "nan":
            good[0][0, 0] = float("nan")
        if self.fault == "shape":
            good[1] = torch.zeros(33)
        payload = relative_encode(good, reference(), "fp16")
        if self.fault == "dtype":
            payload[2] = serialize_torch_tensor(torch.zeros(5, 7, dtype=torch.float64))
        return payload

    async def rpc_exchange(self, requests: AsyncIterator[averaging_pb2.DownloadData],
                           _context: Any) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for _message in requests:  # drain the offer (we never validate it)
            break
        if self.fault == "stall":
            await asyncio.sleep(3600)
        payload = self._payload()
        nbytes = sum(len(t.buffer) for t in payload) + (100 if self.fault == "truncated" else 0)
        parts = list(stream_parts(payload))
        header = encode_metadata({"status": "ok", "codec": "fp16", "nbytes": nbytes, "round": 0})
        yield averaging_pb2.DownloadData(tensor_part=parts[0], metadata=header)
        if self.fault == "midstream":
            raise RuntimeError("partner crashed mid-stream")
        for part in parts[1:]:
            yield averaging_pb2.DownloadData(tensor_part=part)
        if self.fault == "no_ack":
            await asyncio.sleep(3600)


async def start_pair() -> tuple[P2P, P2P]:
    options = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False)
    a = await P2P.create(**options)
    b = await P2P.create(initial_peers=await a.get_visible_maddrs(), **options)
    return a, b


def make_mixer(p2p: P2P, **config: Any) -> ParamGossip:
    sync = SyncConfig(mode="gasloc", exchange_safety_factor=1.0, state_download_timeout_s=2.0, **config)
    return ParamGossip(p2p, RUN, FINGERPRINT, "gasloc", reference(), sync, seed=0)


def state_of(mixer: ParamGossip) -> list[torch.Tensor]:
    return [t.clone() for t in mixer._correction] + [t.clone() for t in mixer._base]


@pytest.mark.parametrize("fault", ["nan", "shape", "dtype", "truncated", "midstream", "stall", "no_ack"])
def test_a_faulty_partner_leaves_the_initiator_bit_identical(fault: str) -> None:
    async def scenario() -> None:
        a, b = await start_pair()
        try:
            await GossipServicer(fault).add_p2p_handlers(b, namespace=f"{RUN}.gasloc")
            mixer = make_mixer(a)
            mixer.set_base_(reference())
            before = state_of(mixer)
            value = near(reference())
            original = [v.clone() for v in value]
            mixed, stats = await mixer.mix(value, [b.peer_id.to_base58()], round_=0)
            assert stats.failed == 1 and stats.partners == [] and stats.group_size == 1
            assert all(torch.equal(m, o) for m, o in zip(mixed, original, strict=True))
            assert all(torch.equal(v, o) for v, o in zip(value, original, strict=True))
            assert all(torch.equal(x, y) for x, y in zip(state_of(mixer), before, strict=True))
        finally:
            await a.shutdown()
            await b.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


@dataclasses.dataclass
class Offer:
    name: str
    header: dict[str, Any]
    tensors: list[torch.Tensor]


def bad_offers() -> list[Offer]:
    header = {"run_id": RUN, "fingerprint": FINGERPRINT, "kind": "gasloc", "round": 0, "codec": "fp16",
              "weight": 0.5, "deadline_s": 20.0}
    far = [v * 50 for v in reference()]  # 49× our norm away: beyond the default bound of 10
    return [Offer("inf", header, near(reference())), Offer("too far", header, far),
            Offer("other run", dict(header, run_id="other"), near(reference())),
            Offer("other model", dict(header, fingerprint="fp-2"), near(reference())),
            Offer("bad weight", dict(header, weight=0.9), near(reference()))]


@pytest.mark.parametrize("offer", bad_offers(), ids=lambda o: o.name)
def test_an_invalid_offer_is_refused_and_leaves_the_responder_unchanged(offer: Offer) -> None:
    async def scenario() -> None:
        a, b = await start_pair()
        try:
            responder = make_mixer(b)
            await serve_exchanges(b, responder.driver)
            responder.set_base_(reference())
            before = state_of(responder)
            payload = relative_encode(offer.tensors, reference(), "fp16")
            if offer.name == "inf":  # our encoder refuses non-finite values: poison the bytes by hand
                payload[2].buffer = b"\x00\x7c" + payload[2].buffer[2:]  # fp16 +inf
            with pytest.raises(exchange.ExchangeRefused):
                await push_pull(a, b.peer_id, f"{RUN}.gasloc", offer.header, payload, lambda h, p: lambda: None,
                                10**8, deadline_s=20)
            assert all(torch.equal(x, y) for x, y in zip(state_of(responder), before, strict=True))
            assert responder.take_incoming_stats().answered == []
        finally:
            await a.shutdown()
            await b.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_two_honest_peers_end_with_the_pair_average_and_preserve_the_sum() -> None:
    async def scenario() -> None:
        a, b = await start_pair()
        try:
            initiator, responder = make_mixer(a), make_mixer(b)
            await serve_exchanges(b, responder.driver)
            theirs = near(reference(), 0.05)
            ours = near(reference(), 0.05)
            for mixer, value in ((responder, theirs), (initiator, ours)):  # a round's step each, from θ_0: the
                mixer.set_base_(reference())  # partner is then within the clipping radius (2 × our step)
                mixer.set_base_(value)
            mixed, stats = await initiator.mix(ours, [b.peer_id.to_base58()], round_=0)
            assert stats.partners == [b.peer_id.to_base58()] and stats.failed == 0
            correction = responder.take_correction_()
            responder_after = [t + c for t, c in zip(theirs, correction, strict=True)]
            for m, r, o, t in zip(mixed, responder_after, ours, theirs, strict=True):
                assert torch.allclose(m, (o + t) / 2, atol=1e-3)  # fp16 differences from θ_0
                assert torch.allclose(m, r, atol=2e-3)  # the pair ends (nearly) equal
                assert torch.allclose(m + r, o + t, atol=1e-3)  # and their sum is preserved
            assert stats.bytes_sent == sum(2 * t.numel() for t in ours)  # fp16: 2 bytes per value
        finally:
            await a.shutdown()
            await b.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_a_busy_refusal_reaches_an_initiator_that_is_still_streaming_a_large_payload() -> None:
    """The responder must not close its end while our payload still arrives: p2pd would reset the stream and
    drop the refusal, and we would wait out the deadline instead of trying another peer at once."""
    big = [torch.randn(2**21), torch.randn(2**20)]  # 6 MB as fp16 differences
    header = {"run_id": RUN, "fingerprint": FINGERPRINT, "kind": "gasloc", "round": 0, "codec": "fp16",
              "weight": 0.5, "deadline_s": 20.0}

    async def scenario() -> None:
        a, b = await start_pair()
        try:
            responder = ParamGossip(b, RUN, FINGERPRINT, "gasloc", big, SyncConfig(mode="gasloc"), seed=0)
            await serve_exchanges(b, responder.driver)
            responder.answering = True  # in the middle of another exchange
            payload = relative_encode(near(big), big, "fp16")
            for _ in range(10):
                started = asyncio.get_running_loop().time()
                # busy; or, when the responder has not yet seen our last two refused streams close (a loaded CI
                # machine), the per-peer cap: a refusal either way, never a reset or the deadline
                with pytest.raises(exchange.ExchangeRefused, match="busy|exchanges at once"):
                    await push_pull(a, b.peer_id, f"{RUN}.gasloc", header, payload, lambda h, p: lambda: None,
                                    10**8, deadline_s=20)
                assert asyncio.get_running_loop().time() - started < 10
        finally:
            await a.shutdown()
            await b.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=300))


def test_repeated_honest_exchanges_all_complete_on_both_sides() -> None:
    """Every ack arrives: the initiator mixes exactly as often as the responder did (no one-sided mixes)."""
    async def scenario() -> None:
        a, b = await start_pair()
        try:
            initiator, responder = make_mixer(a), make_mixer(b)
            await serve_exchanges(b, responder.driver)
            completed = 0
            for round_ in range(30):
                responder.round = round_  # a partner may open a bounded number of exchanges with us per round
                # values that move each round, as training moves them (`reference` reseeds, so `near` alone gives one
                # value every round: a replay, sync/replay_check.py)
                responder.set_base_(moved(near(reference(), 0.05), round_))
                _mixed, stats = await initiator.mix(moved(near(reference(), 0.05), round_), [b.peer_id.to_base58()],
                                                    round_)
                assert stats.failed == 0, "an exchange failed between two idle peers on loopback"
                completed += len(stats.partners)
            incoming = responder.take_incoming_stats()
            assert completed == 30 and incoming.answered == [a.peer_id.to_base58()] * 30
            assert incoming.bytes_sent == incoming.bytes_received > 0  # the responder's side counts its traffic
        finally:
            await a.shutdown()
            await b.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=300))


def test_the_responder_learns_who_offers_from_libp2p_not_from_the_offer() -> None:
    seen: list[str] = []

    class Recorder(exchange.JudgedAtOnce):
        def open(self, header: dict[str, Any]) -> str:
            seen.append(header["sender"])
            return "busy"

    async def scenario() -> None:
        a, b = await start_pair()
        try:
            await exchange.GossipServicer(Recorder(), 10**6, chunk_timeout_s=5.0).add_p2p_handlers(
                b, namespace=f"{RUN}.gasloc")
            header = {"run_id": RUN, "sender": "somebody-else"}
            with pytest.raises(exchange.ExchangeRefused, match="busy"):
                await push_pull(a, b.peer_id, f"{RUN}.gasloc", header, relative_encode(near(reference()),
                                reference()), lambda h, p: lambda: None, 10**8, deadline_s=20)
            assert seen == [a.peer_id.to_base58()]
        finally:
            await a.shutdown()
            await b.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


@pytest.mark.parametrize("keep", [False, True])
def test_a_payload_committed_to_whose_ack_never_comes_is_handed_back_only_to_a_caller_that_keeps_it(keep: bool) -> None:
    """The partner sends its payload and then nothing: past the deadline, push_pull raises UnconfirmedMix (nothing
    applied), or, with `keep_unconfirmed` (an all-reduce, whose members confirm what they reduced), returns the
    validated payload marked unconfirmed."""
    async def scenario() -> None:
        a, b = await start_pair()
        try:
            await GossipServicer("no_ack").add_p2p_handlers(b, namespace=f"{RUN}.gasloc")
            applied: list[int] = []
            call = push_pull(a, b.peer_id, f"{RUN}.gasloc", {"round": 0}, relative_encode(near(reference()),
                             reference(), "fp16"), lambda h, p: lambda: applied.append(len(p)), 10**8,
                             deadline_s=1.0, keep_unconfirmed=keep)
            if keep:
                outcome = await call
                assert not outcome.confirmed and outcome.bytes_received > 0 and outcome.seconds >= 1.0
                outcome.apply()
                assert applied == [len(SHAPES)]
            else:
                with pytest.raises(exchange.UnconfirmedMix) as raised:
                    await call
                assert not raised.value.outcome.confirmed and raised.value.timed_out and applied == []
        finally:
            await a.shutdown()
            await b.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_a_partner_that_mixed_with_us_both_ways_in_one_round_counts_once() -> None:
    """GASLoC's rounds are not aligned: the partner we opened to may open to us in the same round of ours. The round
    averaged 2 peers, not 3 (what `peers` says in the testnet's lines)."""
    ours = RoundSync()
    ours.add_exchange_(ExchangeRecord(partner="b", bytes_sent=1, bytes_received=1, seconds=0.1, codec="fp16"))
    assert ours.add_incoming_(RoundSync(group_size=0, answered=["b", "c", "c"])).group_size == 3  # us, b and c


def test_a_partner_whose_exchanges_fail_sits_out_one_then_two_rounds_and_a_round_pays_one_dead_partner() -> None:
    """A peer that left (its record lingers) fails every exchange we open: it is not drawn the round after its
    first failure, nor the two after its second (`FailedPartners`). Two partners that stall cost a round one
    deadline: after the first time-out the round opens no more, and the link's deadline does not grow for it."""
    async def scenario() -> None:
        a, b = await start_pair()
        c = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False,
                             use_relay=False, initial_peers=await a.get_visible_maddrs())
        try:
            gone = (await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False,
                                     use_relay=False))
            gone_id = gone.peer_id.to_base58()
            await gone.shutdown()
            mixer = make_mixer(a)
            mixer.set_base_(reference())
            failed_by_round = []
            for round_ in range(6):
                _, stats = await mixer.mix(near(reference()), [gone_id], round_=round_)
                failed_by_round.append(stats.failed)
            assert failed_by_round == [1, 0, 1, 0, 0, 1]

            for servicer_host in (b, c):
                await GossipServicer("stall").add_p2p_handlers(servicer_host, namespace=f"{RUN}.gasloc")
            started = asyncio.get_running_loop().time()
            _, stats = await mixer.mix(near(reference()), [b.peer_id.to_base58(), c.peer_id.to_base58()], round_=0)
            assert stats.failed == 1 and stats.partners == []
            assert asyncio.get_running_loop().time() - started < 2 * SETUP_FLOOR_S
            # one time-out is no proof of a slow link: the next deadline is still the floor, not 4× it
            assert {mixer.links.estimate_bytes_per_s(p.peer_id.to_base58()) for p in (b, c)} == \
                {mixer.links.prior_bytes_per_s}
        finally:
            for p2p in (a, b, c):
                await p2p.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))
