"""A hostile all-reduce member (issue 9): the check of the group's mean against our own Δ (maths/robust_mean.py),
its use in DiLoCo (plain and overlapped) and Factored's all-reduce Mix2, and a loopback swarm with an attacker."""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Sequence

import pytest
import torch
from swarm_utils import run_peers, start_peer, tiny_config

from p2ptrain.maths.centered_clip import RobustMean, centered_clip
from p2ptrain.maths.mixing import exact_average
from p2ptrain.maths.outer_optimizer import OuterConfig, OuterOptimizer
from p2ptrain.maths.robust_mean import MIN_HISTORY_ROUNDS, MeanCheck, own_scale
from p2ptrain.metrics import RoundMetrics
from p2ptrain.net.allreduce import AveragingResult, claimed_norms
from p2ptrain.net.discovery import PeerRecord
from p2ptrain.status import status_document
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.diloco import DilocoSync, mean_check
from p2ptrain.sync.exchange_allreduce import robust_reduction
from p2ptrain.sync.factored import AllReduceMix2
from p2ptrain.sync.interface import RoundContext, why_alone
from p2ptrain.tensor_layout import distance, norm
from p2ptrain.testnet.adversary import FREE_RIDER_SCALE

Tensors = list[torch.Tensor]
MULTIPLIER = 2.0  # sync.clip_multiplier's default
SHAPES = ((64, 32), (32,))


def honest_deltas(peers: int, shared: float, own: float, seed: int = 0) -> list[Tensors]:
    """Δ_j = shared · g + own · e_j: one direction the peers share plus a part of each one's data shard."""
    generator = torch.Generator().manual_seed(seed)
    g = [torch.randn(s, generator=generator) for s in SHAPES]
    return [[shared * gi + own * torch.randn(s, generator=generator) for gi, s in zip(g, SHAPES, strict=True)]
            for _ in range(peers)]


def weighted_mean(values: Sequence[Tensors], weights: Sequence[float]) -> Tensors:
    """What hivemind's reducer returns: Σ w·x / Σ w, each w as its sender claims it."""
    total = sum(weights)
    return [sum(w * v[i] for v, w in zip(values, weights, strict=True)) / total for i in range(len(SHAPES))]


def scaled(tensors: Tensors, factor: float) -> Tensors:
    return [t * factor for t in tensors]


def reduced(inputs: Sequence[Tensors]) -> RobustMean:
    """What every member of a round with these inputs (named by position) computes."""
    return robust_reduction([(str(j), x) for j, x in enumerate(inputs)], 0, MULTIPLIER)[0]


# ---- the check ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("peers", [2, 4, 16])
@pytest.mark.parametrize("shared", [1.0, 0.0])  # early training (a common direction), late (pure disagreement)
def test_every_honest_member_accepts_the_honest_mean(peers, shared):
    deltas = honest_deltas(peers, shared=shared, own=1.0)
    mean = exact_average(deltas)
    for own in deltas:
        verdict = MeanCheck(MULTIPLIER).judge_(mean, own)
        assert verdict.accepted
        assert verdict.deviation < norm(own)  # the docstring's claim: honest deviations stay below ‖Δ_i‖


@pytest.mark.parametrize("factor", [1000.0, -1000.0, -10.0])
def test_an_attacker_scaling_its_delta_gets_the_mean_refused_by_every_honest_member(factor):
    honest = honest_deltas(3, shared=1.0, own=0.5)
    mean = exact_average(honest + [scaled(honest[0], factor)])
    for own in honest:
        verdict = MeanCheck(MULTIPLIER).judge_(mean, own)
        assert not verdict.accepted and verdict.reason == "too far"
        assert verdict.deviation > verdict.radius


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_a_non_finite_mean_is_refused(poison):
    honest = honest_deltas(3, shared=1.0, own=0.5)
    attacker = [t.clone() for t in honest[0]]
    attacker[1][3] = poison
    verdict = MeanCheck(MULTIPLIER).judge_(exact_average(honest + [attacker]), honest[0])
    assert not verdict.accepted and verdict.reason == "not finite"


def test_a_huge_claimed_weight_makes_the_mean_the_attackers_value_and_is_refused_when_far():
    honest = honest_deltas(3, shared=1.0, own=0.5)
    far = scaled(honest[0], -1.5)  # a plausible size, the opposite direction
    mean = weighted_mean(honest + [far], [5.0, 5.0, 5.0, 1e9])
    assert distance(mean, far) < 1e-3 * norm(far)  # the claimed weight hands the attacker the whole mean
    assert not any(MeanCheck(MULTIPLIER).judge_(mean, own).accepted for own in honest)


