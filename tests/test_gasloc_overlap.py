"""GASLoC with `sync.overlap: delayed`: the exchanges a peer starts run during its next inner phase, and their pull
(mixed − y_r) joins the next round's proposal, as the corrections of exchanges that others start always do."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import Sequence

import pytest
import torch
from swarm_utils import run_peers, run_swarm, start_peer, tiny_config

from p2ptrain.errors import ConfigError
from p2ptrain.maths.outer_optimizer import OuterConfig, OuterOptimizer
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.gasloc import GaslocSync
from p2ptrain.sync.interface import RoundContext, RoundSync
from p2ptrain.sync.param_gossip import ParamGossip
from p2ptrain.tensor_layout import distance

PULL = 0.25  # what a scripted exchange moves a value by: mixed = value + PULL


class ScriptedMixer:
    """A mixer whose exchange adds PULL to the value it mixes; no exchanges from others."""

    round, budget_s = 0, 0.0

    def __init__(self) -> None:
        self.mixed_values: list[list[torch.Tensor]] = []

    def set_base_(self, base: Sequence[torch.Tensor]) -> None:
        self.base = [b.clone() for b in base]

    async def mix(self, value: list[torch.Tensor], *_args: object, **_kwargs: object):
        self.mixed_values.append([v.clone() for v in value])
        return [v + PULL for v in value], RoundSync(group_size=2)

    def take_correction_(self) -> list[torch.Tensor]:
        return [torch.zeros_like(b) for b in self.base]

    def take_incoming_stats(self) -> RoundSync:
        return RoundSync(group_size=0)

    def show_work_(self, outer_gradient: Sequence[torch.Tensor], tokens: int) -> None:
        self.shown = [g.clone() for g in outer_gradient]


class HeldLoop:
    """`BackgroundLoop`'s interface: `run` runs the coroutine at once, `submit` holds it until `release`."""

    def __init__(self) -> None:
        self.held: list[tuple[concurrent.futures.Future, object]] = []

    def run(self, coro, timeout=None):
        return asyncio.run(coro)

    def submit(self, coro) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.held.append((future, coro))
        return future

    def release(self, fail: bool = False) -> None:
        for future, coro in self.held:
            if fail or future.cancelled():
                coro.close()
                if not future.cancelled():
                    future.set_exception(RuntimeError("scripted failure"))
            else:
                future.set_result(asyncio.run(coro))
        self.held.clear()


def gasloc(overlap: str) -> tuple[GaslocSync, list[torch.nn.Parameter], ScriptedMixer, HeldLoop]:
    params = [torch.nn.Parameter(torch.zeros(3))]
    mixer, loop = ScriptedMixer(), HeldLoop()
    sync = GaslocSync(OuterOptimizer(params, OuterConfig(lr=1.0, momentum=0.0)), mixer, loop,  # type: ignore[arg-type]
                      SyncConfig(mode="gasloc", overlap=overlap))
    return sync, params, mixer, loop


def play_round(sync: GaslocSync, params: list[torch.nn.Parameter], round_: int, step: float) -> RoundSync:
    context = RoundContext(round_, 5, ["p"], 0, 1.0, {})
    sync.start_round(context)
    with torch.no_grad():
        params[0].add_(step)  # the inner phase moved θ by `step`: Δ = −step, y = θ + step (lr 1)
    return sync.finish_round(context)


def test_without_overlap_the_round_applies_its_own_mix():
    sync, params, _mixer, _loop = gasloc("none")
    play_round(sync, params, 0, 1.0)
    assert torch.allclose(params[0], torch.full((3,), 1.0 + PULL))


def test_with_overlap_the_round_ends_before_its_mix_and_the_pull_joins_the_next_proposal():
    sync, params, mixer, loop = gasloc("delayed")
    stats = play_round(sync, params, 0, 1.0)
    assert torch.allclose(params[0], torch.full((3,), 1.0)) and stats.group_size == 1  # nothing mixed yet
    assert len(loop.held) == 1  # round 0's exchange runs during round 1's inner phase
    loop.release()
    stats = play_round(sync, params, 1, 1.0)
    # round 1's proposal: θ_1 + step + round 0's pull; its own mix is in flight, and the report is round 0's mix
    assert torch.allclose(params[0], torch.full((3,), 2.0 + PULL)) and stats.group_size == 2
    loop.release()
    assert torch.allclose(mixer.mixed_values[-1][0], torch.full((3,), 2.0 + PULL))  # what round 1 sent
    play_round(sync, params, 2, 1.0)
    assert torch.allclose(params[0], torch.full((3,), 3.0 + 2 * PULL))
    loop.release(fail=True)  # a failed background mix: no pull, a warning, training goes on
    play_round(sync, params, 3, 1.0)
    assert torch.allclose(params[0], torch.full((3,), 4.0 + 2 * PULL))
    sync.shutdown()
    loop.release()


def test_a_state_adopted_drops_the_mix_in_flight_and_shutdown_cancels_it():
    sync, params, _mixer, loop = gasloc("delayed")
    play_round(sync, params, 0, 1.0)
    future = sync.pending[1] if sync.pending is not None else None
    sync.load_state_tensors_([])  # γ 0: a state's outer part is empty
    assert sync.pending is None and future is not None and future.cancelled()
    loop.release()
    play_round(sync, params, 1, 1.0)
    assert torch.allclose(params[0], torch.full((3,), 2.0))  # no pull of the dropped mix
    pending = sync.pending
    sync.shutdown()
    assert pending is not None and pending[1].cancelled() and sync.pending is None
    loop.release()


