"""GASLoC: the proposal y = θ − ηΔ mixed with 1–2 random live peers by parameter gossip, then momentum on the
mixed iterates (docs/algorithms.md §2). A round whose Δ is not finite (a diverged inner phase) proposes θ itself: the
peer takes no step but still mixes, and never sends or applies a non-finite value.

With `sync.overlap: delayed` the exchanges this peer starts no longer block: DiLoCoX's one-step delay applied to
GASLoC's mixing. Round r's proposal is mixed in the background during round r + 1's inner phase, and its pull
(mixed − y_r) joins round r + 1's proposal, as the corrections of exchanges that others start with us always do."""

from __future__ import annotations

import concurrent.futures
import logging
import math
from collections.abc import Sequence

import torch

from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.maths.outer_rules import X_PREV_PREFIX, GaslocState, propose
from p2ptrain.maths.robust import all_finite
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.interface import RoundContext, RoundSync
from p2ptrain.sync.param_gossip import ParamGossip
from p2ptrain.tensor_layout import distance, norm

logger = logging.getLogger(__name__)

Mixed = tuple[list[torch.Tensor], RoundSync]


class GaslocSync:
    """GASLoC: y = θ − ηΔ (+ what others' exchanges moved us by), mixed with 1–2 random peers, then momentum."""

    # gossip with partners of any round, a view a heartbeat old will do; a slow link's peer counts fewer rounds, so a
    # peer keeps its own count when it adopts a state of a lower round
    aligned_rounds = False
    needs_current_swarm = False
    rounds_count_own_steps = True

    def __init__(self, outer: OuterOptimizer, mixer: ParamGossip, loop: BackgroundLoop, config: SyncConfig):
        self.outer, self.mixer, self.loop, self.config = outer, mixer, loop, config
        self.state = GaslocState([a.detach().float().cpu() for a in outer.anchor], outer.config.momentum)
        self.overlapped = config.overlap == "delayed"
        self.pending: tuple[list[torch.Tensor], concurrent.futures.Future[Mixed]] | None = None  # (y_r, its mix)

    def start_round(self, context: RoundContext) -> None:
        self.mixer.round = context.round
        self.mixer.budget_s = context.inner_phase_s
        self.mixer.set_base_(self.outer.anchor)

    def finish_round(self, context: RoundContext) -> RoundSync:
        outer_gradient = self.outer.outer_gradient()
        proposal = propose(self.outer.anchor, outer_gradient, self.outer.config.lr)
        if not all_finite(proposal):
            logger.warning(f"round {context.round}: the outer gradient is not finite; dropping it (no step this round)")
            proposal = [a.detach().clone() for a in self.outer.anchor]
            outer_gradient = [torch.zeros_like(a) for a in self.outer.anchor]
        self.mixer.show_work_(outer_gradient, context.tokens)  # what our values show partners of our work
        late_pull, stats = self._collect_pending()
        y = [t.float().cpu() + c + p for t, c, p in zip(proposal, self.mixer.take_correction_(), late_pull,
                                                        strict=True)]
        self.mixer.set_base_(y)  # exchanges others start while we mix see our proposal
        mix = self.mixer.mix(y, context.live_peers, context.round, links=context.link_bytes_per_s)
        if self.overlapped:
            self.pending, x = (y, self.loop.submit(mix)), y
        else:
            mixed, stats = self.loop.run(mix)
            x = [m + c for m, c in zip(mixed, self.mixer.take_correction_(), strict=True)]
        self.outer.set_params_(self.state.momentum_step(x))
        self.mixer.set_base_(self.outer.anchor)
        return stats.add_incoming_(self.mixer.take_incoming_stats())

    def _collect_pending(self) -> tuple[list[torch.Tensor], RoundSync]:
        """The pull of the mix started last round (overlap), waiting for it if it is still running, and what it
        did; zeros and an empty report when none is pending (or it failed)."""
        pending, self.pending = self.pending, None
        zeros = [torch.zeros_like(a, dtype=torch.float32, device="cpu") for a in self.outer.anchor]
        if pending is None:
            return zeros, RoundSync()
        value, future = pending
        try:
            mixed, stats = future.result()
        except Exception as e:  # the exchange's own errors are handled inside `mix`; this is a bug or shutdown
            logger.warning(f"the overlapped mix failed: {e!r}; its pull is dropped")
            return zeros, RoundSync()
        return [m - v for m, v in zip(mixed, value, strict=True)], stats

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"{X_PREV_PREFIX}{i}", x) for i, x in enumerate(self.state.x_prev)]

    def outer_state_problem(self, params: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> str | None:
        """The previous iterate lies one outer step behind the parameters: farther than
        `sync.join_gossip_max_distance` (relative), the next outer step would throw them γ × as far. With γ 0 there
        is none (the layout check refused any)."""
        if not tensors:
            return None
        gap, scale = distance(tensors, params), norm(params)
        if not gap <= self.config.join_gossip_max_distance * scale:  # NaN fails too
            return f"its previous iterate is {gap / scale if scale else math.inf:.3g} (relative) from its parameters"
        return None

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        self._drop_pending()  # its pull is relative to the value we had, not to the state adopted
        self.state.load_state_dict({"momentum": self.state.momentum, "x_prev": [t.clone() for t in tensors]})

    def shutdown(self) -> None:
        self._drop_pending()

    def _drop_pending(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending[1].cancel()
