"""Golden regression test of the outer step: every production sync strategy, 4 simulated peers, 3 rounds.

In the spirit of torchft's `diloco_regression_test.py`: fixed seeds, the network faked in one process, and each
peer's final parameters compared with tests/fixtures/outer_step_golden.json. After an intended change of the
numbers, regenerate the fixture and review its diff:

    P2PTRAIN_REGENERATE_GOLDEN=1 pytest tests/test_outer_step_golden.py

The peers run in lockstep, one thread each: the fake all-reduce and the fake gossip wait at a barrier for all
peers, so `DilocoSync`, `GaslocSync` and `FactoredSync` run unchanged, peer by peer. The peers start a little
apart (so that Mix1 has something to mix) and each pulls towards its own target in the inner phase: a few steps of
gradient descent on ‖θ − target_i‖². Every rule also has a check that does not depend on the fixture.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import random
import re
import threading
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from p2ptrain.maths.mixing import exact_average, pull_toward_, uniform_weight
from p2ptrain.maths.outer_optimizer import OuterConfig, OuterOptimizer
from p2ptrain.net.allreduce import AveragingResult
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.diloco import DilocoSync, mean_check
from p2ptrain.sync.factored import AllReduceMix2, FactoredSync
from p2ptrain.sync.gasloc import GaslocSync
from p2ptrain.sync.interface import ExchangeRecord, OuterSync, RoundContext, RoundSync

GOLDEN = Path(__file__).parent / "fixtures" / "outer_step_golden.json"
REGENERATE_ENV = "P2PTRAIN_REGENERATE_GOLDEN"
PEERS = 4
ROUNDS = 3
SHAPES = ((3, 4), (5,))
SEED = 0  # parameters, targets and the gossip matchings
START_SPREAD = 0.1  # peers start at θ_0 + this × their own N(0, 1) offset
INNER_STEPS = 3  # H
INNER_LR = 0.1  # gradient descent on ‖θ − target‖²: θ ← θ − 2·lr·(θ − target)
OUTER_LR = 0.7  # η
OUTER_MOMENTUM = 0.9  # γ as configured; each mode runs with SyncConfig.outer_momentum(γ), as peer.py does
BARRIER_TIMEOUT_S = 10.0  # a peer that never reaches an exchange fails the test instead of hanging it
RTOL, ATOL = 1e-5, 1e-6

# The rules' arithmetic, without the defences against hostile peers (sync.robust): the fake peers pull toward
# unrelated random targets, farther from each other (up to 1.22 ‖Δ_i‖) than peers on one corpus, which the all-reduce
# check would clip; the defences have their own tests (test_robust_allreduce.py, test_robust_gossip.py)
RULES = {
    "diloco": SyncConfig(mode="diloco", robust=False),
    "diloco_delayed": SyncConfig(mode="diloco", overlap="delayed", robust=False),
    "diloco_eager": SyncConfig(mode="diloco", overlap="eager", robust=False),
    "diloco_local": SyncConfig(mode="diloco", overlap="local", robust=False),
    "gasloc": SyncConfig(mode="gasloc", gossip_peers=1, robust=False),
    "factored": SyncConfig(mode="factored", gossip_peers=1, mix2_every=1, mix2_transport="allreduce", robust=False),
}

Tensors = list[torch.Tensor]


def _clone(tensors: Sequence[torch.Tensor]) -> Tensors:
    return [t.detach().clone() for t in tensors]


def swarm_start() -> tuple[list[Tensors], list[Tensors]]:
    """Each peer's initial parameters and the target its inner phase pulls towards (seeded)."""
    generator = torch.Generator().manual_seed(SEED)
    base = [torch.randn(shape, generator=generator) for shape in SHAPES]
    starts = [[b + START_SPREAD * torch.randn(b.shape, generator=generator) for b in base] for _ in range(PEERS)]
    targets = [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(PEERS)]
    return starts, targets


@torch.no_grad()
def inner_phase_(params: Sequence[torch.Tensor], target: Sequence[torch.Tensor]) -> None:
    """In place: H steps of gradient descent on ‖θ − target‖² (gradient 2(θ − target))."""
    for _ in range(INNER_STEPS):
        for p, t in zip(params, target, strict=True):
            p.sub_(p - t, alpha=2 * INNER_LR)


# ---- the faked network -------------------------------------------------------------------------------------------


