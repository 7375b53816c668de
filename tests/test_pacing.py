"""Heterogeneous bandwidth: throughput estimates, inner steps per link, exchange deadlines (hand-computed)."""

from __future__ import annotations

import math
import types

import pytest
import torch

from p2ptrain.maths.pacing import LinkSpeeds, ThroughputEMA, inner_steps_for_link, inner_steps_for_pace, swarm_step_s
from p2ptrain.net.discovery import PeerRecord, SwarmView
from p2ptrain.net.reputation import Reputation
from p2ptrain.peer import TrainingPeer
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.param_gossip import ParamGossip
from p2ptrain.timing import PRIOR_BYTES_PER_S, exchange_deadline_s


def test_inner_steps_hand_computed() -> None:
    # 10 s rounds, 0.1 s per step: 100 steps of room
    assert inner_steps_for_link(10.0, 0.1, 0.0, h_min=1, h_max=500) == 100
    assert inner_steps_for_link(10.0, 0.1, 2.05, h_min=1, h_max=500) == 100 - 21  # ceil(20.5) = 21
    assert inner_steps_for_link(10.0, 0.1, 0.0, h_min=1, h_max=80) == 80  # clamped from above
    assert inner_steps_for_link(10.0, 0.1, 9.5, h_min=10, h_max=80) == 10  # 100 − 95 = 5, clamped from below
    assert inner_steps_for_link(10.0, 0.1, 50.0, h_min=3, h_max=80) == 3  # comm longer than the round
    assert inner_steps_for_link(10.0, 0.1, float("inf"), h_min=3, h_max=80) == 3


def test_slow_link_gets_fewer_inner_steps() -> None:
    payload_bytes, round_time_s, step_time_s = 50_000_000, 60.0, 0.2
    fast, slow = ThroughputEMA(prior_bytes_per_s=1e8), ThroughputEMA(prior_bytes_per_s=1e8)
    for _ in range(20):
        fast.update_(payload_bytes, 0.5)  # 100 MB/s
        slow.update_(payload_bytes, 25.0)  # 2 MB/s
    h_fast = inner_steps_for_link(round_time_s, step_time_s, payload_bytes / fast.bytes_per_s, 5, 500)
    h_slow = inner_steps_for_link(round_time_s, step_time_s, payload_bytes / slow.bytes_per_s, 5, 500)
    assert h_fast == 300 - 3  # ceil(0.5 / 0.2) = 3
    assert h_slow == pytest.approx(300 - 125, abs=1)  # the EMA is within a hair of 25 s after 20 updates
    # both rounds then take about the same wall time: compute + own transfer
    assert abs((h_fast * step_time_s + 0.5) - (h_slow * step_time_s + 25.0)) <= 2 * step_time_s


def test_inner_steps_rejects_bad_arguments() -> None:
    for args in ((10.0, 0.0, 1.0, 1, 10), (10.0, 0.1, -1.0, 1, 10), (10.0, 0.1, 1.0, 0, 10), (10.0, 0.1, 1.0, 5, 4)):
        with pytest.raises(ValueError):
            inner_steps_for_link(*args)


def test_throughput_ema_hand_computed() -> None:
    ema = ThroughputEMA(prior_bytes_per_s=1e6, smoothing=0.5)
    assert ema.bytes_per_s == pytest.approx(1e6) and ema.num_measurements == 0
    ema.update_(2_000_000, 1.0)  # the first exchange replaces the prior: 0.5 µs/byte
    assert ema.bytes_per_s == pytest.approx(2e6)
    ema.update_(1_000_000, 1.0)  # then blends: s/B = 0.5e-6 + 0.5 (1e-6 − 0.5e-6) = 0.75e-6
    assert ema.bytes_per_s == pytest.approx(1 / 0.75e-6)
    assert 4_000_000 / ema.bytes_per_s == pytest.approx(3.0)
    ema.update_(0, 1.0)  # empty exchanges carry no information
    ema.update_(10, 0.0)
    assert ema.num_measurements == 2