def test_whatever_weight_an_attacker_claims_an_accepted_mean_stays_within_the_radius_of_our_own():
    honest = honest_deltas(3, shared=1.0, own=0.5)
    own = honest[0]
    radius = MeanCheck(MULTIPLIER).radius(norm(own))
    for weight in (1.0, 10.0, 1e3, 1e9):
        for value in (scaled(own, 2.5), scaled(own, -0.9), scaled(honest[1], 3.0)):
            mean = weighted_mean(honest + [value], [5.0, 5.0, 5.0, weight])
            verdict = MeanCheck(MULTIPLIER).judge_(mean, own)
            assert verdict.accepted == (distance(mean, own) <= radius)
            if verdict.accepted:
                assert verdict.deviation <= radius


def test_the_radius_learns_from_accepted_deviations_and_forgets_refused_ones():
    own = honest_deltas(1, shared=1.0, own=0.0)[0]
    direction = honest_deltas(1, shared=0.0, own=1.0, seed=1)[0]
    away = [d / norm(direction) for d in direction]

    def mean_at(ratio: float) -> Tensors:  # a mean `ratio` × ‖Δ‖ away from Δ
        return [o + ratio * norm(own) * a for o, a in zip(own, away, strict=True)]

    fresh = MeanCheck(MULTIPLIER)
    assert not fresh.judge_(mean_at(3.0), own).accepted  # τ = 2‖Δ‖ with no history
    learnt = MeanCheck(MULTIPLIER)
    for _ in range(MIN_HISTORY_ROUNDS):
        assert learnt.judge_(mean_at(1.9), own).accepted
    assert learnt.radius(norm(own)) == pytest.approx(MULTIPLIER * 1.9 * norm(own), rel=1e-6)
    assert learnt.judge_(mean_at(3.0), own).accepted  # honest disagreement near the floor widened τ
    assert not learnt.judge_(mean_at(1000.0), own).accepted
    assert learnt.radius(norm(own)) == pytest.approx(MULTIPLIER * 1.9 * norm(own), rel=1e-6)


def test_an_attacker_staying_just_inside_the_radius_cannot_ratchet_it_beyond_multiplier_squared():
    own = honest_deltas(1, shared=1.0, own=0.5)[0]
    direction = honest_deltas(1, shared=0.0, own=1.0, seed=1)[0]
    away = [d / norm(direction) for d in direction]
    check = MeanCheck(MULTIPLIER)
    for _ in range(100):
        reach = 0.999 * check.radius(norm(own))
        assert check.judge_([o + reach * a for o, a in zip(own, away, strict=True)], own).accepted
    assert check.radius(norm(own)) <= MULTIPLIER**2 * norm(own) * (1 + 1e-6)


def test_a_short_own_delta_is_judged_by_the_members_announced_lengths():
    """A joiner's first round: 1 inner step where its partners took 5, so a Δ a fifth as long and a fifth the weight."""
    partners = honest_deltas(3, shared=1.0, own=0.5)
    own = scaled(honest_deltas(1, shared=1.0, own=0.5, seed=1)[0], 0.2)
    mean = weighted_mean(partners + [own], [5.0, 5.0, 5.0, 1.0])
    claims = [norm(d) for d in partners + [own]]
    assert not MeanCheck(MULTIPLIER).judge_(mean, own).accepted  # own ‖Δ‖ alone: too short a yardstick
    assert MeanCheck(MULTIPLIER).judge_(mean, own, claims).accepted


