"""What partners' outer gradients show of their work (sync/contribution.py): a free rider is `idle`, and the tokens
a partner claims are verified only by values that did work; how the exchange driver judges them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from p2ptrain.net.discovery import MAX_VOUCHES, PeerRecord, short_id
from p2ptrain.net.reputation import OFFENCES, Reputation
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.contribution import (
    IDLE_FRACTION,
    MAX_CLAIM_FACTOR,
    MAX_ROUND_TOKENS,
    WORK_KEY,
    Contributions,
    OwnWork,
    claimed_tokens,
    shown_sample,
    work_sample,
)
from p2ptrain.sync.exchange_driver import ExchangeDriver
from p2ptrain.sync.state_evidence import STATE_SAMPLE
from p2ptrain.testnet.adversary import FREE_RIDER_SCALE

OWN_NORM, OWN_TOKENS = 2.0, 1000


def judge(ledger: Contributions, partner: str, round_: int, norm: float, claimed: int = OWN_TOKENS,
          replayed: bool = False) -> bool:
    return ledger.judge_(partner, round_, claimed, norm, OWN_NORM, OWN_TOKENS, replayed)


def test_a_free_riders_values_are_idle_from_its_second_on_and_verify_nothing() -> None:
    ledger = Contributions()
    free_rider = OWN_NORM * FREE_RIDER_SCALE  # the red team's: a millionth of a trained Δ
    assert [judge(ledger, "rider", r, free_rider) for r in range(4)] == [False, True, True, True]
    work = ledger.work()["rider"]
    assert (work.values, work.idle, work.tokens_claimed, work.tokens_verified) == (4, 3, 4 * OWN_TOKENS, OWN_TOKENS)


@pytest.mark.parametrize("ratio", [IDLE_FRACTION, 1e-3, 0.05, 1.0, 30.0])
def test_honest_lengths_are_never_idle_and_verify_their_claims(ratio: float) -> None:
    """From the shortest honest Δ (one step at the schedule's floor against H = 1000 at its peak) to a longer one."""
    ledger = Contributions()
    assert not any(judge(ledger, "honest", r, ratio * OWN_NORM) for r in range(5))
    assert ledger.work()["honest"].tokens_verified == 5 * OWN_TOKENS


def test_a_zero_or_non_finite_length_is_idle_but_our_own_zero_judges_nobody() -> None:
    ledger = Contributions()
    judge(ledger, "p", 0, 1.0)
    assert judge(ledger, "p", 1, 0.0) and judge(ledger, "p", 2, float("nan"))
    assert not ledger.judge_("q", 0, 10, 0.0, 0.0, 10) and not ledger.judge_("q", 1, 10, 0.0, 0.0, 10)


def test_a_partner_vouches_once_one_of_its_values_did_work() -> None:
    """What the quorum round counts (join_rules.py): idle or replayed values earn no vote."""
    ledger = Contributions()
    assert not ledger.vouches_for("p")
    judge(ledger, "rider", 0, OWN_NORM, replayed=True)
    judge(ledger, "rider", 1, 0.0)
    assert not ledger.vouches_for("rider")
    judge(ledger, "p", 0, OWN_NORM)
    assert ledger.vouches_for("p") and ledger.work()["p"].worked == 1


def test_a_claim_verifies_at_most_a_multiple_of_ours_and_a_replay_verifies_nothing() -> None:
    ledger = Contributions()
    judge(ledger, "p", 0, OWN_NORM, claimed=10**11)
    judge(ledger, "p", 1, OWN_NORM, replayed=True)
    assert ledger.work()["p"].tokens_verified == MAX_CLAIM_FACTOR * OWN_TOKENS
    assert ledger.work()["p"].tokens_claimed == 10**11 + OWN_TOKENS


def test_a_round_counts_once_and_a_round_back_counts_nothing() -> None:
    ledger = Contributions()
    judge(ledger, "p", 3, OWN_NORM)
    assert not judge(ledger, "p", 3, 0.0) and not judge(ledger, "p", 2, 0.0)  # an all-reduce's stages, a gossip gap
    assert ledger.work()["p"].values == 1


def test_partners_held_and_vouched_for_are_bounded() -> None:
    ledger = Contributions(max_partners=4)
    partners = [f"12D3KooW{i:02d}abcdefgh{i:02d}" for i in range(6)]
    for partner in partners:
        judge(ledger, partner, 0, OWN_NORM)
    assert list(ledger.work()) == partners[2:]  # the least recently judged go first
    ledger = Contributions()
    names = [f"12D3KooWpartner{letter}" for letter in "abcdefghijk"[:MAX_VOUCHES + 3]]
    for name in names:
        judge(ledger, name, 0, OWN_NORM)
    vouches = ledger.vouches()
    assert list(vouches) == [short_id(name) for name in names[3:]] and set(vouches.values()) == {OWN_TOKENS}
    PeerRecord(peer_id="me", round=0, inner_step=0, phase="inner", round_eta=0.0, vouched=vouches)  # it validates


@pytest.mark.parametrize("header, tokens", [({}, 0), ({"tokens": 512}, 512), ({"tokens": -1}, 0),
                                            ({"tokens": MAX_ROUND_TOKENS + 1}, 0), ({"tokens": 5.0}, 0),
                                            ({"tokens": True}, 0), ({"tokens": "9"}, 0)])
def test_a_claim_is_an_int_within_bounds(header: dict, tokens: int) -> None:
    assert claimed_tokens(header) == tokens


@pytest.mark.parametrize("vouched", [{f"a{i}": 1 for i in range(MAX_VOUCHES + 1)}, {"0OIl": 1}, {"abc": -1},
                                     {"123456789": 1}, {"abc": 1.5}])
def test_a_record_with_bad_vouches_is_refused(vouched: dict) -> None:
    with pytest.raises(ValueError):
        PeerRecord(peer_id="me", round=0, inner_step=0, phase="inner", round_eta=0.0, vouched=vouched)


def driver(robust: bool = True) -> tuple[ExchangeDriver, Reputation]:
    reputation = Reputation()
    return ExchangeDriver(None, "run", "fp", "allreduce.diloco", SyncConfig(robust=robust), policy=None,
                          codecs=(), max_payload_bytes=2**20, reputation=reputation), reputation


def value(length: float) -> list[torch.Tensor]:
    return [torch.full((4,), length / 2)]  # ‖·‖ = length


def test_the_driver_bans_a_free_rider_on_its_fourth_value_and_spares_an_honest_partner() -> None:
    drive, reputation = driver()
    rnd = SimpleNamespace(measures_link=True, own_work=OwnWork(OWN_NORM, OWN_TOKENS))
    verdicts: dict[str, list[bool]] = {"rider": [], "honest": []}
    for round_ in range(4):
        verdicts["rider"].append(drive.judge_value(rnd, "rider", {"round": round_, "tokens": OWN_TOKENS},
                                                   value(OWN_NORM * FREE_RIDER_SCALE * (1 + round_))))  # no replay
        verdicts["honest"].append(drive.judge_value(rnd, "honest", {"round": round_, "tokens": OWN_TOKENS},
                                                    value(OWN_NORM * (1 + round_))))
    # a value that showed no work is False: the policy's stand-in is applied for it (a gossip partner's: not mixed)
    assert verdicts == {"rider": [True, False, False, False], "honest": [True] * 4}
    assert 3 * OFFENCES["idle"] >= 4.0 > 2 * OFFENCES["idle"]  # the default ban score: a third idle value bans
    assert reputation.is_banned("rider") and reputation.offences()["rider"] == {"idle": 3}
    assert "honest" not in reputation.offences()
    assert drive.contributions.work()["honest"].tokens_verified == 4 * OWN_TOKENS


def test_the_driver_judges_no_work_without_robust_or_where_values_are_not_outer_gradients() -> None:
    for robust, own_work in ((False, OwnWork(OWN_NORM, OWN_TOKENS)), (True, None)):
        drive, reputation = driver(robust)
        rnd = SimpleNamespace(measures_link=True, own_work=own_work)
        for round_ in range(4):
            assert drive.judge_value(rnd, "rider", {"round": round_}, value(1e-9 * (1 + round_)))
        assert reputation.offences() == {} and drive.contributions.work() == {}


# ---- GASLoC: values are parameters, and a header shows the work ---------------------------------------------------


def gradient(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(shape, generator=generator) for shape in ((40, 30), (30,), (7, 3))]


def test_every_peer_samples_its_outer_gradient_at_the_runs_same_coordinates() -> None:
    ours, theirs = gradient(1), gradient(2)
    assert len(work_sample(ours, "run")) == STATE_SAMPLE
    assert work_sample(ours, "run") == work_sample([t.clone() for t in ours], "run")  # the run's coordinates
    assert work_sample(ours, "run") != work_sample(ours, "other-run")
    doubled = work_sample([2 * t for t in theirs], "run")  # the same coordinates of another gradient
    assert doubled == [2 * v for v in work_sample(theirs, "run")]


@pytest.mark.parametrize("shown", [None, "text", [1.0] * (STATE_SAMPLE - 1), [math.nan] * STATE_SAMPLE,
                                   [True] * STATE_SAMPLE, [1e300] * STATE_SAMPLE])
def test_a_header_without_a_valid_work_sample_shows_no_work(shown: object) -> None:
    header = {} if shown is None else {WORK_KEY: shown}
    assert shown_sample(header) is None  # and the parameters themselves are no measure of work: idle (below)
    assert shown_sample({WORK_KEY: work_sample(gradient(1), "run")}) == work_sample(gradient(1), "run")


def test_the_driver_bans_a_gasloc_free_rider_by_its_samples_and_spares_an_honest_partner() -> None:
    """Parameters show no work; the header's sample of the round's outer gradient does, judged at the same
    coordinates as ours: a millionth of a trained Δ (or no sample at all) is idle from the second value on."""
    drive, reputation = driver()
    own = OwnWork.of_sample(work_sample(gradient(1), "run"), OWN_TOKENS)
    rnd = SimpleNamespace(measures_link=True, own_work=own)
    params = gradient(9)  # what both partners send: near each other, as gossip partners are
    for round_ in range(4):
        moved = [p + 0.01 * (round_ + 1) for p in params]  # no replay
        rider = {"round": round_, "tokens": OWN_TOKENS,
                 WORK_KEY: work_sample(gradient(10 + round_, FREE_RIDER_SCALE), "run")}
        drive.judge_value(rnd, "rider", rider, moved)
        drive.judge_value(rnd, "silent", {"round": round_, "tokens": OWN_TOKENS}, moved)
        honest = {"round": round_, "tokens": OWN_TOKENS, WORK_KEY: work_sample(gradient(20 + round_), "run")}
        drive.judge_value(rnd, "honest", honest, moved)
    assert reputation.offences()["rider"] == {"idle": 3} and reputation.is_banned("rider")
    assert reputation.offences()["silent"] == {"idle": 3}
    assert "honest" not in reputation.offences()
    work = drive.contributions.work()
    assert work["honest"].tokens_verified == 4 * OWN_TOKENS and work["rider"].tokens_verified == OWN_TOKENS


def test_a_work_sample_shown_again_for_a_later_round_is_a_replay_and_verifies_nothing() -> None:
    """An honest sample stands for two claimed rounds in a row (an answer during the next inner phase shows the
    last step's); the same bits two rounds on are a stale Δ. Zeros (a round that took no step) are idle instead."""
    drive, reputation = driver()
    rnd = SimpleNamespace(measures_link=True, own_work=OwnWork.of_sample(work_sample(gradient(1), "run"), OWN_TOKENS))
    stale = work_sample(gradient(5), "run")
    shown = []
    for round_ in range(3):
        moved = [p + 0.01 * round_ for p in gradient(9)]
        shown.append(drive.judge_value(rnd, "stale", {"round": round_, "tokens": OWN_TOKENS, WORK_KEY: stale}, moved))
        drive.judge_value(rnd, "still", {"round": round_, "tokens": OWN_TOKENS, WORK_KEY: [0.0] * STATE_SAMPLE},
                          moved)
    assert reputation.offences()["stale"] == {"replayed": 1} and shown == [True, True, False]
    assert drive.contributions.work()["stale"].tokens_verified == 2 * OWN_TOKENS  # rounds 0 and 1, not 2
    assert reputation.offences()["still"] == {"idle": 2}