def test_throughput_ema_first_exchange_replaces_the_prior_even_after_a_timeout() -> None:
    ema = ThroughputEMA(prior_bytes_per_s=2.5e6, smoothing=0.3)
    ema.update_timeout_(1_000_000, deadline_s=2.0)  # a bound (at most 0.5 MB/s), not a measurement of the link
    assert ema.bytes_per_s == pytest.approx(5e5) and ema.num_completed == 0
    ema.update_(1_000_000, 8.0)  # a 1 Mbit/s link: believed at once, not blended into the guess
    assert ema.bytes_per_s == pytest.approx(1.25e5)


def test_throughput_ema_converges_and_learns_from_timeouts() -> None:
    ema = ThroughputEMA(prior_bytes_per_s=1e9, smoothing=0.3)
    for _ in range(40):
        ema.update_(1_000_000, 0.1)
    assert ema.bytes_per_s == pytest.approx(1e7, rel=1e-3)
    ema.update_timeout_(1_000_000, deadline_s=2.0)  # missed a 2 s deadline: at most 0.5 MB/s
    assert ema.bytes_per_s <= 5e5
    with pytest.raises(ValueError):
        ThroughputEMA(prior_bytes_per_s=0.0)
    with pytest.raises(ValueError):
        ThroughputEMA(prior_bytes_per_s=1.0, smoothing=0.0)


def test_exchange_deadline_hand_computed() -> None:
    assert exchange_deadline_s(10_000_000, 1e6, safety_factor=3.0, floor_s=5.0) == pytest.approx(30.0)
    assert exchange_deadline_s(1_000, 1e6, safety_factor=3.0, floor_s=5.0) == 5.0
    with pytest.raises(ValueError):
        exchange_deadline_s(1_000, 0.0, safety_factor=3.0, floor_s=5.0)
    with pytest.raises(ValueError):
        exchange_deadline_s(1_000, 1e6, safety_factor=0.5, floor_s=5.0)


def mixer_with_links(measured: dict[str, float], overlapped: bool = False) -> ParamGossip:
    """A mixer (no network) whose links to these peers measured these two-way throughputs (bytes/s)."""
    reference = [torch.zeros(250_000)]  # 1 MB of fp32: 500 kB one way in fp16
    mixer = ParamGossip(None, "run", "fp", "gasloc", reference, SyncConfig(mode="gasloc"), seed=0,  # type: ignore[arg-type]
                        overlapped=overlapped)
    for peer, bytes_per_s in measured.items():
        mixer.links.by_partner[peer] = ThroughputEMA(bytes_per_s, smoothing=1.0)
        mixer.links.by_partner[peer].update_(int(bytes_per_s), 1.0)
    return mixer


def test_equal_links_measured_apart_under_cpu_load_stay_partners() -> None:
    """Measured in a loaded 4-peer swarm on loopback: own 3.41 MB/s, the others 1.84, 2.29 and 2.10 MB/s. At a
    1.25 × tolerance the fastest peer started no exchange in any round (CI: 0 exchanges in the whole run)."""
    mixer = mixer_with_links({"a": 3.41e6})
    links = {"b": 1.84e6, "c": 2.29e6, "d": 2.10e6}
    assert mixer.partners_worth_waiting_for(["b", "c", "d"], links) == ["b", "c", "d"]


def test_a_fast_peer_does_not_start_exchanges_with_a_peer_too_slow_to_wait_for() -> None:
    mixer = mixer_with_links({"fast": 10e6})  # own link >= 10 MB/s: an exchange takes 0.1 s
    links = {"fast": 10e6, "slow": 0.25e6, "slower-than-us-a-bit": 9e6}
    assert mixer.expected_exchange_s() == pytest.approx(0.1)
    assert mixer.expected_exchange_s(0.25e6) == pytest.approx(4.0)
    eligible = mixer.partners_worth_waiting_for(["fast", "slow", "slower-than-us-a-bit", "unannounced"], links)
    assert eligible == ["fast", "slower-than-us-a-bit", "unannounced"]  # unknown speed: given the benefit of doubt