def test_a_member_that_cut_its_inner_phase_judges_the_mean_by_the_delta_of_its_whole_phase():
    """netns testnet, DiLoCo round 1: 2 of 5 peers began it early and ran 10 steps; the 3 others cut theirs to 1 to
    end with them. The mean lay beyond 4 × the lower median ‖Δ‖ (a 1-step one) from each short Δ: all three refused
    it, applied their own, and the swarm split (here 1 step of 12, where these inputs cross the margin). Stretched
    by the steps cut, the yardstick is a whole phase's Δ again; a hostile mean is still refused."""
    full = honest_deltas(5, shared=1.0, own=0.5)
    deltas = full[:2] + [scaled(d, 0.08) for d in full[2:]]  # 1 step of 12: about a twelfth of the way
    mean, own, claims = exact_average(deltas), deltas[2], [norm(d) for d in deltas]
    assert not mean_check(SyncConfig()).judge_(mean, own, claims).accepted  # what happened
    assert mean_check(SyncConfig()).judge_(mean, own, claims, stretch=12.0).accepted
    hostile = exact_average(deltas[:4] + [scaled(full[0], -1000.0)])
    assert not mean_check(SyncConfig()).judge_(hostile, own, claims, stretch=12.0).accepted
    for full_steps, failed in ((0, 1), (12, 0)):  # the round's context says how far the phase was cut
        cut = RoundContext(round=1, inner_steps=1, live_peers=["a"], same_round_peers=4, full_steps=full_steps)
        outer = outer_with_delta(own)
        record = DilocoSync(outer, FixedAverager([mean]), SyncConfig()).finish_round(cut)  # type: ignore[arg-type]
        assert record.failed == failed and cut.steps_cut_stretch() == max(1, full_steps)


def test_one_member_cannot_move_the_announced_scale_beyond_the_honest_claims():
    assert own_scale(1.0, [1.0, 2.0, 2.2, 1e9]) == 2.0  # a liar claiming a huge ‖Δ‖: the honest lower median
    assert own_scale(1.0, [0.0, 1.0, 2.0, 2.2]) == 1.0  # a liar claiming nothing: still the honest claims
    assert own_scale(1.0, [1.0, 1e9]) == 1.0  # a pair: the lower of the two, never below our own
    assert own_scale(3.0, [0.1, 0.1, 0.1]) == 3.0 and own_scale(3.0, []) == 3.0
    honest = honest_deltas(3, shared=1.0, own=0.5)
    mean = exact_average(honest + [scaled(honest[0], -1000.0)])
    liar = [norm(d) for d in honest] + [1000.0 * norm(honest[0])]  # the attacker announces its true length
    assert not any(MeanCheck(MULTIPLIER).judge_(mean, own, liar).accepted for own in honest)


@pytest.mark.parametrize("attacker", [False, True])
def test_the_exchanges_measurements_of_our_input_are_what_the_check_would_measure(attacker):
    """The exchange all-reduce hands the check ‖own‖ and ‖mean − own‖ as CenteredClip measured them (no second pass
    over the vector); they agree with the check's own measurement, with or without a far input sorting first."""
    honest = honest_deltas(5, shared=1.0, own=0.5)
    inputs = ([scaled(honest[0], -1000.0)] if attacker else []) + honest
    result = reduced(inputs)
    ours = len(inputs) - 1
    assert result.lengths[ours] == pytest.approx(norm(inputs[ours]), rel=1e-5)
    assert result.distances[ours] == pytest.approx(distance(result.mean, inputs[ours]), rel=1e-4)
    own = inputs[ours]
    measured = MeanCheck(MULTIPLIER).judge_(result.mean, own, result.lengths, result.lengths[ours],
                                            result.distances[ours])
    itself = MeanCheck(MULTIPLIER).judge_(result.mean, own, result.lengths)
    assert measured.accepted and itself.accepted
    assert (measured.deviation, measured.radius) == pytest.approx((itself.deviation, itself.radius), rel=1e-4)
    assert not MeanCheck(MULTIPLIER).judge_(own, own, deviation=1e6).accepted  # the measured deviation is what counts


@pytest.mark.parametrize("riders_first", [True, False])
def test_free_riders_are_left_out_of_the_mean_by_every_member_alike(riders_first):
    """Two free riders of 8 DiLoCo members (a Δ a millionth of an honest one's) sat in the mean at 1/8 each and
    shrank the honest step by a quarter each round until their bans (+5.1 % honest loss on the netns testnet).
    Every member holds the same inputs, so leaves the same riders out: the mean is the honest members' alone, and
    each input's length and distance stay in the order of the inputs."""
    honest = honest_deltas(6, shared=1.0, own=0.5)
    riders = [scaled(x, FREE_RIDER_SCALE) for x in honest_deltas(2, shared=1.0, own=0.5, seed=1)]
    inputs = riders + honest if riders_first else honest + riders
    result = reduced(inputs)
    alone = reduced(honest)
    assert distance(result.mean, alone.mean) <= 1e-5 * norm(alone.mean)
    assert result.lengths == pytest.approx([norm(x) for x in inputs], rel=1e-5)
    assert result.distances == pytest.approx([distance(result.mean, x) for x in inputs], rel=1e-4)
    assert len(result.against) == len(inputs) and result.far_inputs() == []  # a rider pays as idle, not as far


