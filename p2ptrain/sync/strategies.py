"""The three outer-sync strategies (see sync.py): DiLoCo, GASLoC and Factored Gossip DiLoCo.

Each joins maths (outer.py, gasloc.py) with a transport (allreduce.py, gossip_peer.py) behind the `OuterSync`
interface, so the round loop in peer.py is the same for all of them.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence

import hivemind
import torch
from hivemind.p2p import P2P

from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.maths.outer_rules import DelayedOuterGradient, GaslocState, propose
from p2ptrain.net.allreduce import AllReduceAverager, AveragingResult, PendingAverage
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.grad_gossip import GossipMix2, GradGossip
from p2ptrain.sync.interface import Mix2, OuterSync, RoundContext, RoundSync
from p2ptrain.sync.param_gossip import GossipMixer

MIX1_PATIENCE_S = 10.0  # Mix1 waits at most this long (or the inner phase) for a partner to reach its round


def _from_average(result: AveragingResult, codec: str) -> RoundSync:
    return RoundSync(group_size=result.group_size, bytes_sent=result.bytes_sent,
                     bytes_received=result.bytes_received, exchange_s=result.seconds, codec=codec)


@torch.no_grad()
def _set_params_(outer: OuterOptimizer, values: Sequence[torch.Tensor]) -> None:
    """Write new parameters and make them the anchor of the next round."""
    for p, v in zip(outer.params, values, strict=True):
        p.copy_(v.to(device=p.device, dtype=p.dtype))
    outer.reset_anchor_()


class DilocoSync:
    """Exact all-reduce of Δ among the peers of the round, then Nesterov; optionally one round late (DiLoCoX)."""

    def __init__(self, outer: OuterOptimizer, averager: AllReduceAverager, config: SyncConfig):
        self.outer, self.averager, self.config = outer, averager, config
        self.delayed = DelayedOuterGradient(eager=config.overlap == "eager") if config.overlap != "none" else None
        self.pending: PendingAverage | None = None

    def start_round(self, context: RoundContext) -> None:
        pass

    def finish_round(self, context: RoundContext) -> RoundSync:
        delta = self.outer.outer_gradient()
        if self.delayed is None:
            result = self.averager.average(delta, context.round, float(context.inner_steps), context.same_round_peers)
            self.outer.step_(result.delta)
            return _from_average(result, self.config.grad_codec)
        return self._finish_overlapped(delta, context)

    def _finish_overlapped(self, delta: list[torch.Tensor], context: RoundContext) -> RoundSync:
        """Collect the average of the previous round's Δ, launch this round's, apply the delayed/eager gradient."""
        previous = self.pending.result() if self.pending is not None else None
        self.pending = self.averager.launch(delta, context.round, float(context.inner_steps),
                                            context.same_round_peers)
        own_weight = 1.0 / previous.group_size if previous is not None else 1.0
        assert self.delayed is not None
        applied = self.delayed.outer_gradient_(delta, previous.delta if previous else None, own_weight)
        if applied is None:
            self.outer.restore_anchor_()
        else:
            self.outer.step_(applied)
        return _from_average(previous, self.config.grad_codec) if previous else RoundSync()

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"momentum:{i}", b) for i, b in enumerate(self.outer.momentum_buffers())]

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        self.outer.load_momentum_buffers_(tensors)

    def shutdown(self) -> None:
        if self.pending is not None:
            self.pending.result()
        self.averager.shutdown()


class GaslocSync:
    """GASLoC: y = θ − ηΔ (+ what others' exchanges moved us by), mixed with 1–2 random peers, then momentum."""

    def __init__(self, outer: OuterOptimizer, mixer: GossipMixer, loop: BackgroundLoop, config: SyncConfig):
        self.outer, self.mixer, self.loop, self.config = outer, mixer, loop, config
        self.state = GaslocState([a.detach().float().cpu() for a in outer.anchor], outer.config.momentum)

    def start_round(self, context: RoundContext) -> None:
        self.mixer.round = context.round
        self.mixer.budget_s = context.inner_phase_s
        self.mixer.set_base_(self.outer.anchor)

    def finish_round(self, context: RoundContext) -> RoundSync:
        proposal = propose(self.outer.anchor, self.outer.outer_gradient(), self.outer.config.lr)
        y = [t.float().cpu() + c for t, c in zip(proposal, self.mixer.take_correction_(), strict=True)]
        self.mixer.set_base_(y)  # exchanges others start while we mix see our proposal
        mixed, stats = self.loop.run(self.mixer.mix(y, context.live_peers, context.round,
                                                    links=context.link_bytes_per_s))
        x = [m + c for m, c in zip(mixed, self.mixer.take_correction_(), strict=True)]
        _set_params_(self.outer, self.state.momentum_step(x))
        self.mixer.set_base_(self.outer.anchor)
        return _merge_incoming(stats, self.mixer.take_incoming_stats())

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"x_prev:{i}", x) for i, x in enumerate(self.state.x_prev)]

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        self.state.load_state_dict({"momentum": self.state.momentum, "x_prev": [t.clone() for t in tensors]})

    def shutdown(self) -> None:
        pass