def test_a_peer_that_announced_no_speed_is_judged_by_what_we_measured_with_it() -> None:
    """A slow peer whose own offers never complete announces no speed; once we measured it slow, we leave it to
    start the exchanges (in CI a fast peer kept starting them: 6 of its 32 rounds waited on a 1 Mbit/s link)."""
    mixer = mixer_with_links({"fast": 10e6, "measured-slow": 0.25e6})
    assert mixer.partners_worth_waiting_for(["fast", "measured-slow", "unknown"], {"fast": 10e6}) == ["fast", "unknown"]
    # what a peer announced still comes first: our one slow exchange with it may have been our CPU's stall
    assert mixer.partners_worth_waiting_for(["measured-slow"], {"measured-slow": 10e6}) == ["measured-slow"]


def test_a_partner_whose_exchange_blocks_a_tenth_of_the_inner_phase_or_less_is_worth_waiting_for() -> None:
    """A partner somewhat slower than the noise allows is still worth waiting for when its exchange blocks little
    of the inner phase, while a truly slow partner (4 s for a 10 s phase) is still left to start exchanges itself."""
    mixer = mixer_with_links({"fast": 3.6e6})  # own exchange: 1 MB / 3.6 MB/s = 0.28 s
    links = {"noisy-fast": 1.0e6, "slow": 0.25e6}  # 1 s (> 3 × 0.28 s) and 4 s
    assert mixer.partners_worth_waiting_for(["noisy-fast", "slow"], links) == []  # inner phase not known yet
    mixer.budget_s = 10.0  # a 1 s wait is a tenth of the inner phase
    assert mixer.partners_worth_waiting_for(["noisy-fast", "slow"], links) == ["noisy-fast"]


def test_a_slow_peer_starts_exchanges_with_anyone_and_overlapped_exchanges_may_use_the_inner_phase() -> None:
    slow = mixer_with_links({"fast": 0.25e6, "also-fast": 0.25e6})  # our own link is every exchange's bottleneck
    assert slow.own_link_bytes_per_s() == pytest.approx(0.25e6)
    assert slow.partners_worth_waiting_for(["fast", "other"], {"fast": 10e6, "other": 5e6}) == ["fast", "other"]
    mix1 = mixer_with_links({"fast": 10e6}, overlapped=True)
    mix1.budget_s = 5.0  # a Mix1 exchange of up to 5 s hides behind the inner phase
    assert mix1.partners_worth_waiting_for(["slow"], {"slow": 0.25e6}) == ["slow"]
    mix1.budget_s = 1.0
    assert mix1.partners_worth_waiting_for(["slow"], {"slow": 0.25e6}) == []


def test_one_slow_partner_does_not_make_a_peer_believe_its_own_link_slow() -> None:
    """Else a fast peer whose first partner was slow keeps choosing slow partners and never learns otherwise."""
    first_partner_slow = mixer_with_links({"slow": 0.25e6})
    assert first_partner_slow.own_link_bytes_per_s() == PRIOR_BYTES_PER_S
    assert first_partner_slow.links.fastest_measured_bytes_per_s() == pytest.approx(0.25e6)  # announced: not the prior
    assert mixer_with_links({}).links.fastest_measured_bytes_per_s() == 0.0  # nothing measured: announce "unknown"
    slow_first = mixer_with_links({"fast": 0.25e6})  # but a partner that announced 10 MB/s: we were the bottleneck
    slow_first.announced = {"fast": 10e6}
    assert slow_first.own_link_bytes_per_s() == pytest.approx(0.25e6)
    assert first_partner_slow.partners_worth_waiting_for(["slow", "fast"], {"slow": 0.25e6, "fast": 10e6}) == ["fast"]