@pytest.mark.parametrize(("riders", "members"), [(1, 2), (2, 4), (3, 4)])
def test_with_half_the_members_or_more_idle_none_is_left_out(riders, members):
    """The lower median decides: the short inputs must be a minority for the others to be the ones that trained (a
    pair, or two riders of 4, reduce as before)."""
    honest = honest_deltas(members - riders, shared=1.0, own=0.5)
    inputs = honest + [scaled(x, FREE_RIDER_SCALE) for x in honest_deltas(riders, 1.0, 0.5, seed=1)]
    result = reduced(inputs)
    every = centered_clip(inputs, MULTIPLIER).mean
    assert distance(result.mean, every) <= 1e-5 * norm(every)


def test_an_attacker_scaling_its_delta_up_cannot_make_the_honest_members_idle():
    honest = honest_deltas(3, shared=1.0, own=0.5)
    inputs = [*honest, scaled(honest[0], 1e9)]
    result = reduced(inputs)
    assert distance(result.mean, exact_average(honest)) < norm(exact_average(honest))  # the honest ones count
    assert result.far_inputs() == [3]


def test_only_well_formed_claims_of_the_gathered_records_count():
    gathered = {"a": {"round": 3, "norm": 2.0}, "b": {"round": 3, "norm": 1}, "c": {"norm": "far"},
                "d": {"norm": math.nan}, "e": {"norm": -1.0}, "f": {"norm": True}, "g": 5, "h": {"round": 3},
                "i": {"norm": math.inf}}
    assert sorted(claimed_norms(gathered)) == [1.0, 2.0]


def test_with_the_check_off_every_mean_is_accepted_as_it_is():
    honest = honest_deltas(3, shared=1.0, own=0.5)
    check = MeanCheck(MULTIPLIER, enabled=False)
    for mean in (exact_average(honest + [scaled(honest[0], -1000.0)]), [torch.full(s, math.nan) for s in SHAPES]):
        assert check.judge_(mean, honest[0]).accepted


# ---- in the sync strategies, with the all-reduce faked --------------------------------------------------------


class FixedAverager:
    """An all-reduce whose group (of `group_size`) returns `means` in turn, whatever Δ we send."""

    def __init__(self, means: list[Tensors], group_size: int = 4):
        self.means, self.group_size = list(means), group_size

    def average(self, delta: Sequence[torch.Tensor], round_: int, weight: float,
                partners: Sequence[str], tokens: int = 0) -> AveragingResult:
        return AveragingResult([m.clone() for m in self.means.pop(0)], self.group_size, bytes_sent=10,
                               bytes_received=10)

    def launch(self, delta: Sequence[torch.Tensor], round_: int, weight: float,
               partners: Sequence[str], tokens: int = 0) -> FixedAverager:
        self._pending = self.average(delta, round_, weight, partners)
        return self

    def result(self) -> AveragingResult:
        return self._pending

    def forget_(self) -> None:
        self.forgotten = getattr(self, "forgotten", 0) + 1

    def shutdown(self) -> None:
        pass


def outer_with_delta(delta: Tensors) -> OuterOptimizer:
    """An outer optimizer (η 1, no momentum) whose inner phase moved the parameters by −Δ."""
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    outer = OuterOptimizer(params, OuterConfig(lr=1.0, momentum=0.0))
    with torch.no_grad():
        for p, d in zip(params, delta, strict=True):
            p.sub_(d)
    return outer


def context(round_: int = 0) -> RoundContext:
    return RoundContext(round=round_, inner_steps=5, live_peers=["a", "b", "c"], same_round_peers=3,
                        round_peers=["a", "b", "c"])


@pytest.mark.parametrize("robust", [True, False])
def test_diloco_applies_its_own_delta_instead_of_a_hostile_mean_unless_robust_is_off(robust):
    honest = honest_deltas(3, shared=1.0, own=0.5)
    hostile = exact_average(honest + [scaled(honest[0], -1000.0)])
    outer = outer_with_delta(honest[0])
    averager = FixedAverager([hostile])
    sync = DilocoSync(outer, averager, SyncConfig(robust=robust))  # type: ignore[arg-type]
    record = sync.finish_round(context())
    assert getattr(averager, "forgotten", 0) == int(robust)  # a refused mean is not reported as ours next round
    applied = [-p.detach() for p in outer.params]  # θ_0 = 0, η = 1: θ_1 = −(applied outer gradient)
    expected = hostile if not robust else honest[0]
    assert distance(applied, expected) < 1e-5 * norm(expected)
    assert (record.failed, record.group_size) == ((1, 1) if robust else (0, 4))
    assert record.bytes_sent == 10  # the refused all-reduce still cost its traffic


