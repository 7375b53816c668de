"""DiLoCo's state evidence (sync/state_evidence.py): the sample each member shows of its anchor, and whether ours
is the group's: by hand, then members of a real exchange all-reduce that hold one, two and three states."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from swarm_utils import shutdown, start_p2ps

from p2ptrain.join_rules import choose_donors
from p2ptrain.net.discovery import PeerRecord
from p2ptrain.net.exchange import serve_exchanges
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.exchange_allreduce import ExchangeAllReduce
from p2ptrain.sync.state_evidence import (
    ALIGNED_MAX_DISTANCE,
    STATE_SAMPLE,
    parse_sample,
    same_state,
    state_in_step,
    state_sample,
)

SHAPES = [(40, 30), (30,), (7, 5)]


def tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator) for s in SHAPES]


def test_a_sample_is_the_same_coordinates_for_every_peer_of_a_round_and_new_ones_each_round():
    theta = tensors(0)
    sample = state_sample(theta, 5, "run")
    assert len(sample) == STATE_SAMPLE and sample == state_sample([t.clone() for t in theta], 5, "run")
    flat = torch.cat([t.reshape(-1) for t in theta])
    assert all(any(math.isclose(v, float(x)) for x in flat) for v in sample)  # values of θ itself
    assert state_sample(theta, 6, "run") != sample and state_sample(theta, 5, "other run") != sample
    assert state_sample([], 0, "run") == []


def test_float_rounding_is_one_state_and_one_rounds_step_is_another():
    theta = tensors(0)
    sample = state_sample(theta, 1, "run")
    rounded = state_sample([t * (1 + 1e-6) for t in theta], 1, "run")
    stepped = state_sample([t + 0.01 * torch.randn(t.shape) for t in theta], 1, "run")
    assert same_state(sample, rounded) and not same_state(sample, stepped)
    assert not same_state([1.0] * STATE_SAMPLE, [1.0 + 2 * ALIGNED_MAX_DISTANCE] * STATE_SAMPLE)


@pytest.mark.parametrize("value", [None, "x", [1.0] * (STATE_SAMPLE - 1), [1.0] * (STATE_SAMPLE + 1),
                                   [float("nan")] + [1.0] * (STATE_SAMPLE - 1), [True] * STATE_SAMPLE,
                                   ["1"] * STATE_SAMPLE, [float("inf")] * STATE_SAMPLE, {"a": 1},
                                   [1e300] * STATE_SAMPLE, [10**400] * STATE_SAMPLE])
def test_a_malformed_sample_shows_nothing(value: object):
    assert parse_sample(value) is None


def test_ours_is_the_groups_state_when_held_by_most_members_ties_going_to_the_lowest_peer_id():
    a, b = [1.0] * STATE_SAMPLE, [2.0] * STATE_SAMPLE
    c = [3.0] * STATE_SAMPLE
    assert state_in_step("p", a, {}) is None  # alone: nothing to judge by
    assert state_in_step("p", a, {"q": a, "r": b}) is True  # two of three
    assert state_in_step("p", b, {"q": a, "r": a}) is False
    assert state_in_step("m", a, {"q": b}) is True and state_in_step("q", b, {"m": a}) is False  # a tie: lowest id
    # four states of one member each (the netns testnet's split): exactly one holder, the lowest id, is in step
    samples = {"w": a, "x": b, "y": c, "z": [4.0] * STATE_SAMPLE}
    verdicts = {p: state_in_step(p, s, {q: t for q, t in samples.items() if q != p}) for p, s in samples.items()}
    assert verdicts == {"w": True, "x": False, "y": False, "z": False}
    # two against two: the pair holding the lowest id
    samples = {"w": b, "x": a, "y": a, "z": b}
    verdicts = {p: state_in_step(p, s, {q: t for q, t in samples.items() if q != p}) for p, s in samples.items()}
    assert verdicts == {"w": True, "x": False, "y": False, "z": True}


def test_an_out_of_step_peer_takes_a_synced_peer_of_its_round_or_of_the_last_that_is_syncing():
    """Every peer reads the swarm before announcing its new round: in step with us, the others show the last
    round, syncing. A synced one of those is a donor (without overlap: `last_round_syncing_s`), unless it has been
    syncing too long (stuck, or done); a synced one still training the last round is not. In step: nobody."""
    def record(peer: str, round_: int, phase: str, synced: bool, eta: float) -> PeerRecord:
        return PeerRecord(peer_id=peer, round=round_, inner_step=0, phase=phase, round_eta=eta, fingerprint="f",
                          synced=synced)

    others = [record("a", 4, "sync", True, 99.0), record("b", 4, "sync", False, 99.0),
              record("c", 4, "inner", True, 101.0), record("d", 5, "inner", True, 103.0),
              record("f", 4, "sync", True, 0.0),  # its inner phase had no ETA: nothing to tell how long
              record("e", 4, "sync", True, 90.0)]  # syncing for 10 s: stuck, or done with its rounds
    choice = choose_donors(others, 5, False, False, True, 2, lambda p: False, last_round_syncing_s=5.0, now=100.0)
    assert [r.peer_id for r in choice.donors] == ["d", "a"]
    assert [r.peer_id for r in choose_donors(others, 5, False, False, True, 2, lambda p: False).donors] == ["d"]
    assert choose_donors(others, 5, True, False, True, 2, lambda p: False, 5.0, 100.0).donors == []


@pytest.mark.network
def test_members_of_an_all_reduce_judge_their_states_by_the_samples_shown():
    """Four members: three hold one state and one another, and one of the three shows garbage in place of its
    sample (dropped, and nobody fails on it: the member holding the other state is still outvoted). The
    next round nobody shows a state: no verdict."""
    async def main() -> None:
        p2ps = await start_p2ps(4)
        try:
            config = SyncConfig(mode="diloco", exchange_safety_factor=1.0, state_download_timeout_s=5.0)
            transports = [ExchangeAllReduce(p, "evidence", "fp", tensors(0), config, "allreduce.diloco", None)
                          for p in p2ps]
            for t in transports:
                await serve_exchanges(t.p2p, t.driver)
            ids = [t.own_id for t in transports]
            held, other = state_sample(tensors(1), 0, "evidence"), state_sample(tensors(2), 0, "evidence")
            shown = transports[3].header_extra  # the fourth shows garbage in place of its sample

            def garbage() -> dict[str, object]:
                return {k: (["garbage"] if k == "state" else v) for k, v in shown().items()}

            transports[3].header_extra = garbage  # type: ignore[method-assign]
            states = [held, held, other, held]
            results = await asyncio.gather(*(t.gather(tensors(10 + i), [p for p in ids if p != t.own_id], 0, 3.0,
                                                      state=states[i]) for i, t in enumerate(transports)))
            assert [r.group_size for r in results] == [4] * 4
            assert [r.in_step for r in results] == [True, True, False, True]
            results = await asyncio.gather(*(t.gather(tensors(20 + i), [p for p in ids if p != t.own_id], 1, 3.0)
                                             for i, t in enumerate(transports)))
            assert [r.in_step for r in results] == [None] * 4  # nothing shown: no verdict
        finally:
            await shutdown(p2ps)

    asyncio.run(asyncio.wait_for(main(), timeout=60))
