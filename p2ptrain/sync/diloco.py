"""DiLoCo: an exact all-reduce of the outer gradient Δ among the peers of the round, then the Nesterov step;
optionally one round late (DiLoCoX's one-step delay, `sync.overlap`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.maths.outer_rules import DelayedOuterGradient
from p2ptrain.net.allreduce import AllReduceAverager, AveragingResult, PendingAverage
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.interface import RoundContext, RoundSync


def round_sync_of(result: AveragingResult, codec: str) -> RoundSync:
    """What an all-reduce did and cost, as the round's record."""
    return RoundSync(group_size=result.group_size, bytes_sent=result.bytes_sent,
                     bytes_received=result.bytes_received, exchange_s=result.seconds, codec=codec)


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
            return round_sync_of(result, self.config.grad_codec)
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
        return round_sync_of(previous, self.config.grad_codec) if previous else RoundSync()

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self.outer.state_tensors()

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        self.outer.load_state_tensors_(tensors)

    def shutdown(self) -> None:
        if self.pending is not None:
            self.pending.result()
        self.averager.shutdown()
