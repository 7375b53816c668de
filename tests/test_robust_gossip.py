"""Hostile partners against robust gossip (issue 9), on real hivemind P2P over loopback.

An attacker is a mixer whose `outgoing` (the one place where what a peer sends is formed) sends a tampered value.
It knows the victim's exact value (an exchange opened and never committed reveals it): the worst case. The victim
and its honest neighbour drive their mixers as GaslocSync does (γ = 0, a scripted inner phase): set the anchor,
propose y = θ + step + corrections, mix y, take the corrections.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from swarm_utils import replace_section, run_peers, shutdown, start_p2ps, start_peer, tiny_config

from p2ptrain.maths import codecs
from p2ptrain.maths.codecs import relative_encode
from p2ptrain.maths.outer_optimizer import OuterConfig, OuterOptimizer
from p2ptrain.maths.robust import HARD_CLIP_FACTOR, SPREAD, all_finite
from p2ptrain.metrics import RoundMetrics
from p2ptrain.net.exchange import ExchangeRefused, push_pull, serve_exchanges
from p2ptrain.net.responder_limits import OfferLimit
from p2ptrain.peer import TrainingPeer
from p2ptrain.sync import build
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.contribution import WORK_KEY
from p2ptrain.sync.factored import FactoredSync, GossipMix2
from p2ptrain.sync.gasloc import GaslocSync
from p2ptrain.sync.grad_gossip import GradGossip
from p2ptrain.sync.interface import RoundContext
from p2ptrain.sync.param_gossip import (
    JUMP_GRACE_ROUNDS,
    OFFER_BURST,
    OFFERS_PER_S,
    OPENS_PER_ROUND,
    ParamGossip,
)
from p2ptrain.sync.refusals import Refusal
from p2ptrain.sync.round_retry import FIRST_RETRY_S, retry_delay_s
from p2ptrain.sync.state_evidence import STATE_SAMPLE
from p2ptrain.tensor_layout import distance, norm
from p2ptrain.testnet.adversary import Attack, HostileConduct
from p2ptrain.testnet.sybils import StallingIdentities
from p2ptrain.timing import POLL_S

Tensors = list[torch.Tensor]
RUN, FINGERPRINT = "robust", "fp-1"
SHAPES = [(64, 32), (32,), (5, 7)]
STEP = 0.5  # ‖one round's honest step‖, about 1 % of ‖θ_0‖ ≈ 46
TRAINED = 10.0  # ‖θ − θ_0‖ when the test starts: the victim has moved away from θ_0
W = 1 / 3  # the victim mixes with 2 partners a round; the attacker offers 1/2 and gets 1/3


def reference() -> Tensors:
    torch.manual_seed(0)
    return [torch.randn(s) for s in SHAPES]


def random_direction(seed: int, length: float) -> Tensors:
    generator = torch.Generator().manual_seed(seed)
    raw = [torch.randn(s, generator=generator) for s in SHAPES]
    return [t * (length / norm(raw)) for t in raw]


def plus(*terms: Sequence[torch.Tensor]) -> Tensors:
    return [torch.stack(list(group)).sum(0) for group in zip(*terms, strict=True)]


def scaled(tensors: Sequence[torch.Tensor], factor: float) -> Tensors:
    return [t * factor for t in tensors]


def honest_step(round_: int, peer: int) -> Tensors:
    """A round's step: a direction the honest peers share, and a part of their own."""
    return plus(random_direction(1000 + round_, 0.9 * STEP), random_direction(10 * round_ + peer, 0.4 * STEP))


def public_value(mixer: ParamGossip) -> Tensors:
    """What the mixer answers with now (base + corrections): what an uncommitted exchange shows a prober."""
    return [b + c for b, c in zip(mixer._base, mixer._correction, strict=True)]


def config(**changes: Any) -> SyncConfig:
    return SyncConfig(**({"mode": "gasloc", "exchange_safety_factor": 1.0, "state_download_timeout_s": 5.0}
                         | changes))


def mixer(p2p: P2P, cls: type[ParamGossip] = ParamGossip, **changes: Any) -> ParamGossip:
    return cls(p2p, RUN, FINGERPRINT, "gasloc", reference(), config(**changes), seed=0)




class Attacker(ParamGossip):
    """A partner that sends `attack(the victim's current value)` instead of its own value."""

    victim: ParamGossip
    attack: Callable[[Tensors], Tensors]

    def outgoing(self, value: Tensors) -> Tensors:
        return self.attack(public_value(self.victim))


class HonestPeer:
    """A GASLoC peer's round as GaslocSync drives its mixer (γ = 0, inner phase scripted as a step)."""

    def __init__(self, gossip: ParamGossip, start: Tensors):
        self.mixer, self.x = gossip, start
        self.y: Tensors = []
        self.mixed: Tensors = []

    def propose_(self, round_: int, step: Tensors) -> None:
        self.mixer.round = round_
        self.mixer.set_base_(self.x)
        self.y = plus(self.x, step, self.mixer.take_correction_())
        self.mixer.show_work_(step, tokens=0)
        self.mixer.set_base_(self.y)
        self.mixed = [t.clone() for t in self.y]

    async def mix_with(self, partner: str) -> float:
        """One exchange we start; returns how far it moved us."""
        mixed, _stats = await self.mixer.mix(self.y, [partner], self.mixer.round)
        pull = [m - y for m, y in zip(mixed, self.y, strict=True)]
        self.mixed = plus(self.mixed, pull)
        return norm(pull)

    def finish_(self) -> None:
        self.x = plus(self.mixed, self.mixer.take_correction_())
        self.mixer.set_base_(self.x)