class FakeAllReduce:
    """The swarm's all-reduce: every peer's `average` waits for all of them and gets the exact mean of their Δs."""

    def __init__(self) -> None:
        self.deposits: list[Tensors] = [[] for _ in range(PEERS)]
        self.barrier = threading.Barrier(PEERS, action=self._reduce, timeout=BARRIER_TIMEOUT_S)
        self.means: list[Tensors] = []  # one per all-reduce, in order
        self.closed = [False] * PEERS

    def _reduce(self) -> None:  # runs once, in the last peer to arrive, before any peer is released
        self.means.append(exact_average(self.deposits))

    def averager(self, peer: int) -> FakeAverager:
        return FakeAverager(self, peer)


class _Done:
    """A `PendingAverage` whose all-reduce already ran."""

    def __init__(self, result: AveragingResult):
        self._result = result

    def result(self) -> AveragingResult:
        return self._result


class FakeAverager:
    """One peer's end of `FakeAllReduce`, with `AllReduceAverager`'s interface."""

    def __init__(self, swarm: FakeAllReduce, peer: int):
        self.swarm, self.peer = swarm, peer

    def average(self, delta: Sequence[torch.Tensor], round_: int, weight: float,
                partners: Sequence[str], tokens: int = 0) -> AveragingResult:
        assert weight == INNER_STEPS and len(partners) == PEERS - 1  # equal weights: the weighted mean is the mean
        self.swarm.deposits[self.peer] = _clone(delta)
        self.swarm.barrier.wait()
        return AveragingResult(_clone(self.swarm.means[-1]), group_size=PEERS)

    def launch(self, delta: Sequence[torch.Tensor], round_: int, weight: float, partners: Sequence[str],
               tokens: int = 0) -> _Done:
        return _Done(self.average(delta, round_, weight, partners))

    def forget_(self) -> None:
        pass

    def shutdown(self) -> None:
        self.swarm.closed[self.peer] = True


@dataclasses.dataclass(frozen=True)
class _Exchange:
    pairs: list[tuple[int, int]]  # (starts the exchange, answers it)
    offers: list[Tensors]  # what each peer mixes (the value passed to `mix`)
    publics: list[Tensors]  # what each peer answers with (its base + correction, as `ParamGossip` offers)


class FakeGossip:
    """Pair averaging (w = 1/2) on a seeded random perfect matching, drawn afresh for every exchange.

    In each pair one peer starts the exchange: `mix` returns value + w(partner − value). The other answers with its
    public value and finds w(partner − own) in its correction (`take_correction_`), as with `ParamGossip`.
    """

    def __init__(self) -> None:
        self.rng = random.Random(SEED)
        self.offers: list[Tensors] = [[] for _ in range(PEERS)]
        self.publics: list[Tensors] = [[] for _ in range(PEERS)]
        self.barrier = threading.Barrier(PEERS, action=self._match, timeout=BARRIER_TIMEOUT_S)
        self.exchanges: list[_Exchange] = []

    def _match(self) -> None:
        order = list(range(PEERS))
        self.rng.shuffle(order)
        pairs = [(order[k], order[k + 1]) for k in range(0, PEERS, 2)]
        self.exchanges.append(_Exchange(pairs, list(self.offers), list(self.publics)))

    def mixer(self, peer: int, config: SyncConfig) -> FakeMixer:
        return FakeMixer(self, peer, config)


class FakeMixer:
    """One peer's end of `FakeGossip`, with the members of `ParamGossip` that the strategies use."""

    def __init__(self, swarm: FakeGossip, peer: int, config: SyncConfig):
        self.swarm, self.peer, self.config = swarm, peer, config
        self.round, self.budget_s, self.give_up_at = 0, float("inf"), 0.0
        self._base: Tensors = [torch.zeros(shape) for shape in SHAPES]
        self._correction: Tensors = [torch.zeros(shape) for shape in SHAPES]
        self.incoming = RoundSync(group_size=0)

    def set_base_(self, base: Sequence[torch.Tensor]) -> None:
        self._base = [t.detach().float().clone() for t in base]

    def take_correction_(self) -> Tensors:
        correction, self._correction = self._correction, [torch.zeros(shape) for shape in SHAPES]
        return correction

    def take_incoming_stats(self) -> RoundSync:
        stats, self.incoming = self.incoming, RoundSync(group_size=0)
        return stats

    def show_work_(self, outer_gradient: Sequence[torch.Tensor], tokens: int) -> None:
        pass

    async def mix(self, value: Tensors, live_peers: list[str], round_: int, patience_s: float = 0.0,
                  links: dict[str, float] | None = None) -> tuple[Tensors, RoundSync]:
        assert len(live_peers) == PEERS - 1 and self.config.gossip_peers == 1
        self.swarm.offers[self.peer] = _clone(value)
        self.swarm.publics[self.peer] = [b + c for b, c in zip(self._base, self._correction, strict=True)]
        self.swarm.barrier.wait()
        exchange = self.swarm.exchanges[-1]
        starter, answerer = next(pair for pair in exchange.pairs if self.peer in pair)
        weight = uniform_weight(self.config.gossip_peers)
        mixed, stats = _clone(value), RoundSync(group_size=1)
        if self.peer == starter:
            pull_toward_(mixed, exchange.publics[answerer], value, weight)
            stats.add_exchange_(ExchangeRecord(f"peer{answerer}", "none", 0, 0, 0.0))
        else:
            pull_toward_(self._correction, exchange.offers[starter], exchange.publics[self.peer], weight)
            self.incoming.group_size += 1
        return mixed, stats


