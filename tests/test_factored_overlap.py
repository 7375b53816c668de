"""Factored Gossip DiLoCo with `sync.overlap`: Mix2 runs in the background during the next inner phase (DiLoCoX's
one-step delay applied to Mix2) and its result is applied one round late."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import types
import uuid
from collections.abc import Sequence

import pytest
import torch
from swarm_utils import LoneMixer, run_swarm, tiny_config

from p2ptrain.maths.outer_optimizer import OuterConfig, OuterOptimizer
from p2ptrain.maths.outer_rules import DelayedOuterGradient
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.factored import FactoredSync
from p2ptrain.sync.interface import RoundContext, RoundSync

MIX2_S = 0.5  # how long the scripted Mix2 takes: a blocking Mix2 would hold finish_round this long


class HalvingMix2:
    """A Mix2 that takes MIX2_S and returns Δ/2 (a group of two whose other member sent zeros); records threads."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def mix(self, delta: list[torch.Tensor], context: RoundContext) -> tuple[list[torch.Tensor], RoundSync]:
        self.threads.append(threading.current_thread().name)
        time.sleep(MIX2_S)
        return [d / 2 for d in delta], RoundSync(group_size=2)

    def own_share(self, delta: list[torch.Tensor], context: RoundContext) -> list[torch.Tensor]:
        return delta

    def state_tensors(self) -> list:
        return []

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        pass

    def stop_(self) -> None:
        pass


def done(coroutine) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(asyncio.run(coroutine))
    return future


def context(round_: int) -> RoundContext:
    return RoundContext(round_, 5, [], 0, 1.0, {})


@pytest.mark.slow
@pytest.mark.parametrize("overlap", ["delayed", "eager", "local"])
def test_mix2_runs_during_the_next_round_and_its_result_is_applied_then(overlap):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    reference = [torch.nn.Parameter(params[0].detach().clone())]
    config = SyncConfig(mode="factored", overlap=overlap)
    mix2 = HalvingMix2()
    sync = FactoredSync(OuterOptimizer(params, OuterConfig(momentum=0.0)), LoneMixer(), mix2,  # type: ignore[arg-type]
                        types.SimpleNamespace(submit=done), config)  # type: ignore[arg-type]
    outer = OuterOptimizer(reference, OuterConfig(momentum=0.0))
    rule = DelayedOuterGradient(eager=overlap != "delayed")
    previous_mix = None
    try:
        for r in range(3):
            sync.start_round(context(r))
            step = torch.randn(4, 3) * 0.1
            with torch.no_grad():
                params[0].sub_(step)
                reference[0].sub_(step)
            time.sleep(1.5 * MIX2_S)  # the inner phase, during which the previous round's Mix2 ends
            started = time.monotonic()
            sync.finish_round(context(r))
            assert time.monotonic() - started < 0.8 * MIX2_S, "Mix2 blocked the round"
            delta = outer.outer_gradient()  # what the reference sees: apply the delayed rule by hand
            applied = rule.outer_gradient_(delta, previous_mix, config.own_weight(2) if previous_mix else 1.0)
            previous_mix = [d / 2 for d in delta]
            if applied is None:
                outer.restore_anchor_()
            else:
                outer.step_(applied)
            assert torch.allclose(params[0], reference[0], atol=1e-6), r
    finally:
        sync.shutdown()
    assert mix2.threads and all(name.startswith("mix2") for name in mix2.threads)