@dataclasses.dataclass
class Outcome:
    victim: Tensors
    neighbour: Tensors
    moves: list[tuple[float, float]]  # per exchange with the attacker: (how far it moved the victim, w·τ)
    banned: bool
    offences: dict[str, int]


async def attacked_rounds(attack: Callable[[Tensors], Tensors], robust: bool, rounds: int) -> Outcome:
    """Victim V, honest neighbour H, attacker A. Each round A opens an exchange with V, then V starts one with A
    and one with H (H only answers)."""
    p2ps = await start_p2ps(3)
    try:
        victim = mixer(p2ps[0], robust=robust, gossip_peers=2)
        neighbour = mixer(p2ps[1], gossip_peers=2)
        attacker = mixer(p2ps[2], Attacker)
        assert isinstance(attacker, Attacker)
        attacker.victim, attacker.attack = victim, attack
        for gossip in (victim, neighbour, attacker):
            await serve_exchanges(gossip.p2p, gossip.driver)
        start = plus(reference(), random_direction(7, TRAINED))
        v, h = HonestPeer(victim, start), HonestPeer(neighbour, start)
        attacker_id, neighbour_id = attacker.p2p.peer_id.to_base58(), neighbour.p2p.peer_id.to_base58()
        moves = []
        for round_ in range(rounds):
            v.propose_(round_, honest_step(round_, 0))
            h.propose_(round_, honest_step(round_, 1))
            before = public_value(victim)
            attacker.round = round_
            attacker.show_work_(honest_step(round_, 2), tokens=0)  # it trains: only the attack's own defence bans it
            await attacker.mix(reference(), [victim.p2p.peer_id.to_base58()], round_)
            moves.append((distance(public_value(victim), before), W * victim.clip_radius(before)))
            moved = await v.mix_with(attacker_id)  # τ as this mix saw it (its own step is known from now on)
            moves.append((moved, W * victim.clip_radius(v.y)))
            await v.mix_with(neighbour_id)
            v.finish_()
            h.finish_()
        offences = victim.reputation.offences().get(attacker_id, {})
        return Outcome(v.x, h.x, moves, victim.reputation.is_banned(attacker_id), offences)
    finally:
        await shutdown(p2ps)


def aimed(victim: Tensors) -> Tensors:
    return scaled(victim, -7.0)  # 8 × ‖victim‖ away: inside max_partner_distance (10)


def sign_flip(victim: Tensors) -> Tensors:
    return scaled(victim, -1000.0)


def constant(victim: Tensors) -> Tensors:
    return [torch.full_like(t, 1000.0) for t in victim]


def replay(victim: Tensors) -> Tensors:
    return reference()  # θ_0, while the victim is TRAINED away from it


def nan(victim: Tensors) -> Tensors:
    return [torch.full_like(t, math.nan) for t in victim]


# attack → (what it sends, the offence it commits, how many of them at least before the ban). A replay is clipped
# hard too, and sent again for a later round it is a replay (2.5 of the ban score of 4, sync/replay_check.py)
ATTACKS = {"aimed": (aimed, "clipped", 4), "sign_flip": (sign_flip, "invalid_payload", 4),
           "constant": (constant, "invalid_payload", 4), "replay": (replay, "replayed", 1),
           "nan": (nan, "invalid_payload", 4)}