class InlineLoop:
    """`BackgroundLoop`'s interface run in the calling peer's thread: `submit` too runs the coroutine to the end."""

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run(coro)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(asyncio.run(coro))
        except Exception as e:
            future.set_exception(e)
        return future


# ---- the swarm ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RoundRecord:
    """One peer's round: the anchor θ_r, its outer gradient Δ_r, then θ_{r+1} and the strategy's state tensors."""

    anchor: Tensors
    delta: Tensors
    params: Tensors
    state: Tensors


@dataclasses.dataclass
class Swarm:
    starts: list[Tensors]
    targets: list[Tensors]
    momentum: float  # the γ the outer optimizers ran with
    history: list[list[RoundRecord]]  # per peer, per round
    allreduce: FakeAllReduce
    gossip: FakeGossip

    def final(self, peer: int) -> Tensors:
        return self.history[peer][-1].params


def build_sync(config: SyncConfig, outer: OuterOptimizer, peer: int, allreduce: FakeAllReduce,
               gossip: FakeGossip) -> OuterSync:
    """The strategy `config.mode` names, wired as p2ptrain/sync/build.py does, over the fake transports."""
    if config.mode == "diloco":
        return DilocoSync(outer, allreduce.averager(peer), config)
    mixer = gossip.mixer(peer, config)
    if config.mode == "gasloc":
        return GaslocSync(outer, mixer, InlineLoop(), config)
    averager = allreduce.averager(peer)
    return FactoredSync(outer, mixer, AllReduceMix2(averager, config.grad_codec, mean_check(config)), InlineLoop(),
                        config, closers=[averager.shutdown])


def run_peer(peer: int, sync: OuterSync, outer: OuterOptimizer, target: Tensors, rounds: int,
             history: list[RoundRecord]) -> None:
    """The round loop of p2ptrain/peer.py, cut down: start_round, inner phase, finish_round; shutdown at the end."""
    live = [f"peer{j}" for j in range(PEERS) if j != peer]
    try:
        for round_ in range(rounds):
            sync.start_round(RoundContext(round_, 0, live, PEERS - 1, round_peers=live))
            anchor = _clone(outer.anchor)
            inner_phase_(outer.params, target)
            delta = outer.outer_gradient()
            sync.finish_round(RoundContext(round_, INNER_STEPS, live, PEERS - 1, round_peers=live))
            state = [t.clone() for _, t in sync.state_tensors()]
            history.append(RoundRecord(anchor, delta, _clone(outer.params), state))
    finally:
        sync.shutdown()