class ExactMeanMix2:
    """A two-peer swarm's Mix2: both peers' Δ meet at a barrier (in their Mix2 threads) and each gets their mean."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)
        self.deltas: dict[int, list[torch.Tensor]] = {}

    def member(self, peer: int) -> types.SimpleNamespace:
        def mix(delta: list[torch.Tensor], _context: RoundContext) -> tuple[list[torch.Tensor], RoundSync]:
            self.deltas[peer] = delta
            self.barrier.wait()
            mean = [(a + b) / 2 for a, b in zip(self.deltas[0], self.deltas[1], strict=True)]
            self.barrier.wait()  # both have read before the next round's deltas land
            return mean, RoundSync(group_size=2)
        return types.SimpleNamespace(mix=mix, own_share=lambda delta, context: delta, state_tensors=list,
                                     load_state_tensors_=lambda tensors: None, stop_=lambda: None)


def test_local_overlap_mix1_gossips_the_point_its_mix2_group_shares():
    """With `sync.overlap: local` each peer holds θ = common point − η × its own unsettled Δ. Mix1 must gossip the
    common point (which Mix2 keeps equal), not θ: averaging θ would half undo the own Δ that the Mix2 mean replaces
    a round later. And the swarm's mean takes the exact step of the round's mean Δ, with nothing lost to the delay."""
    torch.manual_seed(0)
    start = torch.randn(4, 3)
    params = [[torch.nn.Parameter(start.clone())] for _ in range(2)]
    lr = 0.7
    mix2, mixers = ExactMeanMix2(), [LoneMixer(), LoneMixer()]
    syncs = [FactoredSync(OuterOptimizer(params[i], OuterConfig(lr=lr, momentum=0.0)), mixers[i],  # type: ignore
                          mix2.member(i), types.SimpleNamespace(submit=done),  # type: ignore[arg-type]
                          SyncConfig(mode="factored", overlap="local")) for i in range(2)]
    try:
        for r in range(4):
            for sync in syncs:
                sync.start_round(context(r))
            if r:
                assert not torch.allclose(params[0][0], params[1][0]), "each peer's own Δ differs"
                torch.testing.assert_close(mixers[0].base[0], mixers[1].base[0])  # the Mix2 group's common point
            before = (params[0][0].detach() + params[1][0].detach()) / 2
            steps = [torch.randn(4, 3) * 0.1 for _ in range(2)]
            with torch.no_grad():
                for p, step in zip(params, steps, strict=True):
                    p[0].sub_(step)
            for sync in syncs:
                sync.finish_round(context(r))
            after = (params[0][0].detach() + params[1][0].detach()) / 2
            torch.testing.assert_close(after, before - lr * (steps[0] + steps[1]) / 2)
    finally:
        for sync in syncs:
            sync.shutdown()


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("overlap", ["delayed", "local"])
def test_a_factored_swarm_with_overlapped_mix2_trains_and_mixes(overlap):
    config = tiny_config(f"factored-overlap-{uuid.uuid4().hex[:6]}", run={"rounds": 6},
                         sync={"mode": "factored", "overlap": overlap})
    _threads, histories = run_swarm(config, peers=3)
    for history in histories:
        assert min(m.val_loss for m in history[1:]) < history[0].val_loss
        # round r reports the Mix2 of round r − 1, collected at its end: the group of a mixed round holds others
        assert sum(m.peers_averaged > 1 for m in history[1:]) >= 3


class CountingMixer(LoneMixer):
    """Mix1 that records the rounds it was started in, and hands over a partner's answered pull every round."""

    def __init__(self) -> None:
        self.started: list[int] = []

    async def mix(self, value: list[torch.Tensor], _live: object, round_: int, **_kwargs: object):
        self.started.append(round_)
        return [v + 1.0 for v in value], RoundSync()

    def take_correction_(self) -> list[torch.Tensor]:
        return [torch.full_like(b, 0.5) for b in self.base]


class OwnMix2:
    """Mix2 with nobody: Δ as it is."""

    def mix(self, delta: list[torch.Tensor], context: RoundContext) -> tuple[list[torch.Tensor], RoundSync]:
        return delta, RoundSync()

    state_tensors, load_state_tensors_, stop_ = list, (lambda self, tensors: None), (lambda self: None)


def test_mix1_starts_every_mix1_every_rounds_and_answered_pulls_land_in_every_round():
    params = [torch.nn.Parameter(torch.zeros(3))]
    mixer = CountingMixer()
    sync = FactoredSync(OuterOptimizer(params, OuterConfig(momentum=0.0)), mixer, OwnMix2(),  # type: ignore[arg-type]
                        types.SimpleNamespace(submit=done), SyncConfig(mode="factored", mix1_every=3))  # type: ignore[arg-type]
    moved = []
    for r in range(6):
        before = params[0].detach().clone()
        sync.start_round(context(r))
        sync.finish_round(context(r))  # no inner step: Δ = 0, so θ moves by Mix1's correction alone
        moved.append(float((params[0].detach() - before)[0]))
    assert mixer.started == [0, 3]
    assert moved == [1.5, 0.5, 0.5, 1.5, 0.5, 0.5]  # its own mix (+1) in rounds 0 and 3, answered pulls (+0.5) in all
    with pytest.raises(Exception, match="mix1_every"):
        SyncConfig(mode="factored", mix1_every=0)
