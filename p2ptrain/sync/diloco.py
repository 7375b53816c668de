"""DiLoCo: an exact all-reduce of the outer gradient Δ among the peers of the round, then the Nesterov step;
optionally one round late (DiLoCoX's one-step delay, `sync.overlap`).

With `sync.robust` (maths/robust_mean.py) the group's mean is applied only if it is finite and near our own Δ;
otherwise our own Δ stands in, as after a failed all-reduce (the round counts one failed exchange). A round whose
members could not agree on their inputs (sync/allreduce_agreement.py) applies nothing: the parameters go back to the
round's anchor (with overlap, the late mean is zero)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.maths.outer_rules import DelayedOuterGradient
from p2ptrain.maths.robust_mean import MeanCheck
from p2ptrain.net.allreduce import AveragingResult
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.interface import HONEST, Averager, Conduct, PendingResult, RoundContext, RoundSync

logger = logging.getLogger(__name__)


# An all-reduce's honest deviations run wider than gossip partners' distances relative to our own step (a joiner's
# first round: about 2 ‖Δ‖, maths/robust_mean.py), and the check refuses rather than clips: twice gossip's multiplier
ALLREDUCE_MARGIN = 2.0


def mean_check(config: SyncConfig) -> MeanCheck:
    """The check of all-reduce means that `sync.robust` and `sync.clip_multiplier` ask for."""
    return MeanCheck(ALLREDUCE_MARGIN * config.clip_multiplier, enabled=config.robust)


def checked(result: AveragingResult, own: Sequence[torch.Tensor], check: MeanCheck,
            round_: int, stretch: float = 1.0) -> tuple[AveragingResult, bool]:
    """The all-reduce's result, or our own Δ when `check` refuses the mean (and whether it did). A refused mean
    counts as a group of one: the peer is then out of step with the swarm and takes a synced peer's state at its
    next round, instead of training on from parameters the others do not hold."""
    if result.group_size <= 1 or result.discarded:  # our own Δ, or nothing to apply: no mean to judge
        return result, False
    own_cpu = [o.detach().float().cpu() for o in own]
    verdict = check.judge_(result.delta, own_cpu, result.claimed_norms, result.own_norm, result.own_deviation,
                           stretch)
    if verdict.accepted:
        return result, False
    logger.warning(f"round {round_}: refused the mean of {result.group_size} peers' outer gradients "
                   f"({verdict.reason}: ‖mean − own Δ‖ = {verdict.deviation:.3g}, radius {verdict.radius:.3g}); "
                   f"applying this peer's own")
    return dataclasses.replace(result, delta=[o.clone() for o in own_cpu], group_size=1), True


def judged(averager: Averager, result: AveragingResult, own: Sequence[torch.Tensor], check: MeanCheck,
           round_: int, stretch: float = 1.0) -> tuple[AveragingResult, bool]:
    """`checked`, and a refused mean forgotten by the averager: we did not apply it, so it is not ours to report in
    the next round's agreement check."""
    result, refused = checked(result, own, check, round_, stretch)
    if refused:
        averager.forget_()
    return result, refused


def round_sync_of(result: AveragingResult, codec: str, refused: bool = False) -> RoundSync:
    """What an all-reduce did and cost, as the round's record (a refused mean counts as a failed exchange)."""
    return RoundSync(group_size=result.group_size, bytes_sent=result.bytes_sent,
                     bytes_received=result.bytes_received, exchange_s=result.seconds, codec=codec,
                     failed=int(refused or result.discarded), in_step=result.in_step)


class DilocoSync:
    """Exact all-reduce of Δ among the peers of the round, then Nesterov; optionally one round late (DiLoCoX)."""

    # an all-reduce expects exactly the peers of its round, read from the DHT; a joiner takes its donor's round
    aligned_rounds = True
    needs_current_swarm = True
    rounds_count_own_steps = False

    def __init__(self, outer: OuterOptimizer, averager: Averager, config: SyncConfig, conduct: Conduct = HONEST):
        self.outer, self.averager, self.config = outer, averager, config
        self.conduct = conduct  # forms the Δ handed to an averager that sends it itself (hivemind's)
        self.delayed = DelayedOuterGradient(eager=config.own_delta_first) if config.overlap != "none" else None
        self.check = mean_check(config)
        self.pending: PendingResult | None = None
        self.pending_own: list[torch.Tensor] = []  # the Δ whose average is pending (what its mean is judged by)
        self.pending_round, self.pending_stretch = -1, 1.0

    def start_round(self, context: RoundContext) -> None:
        pass

    def finish_round(self, context: RoundContext) -> RoundSync:
        delta = self.conduct.own_outer_gradient(self.outer.outer_gradient())
        if self.delayed is None:
            result = self.averager.average(delta, context.round, float(context.inner_steps), context.round_peers,
                                           context.tokens)
            result, refused = judged(self.averager, result, delta, self.check, context.round,
                                     context.steps_cut_stretch())
            if result.discarded:  # the members did not agree on the inputs: all keep the anchor they share
                self.outer.restore_anchor_()
            else:
                self.outer.step_(result.delta)
            return round_sync_of(result, self.config.grad_codec, refused)
        return self._finish_overlapped(delta, context)

    def _finish_overlapped(self, delta: list[torch.Tensor], context: RoundContext) -> RoundSync:
        """Collect the average of the previous round's Δ, launch this round's, apply the delayed/eager gradient."""
        previous, refused = self._collect_previous()
        self.pending = self.averager.launch(delta, context.round, float(context.inner_steps), context.round_peers,
                                           context.tokens)
        self.pending_own, self.pending_round, self.pending_stretch = delta, context.round, context.steps_cut_stretch()
        own_weight = self.config.own_weight(previous.group_size) if previous is not None else 1.0
        assert self.delayed is not None
        applied = self.delayed.outer_gradient_(delta, previous.delta if previous else None, own_weight)
        if applied is None:
            self.outer.restore_anchor_()
        else:
            self.outer.step_(applied)
        if previous is None:
            return RoundSync(nothing_due=True)
        return round_sync_of(previous, self.config.grad_codec, refused)

    def _collect_previous(self) -> tuple[AveragingResult | None, bool]:
        """The checked average of the previous round's Δ (None in the first round)."""
        if self.pending is None:
            return None, False
        return judged(self.averager, self.pending.result(), self.pending_own, self.check, self.pending_round,
                      self.pending_stretch)

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self.outer.state_tensors()

    def outer_state_problem(self, params: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> str | None:
        return None  # a momentum shows nothing beside the parameters (joining.py compares it with the witnesses')

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        self.outer.load_state_tensors_(tensors)
        self.averager.forget_()

    def shutdown(self) -> None:
        if self.pending is not None:
            self.pending.result()
        self.averager.shutdown()