def run_swarm(config: SyncConfig, rounds: int = ROUNDS, momentum: float = OUTER_MOMENTUM) -> Swarm:
    """All peers' rounds under `config`, one thread per peer; raises what a peer raised."""
    starts, targets = swarm_start()
    outer_config = OuterConfig(lr=OUTER_LR, momentum=config.outer_momentum(momentum))
    outers = [OuterOptimizer([torch.nn.Parameter(t.clone()) for t in start], outer_config) for start in starts]
    swarm = Swarm(starts, targets, outer_config.momentum, [[] for _ in range(PEERS)], FakeAllReduce(), FakeGossip())
    syncs = [build_sync(config, outers[i], i, swarm.allreduce, swarm.gossip) for i in range(PEERS)]
    errors: list[BaseException] = []

    def peer_main(peer: int) -> None:
        try:
            run_peer(peer, syncs[peer], outers[peer], targets[peer], rounds, swarm.history[peer])
        except BaseException as e:  # wake the others: they fail with BrokenBarrierError instead of waiting
            errors.append(e)
            swarm.allreduce.barrier.abort()
            swarm.gossip.barrier.abort()

    threads = [threading.Thread(target=peer_main, args=(i,), name=f"golden-peer{i}") for i in range(PEERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=2 * BARRIER_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a simulated peer is still running"
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return swarm


# ---- checks that do not depend on the fixture --------------------------------------------------------------------


def assert_all_close(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], what: str) -> None:
    assert len(actual) == len(expected), what
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def swarm_mean(values: Sequence[Tensors]) -> Tensors:
    return exact_average(list(values))


def reference_diloco(overlap: str, momentum: float, rounds: int = ROUNDS) -> list[Tensors]:
    """DiLoCo by hand (docs/algorithms.md §1 and §4), without the production strategies: Nesterov SGD on the mean Δ, on
    the previous round's mean (delayed), or on Δ̄_{t−1} − w_{t−1}Δ_{t−1} + w_t Δ_t with w = 1/M (eager; 1 in round
    0) or 1 (local)."""
    theta, targets = swarm_start()
    buffers: list[Tensors | None] = [None] * PEERS
    mean_prev: Tensors | None = None
    applied_prev: list[Tensors | None] = [None] * PEERS  # w_{t−1} Δ_{t−1}
    for _ in range(rounds):
        deltas = []
        for th, target in zip(theta, targets, strict=True):
            after = _clone(th)
            inner_phase_(after, target)
            deltas.append([a - b for a, b in zip(th, after, strict=True)])
        mean = [torch.stack(group).mean(dim=0) for group in zip(*deltas, strict=True)]
        for i in range(PEERS):
            if overlap == "none":
                grad = mean
            elif overlap == "delayed":
                grad = mean_prev
            else:
                w = 1 / PEERS if mean_prev is not None and overlap == "eager" else 1.0
                zeros = [torch.zeros_like(d) for d in deltas[i]]
                base = mean_prev if mean_prev is not None else zeros
                prev = applied_prev[i] if applied_prev[i] is not None else zeros
                applied_prev[i] = [w * d for d in deltas[i]]
                grad = [s - p + a for s, p, a in zip(base, prev, applied_prev[i], strict=True)]
            if grad is None:
                continue
            old = buffers[i]
            buffers[i] = _clone(grad) if old is None else [momentum * b + g for b, g in zip(old, grad, strict=True)]
            theta[i] = [t - OUTER_LR * (g + momentum * b) for t, g, b in zip(theta[i], grad, buffers[i], strict=True)]
        mean_prev = mean
    return theta


def check_diloco(rule: str, swarm: Swarm) -> None:
    """Each peer ends where DiLoCo computed by hand puts it; the all-reduce was shut down."""
    expected = reference_diloco(RULES[rule].overlap, swarm.momentum)
    for peer in range(PEERS):
        assert_all_close(swarm.final(peer), expected[peer], f"{rule}, peer {peer} vs DiLoCo by hand")
    assert all(swarm.allreduce.closed)


def check_gasloc(rule: str, swarm: Swarm) -> None:
    """Per round: the mixed iterates x keep the swarm mean of the proposals y = θ − ηΔ, the two peers of each pair end
    with the same x, and θ⁺ = x + γ(x − x_prev) (x is GASLoC's state: `state_tensors()`)."""
    x_prev = swarm.starts
    for round_, exchange in enumerate(swarm.gossip.exchanges):
        records = [swarm.history[peer][round_] for peer in range(PEERS)]
        proposals = [[a - OUTER_LR * d for a, d in zip(r.anchor, r.delta, strict=True)] for r in records]
        x = [r.state if swarm.momentum else r.params for r in records]  # γ 0: θ⁺ = x, and no state is kept
        assert all(len(r.state) == (len(r.params) if swarm.momentum else 0) for r in records)
        assert_all_close(swarm_mean(x), swarm_mean(proposals), f"round {round_}: swarm mean of the proposals")
        for a, b in exchange.pairs:
            assert_all_close(x[a], x[b], f"round {round_}: pair ({a}, {b}) after averaging")
        for peer, r in enumerate(records):
            theta = [m + swarm.momentum * (m - p) for m, p in zip(x[peer], x_prev[peer], strict=True)]
            assert_all_close(r.params, theta, f"round {round_}, peer {peer}: momentum on the mixed iterates")
        x_prev = x
    assert len(swarm.gossip.exchanges) == ROUNDS


def check_factored(rule: str, swarm: Swarm) -> None:
    """Per round: every peer holds the same momentum buffer (Mix2 gave all the same mean Δ), the swarm mean takes
    DiLoCo's Nesterov step (Mix1 keeps it), and the two peers of each Mix1 pair end equal."""
    for round_, exchange in enumerate(swarm.gossip.exchanges):
        records = [swarm.history[peer][round_] for peer in range(PEERS)]
        buffer = records[0].state
        for r in records[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r.state, buffer, strict=True)), "momentum buffers differ"
        mean_delta = swarm_mean([r.delta for r in records])
        step = [-OUTER_LR * (g + swarm.momentum * b) for g, b in zip(mean_delta, buffer, strict=True)]
        expected = [m + s for m, s in zip(swarm_mean([r.anchor for r in records]), step, strict=True)]
        assert_all_close(swarm_mean([r.params for r in records]), expected, f"round {round_}: the swarm mean")
        for a, b in exchange.pairs:
            assert_all_close(records[a].params, records[b].params, f"round {round_}: Mix1 pair ({a}, {b})")
    assert len(swarm.gossip.exchanges) == len(swarm.allreduce.means) == ROUNDS
    assert all(swarm.allreduce.closed)