def test_diloco_accepts_an_honest_mean():
    honest = honest_deltas(4, shared=1.0, own=0.5)
    mean = exact_average(honest)
    outer = outer_with_delta(honest[0])
    record = DilocoSync(outer, FixedAverager([mean]), SyncConfig()).finish_round(context())  # type: ignore[arg-type]
    assert distance([-p.detach() for p in outer.params], mean) < 1e-5 * norm(mean)
    assert (record.failed, record.group_size) == (0, 4)


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_the_overlapped_path_judges_the_late_mean_against_the_delta_it_was_made_of(overlap):
    first = honest_deltas(4, shared=1.0, own=0.5, seed=0)
    second = honest_deltas(4, shared=1.0, own=0.5, seed=1)
    hostile = exact_average(first[:3] + [scaled(first[0], -1000.0)])
    outer = outer_with_delta(first[0])
    config = SyncConfig(mode="diloco", overlap=overlap, overlap_momentum=0.0)
    sync = DilocoSync(outer, FixedAverager([hostile, exact_average(second)]), config)  # type: ignore[arg-type]
    first_round = sync.finish_round(context(0))  # nothing pending yet
    # the first round applies no mean (eager: only its own share, which the next mean takes back), so it leaves the
    # peer as in step as it was (a hivemind pair, which shows no states, took each other's state after it:
    # tests/test_benchmark_loopback_sync.py)
    assert first_round.failed == 0 and first_round.nothing_due
    assert "nothing to average yet" in why_alone(context(0), first_round)
    anchor = [a.clone() for a in outer.anchor]
    with torch.no_grad():
        for p, a, d in zip(outer.params, anchor, second[0], strict=True):
            p.copy_(a - d)
    record = sync.finish_round(context(1))
    applied = [a - p.detach() for a, p in zip(anchor, outer.params, strict=True)]
    # refused: round 0's mean is replaced by our round-0 Δ (delayed), and eager adds w·(Δ_1 − Δ_0) with w = 1
    expected = first[0] if overlap == "delayed" else second[0]
    assert distance(applied, expected) < 1e-5 * norm(expected)
    assert (record.failed, record.group_size) == (1, 1)
    assert all(bool(torch.isfinite(p).all()) for p in outer.params)


@pytest.mark.parametrize("robust", [True, False])
def test_factored_all_reduce_mix2_refuses_a_hostile_mean_unless_robust_is_off(robust):
    honest = honest_deltas(3, shared=1.0, own=0.5)
    hostile = exact_average(honest + [[torch.full(s, math.nan) for s in SHAPES]])
    mix2 = AllReduceMix2(FixedAverager([hostile]), "none", mean_check(SyncConfig(robust=robust)))  # type: ignore
    mixed, record = mix2.mix(honest[0], context())
    if robust:
        assert distance(mixed, honest[0]) == 0.0 and (record.failed, record.group_size) == (1, 1)
    else:
        assert all(bool(torch.isnan(m).all()) for m in mixed) and (record.failed, record.group_size) == (0, 4)


# ---- a loopback swarm with an attacker ----------------------------------------------------------------------


class TamperingAverager:
    """An attacker's end of the all-reduce: it sends `factor` × its outer gradient, or with `factor` None its first
    round's outer gradient every round (a replay)."""

    def __init__(self, inner, factor: float | None):
        self.inner, self.factor = inner, factor
        self.first: list[torch.Tensor] | None = None

    def tampered(self, delta) -> list[torch.Tensor]:
        if self.factor is not None:
            return scaled(list(delta), self.factor)
        self.first = self.first or [t.clone() for t in delta]
        return [t.clone() for t in self.first]

    def average(self, delta, round_, weight, partners, tokens=0):
        return self.inner.average(self.tampered(delta), round_, weight, partners, tokens)

    def launch(self, delta, round_, weight, partners, tokens=0):
        return self.inner.launch(self.tampered(delta), round_, weight, partners, tokens)

    def forget_(self) -> None:
        self.inner.forget_()

    def shutdown(self) -> None:
        self.inner.shutdown()