def test_time_outs_with_two_different_partners_bound_our_own_link_for_partners_not_measured() -> None:
    """A slow uplink whose every exchange went to a partner never measured got the prior's deadline each time and
    timed out forever (a 1.7 Mbit/s peer of swarm32: all 25 exchanges). Two time-outs in a row with different
    partners bound what we assume of unmeasured links; one does not (the partner may be gone); a completed
    exchange raises it again to what it measured, and measured links keep their own speed."""
    links = LinkSpeeds(prior_bytes_per_s=2.5e6)
    links.completed_("measured", 2_000_000, 0.5)  # 4 MB/s: above the prior, so unmeasured links stay at the prior
    assert links.unmeasured_bytes_per_s == 2.5e6
    links.timed_out_("a", 500_000, 5.0, bounds_link=False)
    assert links.estimate_bytes_per_s("new") == 2.5e6  # one time-out: no bound
    assert links.deadline_s("new", 500_000, 4.0) == 5.0  # the set-up floor
    links.timed_out_("a", 500_000, 5.0, bounds_link=False)  # the same partner again: still one partner
    assert links.estimate_bytes_per_s("new") == 2.5e6
    links.timed_out_("b", 500_000, 5.0, bounds_link=False)
    assert links.estimate_bytes_per_s("new") == pytest.approx(100_000)  # 500 kB in 5 s at most
    assert links.deadline_s("new", 500_000, 4.0) == pytest.approx(20.0)  # the next exchange gets 4× the floor
    assert links.estimate_bytes_per_s("a") == pytest.approx(100_000)  # tried, never completed: bounded too
    assert links.estimate_bytes_per_s("measured") == pytest.approx(4e6)  # a measured link keeps its speed
    links.completed_("new", 500_000, 2.5)  # 200 kB/s: our link is at least that fast
    assert links.unmeasured_bytes_per_s == pytest.approx(200_000)
    assert links.timed_out_with == set()
    links.timed_out_("c", 500_000, 5.0, bounds_link=True)  # a bound on that link alone, no new streak yet
    assert links.estimate_bytes_per_s("c") == pytest.approx(100_000)
    assert links.estimate_bytes_per_s("d") == pytest.approx(200_000)


def test_a_partners_time_outs_grow_its_deadline_to_what_its_claimed_speed_needs_and_no_further() -> None:
    """An identity announcing 1 Gbit/s that took each offer and never answered grew its deadline by each time-out
    (5 s, 20 s, then the cap). Until an exchange on the link completes, a time-out bounds it no slower than the
    partner's claim: a fast claim costs the set-up floor a draw, a slow one the deadline it needs; with no claim,
    or once an exchange completed (its measurement is the yardstick), a time-out bounds the link as before. What
    time-outs with two partners say of our own link is unchanged."""
    liar = LinkSpeeds(prior_bytes_per_s=2.5e6)
    for _ in range(3):
        liar.timed_out_("liar", 500_000, liar.deadline_s("liar", 500_000, 4.0), bounds_link=True,
                        claimed_bytes_per_s=125e6)
    assert liar.deadline_s("liar", 500_000, 4.0) == 5.0  # the floor, time-out after time-out
    slow = LinkSpeeds(prior_bytes_per_s=2.5e6)
    slow.timed_out_("slow", 500_000, 5.0, bounds_link=True, claimed_bytes_per_s=10_000)
    assert slow.estimate_bytes_per_s("slow") == pytest.approx(100_000)  # bounded by the time-out: 10 kB/s is slower
    slow.timed_out_("slow", 500_000, 20.0, bounds_link=True, claimed_bytes_per_s=50_000)
    assert slow.estimate_bytes_per_s("slow") == pytest.approx(50_000)  # down to its claim, and no further
    slow.timed_out_("slow", 500_000, 40.0, bounds_link=True, claimed_bytes_per_s=50_000)
    assert slow.estimate_bytes_per_s("slow") == pytest.approx(50_000)
    plain = LinkSpeeds(prior_bytes_per_s=2.5e6)
    plain.timed_out_("unclaimed", 500_000, 5.0, bounds_link=True, claimed_bytes_per_s=None)
    assert plain.estimate_bytes_per_s("unclaimed") == pytest.approx(100_000)
    plain.completed_("known", 500_000, 0.1)
    plain.timed_out_("known", 500_000, 5.0, bounds_link=True, claimed_bytes_per_s=125e6)
    assert plain.estimate_bytes_per_s("known") == pytest.approx(100_000)  # measured: the claim no longer counts
    own = LinkSpeeds(prior_bytes_per_s=2.5e6)
    own.timed_out_("a", 500_000, 5.0, bounds_link=True, claimed_bytes_per_s=125e6)
    own.timed_out_("b", 500_000, 5.0, bounds_link=True, claimed_bytes_per_s=125e6)
    assert own.estimate_bytes_per_s("new") == pytest.approx(100_000)  # two partners in a row: our own link


