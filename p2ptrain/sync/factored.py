"""Factored Gossip DiLoCo (docs/algorithms.md §3): Mix1 gossips the round's parameters during the inner phase; Mix2
mixes outer gradients every K rounds, by all-reduce in small groups or by compressed gossip with 1–2 peers.

With `sync.overlap` (delayed, eager or local) Mix2 no longer blocks: DiLoCoX's one-step delay applied to it. Round r's Δ
is mixed in the background during round r + 1 and its result applied at the end of r + 1 (maths/outer_rules.
DelayedOuterGradient; a round without Mix2 counts as mixing with nobody). What eager and local apply of their own at
once is what the Mix2 gives partners (`Mix2.own_share`): Δ, or with a compressed gossip Mix2 its s."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import torch

from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.maths.outer_rules import DelayedOuterGradient
from p2ptrain.maths.robust import all_finite
from p2ptrain.maths.robust_mean import MeanCheck
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.diloco import judged, round_sync_of
from p2ptrain.sync.grad_gossip import GradGossip
from p2ptrain.sync.interface import Averager, Mix2, RoundContext, RoundSync
from p2ptrain.sync.param_gossip import ParamGossip

logger = logging.getLogger(__name__)

MIX1_PATIENCE_S = 10.0  # Mix1 waits at most this long (or the inner phase) for a partner to reach its round


class AllReduceMix2:
    """Factored's Mix2 as an all-reduce of Δ among a group of the round's peers (sync.allreduce_transport); its mean
    is checked against our own Δ as DiLoCo's is (`check`: `sync.diloco.mean_check` of the peer's config)."""

    def __init__(self, averager: Averager, codec: str, check: MeanCheck):
        self.averager, self.codec, self.check = averager, codec, check

    def mix(self, delta: list[torch.Tensor], context: RoundContext) -> tuple[list[torch.Tensor], RoundSync]:
        result = self.averager.average(delta, context.round, float(context.inner_steps), context.round_peers,
                                       context.tokens)
        result, refused = judged(self.averager, result, delta, self.check, context.round, context.steps_cut_stretch())
        return (delta if result.discarded else result.delta), round_sync_of(result, self.codec, refused)

    def own_share(self, delta: list[torch.Tensor], context: RoundContext) -> list[torch.Tensor]:
        return delta  # every member's Δ enters the mean as it is

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return []

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        self.averager.forget_()  # a state adopted: the last Mix2's report is not ours any more

    def stop_(self) -> None:
        """Nothing to stop: the all-reduce ends with its group."""


class GossipMix2:
    """`GradGossip` behind the `Mix2` interface. Blocking, it waits for partners up to `matchmaking_s`; overlapped
    (`overlapped`), it offers and answers for up to the next inner phase, until `stop_` (its result collected)."""

    def __init__(self, gossip: GradGossip, loop: BackgroundLoop, overlapped: bool = False):
        self.gossip, self.loop, self.overlapped = gossip, loop, overlapped
        self.stopped = threading.Event()

    def mix(self, delta: list[torch.Tensor], context: RoundContext) -> tuple[list[torch.Tensor], RoundSync]:
        patience_s, stop = self.gossip.config.matchmaking_s, None
        if self.overlapped:
            if math.isfinite(context.inner_phase_s):
                patience_s = max(patience_s, context.inner_phase_s)
            self.stopped.clear()
            stop = self.stopped
        return self.loop.run(self.gossip.mix(delta, context.live_peers, context.round, patience_s, stop,
                                             context.tokens))

    def own_share(self, delta: list[torch.Tensor], context: RoundContext) -> list[torch.Tensor]:
        """s: with a compressed codec, the rest of Δ waits in error feedback for a later round."""
        return self.gossip.own_share(delta, context.round)

    def stop_(self) -> None:
        self.stopped.set()

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self.gossip.state_tensors()

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        self.gossip.load_state_tensors_(tensors)


class FactoredSync:
    """Factored Gossip DiLoCo: Mix1 gossips θ_r in the background during the inner phase (its correction is added
    at the round's end; started every `sync.mix1_every` rounds, answered in all); Mix2 mixes Δ every K rounds
    (`sync.mix2_every`); the outer step is Nesterov.

    `closers` shut down the transports this strategy was built with (the all-reduce averager of Mix2)."""

    # Mix1 gossips at any time; Mix1 and Mix2 take partners of the same round, so a joiner takes its donor's round
    aligned_rounds = False
    rounds_count_own_steps = False

    def __init__(self, outer: OuterOptimizer, mixer: ParamGossip, mix2: Mix2, loop: BackgroundLoop,
                 config: SyncConfig, closers: Sequence[Callable[[], None]] = ()):
        self.outer, self.mixer, self.mix2, self.loop, self.config = outer, mixer, mix2, loop, config
        self.closers = list(closers)
        self.mix1: concurrent.futures.Future[tuple[list[torch.Tensor], RoundSync]] | None = None
        self.frozen: list[torch.Tensor] = []
        self.delayed = DelayedOuterGradient(eager=config.own_delta_first) if config.overlap != "none" else None
        self.pending: concurrent.futures.Future[tuple[list[torch.Tensor], RoundSync]] | None = None  # Mix2 of r − 1
        self._mix2_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mix2") if self.delayed \
            else None

    @property
    def needs_current_swarm(self) -> bool:
        """Mix2 by all-reduce expects exactly the peers of its round; by gossip, a view a heartbeat old will do."""
        return self.config.mix2_transport == "allreduce"

    def start_round(self, context: RoundContext) -> None:
        self.mixer.round = context.round
        self.mixer.budget_s = context.inner_phase_s
        self.frozen = self._public_point()
        self.mixer.set_base_(self.frozen)  # answers partners' offers in every round, started ones or not
        self.mix1 = None
        if context.round % self.config.mix1_every == 0:
            self.mix1 = self.loop.submit(self.mixer.mix(self.frozen, context.live_peers, context.round,
                                                        patience_s=min(context.inner_phase_s, MIX1_PATIENCE_S),
                                                        links=context.link_bytes_per_s))

    def _public_point(self) -> list[torch.Tensor]:
        """What Mix1 gossips: the anchor θ_r with the step of Δ_{r−1}'s own share undone where it was applied ahead of
        its Mix2 mean (eager or local, without outer momentum). That point is common to a Mix2 group; θ_r itself
        differs by each member's own Δ, which Mix1 would half undo on top of the Mix2 mean that replaces it."""
        anchor = [a.detach().float().cpu().clone() for a in self.outer.anchor]
        unsettled = self.delayed.unsettled() if self.delayed is not None else None
        if unsettled is None or self.outer.config.momentum > 0:
            return anchor
        lr = self.outer.config.lr
        return [a.add_(u.float().cpu(), alpha=lr) for a, u in zip(anchor, unsettled, strict=True)]

    def finish_round(self, context: RoundContext) -> RoundSync:
        started = time.monotonic()
        self.mixer.give_up_at = started  # the inner phase is over: stop waiting for late partners
        mixed, stats = self.mix1.result() if self.mix1 is not None else (self.frozen, RoundSync())
        correction = [m - f + c for m, f, c in zip(mixed, self.frozen, self.mixer.take_correction_(), strict=True)]
        delta = self.outer.outer_gradient()
        if not all_finite(delta):  # a diverged inner phase: neither send nor apply it, keep Mix1's correction
            logger.warning(f"round {context.round}: the outer gradient is not finite; dropping it (no Mix2, no step)")
            self.outer.restore_anchor_()
        elif self.delayed is not None:
            stats.add_mix2_(self._step_one_round_late_(delta, context))
        else:
            if self._mixes(context):
                delta, mix2 = self.mix2.mix(delta, context)
                stats.add_mix2_(mix2)
            self.outer.step_(delta)
        self.outer.set_params_([p.detach().float().cpu() + c for p, c in zip(self.outer.params, correction,
                                                                             strict=True)])
        stats.exchange_s += time.monotonic() - started
        return stats.add_incoming_(self.mixer.take_incoming_stats())

    def _mixes(self, context: RoundContext) -> bool:
        return context.round % self.config.mix2_every == 0

    def _step_one_round_late_(self, delta: list[torch.Tensor], context: RoundContext) -> RoundSync:
        """Collect the Mix2 launched last round, launch this round's (every K rounds), step with the delayed (or
        eager) outer gradient; returns what the collected Mix2 did (nothing in a round that follows none)."""
        assert self.delayed is not None
        previous, mix2 = self._collect_pending()
        own = delta
        if self._mixes(context):
            assert self._mix2_thread is not None
            own = self.mix2.own_share(delta, context)  # after the collect: its error feedback is committed
            self.pending = self._mix2_thread.submit(self.mix2.mix, [d.clone() for d in delta], context)
        own_weight = self.config.own_weight(mix2.group_size) if previous is not None else 1.0
        applied = self.delayed.outer_gradient_(own, previous, own_weight)
        if applied is None:
            self.outer.restore_anchor_()
        else:
            self.outer.step_(applied)
        return mix2

    def _collect_pending(self) -> tuple[list[torch.Tensor] | None, RoundSync]:
        pending, self.pending = self.pending, None
        if pending is None:
            return None, RoundSync()
        self.mix2.stop_()
        try:
            return pending.result()
        except Exception as e:  # a transport failure is a round mixed with nobody, as in the blocking path
            logger.warning(f"the overlapped Mix2 failed ({e!r}); applying this peer's own outer gradient")
            return None, RoundSync(failed=1)

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self.outer.state_tensors() + self.mix2.state_tensors()

    def outer_state_problem(self, params: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> str | None:
        return None  # a momentum shows nothing beside the parameters (joining.py compares it with the witnesses')

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Adopt a downloaded state: a Mix2 still in flight was of our old Δ, and is dropped with it."""
        if self.delayed is not None:
            self._collect_pending()
            self.delayed = DelayedOuterGradient(eager=self.delayed.eager)
        count = len(self.outer.state_tensors())  # the outer momentum's: none with γ 0
        self.outer.load_state_tensors_(tensors[:count])
        self.mix2.load_state_tensors_(tensors[count:])

    def shutdown(self) -> None:
        if self.mix1 is not None:
            self.mix1.cancel()
        if self.pending is not None:
            self.mix2.stop_()
            with contextlib.suppress(Exception):
                self.pending.result(timeout=self.config.allreduce_timeout_s)
        if self._mix2_thread is not None:
            self._mix2_thread.shutdown(wait=False, cancel_futures=True)
        for close in self.closers:
            close()