ROUNDS = 8
NEIGHBOUR_BOUND = STEP  # ‖victim − neighbour‖ after ROUNDS defended rounds (measured: clean 0.10, aimed 0.19)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.parametrize("name", list(ATTACKS))
def test_an_attacker_moves_a_defended_victim_by_at_most_w_tau_and_ends_banned(name: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    attack, offence, at_least = ATTACKS[name]
    if name == "nan":  # let the attacker's encoder send NaN (ours refuses it); receivers still decode and check
        monkeypatch.setattr(codecs, "_prepare_input", lambda tensor: tensor.detach().cpu().float())
    outcome = asyncio.run(asyncio.wait_for(attacked_rounds(attack, robust=True, rounds=ROUNDS), timeout=300))
    for moved, bound in outcome.moves:
        assert moved <= bound * (1 + 1e-4) + 1e-6, (moved, bound)
    assert all_finite(outcome.victim)
    assert distance(outcome.victim, outcome.neighbour) <= NEIGHBOUR_BOUND, distance(outcome.victim, outcome.neighbour)
    assert outcome.banned and outcome.offences.get(offence, 0) >= at_least, outcome.offences


@pytest.mark.network
def test_an_aimed_attack_moves_an_undefended_victim_far() -> None:
    """`robust: false`, the plain mean: the same attack that the defences contain (so the test above can fail)."""
    outcome = asyncio.run(asyncio.wait_for(attacked_rounds(aimed, robust=False, rounds=3), timeout=120))
    gap = distance(outcome.victim, outcome.neighbour)  # measured: 385, 8 × ‖θ‖, after 3 rounds
    assert gap > 100 * NEIGHBOUR_BOUND and gap > 2 * norm(outcome.neighbour), gap


async def drifted_apart(alone_rounds: int, together_rounds: int) -> tuple[dict[str, dict[str, int]], list[float]]:
    """Two honest GASLoC peers mix every round; then V stalls for one round while H trains `alone_rounds` alone
    (its offers refused); then they mix again. (each one's offences, their distance after each round together)"""
    p2ps = await start_p2ps(2)
    try:
        mixers = [mixer(p2p, gossip_peers=1) for p2p in p2ps]
        for gossip in mixers:
            await serve_exchanges(gossip.p2p, gossip.driver)
        v, h = (HonestPeer(gossip, plus(reference(), random_direction(7, TRAINED))) for gossip in mixers)
        ids = [p2p.peer_id.to_base58() for p2p in p2ps]
        v_round, h_round, gaps = 0, 0, []
        alone_step = random_direction(99, STEP)  # training alone keeps a direction: the drift adds up
        for phase, rounds in (("together", 3), ("apart", alone_rounds), ("together", together_rounds)):
            for _ in range(rounds):
                h.propose_(h_round, honest_step(v_round, 1) if phase == "together" else alone_step)
                if phase == "together":
                    v.propose_(v_round, honest_step(v_round, 0))
                    await (v.mix_with(ids[1]) if v_round % 2 else h.mix_with(ids[0]))  # each opens every other
                    v.finish_()
                    v_round += 1
                h.finish_()
                h_round += 1
                if phase == "together" and v_round > 3:
                    gaps.append(distance(v.x, h.x))
            v_round += phase == "apart"  # V's one stalled round
        return [gossip.reputation.offences() for gossip in mixers], gaps
    finally:
        await shutdown(p2ps)


@pytest.mark.network
def test_honest_gossip_peers_that_drifted_apart_are_clipped_while_they_close_in_but_never_offenders() -> None:
    """CI: a GASLoC peer stalled 5 s while its partner trained 25 rounds alone; they met 15 own steps apart, clipped
    each other hard 5 times each and banned each other. The rounds each side took since their last exchange
    explain the gap (maths/drift_excuse.py): no offence, and the gap closes."""
    offences, gaps = asyncio.run(asyncio.wait_for(drifted_apart(alone_rounds=25, together_rounds=12), timeout=120))
    assert gaps[0] > HARD_CLIP_FACTOR * SPREAD * STEP * 1.5, gaps  # far beyond the offence threshold at first
    assert offences == [{}, {}], offences
    # clipped mixing pulls them together, round after round (measured: 12.0 to 6.7 in 11 rounds, τ ≈ one step)
    assert all(later < earlier for earlier, later in zip(gaps, gaps[1:], strict=False)) and gaps[-1] < 0.7 * gaps[0]


@pytest.mark.network
def test_the_responder_caps_the_weight_and_both_ends_use_it() -> None:
    """An offer claiming 1/2 to a responder with gossip_peers = 2 is mixed at 1/3 on both ends: the sum is kept."""
    async def scenario() -> None:
        a, b = await start_p2ps(2)
        try:
            initiator, responder = mixer(a, gossip_peers=1), mixer(b, gossip_peers=2)
            await serve_exchanges(b, responder.driver)
            ours, theirs = plus(reference(), honest_step(0, 0)), plus(reference(), honest_step(0, 1))
            for gossip, value in ((initiator, ours), (responder, theirs)):
                gossip.set_base_(reference())
                gossip.set_base_(value)  # a round's step: the partner is within the clipping radius
            mixed, stats = await initiator.mix(ours, [b.peer_id.to_base58()], round_=0)
            assert stats.partners == [b.peer_id.to_base58()]
            responder_after = plus(theirs, responder.take_correction_())
            for m, r, o, t in zip(mixed, responder_after, ours, theirs, strict=True):
                assert torch.allclose(m, o + (t - o) / 3, atol=1e-3)  # fp16 differences from θ_0
                assert torch.allclose(r, t + (o - t) / 3, atol=1e-3)
                assert torch.allclose(m + r, o + t, atol=1e-3)
        finally:
            await shutdown([a, b])

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


@pytest.mark.network
def test_a_prober_gets_a_bounded_number_of_opens_per_round_and_is_penalised() -> None:
    """Exchanges opened and never committed: the victim answers OPENS_PER_ROUND of them a round, then refuses."""
    async def scenario() -> None:
        a, b = await start_p2ps(2)
        try:
            victim = mixer(b)
            await serve_exchanges(b, victim.driver)
            victim.set_base_(reference())
            header = {"run_id": RUN, "fingerprint": FINGERPRINT, "kind": "gasloc", "round": 0, "codec": "fp16",
                      "weight": 0.5, "deadline_s": 20.0}
            payload = relative_encode(reference(), reference())

            def read_and_walk_away(_answer: dict[str, Any], _payload: Any) -> Any:
                raise ValueError("probe: seen the value, never committing")

            async def probe() -> None:
                await push_pull(a, b.peer_id, f"{RUN}.gasloc", header, payload, read_and_walk_away, 10**8, 20.0)

            for _ in range(OPENS_PER_ROUND):
                with pytest.raises(ValueError, match="probe"):
                    await probe()
            with pytest.raises(ExchangeRefused, match=Refusal.TOO_MANY_OFFERS):
                await probe()
            # the prober pays for its uncommitted opens (the responder notices each stream's end on its own time);
            # the refusal itself is no offence (a partner faster than us opens more than its share of our round)
            prober = a.peer_id.to_base58()
            deadline = time.monotonic() + 10
            while victim.reputation.offences().get(prober) != {"uncommitted": OPENS_PER_ROUND}:
                assert time.monotonic() < deadline, victim.reputation.offences()
                await asyncio.sleep(0.05)
            victim.round = 1  # a new round: a new share
            with pytest.raises(ValueError, match="probe"):
                await probe()
            assert torch.equal(victim.take_correction_()[0], torch.zeros(SHAPES[0]))  # nothing was ever mixed
        finally:
            await shutdown([a, b])

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_after_its_round_jumps_a_mixer_clips_far_partners_but_penalises_them_only_after_a_grace() -> None:
    """A peer that adopted a state (or resumed a checkpoint) jumps rounds; its first steps from there are no yardstick
    of how far honest partners are, so for JUMP_GRACE_ROUNDS it clips them without counting offences."""
    gossip = ParamGossip(None, RUN, FINGERPRINT, "gasloc", reference(), config(), seed=0)  # type: ignore[arg-type]
    far = plus(reference(), random_direction(7, 100 * STEP))  # far beyond the hard radius of a STEP-long step

    def round_with_far_partner(round_: int) -> float:
        gossip.round = round_
        gossip.set_base_(reference())
        gossip.set_base_(plus(reference(), honest_step(round_, 0)))  # our step: τ's yardstick
        own = public_value(gossip)
        return distance(gossip.clip_value("far", far, own), own)

    counts, moves = [], []
    for round_ in (0, 10, 11, 12):  # 0 → 10: a jump (a state adopted)
        moves.append(round_with_far_partner(round_))
        assert moves[-1] <= gossip.clip_radius(public_value(gossip)) * (1 + 1e-5)  # clipped all along
        counts.append(gossip.reputation.offences().get("far", {}).get("clipped", 0))
    assert JUMP_GRACE_ROUNDS == 2 and counts == [1, 1, 1, 2]
    # a penalised value is not mixed at all; in the grace it is mixed, clipped to τ
    assert moves[0] == moves[3] == 0 and min(moves[1:3]) > 0, moves


def test_a_gasloc_value_that_showed_no_work_is_not_mixed() -> None:
    """A partner whose header's work sample is idle (or replayed): our own value stands in for its parameters, as
    for a hard clip (the driver applies `stand_in` for a value `judge_value` found no work in), so mixing moves
    nothing; the grad-gossip test runs the driver's path (test_grad_gossip.py)."""
    gossip = ParamGossip(None, RUN, FINGERPRINT, "gasloc", reference(), config(), seed=0)  # type: ignore[arg-type]
    own = plus(reference(), random_direction(3, STEP))
    rnd = SimpleNamespace(sent=own)
    stood_in = gossip.stand_in(rnd, "rider", plus(reference(), random_direction(4, STEP)))  # type: ignore[arg-type]
    assert all(torch.equal(a, b) and a is not b for a, b in zip(stood_in, own, strict=True))


def test_offers_beyond_the_token_bucket_are_refused_until_it_refills() -> None:
    now = [0.0]
    limit = OfferLimit(per_round=2, rate_per_s=4.0, burst=3, clock=lambda: now[0])
    assert [limit.offer("p") for _ in range(4)] == [True, True, True, False]
    assert limit.offer("q")  # every partner has its own bucket
    now[0] += 0.25  # one token back
    assert limit.offer("p") and not limit.offer("p")
    assert [limit.accept("p", 5) for _ in range(3)] == [True, True, False]
    assert limit.accept("p", 6)


def test_an_honest_partner_asking_again_on_the_retry_schedule_never_runs_out_of_offers() -> None:
    """The quick first retries (a partner whose round opens a moment after our offer) stay within the token bucket
    of an honest responder, even for a partner that asks without answer, stage after stage, for minutes."""
    delays = [retry_delay_s(a) for a in range(8)]
    assert delays[0] == FIRST_RETRY_S and delays == sorted(delays) and delays[-1] == POLL_S
    now = [0.0]
    limit = OfferLimit(per_round=OPENS_PER_ROUND, rate_per_s=OFFERS_PER_S, burst=OFFER_BURST, clock=lambda: now[0])
    refused = 0
    for _stage in range(200):  # 2 stages a round (an all-reduce's Δ and digests), each asked for its 2 s patience
        started, attempt = now[0], 0
        while now[0] - started < 2.0:
            refused += not limit.offer("p")
            now[0] += retry_delay_s(attempt)
            attempt += 1
    assert refused == 0


@pytest.mark.network
def test_a_peer_whose_own_value_is_not_finite_neither_mixes_nor_answers_nor_dies() -> None:
    async def scenario() -> None:
        a, b = await start_p2ps(2)
        try:
            sick, healthy = mixer(a), mixer(b)
            await serve_exchanges(a, sick.driver)
            await serve_exchanges(b, healthy.driver)
            poisoned = reference()
            poisoned[0][0, 0] = math.nan
            sick.set_base_(poisoned)
            healthy.set_base_(reference())
            value = plus(reference(), honest_step(0, 1))
            mixed, stats = await healthy.mix(value, [a.peer_id.to_base58()], round_=0)
            assert stats.refused == 1 and stats.partners == [] and all(torch.equal(m, v) for m, v in
                                                                       zip(mixed, value, strict=True))
            mixed, stats = await sick.mix(poisoned, [b.peer_id.to_base58()], round_=0)
            assert stats.partners == [] and stats.failed == 0 and torch.isnan(mixed[0][0, 0])
            assert healthy.take_incoming_stats().group_size == 0
        finally:
            await shutdown([a, b])

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


class InlineLoop:
    """`BackgroundLoop`'s interface, run in the calling thread."""

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run(coro)

    def submit(self, coro: Any) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_result(asyncio.run(coro))
        return future


class FakeP2P:
    def __init__(self, name: str):
        self.peer_id = PeerID(name.encode())


def diverged_inner_phase_(outer: OuterOptimizer) -> None:
    with torch.no_grad():
        outer.params[0][0, 0] = math.nan


@pytest.mark.parametrize("mode", ["gasloc", "factored"])
def test_a_non_finite_outer_gradient_is_dropped_and_the_peer_keeps_training(mode: str) -> None:
    sync_config = config(mode=mode, mix2_transport="gossip" if mode == "factored" else "allreduce")
    params = [torch.nn.Parameter(t.clone()) for t in plus(reference(), random_direction(7, TRAINED))]
    outer = OuterOptimizer(params, OuterConfig(lr=0.7, momentum=sync_config.outer_momentum(0.9)))
    gossip = ParamGossip(FakeP2P("a"), RUN, FINGERPRINT, mode, reference(), sync_config, seed=0,  # type: ignore[arg-type]
                         same_round_only=mode == "factored")
    if mode == "gasloc":
        sync: Any = GaslocSync(outer, gossip, InlineLoop(), sync_config)  # type: ignore[arg-type]
    else:
        grads = GradGossip(FakeP2P("a"), RUN, FINGERPRINT, reference(), sync_config, seed=0)  # type: ignore[arg-type]
        sync = FactoredSync(outer, gossip, GossipMix2(grads, InlineLoop()), InlineLoop(),  # type: ignore[arg-type]
                            sync_config)
    anchor = [a.clone() for a in outer.anchor]
    sync.start_round(RoundContext(0, 0, [], 0))
    diverged_inner_phase_(outer)
    sync.finish_round(RoundContext(0, 5, [], 0))
    assert all(torch.equal(p.detach(), a) for p, a in zip(outer.params, anchor, strict=True))  # no step, no NaN
    if mode == "gasloc":  # its headers show the step it took, none (a finite sample)
        assert gossip.header_extra()[WORK_KEY] == [0.0] * STATE_SAMPLE
    sync.start_round(RoundContext(1, 0, [], 0))  # the next round runs as usual
    with torch.no_grad():
        outer.params[0].add_(0.01)
    sync.finish_round(RoundContext(1, 5, [], 0))
    assert all_finite([p.detach() for p in outer.params]) and not torch.equal(outer.params[0].detach(), anchor[0])


# ---- Mix2: outer gradients -----------------------------------------------------------------------------------------


class GradAttacker(GradGossip):
    """Sends −8 × the victim's s (9 ‖s‖ away: inside max_partner_distance) instead of its own."""

    victim_s: Tensors

    def outgoing(self, sent: Tensors) -> Tensors:
        return scaled(self.victim_s, -8.0)


@pytest.mark.network
@pytest.mark.parametrize("robust", [True, False])
def test_a_mix2_attacker_beyond_the_hard_radius_leaves_the_victims_outer_gradient(robust: bool) -> None:
    grad_config = config(mode="factored", mix2_transport="gossip", grad_codec="none", robust=robust)
    victim_delta, attacker_delta = random_direction(1, 0.1), random_direction(2, 0.1)

    async def scenario() -> tuple[Tensors, dict[str, int]]:
        a, b = await start_p2ps(2)
        try:
            victim = GradGossip(a, RUN, FINGERPRINT, reference(), grad_config, seed=0)
            attacker = GradAttacker(b, RUN, FINGERPRINT, reference(), grad_config, seed=1)
            attacker.victim_s = victim_delta  # codec none, no residual yet: s = Δ
            for g in (victim, attacker):
                await serve_exchanges(g.p2p, g.driver)
            (mixed, stats), _ = await asyncio.gather(
                victim.mix(victim_delta, [attacker.own_id], 0, patience_s=5.0),
                attacker.mix(attacker_delta, [victim.own_id], 0, patience_s=5.0))
            assert stats.group_size == 2, stats
            return mixed, victim.reputation.offences().get(attacker.own_id, {})
        finally:
            await shutdown([a, b])

    mixed, offences = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    moved = distance(mixed, victim_delta)
    if robust:  # 9 ‖s‖ away, beyond the hard radius (8 ‖s‖): penalised, and not mixed at all
        assert moved < 1e-6 and offences == {"clipped": 1}
    else:  # the plain mean: s + (−8s − s)/3 = −2s, the victim's step reversed
        assert torch.allclose(torch.cat([m.flatten() for m in mixed]),
                              torch.cat([-2 * d.flatten() for d in victim_delta]), atol=1e-6)


# ---- a swarm -------------------------------------------------------------------------------------------------------

SWARM_ROUNDS = 6
HONEST = 3


class SendsMinusSeven(ParamGossip):
    """A peer that trains honestly but sends −7 × its value: its value is close to its partners', so this is about
    the issue's aimed attack (8 × their norm away, inside max_partner_distance)."""

    def outgoing(self, value: Tensors) -> Tensors:
        return scaled(value, -7.0)


def run_gasloc_swarm(run_id: str, attackers: int, robust: bool,
                     monkeypatch: pytest.MonkeyPatch) -> tuple[list[TrainingPeer], list[list[RoundMetrics]]]:
    """3 honest GASLoC peers (the first founds the swarm) and `attackers` hostile ones, to SWARM_ROUNDS rounds.
    Without `robust` no defence is left: nor the bound on a partner's distance, which refuses (and bans) an
    attacker once a victim's value is far off, so that how much harm is seen would hang on timing."""
    sync = {"mode": "gasloc", "robust": robust, **({} if robust else {"max_partner_distance": 1e9})}
    config = tiny_config(run_id, run={"rounds": SWARM_ROUNDS}, sync=sync)
    peers = [start_peer(config)]
    peers += [start_peer(config, peers[0].maddrs) for _ in range(HONEST - 1)]
    with monkeypatch.context() as patch:
        patch.setattr(build, "ParamGossip", SendsMinusSeven)
        peers += [start_peer(config, peers[0].maddrs) for _ in range(attackers)]
    _threads, histories = run_peers(peers, attackers=attackers)
    return peers, histories


def honest_losses(histories: list[list[RoundMetrics]]) -> list[list[float]]:
    return [[m.val_loss for m in history] for history in histories[:HONEST]]


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_honest_gasloc_peers_keep_training_with_an_attacker_among_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """3 honest peers and one that sends −7 × its value, against the same 3 alone: with defences, the honest peers'
    loss falls every run and ends within 25 % of the clean run's (measured: 3.2–3.3 against 2.83, the attacker
    being a quarter of the swarm); with no defence (`robust: false`, no distance bound) it spikes (measured: up to
    17–97 with the distance bound, which made it 5.6 once in CI)."""
    run = uuid.uuid4().hex[:6]
    _, clean = run_gasloc_swarm(f"clean-{run}", attackers=0, robust=True, monkeypatch=monkeypatch)
    peers, defended = run_gasloc_swarm(f"defended-{run}", attackers=1, robust=True, monkeypatch=monkeypatch)
    _, undefended = run_gasloc_swarm(f"undefended-{run}", attackers=1, robust=False, monkeypatch=monkeypatch)
    clean_loss = statistics.mean(losses[-1] for losses in honest_losses(clean))
    for losses in honest_losses(defended):  # a bump is allowed (seen under load: 4.47 → 3.69 → 4.57 → 3.89, the
        assert max(losses[1:]) < 1.25 * losses[0] and losses[-1] < losses[0], losses  # attacker clipped 5× first)
    defended_loss = statistics.mean(losses[-1] for losses in honest_losses(defended))
    assert defended_loss <= 1.25 * clean_loss, (defended_loss, clean_loss)
    assert max(max(losses) for losses in honest_losses(undefended)) > 2 * clean_loss  # the test can fail
    attacker_id, honest_ids = peers[HONEST].peer_id, {p.peer_id for p in peers[:HONEST]}
    for peer in peers[:HONEST]:
        assert not honest_ids & set(peer.reputation.offences()), peer.reputation.offences()  # honest: no offence
    assert sum(p.reputation.offences().get(attacker_id, {}).get("clipped", 0) for p in peers[:HONEST]) >= 2


FREE_RIDER_ROUNDS = 12  # each honest peer meets the rider about 2 rounds in 3 (each peer opens to 1 of 3 a round)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_gasloc_free_rider_is_banned_and_its_claimed_tokens_are_not_verified() -> None:
    """3 honest GASLoC peers and one that trains at a learning rate of 1e-9 (issue 31's free rider): its parameters
    are a peer's that trains nothing, and its headers' work samples a ~zero outer gradient. It sat in every round
    with no offence before GASLoC's values showed their work; now each value after its first is `idle` (1.5 of the
    ban score of 4), so a third bans it, and the tokens it claims verify nothing beyond the value that was spared.
    The honest peers commit no offence against each other and verify each other's claims. All begin round 0
    together (`run.min_peers`): in CI (on 6331488) no honest peer judged the rider once, as here when its round 0
    is held 3 s (the honest peers end their ten rounds first)."""
    config = tiny_config(f"rider-{uuid.uuid4().hex[:6]}", run={"rounds": FREE_RIDER_ROUNDS, "min_peers": HONEST + 1},
                         sync={"mode": "gasloc"})
    peers = [start_peer(config)]
    peers += [start_peer(config, peers[0].maddrs) for _ in range(HONEST - 1)]
    peers.append(start_peer(replace_section(config, "inner", lr=1e-9), peers[0].maddrs))
    run_peers(peers, attackers=1)
    rider, honest_ids = peers[HONEST].peer_id, {p.peer_id for p in peers[:HONEST]}
    full_round_tokens = config.inner.steps * config.data.batch_size * config.data.seq_len
    idle = [p.reputation.offences().get(rider, {}).get("idle", 0) for p in peers[:HONEST]]
    assert sum(idle) >= 3 and any(p.reputation.is_banned(rider) for p in peers[:HONEST]), idle
    for peer in peers[:HONEST]:
        assert not honest_ids & set(peer.reputation.offences()), peer.reputation.offences()
        work = peer.contributions.work()
        if rider in work:  # the first value judged is spared (a joiner's) and verifies its round's claim, no more
            assert work[rider].worked <= 1, work[rider]
            # a round's claim is its steps' tokens, and GASLoC takes fewer steps when a phase runs late (CI: 1,280
            # verified of 3,584 claimed over 4 values, the first a full round's): at most one full round verifies
            assert work[rider].tokens_verified <= full_round_tokens, (work[rider], full_round_tokens)
            if work[rider].values > 1:
                assert work[rider].tokens_verified < work[rider].tokens_claimed, work[rider]
        assert any(work[p].tokens_verified > 0 for p in honest_ids - {peer.peer_id} if p in work), work


STALL_ROUNDS = 12


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_identities_that_take_offers_and_never_answer_are_banned_or_cost_a_set_up_floor() -> None:
    """Issue 31: 3 honest GASLoC peers beside identities that announce a 1 Gbit/s link and take every offer: two
    say they hold it (gossip grants no hold), one says nothing; none answers. Each cost a peer that drew it a
    deadline every fifth round, each longer than the last (5 s, 20 s, then the cap): 12 rounds took 62-148 s a peer
    with 3 of them, 3 s without. Now one that says it holds is banned at its first draw, and a silent one's
    time-outs bound its link no slower than it claimed: the link stays at the prior, its deadline at the floor
    (unless time-outs with two partners in a row take our own link for slow, `LinkSpeeds.timed_out_`)."""
    config = tiny_config(f"stall-{uuid.uuid4().hex[:6]}", run={"rounds": STALL_ROUNDS, "min_peers": HONEST},
                         sync={"mode": "gasloc"})
    peers = [start_peer(config)]
    peers += [start_peer(config, peers[0].maddrs) for _ in range(HONEST - 1)]
    identities: list[StallingIdentities] = []
    try:  # each group stopped even if a later one fails to start
        for count, says_held in ((2, True), (1, False)):
            identities.append(StallingIdentities(config.network, peers[0].maddrs, config.run.run_id, count,
                                                 peers[0].fingerprint, config.network.record_ttl_s,
                                                 config.network.heartbeat_s, claims={"bandwidth_bps": 1e9},
                                                 says_held=says_held))
        _threads, histories = run_peers(peers)
    finally:
        for group in identities:
            group.stop()
    holding, (silent,) = identities[0].peer_ids, identities[1].peer_ids
    for peer, history in zip(peers, histories, strict=True):
        # (a peer that waited out a floor while the others ran ahead may take their state: a round skipped)
        assert history[-1].round == STALL_ROUNDS - 1 and history[-1].val_loss < history[0].val_loss
        # it kept mixing: about 1 draw in 3 meets the silent identity once the holders are banned; under load (a CI
        # run beside another test) honest exchanges time out too, and one peer mixed in 5 of 12 rounds
        assert sum(m.peers_averaged > 1 for m in history) >= len(history) // 3, [m.peers_averaged for m in history]
        driver = peer.sync.mixer.driver
        offences = driver.reputation.offences()
        for identity in holding:  # banned at a draw for a minute at least: drawn once in so short a run
            assert offences.get(identity, {}).get("held_ungranted", 0) <= 1, offences
        link = driver.links.by_partner.get(silent)  # bounded by a second time-out in a row: no slower than claimed
        assert link is None or link.bytes_per_s >= driver.links.prior_bytes_per_s, link.bytes_per_s
        assert silent not in offences  # silence is no offence: a peer behind a cut is silent too
    offended = [peer.sync.mixer.driver.reputation.offences() for peer in peers]
    assert all(any(identity in seen for seen in offended) for identity in holding), offended
    assert any(silent in peer.sync.mixer.driver.failed_partners.failed for peer in peers)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_silent_identities_of_one_host_are_drawn_as_one_partner() -> None:
    """Issue 31: identities are free, addresses are not. 8 identities listening on one address (127.0.0.2: one host
    to the honest peers, whose own loopback address is no host) that take every offer and never answer, beside 3
    honest GASLoC peers. Drawn one identity at a time, each honest peer drew one 8 times in 10, waited out a set-up
    floor most rounds, and its time-outs with two identities in a row took its own link for slow (rounds of 10, 20,
    30 s): 33-113 s a peer for 12 rounds, 5-10 of them mixed. Drawn as one host, 1 time in 3 (13-28 s, 10-11
    mixed)."""
    config = tiny_config(f"hosts-{uuid.uuid4().hex[:6]}", run={"rounds": STALL_ROUNDS, "min_peers": HONEST},
                         sync={"mode": "gasloc"})
    peers = [start_peer(config)]
    peers += [start_peer(config, peers[0].maddrs) for _ in range(HONEST - 1)]
    one_host = dataclasses.replace(config.network, host_maddrs=("/ip4/127.0.0.2/tcp/0",))
    # each identity dials every honest peer, which then knows its host from the start: an identity of a host we
    # hold no connection from is a host of its own until a draw of it fails (the ramp: docs/threat-model.md)
    everyone = [maddr for peer in peers for maddr in peer.maddrs]
    identities = StallingIdentities(one_host, everyone, config.run.run_id, 8, peers[0].fingerprint,
                                    config.network.record_ttl_s, config.network.heartbeat_s,
                                    claims={"bandwidth_bps": 1e9}, says_held=False)
    try:
        _threads, histories = run_peers(peers)
    finally:
        identities.stop()
    rows = [[(m.failed_exchanges, m.peers_averaged) for m in history] for history in histories]
    for history in histories:
        assert history[-1].round == STALL_ROUNDS - 1 and history[-1].val_loss < history[0].val_loss
        assert sum(m.peers_averaged > 1 for m in history) >= len(history) // 2, rows
    # a failed exchange ends a round's draws: at most one a round; 1 in 3 expected, 4 in 5 drawn one at a time (a
    # loaded CI run: 20 of 36, so the bound sits between the two)
    failed = sum(m.failed_exchanges for history in histories for m in history)
    assert 3 * failed <= 2 * sum(map(len, histories)), rows


def test_a_gasloc_peer_whose_round_jumped_answers_no_offer_until_its_next_step_shows_its_work() -> None:
    """Its latest work sample is of the state it left: shown for its new round it would be a replay to partners
    that saw it before. So it refuses offers as busy (no offence) until its next outer step shows a new one."""
    gossip = ParamGossip(FakeP2P("a"), RUN, FINGERPRINT, "gasloc", reference(), config(mode="gasloc"),  # type: ignore[arg-type]
                         seed=0, shows_work=True)
    assert gossip.driver.current.accept_("b", 0, 0.0) is None  # a fresh peer answers in its first round
    gossip.driver.current.release_("b", outgoing=False)
    assert gossip.header_extra() == {}  # with no sample yet: partners spare the first value they judge
    gossip.round = 3  # resumed from a checkpoint: nothing to show yet
    assert gossip.driver.current.accept_("b", 3, 0.0) == Refusal.BUSY
    gossip.show_work_(random_direction(1, STEP), tokens=100)
    shown = gossip.header_extra()
    assert len(shown[WORK_KEY]) == STATE_SAMPLE and shown["tokens"] == 100
    gossip.round = 4  # the next round: its sample stands (an answer in round 4 shows round 3's step)
    assert gossip.driver.current.accept_("b", 4, 0.0) is None
    gossip.driver.current.release_("b", outgoing=False)
    gossip.round = 40  # a state adopted
    assert gossip.driver.current.accept_("b", 40, 0.0) == Refusal.BUSY
    gossip.show_work_(random_direction(2, STEP), tokens=100)
    assert gossip.driver.current.accept_("b", 40, 0.0) is None
    assert gossip.header_extra()[WORK_KEY] != shown[WORK_KEY]
    mix1 = ParamGossip(FakeP2P("c"), RUN, FINGERPRINT, "mix1", reference(), config(mode="factored"),  # type: ignore[arg-type]
                       seed=0, same_round_only=True)  # Factored's Mix1 shows no work: a jump holds nothing back
    mix1.round = 40
    assert mix1.driver.current.accept_("b", 40, 0.0) is None and mix1.header_extra() == {}


NOISY_REPLAY_ROUNDS = 20


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_noisy_replay_held_apart_without_closing_in_is_banned() -> None:
    """The red team's `noisy_replay`: θ_0 plus fresh noise a step long in every value, never the same bits twice, so
    the replay check cannot see it, and inside the hard radius, clipped to τ with no offence: it moved every victim
    toward θ_0 by w·τ an exchange (real path, 1 of 4, 30 rounds: +6.4 % honest loss). Held beyond half the hard
    radius without closing in, it pays from the third clip of a run (maths/drift_excuse.py): banned by the honest
    peers, who commit no offence against each other."""
    config = tiny_config(f"noisy-{uuid.uuid4().hex[:6]}",
                         run={"rounds": NOISY_REPLAY_ROUNDS, "min_peers": HONEST + 1},
                         sync={"mode": "gasloc", "gossip_peers": 2})
    peers = [start_peer(config)]
    peers += [start_peer(config, peers[0].maddrs) for _ in range(HONEST - 1)]
    peers.append(TrainingPeer(config, peers[0].maddrs, conduct=HostileConduct(Attack("noisy_replay", 2))))
    run_peers(peers, attackers=1)
    replayer, honest_ids = peers[HONEST].peer_id, {p.peer_id for p in peers[:HONEST]}
    clipped = [p.reputation.offences().get(replayer, {}).get("clipped", 0) for p in peers[:HONEST]]
    banned = [p.reputation.is_banned(replayer) for p in peers[:HONEST]]
    assert sum(clipped) >= 6 and sum(banned) >= 2, (clipped, banned)
    for peer in peers[:HONEST]:
        assert not honest_ids & set(peer.reputation.offences()), peer.reputation.offences()


PUSH_ROUNDS = 30


def honest_final_loss_beside_a_pusher(robust: bool, attackers: int = 1) -> float:
    """3 honest GASLoC peers (2 partners a round) and `attackers` playing the red team's `push` from their round 2,
    for PUSH_ROUNDS rounds: the honest peers' mean final validation loss."""
    config = tiny_config(f"push-{uuid.uuid4().hex[:6]}", run={"rounds": PUSH_ROUNDS},
                         sync={"mode": "gasloc", "gossip_peers": 2, "robust": robust})
    peers = [start_peer(config)]
    peers += [start_peer(config, peers[0].maddrs) for _ in range(HONEST - 1)]
    peers += [TrainingPeer(config, peers[0].maddrs, conduct=HostileConduct(Attack("push", 2)))
              for _ in range(attackers)]
    _threads, histories = run_peers(peers, attackers=attackers)
    honest_ids = {p.peer_id for p in peers[:HONEST]}
    for peer in peers[:HONEST]:
        assert not honest_ids & set(peer.reputation.offences()), peer.reputation.offences()
    return statistics.mean(losses[-1] for losses in honest_losses(histories))


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.alone  # the harm grows with the exchanges the rounds make, which load beside it would cut
def test_a_partner_pushing_one_way_inside_the_radius_is_held_by_the_clip() -> None:
    """Issue 31's first attack: a value a few steps off ours, always the same way, is clipped to τ with no offence
    and moves each victim by w·τ an exchange, every round. Unclipped it drags the honest peers off (the real path,
    30 rounds, 1 of 4: +22.9 % honest loss, benchmarks/robustness_netns.py; here 2.51, 3.91 and 49.7 against
    2.08-2.20 defended in three runs); the clip holds it near the honest peers alone (−1.6 % there)."""
    clean = honest_final_loss_beside_a_pusher(robust=True, attackers=0)
    defended = honest_final_loss_beside_a_pusher(robust=True)
    assert defended <= 1.1 * clean, (clean, defended)
    # the attack is real: undefended it hurts. Once in a loaded CI run it did not (2.305 against the clean 2.298),
    # so a run it did not bite is run again, once
    undefended = [honest_final_loss_beside_a_pusher(robust=False)]
    if undefended[0] <= 1.1 * defended:
        undefended.append(honest_final_loss_beside_a_pusher(robust=False))
    assert undefended[-1] > 1.1 * defended, (clean, defended, undefended)