def test_a_time_out_held_at_a_fast_partners_claim_does_not_make_a_slow_peer_take_its_link_for_fast() -> None:
    """A time-out bounds a link from above; held at a fast partner's claim it stays at the prior, and a 1 Mbit/s peer
    that took it for a measure of its own link ran all its steps and announced the prior (CI: half its steps where
    the exchange's time was worth all but the fewest)."""
    slow = LinkSpeeds(prior_bytes_per_s=2.5e6)
    slow.completed_("fast", 250_000, 2.0)  # 125 kB/s: our link
    slow.timed_out_("also-fast", 500_000, 5.0, bounds_link=True, claimed_bytes_per_s=6.25e6)
    announced = {"fast": 6.25e6, "also-fast": 6.25e6}
    assert slow.own_bytes_per_s(announced) == pytest.approx(125_000)
    assert slow.fastest_measured_bytes_per_s() == pytest.approx(125_000)
    only_time_outs = LinkSpeeds(prior_bytes_per_s=2.5e6)  # nothing completed: the bounds are all there is
    only_time_outs.timed_out_("a", 500_000, 5.0, bounds_link=True)
    only_time_outs.timed_out_("b", 500_000, 10.0, bounds_link=True)
    assert only_time_outs.own_bytes_per_s({"a": 6.25e6}) == pytest.approx(100_000)
    assert only_time_outs.fastest_measured_bytes_per_s() == 0.0  # announce "unknown", not a bound


def test_time_outs_with_identities_of_one_host_say_nothing_of_our_own_link() -> None:
    """Identities are free: many of one machine that never answer took our own link for slow (two in a row) and grew
    every unmeasured deadline. Partners of one host count as one partner of the streak; of two hosts, as before."""
    links = LinkSpeeds(prior_bytes_per_s=2.5e6)
    for sybil in ("sybil1", "sybil2", "sybil3"):
        links.timed_out_(sybil, 500_000, 5.0, bounds_link=False, host="203.0.113.7")
    assert links.estimate_bytes_per_s("new") == 2.5e6
    links.timed_out_("elsewhere", 500_000, 5.0, bounds_link=False, host="198.51.100.2")
    assert links.estimate_bytes_per_s("new") == pytest.approx(100_000)


def test_an_exchange_a_partner_opened_with_us_that_completed_is_a_floor_under_our_own_link() -> None:
    """Time-outs with two silent identities in a row took our own link for slow; an honest partner's exchange with
    us, our payload included, completing fast says otherwise, as one we opened does: the streak ends and unmeasured
    links get their deadline back."""
    links = LinkSpeeds(prior_bytes_per_s=2.5e6)
    links.timed_out_("a", 500_000, 5.0, bounds_link=False)
    links.timed_out_("b", 500_000, 5.0, bounds_link=False)
    assert links.deadline_s("new", 500_000, 4.0) == pytest.approx(20.0)
    links.answered_(500_000, 0.1)  # 5 MB/s: above the prior
    assert links.deadline_s("new", 500_000, 4.0) == 5.0 and links.timed_out_with == set()
    links.timed_out_("c", 500_000, 5.0, bounds_link=False)  # one partner: no new streak yet
    assert links.deadline_s("new", 500_000, 4.0) == 5.0
    links.answered_(0, 0.1)  # nothing moved: nothing learnt
    assert links.timed_out_with == {"c"}
    links.answered_(500_000, 1.0)  # 0.5 MB/s: a floor, not a cap
    assert links.estimate_bytes_per_s("new") == 2.5e6
    links.timed_out_("d", 500_000, 5.0, bounds_link=False)
    links.timed_out_("e", 500_000, 5.0, bounds_link=False)  # two partners since the answer: a streak again
    assert links.estimate_bytes_per_s("new") == pytest.approx(100_000)