def test_a_mix_takes_its_yardstick_when_started_not_when_it_runs():
    """An overlapped mix runs after the round loop set the anchor as the base: τ's yardstick must still be the
    proposal's own step (with momentum 0 the anchor moved 0 from it, and every honest partner would look far)."""
    reference = [torch.zeros(4)]
    mixer = ParamGossip(None, "run", "fp", "gasloc", reference, SyncConfig(mode="gasloc"), seed=0)  # type: ignore[arg-type]
    mixer.set_base_(reference)
    y = [torch.full((4,), 0.5)]  # our step: 1.0 long
    mixer.set_base_(y)
    mix = mixer.mix(y, [], 0)
    mixer.set_base_(y)  # the anchor, where the proposal stays (momentum 0): a move of 0
    mixed, stats = asyncio.run(mix)
    assert torch.equal(mixed[0], y[0]) and stats.group_size == 1
    assert mixer.yardstick() == pytest.approx(1.0)


def test_overlap_for_gasloc_is_delayed_only_and_its_momentum_is_gasloc_momentum():
    assert SyncConfig(mode="gasloc", overlap="delayed").outer_momentum(0.9) == 0.0
    for own_first in ("eager", "local"):
        with pytest.raises(ConfigError, match=f"sync.overlap {own_first} applies to sync.mode diloco and factored"):
            SyncConfig(mode="gasloc", overlap=own_first)
    with pytest.raises(ConfigError, match="gasloc's is sync.gasloc_momentum"):
        SyncConfig(mode="gasloc", overlap="delayed", overlap_momentum=0.5)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.alone  # how far the peers agree depends on how many exchanges their wall-clock rounds completed
@pytest.mark.usefixtures("one_torch_thread")
def test_an_overlapped_gasloc_swarm_trains_and_its_peers_agree():
    """15 inner steps a round, not 5: the peers begin round 0 up to a second apart (`run.min_peers` reads the view
    a heartbeat at a time), and at 0.05 s a round the first ran its 12 rounds before the last ended its first (4 of
    18 runs here, compared then with its start: spread 5.48 against 5.47 travelled). At 15: 12 runs, spread at
    most 0.36 × travelled."""
    config = tiny_config(f"gasloc-overlap-{uuid.uuid4().hex[:6]}", run={"rounds": 12},
                         inner={"steps": 15, "warmup_steps": 2, "lr": 3e-3},
                         sync={"mode": "gasloc", "overlap": "delayed"})
    threads, histories = run_swarm(config, peers=3)
    for history in histories:
        assert min(m.val_loss for m in history[2:]) < history[0].val_loss
        # round r reports the exchanges of round r − 1 (its own, collected at r's end) and those others started
        assert sum(m.peers_averaged > 1 for m in history[1:]) >= 4, [m.peers_averaged for m in history]
    # the peers' parameters when the first of them ended its last round, against how far training moved each since
    # its first. Compared at one moment, not one round number: gossip rounds count a peer's own steps, and a peer
    # that ran 4 rounds ahead while the others started (3 of 11 CI runs) was compared with them 4 of its rounds early.
    # Not before every peer ended a round: one ran all 12 of its rounds (0.05 s each) before another ended its first
    # (1 of 8 runs here), and a peer done stands at its last round's parameters
    moment = max(min(max(t.round_ended_at.values()) for t in threads),
                 max(min(t.round_ended_at.values()) for t in threads))
    finals = [t.params_at(moment) for t in threads]
    travelled = min(distance(t.params_at(moment), t.params_after_round[min(t.params_after_round)]) for t in threads)
    spread = max(distance(a, b) for a in finals for b in finals)
    print(f"peers {spread:.4g} apart when the first ended, each moved at least {travelled:.4g}")
    assert spread < 0.5 * travelled, (spread, travelled)


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.usefixtures("one_torch_thread")
def test_a_peer_slower_to_compute_keeps_the_swarms_pace_with_fewer_steps():
    """`sync.keep_pace`: one of 4 GASLoC peers takes 0.3 s more a step (a slower GPU); once the others' records
    carry their step times it runs half its H (the most it gives up), the others all of it. On 2 cores with 32
    peers, peers 2-3× slower ran half the rounds and drifted from the swarm's mean."""
    config = tiny_config(f"pace-{uuid.uuid4().hex[:6]}", run={"rounds": 6, "min_peers": 4},
                         inner={"steps": 10, "warmup_steps": 2, "lr": 3e-3}, sync={"mode": "gasloc"})
    first = start_peer(config)
    peers = [first] + [start_peer(config, first.maddrs) for _ in range(3)]
    slow = peers[-1]
    on_step = slow._on_inner_step

    def slow_step(*args, **kwargs):
        time.sleep(0.3)
        on_step(*args, **kwargs)

    slow._on_inner_step = slow_step  # type: ignore[method-assign]
    _threads, histories = run_peers(peers, timeout_s=240)
    slow_steps = [m.inner_steps for m in histories[-1]]
    assert slow_steps[0] == 10 and slow_steps[-3:] == [5, 5, 5], slow_steps  # the pace is known after a round
    for history in histories[:-1]:
        assert [m.inner_steps for m in history].count(10) >= len(history) - 1, [m.inner_steps for m in history]