class AllReduceMix2:
    """Factored's Mix2 as an exact all-reduce of Δ among a group of the round's peers (hivemind)."""

    def __init__(self, averager: AllReduceAverager):
        self.averager = averager

    def mix(self, delta: list[torch.Tensor], context: RoundContext) -> tuple[list[torch.Tensor], RoundSync]:
        result = self.averager.average(delta, context.round, float(context.inner_steps), context.same_round_peers)
        return result.delta, RoundSync(group_size=result.group_size, bytes_sent=result.bytes_sent,
                                       bytes_received=result.bytes_received)

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return []

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        pass

    def shutdown(self) -> None:
        self.averager.shutdown()


class FactoredSync:
    """Factored Gossip DiLoCo: Mix1 gossips θ_r in the background during the inner phase (its correction is added
    at the round's end); Mix2 mixes Δ every K rounds, all-reduced in small groups or gossiped compressed with
    1–2 peers (`sync.mix2_transport`); the outer step is Nesterov."""

    def __init__(self, outer: OuterOptimizer, mixer: GossipMixer, mix2: Mix2, loop: BackgroundLoop,
                 config: SyncConfig):
        self.outer, self.mixer, self.mix2, self.loop, self.config = outer, mixer, mix2, loop, config
        self.mix1: concurrent.futures.Future[tuple[list[torch.Tensor], RoundSync]] | None = None
        self.frozen: list[torch.Tensor] = []

    def start_round(self, context: RoundContext) -> None:
        self.mixer.round = context.round
        self.mixer.budget_s = context.inner_phase_s
        self.frozen = [a.detach().float().cpu().clone() for a in self.outer.anchor]
        self.mixer.set_base_(self.frozen)
        self.mix1 = self.loop.submit(self.mixer.mix(self.frozen, context.live_peers, context.round,
                                                    patience_s=min(context.inner_phase_s, MIX1_PATIENCE_S),
                                                    links=context.link_bytes_per_s))

    def finish_round(self, context: RoundContext) -> RoundSync:
        started = time.monotonic()
        self.mixer.give_up_at = started  # the inner phase is over: stop waiting for late partners
        mixed, stats = self.mix1.result() if self.mix1 is not None else (self.frozen, RoundSync())
        correction = [m - f + c for m, f, c in zip(mixed, self.frozen, self.mixer.take_correction_(), strict=True)]
        delta = self.outer.outer_gradient()
        if context.round % self.config.mix2_every == 0:
            delta, mix2 = self.mix2.mix(delta, context)
            _merge_mix2(stats, mix2)
        self.outer.step_(delta)
        _set_params_(self.outer, [p.detach().float().cpu() + c for p, c in zip(self.outer.params, correction,
                                                                                  strict=True)])
        stats.exchange_s += time.monotonic() - started
        return _merge_incoming(stats, self.mixer.take_incoming_stats())

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        momentum = [(f"momentum:{i}", b) for i, b in enumerate(self.outer.momentum_buffers())]
        return momentum + self.mix2.state_tensors()

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        count = len(self.outer.params)
        self.outer.load_momentum_buffers_(tensors[:count])
        self.mix2.load_state_tensors_(tensors[count:])

    def shutdown(self) -> None:
        if self.mix1 is not None:
            self.mix1.cancel()
        self.mix2.shutdown()


def _merge_mix2(stats: RoundSync, mix2: RoundSync) -> None:
    """Add Mix2's traffic and exchanges to the round's record (Mix1's)."""
    if mix2.partners:
        stats.codec = f"{stats.codec}+{mix2.codec}" if stats.partners else mix2.codec
    stats.bytes_sent += mix2.bytes_sent
    stats.bytes_received += mix2.bytes_received
    stats.group_size = max(stats.group_size, mix2.group_size)
    stats.partners += mix2.partners
    stats.exchanges += mix2.exchanges
    stats.failed += mix2.failed
    stats.refused += mix2.refused


def _merge_incoming(own: RoundSync, incoming: RoundSync) -> RoundSync:
    """Count exchanges that others started with us beside the ones we started."""
    own.group_size += incoming.group_size
    own.consensus_distance += incoming.consensus_distance
    return own


def build_outer_sync(config: SyncConfig, dht: hivemind.DHT, p2p: P2P, loop: BackgroundLoop, outer: OuterOptimizer,
                     run_id: str, fingerprint: str, reference: Sequence[torch.Tensor], seed: int) -> OuterSync:
    """The strategy `config.mode` names, with its transports started (`reference` = the run's θ_0)."""
    def averager(prefix: str, group_size: int | None) -> AllReduceAverager:
        return AllReduceAverager(dht, f"{run_id}_{prefix}", outer.params, config.matchmaking_s,
                                 config.allreduce_timeout_s, config.grad_codec, target_group_size=group_size)

    if config.mode == "diloco":
        return DilocoSync(outer, averager("diloco", None), config)
    factored = config.mode == "factored"
    mixer = GossipMixer(p2p, run_id, fingerprint, "mix1" if factored else "gasloc", reference, config, seed,
                        same_round_only=factored, overlapped=factored)
    loop.run(mixer.register(), timeout=30)
    if config.mode == "gasloc":
        return GaslocSync(outer, mixer, loop, config)
    if config.mix2_transport == "gossip":
        gossip = GradGossip(p2p, run_id, fingerprint, reference, config, seed)
        loop.run(gossip.register(), timeout=30)
        return FactoredSync(outer, mixer, GossipMix2(gossip, loop), loop, config)
    return FactoredSync(outer, mixer, AllReduceMix2(averager("mix2", config.mix2_group_size)), loop, config)