CHECKS: dict[str, Callable[[str, Swarm], None]] = {
    "diloco": check_diloco, "diloco_delayed": check_diloco, "diloco_eager": check_diloco, "diloco_local": check_diloco,
    "gasloc": check_gasloc, "factored": check_factored,
}


@pytest.mark.parametrize("rule", RULES)
def test_strategy_matches_its_rule(rule: str) -> None:
    swarm = run_swarm(RULES[rule])
    assert all(len(h) == ROUNDS for h in swarm.history)
    CHECKS[rule](rule, swarm)


def test_diloco_one_round_without_momentum_is_anchor_minus_lr_mean_delta() -> None:
    """θ_1 = θ_0 − η · mean Δ, with Δ_i = (1 − (1 − 2·lr_inner)^H)(θ_0,i − target_i) in closed form."""
    swarm = run_swarm(RULES["diloco"], rounds=1, momentum=0.0)
    shrink = 1 - (1 - 2 * INNER_LR) ** INNER_STEPS
    deltas = [[shrink * (s - t) for s, t in zip(start, target, strict=True)]
              for start, target in zip(swarm.starts, swarm.targets, strict=True)]
    mean_delta = [sum(group) / PEERS for group in zip(*deltas, strict=True)]
    for peer in range(PEERS):
        expected = [s - OUTER_LR * d for s, d in zip(swarm.starts[peer], mean_delta, strict=True)]
        assert_all_close(swarm.final(peer), expected, f"peer {peer}")


# ---- the golden fixture ------------------------------------------------------------------------------------------


def rounded(tensor: torch.Tensor) -> Any:
    """Nested lists of the values with 9 significant digits (float32 reads back exactly)."""
    if tensor.dim() == 0:
        return float(f"{tensor.item():.9g}")
    return [rounded(t) for t in tensor]


def write_golden(rule: str, peers: dict[str, Any]) -> None:
    """Store `rule`'s entry, keeping the others'; lists of numbers on one line each."""
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    golden["comment"] = (f"Final parameters per peer (one list per tensor) written by {Path(__file__).name}; "
                         f"regenerate with {REGENERATE_ENV}=1 only after an intended change of the numbers")
    golden.setdefault("rules", {})[rule] = peers
    text = json.dumps(golden, indent=2, sort_keys=True)
    text = re.sub(r"\[[^\[\]{}\"]*\]", lambda m: "[" + " ".join(m.group(0)[1:-1].split()) + "]", text)
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(text + "\n")


def read_golden(rule: str) -> dict[str, Any]:
    how = f"generate it with `{REGENERATE_ENV}=1 pytest {Path(__file__).parent.name}/{Path(__file__).name}`"
    if not GOLDEN.exists():
        pytest.fail(f"golden fixture {GOLDEN} is missing: {how}")
    rules = json.loads(GOLDEN.read_text()).get("rules", {})
    if rule not in rules:
        pytest.fail(f"golden fixture {GOLDEN} has no entry for {rule!r}: {how}")
    return rules[rule]


@pytest.mark.parametrize("rule", RULES)
def test_outer_step_matches_golden(rule: str) -> None:
    swarm = run_swarm(RULES[rule])
    actual = {f"peer{i}": [rounded(t) for t in swarm.final(i)] for i in range(PEERS)}
    if os.environ.get(REGENERATE_ENV) == "1":
        CHECKS[rule](rule, swarm)  # never write a fixture from a run that breaks its rule
        write_golden(rule, actual)
        pytest.skip(f"{REGENERATE_ENV}=1: wrote {rule!r} to {GOLDEN}")
    golden = read_golden(rule)
    assert sorted(golden) == sorted(actual)
    for peer, tensors in golden.items():
        expected = [torch.tensor(values, dtype=torch.float32) for values in tensors]
        assert_all_close(swarm.final(int(peer.removeprefix("peer"))), expected, f"{rule}, {peer} vs {GOLDEN.name}")