SWARM_ROUNDS = 8  # a hard clip costs 1 of the ban score of 4 (it decays): banned after 4 or 5 rounds as a member
HONEST = 3
UNIFORM_GUESS_LOSS = math.log(257)  # the tiny model's loss when it guesses bytes uniformly (ByteTokenizer)


def run_attacked_swarm(factor: float | None, together: bool = False, **sync: object
                       ) -> tuple[list[list[RoundMetrics]], list[list[torch.Tensor]], list[PeerRecord]]:
    """3 honest DiLoCo peers and 1 sending `factor` × its Δ (None: its first Δ again) for `SWARM_ROUNDS` rounds:
    each honest peer's history and its parameters after the last round, and every member's last record (the
    attacker's last). `together`: the 4 begin round 0 together (`run.min_peers`)."""
    run = {"rounds": SWARM_ROUNDS, **({"min_peers": HONEST + 1} if together else {})}
    config = tiny_config(f"attack-{uuid.uuid4().hex[:6]}", run=run, sync=sync)
    first = start_peer(config)
    members = [first] + [start_peer(config, first.maddrs) for _ in range(HONEST)]
    attacker = members[-1]
    attacker.sync.averager = TamperingAverager(attacker.sync.averager, factor)  # type: ignore[attr-defined]
    threads, histories = run_peers(members, attackers=1)
    for history in histories[:HONEST]:  # rounds and joins too: CI once saw two honest peers lose a round and the
        print(f"{sync} ×{factor}: val loss {[round(m.val_loss, 3) for m in history]}, "  # third average alone
              f"group {[m.peers_averaged for m in history]}, banned {history[-1].banned_peers}, "
              f"rounds {[m.round for m in history]}, joined {[m.joined for m in history]}, "
              f"steps {[m.inner_steps for m in history]}")
    # the attacker's side, for a failure's output: its rounds, groups and joins (a CI run once saw it missing from
    # the last two groups, neither banned nor refused, and left nothing else to read)
    print(f"attacker: rounds {[m.round for m in histories[HONEST]]}, group "
          f"{[m.peers_averaged for m in histories[HONEST]]}, joined {[m.joined for m in histories[HONEST]]}")
    return (histories[:HONEST], [t.params_after_round[SWARM_ROUNDS - 1] for t in threads[:HONEST]],
            [member.announcer.record for member in members])


def assert_honest_peers_train_in_step(histories: list[list[RoundMetrics]], params: list[list[torch.Tensor]]) -> None:
    for history in histories:
        losses = [m.val_loss for m in history]
        # every honest peer ends with the others at the last round (a round lost to a catch-up is not run again)
        assert history[-1].round == SWARM_ROUNDS - 1, [m.round for m in history]
        # no round's loss above the untrained model's: γ 0.9 / η 0.7, the default until the outer step was measured
        # (benchmarks/outer_step.py), spiked one round now and then (3.07 -> 6.46 -> 3.09)
        assert min(losses[1:]) < losses[0] and max(losses) < UNIFORM_GUESS_LOSS, losses
    for other in params[1:]:  # the same inputs, sorted alike: the same robust mean, the same parameters
        assert distance(other, params[0]) <= 1e-5 * norm(params[0])