def test_a_peer_slower_to_compute_than_the_swarm_takes_fewer_steps_down_to_half() -> None:
    """The round-time rule for compute: the target round is H steps at the swarm's pace (the median of the step
    times others announce). Within PACE_SLACK of it, or faster, or with the pace unknown, a peer keeps H; at most
    half is given up, whatever identities claim; never below H_min."""
    assert swarm_step_s([0.5, 0.6, 0.7]) == 0.6
    assert math.isnan(swarm_step_s([0.5, 0.6]))  # too few to know the swarm's pace
    assert math.isnan(swarm_step_s([0.5, 0.0, math.inf, math.nan]))  # unknown, and what is no step time
    assert swarm_step_s([0.5, 0.5, 0.5, 1e-9, 1e-9]) == 0.5  # two liars move a median of five little
    assert inner_steps_for_pace(20, own_step_s=0.5, swarm_step_s=0.5, h_min=1) == 20
    assert inner_steps_for_pace(20, own_step_s=0.74, swarm_step_s=0.5, h_min=1) == 20  # within the slack
    assert inner_steps_for_pace(20, own_step_s=0.25, swarm_step_s=0.5, h_min=1) == 20  # faster: all of H
    assert inner_steps_for_pace(20, own_step_s=0.8, swarm_step_s=0.5, h_min=1) == 12  # floor(20 × 0.5 / 0.8)
    assert inner_steps_for_pace(20, own_step_s=0.76, swarm_step_s=0.5, h_min=1) == 13
    assert inner_steps_for_pace(20, own_step_s=1.5, swarm_step_s=0.5, h_min=1) == 10  # 3× slower: half at most
    assert inner_steps_for_pace(20, own_step_s=1.5, swarm_step_s=1e-12, h_min=1) == 10  # claims of infinite speed
    assert inner_steps_for_pace(20, own_step_s=1.5, swarm_step_s=0.5, h_min=14) == 14
    assert inner_steps_for_pace(20, own_step_s=1.5, swarm_step_s=math.nan, h_min=1) == 20  # pace unknown
    assert inner_steps_for_pace(20, own_step_s=math.nan, swarm_step_s=0.5, h_min=1) == 20  # own time unknown
    assert inner_steps_for_pace(1, own_step_s=1.5, swarm_step_s=0.5, h_min=1) == 1


def test_once_a_partners_work_is_verified_only_such_partners_set_the_pace() -> None:
    """A step time is a free claim: 20 identities announcing 1 ms steps made the median every honest peer's pace,
    and each ran half its inner steps (twice the rounds and bytes per token). Counted among partners whose work we
    verified (3 of them at least), they move nothing; a peer that verified fewer still counts every record."""
    honest = [PeerRecord(peer_id=f"h{i}", round=3, inner_step=0, phase="inner", round_eta=0.0, step_s=0.5)
              for i in range(3)]
    identities = [PeerRecord(peer_id=f"s{i}", round=3, inner_step=0, phase="inner", round_eta=0.0, step_s=0.001)
                  for i in range(20)]

    def paced_steps(vouched: set[str]) -> int:
        peer = types.SimpleNamespace(
            config=types.SimpleNamespace(sync=SyncConfig(mode="gasloc"), inner=types.SimpleNamespace(steps=20,
                                                                                                     min_steps=1)),
            sync=types.SimpleNamespace(aligned_rounds=False), reputation=Reputation(),
            contributions=types.SimpleNamespace(vouches_for=lambda p: p in vouched), step_time_s=0.5,
            swarm_step_s=math.nan, paced_steps=20, state=types.SimpleNamespace(round=3))
        TrainingPeer._pace(peer, SwarmView("me", honest + identities))  # type: ignore[arg-type]
        return peer.paced_steps

    assert paced_steps(vouched=set()) == 10  # the identities' median: half of H
    assert paced_steps(vouched={"h0", "h1", "h2"}) == 20  # the verified partners' pace is ours
    assert paced_steps(vouched={"h0", "h1"}) == 10  # a median of two verified swings with one's noise: all count
