"""GASLoC: the proposal y = θ − ηΔ mixed with 1–2 random live peers by parameter gossip, then momentum on the
mixed iterates (ALGORITHMS.md §2). A round whose Δ is not finite (a diverged inner phase) proposes θ itself: the
peer takes no step but still mixes, and never sends or applies a non-finite value."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.maths.outer_rules import GaslocState, propose
from p2ptrain.maths.robust import all_finite
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.interface import RoundContext, RoundSync
from p2ptrain.sync.param_gossip import ParamGossip

logger = logging.getLogger(__name__)


class GaslocSync:
    """GASLoC: y = θ − ηΔ (+ what others' exchanges moved us by), mixed with 1–2 random peers, then momentum."""

    def __init__(self, outer: OuterOptimizer, mixer: ParamGossip, loop: BackgroundLoop, config: SyncConfig):
        self.outer, self.mixer, self.loop, self.config = outer, mixer, loop, config
        self.state = GaslocState([a.detach().float().cpu() for a in outer.anchor], outer.config.momentum)

    def start_round(self, context: RoundContext) -> None:
        self.mixer.round = context.round
        self.mixer.budget_s = context.inner_phase_s
        self.mixer.set_base_(self.outer.anchor)

    def finish_round(self, context: RoundContext) -> RoundSync:
        proposal = propose(self.outer.anchor, self.outer.outer_gradient(), self.outer.config.lr)
        if not all_finite(proposal):
            logger.warning(f"round {context.round}: the outer gradient is not finite; dropping it (no step this round)")
            proposal = [a.detach().clone() for a in self.outer.anchor]
        y = [t.float().cpu() + c for t, c in zip(proposal, self.mixer.take_correction_(), strict=True)]
        self.mixer.set_base_(y)  # exchanges others start while we mix see our proposal
        mixed, stats = self.loop.run(self.mixer.mix(y, context.live_peers, context.round,
                                                    links=context.link_bytes_per_s))
        x = [m + c for m, c in zip(mixed, self.mixer.take_correction_(), strict=True)]
        self.outer.set_params_(self.state.momentum_step(x))
        self.mixer.set_base_(self.outer.anchor)
        return stats.add_incoming_(self.mixer.take_incoming_stats())

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"x_prev:{i}", x) for i, x in enumerate(self.state.x_prev)]

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        self.state.load_state_dict({"momentum": self.state.momentum, "x_prev": [t.clone() for t in tensors]})

    def shutdown(self) -> None:
        pass