def assert_banned_by_the_end_of_round(histories: list[list[RoundMetrics]], last_round: int) -> None:
    """Every honest peer banned the attacker in a round up to `last_round`, and averaged without it after."""
    for history in histories:
        banned_at = next((m.round for m in history if m.banned_peers), None)
        assert banned_at is not None and banned_at <= last_round, [m.banned_peers for m in history]
        assert all(m.peers_averaged <= HONEST for m in history if m.round > banned_at), \
            [m.peers_averaged for m in history]


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.alone  # a ban needs the attacker in its rounds' groups, which deadlines decide
def test_a_member_sending_minus_1000_times_its_delta_is_left_out_and_banned():
    histories, params, _ = run_attacked_swarm(-1000.0)
    assert_honest_peers_train_in_step(histories, params)
    for history in histories:  # its Δ, ~500 τ from CenteredClip's mean, bans it at every honest member at once
        assert history[-1].banned_peers, "the attacker was not banned"
        # banned in the first round it attacked (it took 4 or 5 rounds as a member when every clip cost 1): no longer
        # a member. Not "the 3 honest together in the last round": in a CI run one honest peer's last group was 2
        # after a round lost to a failed catch-up, while the three ended with one state (checked above)
        assert all(m.peers_averaged <= HONEST for m in history[1:]), [m.peers_averaged for m in history]


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.alone  # a ban needs the attacker in its rounds' groups, which deadlines decide
def test_a_member_aiming_inside_the_distance_bound_is_clipped_then_banned_within_two_rounds(caplog):
    """−7 × Δ (the red team's `aimed`) passes the 10 × ‖Δ‖ plausibility bound, so its Δ enters the group's inputs:
    CenteredClip bounds it, and pointing against the others' it costs 2.5 of the ban score of 4 (4 beyond 4 τ). It took
    4 to 9 rounds to ban when it cost 1 a round as any hard clip."""
    caplog.set_level(logging.INFO, logger="p2ptrain")  # a failure shows the rounds' story (joins, out of step)
    histories, params, _ = run_attacked_swarm(-7.0)
    assert_honest_peers_train_in_step(histories, params)
    assert_banned_by_the_end_of_round(histories, 1)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.alone  # a ban needs the attacker in its rounds' groups, which deadlines decide
def test_a_member_replaying_its_first_delta_is_banned_by_its_fourth_round():
    """Its round-0 Δ every round: honest-looking, inside the radius, so never clipped hard (issue 31 measured +5.3 %
    honest loss over 30 rounds, never banned). Sent again for round 2 it is a replay (2.5), and for round 3 a ban."""
    histories, params, _ = run_attacked_swarm(None)
    assert_honest_peers_train_in_step(histories, params)
    assert_banned_by_the_end_of_round(histories, 3)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.alone  # a ban needs the attacker in its rounds' groups, which deadlines decide
def test_a_free_rider_is_banned_in_its_fourth_round_as_a_member_and_its_claimed_tokens_are_not_verified():
    """A free rider: a millionth of its Δ, as if it trained at a millionth of the learning rate, and reduced as it
    sent it (the red team's `free_rider` conduct keeps its own true Δ among its inputs, so it falls out of step and
    catches up by download, a member of fewer rounds). Inside every radius and never the same bits twice, such a
    peer sat in every group (issue 31: 15 rounds, no offence). Its first value is spared (a joiner's); each later one
    is `idle` (1.5 of the ban score of 4): a ban on the third, in the fourth round it is a member of (its round 3 when
    it is in every round's group; a deadline may leave it out of some)."""
    histories, params, records = run_attacked_swarm(FREE_RIDER_SCALE)
    assert_honest_peers_train_in_step(histories, params)
    for history in histories:  # rounds the free rider was a member of (a CI run: 0, 1, 4, 5; it lost 2 and 3)
        joint = [m.round for m in history if m.peers_averaged == HONEST + 1]
        assert len(joint) >= 4, [m.peers_averaged for m in history]
        assert_banned_by_the_end_of_round([history], joint[3])
    verified = {p["peer_id"]: p["verified_tokens"] for p in status_document("r", False, records, 0.0)["peers"]}
    claimed = {record.peer_id: record.tokens for record in records}
    rider = records[-1].peer_id
    # each honest peer verified the round-0 claim it spared at most, of the rider's 4 or more rounds
    assert verified[rider] is not None and verified[rider] <= claimed[rider] / 4, (verified, claimed)
    for record in records[:HONEST]:  # the honest peers verified each other's rounds, all but one at most
        assert verified[record.peer_id] >= claimed[record.peer_id] * (SWARM_ROUNDS - 1) / SWARM_ROUNDS, \
            (verified, claimed)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.alone  # a ban needs the attacker in its rounds' groups, which deadlines decide
def test_the_attack_is_real_on_hiveminds_averager_without_the_check():
    # together: in a CI run the attacker, started last, ran a round behind the others throughout (hivemind's groups
    # are per round), was in no group, and wrecked nobody
    histories, params, _ = run_attacked_swarm(-1000.0, together=True, allreduce_transport="hivemind", robust=False)
    wrecked = [not all(bool(torch.isfinite(p).all()) for p in ps) or not all(
        math.isfinite(m.val_loss) and m.val_loss < UNIFORM_GUESS_LOSS for m in h)
        for h, ps in zip(histories, params, strict=True)]
    assert all(wrecked)
