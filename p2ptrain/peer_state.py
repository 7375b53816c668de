"""A training peer's state, as one object: the round's anchor and the outer sync's state (what a joiner downloads
and a checkpoint keeps), the round, and whether that state is the swarm's. The round loop (peer.py) applies what
the joiner decides to it, and checkpoints save and load it (peer_checkpoint.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from p2ptrain.join_rules import JoinDecision
from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.net.state_sharing import OUTER_PREFIX, StateSnapshot
from p2ptrain.sync.interface import OuterSync
from p2ptrain.tensor_layout import layout_of


class PeerState:
    """The anchor θ_r (held by `outer`, parameters named `names`), the outer sync's state (held by `sync`), and
    where the peer stands: its `round`; `synced`, whether its state is the swarm's; `joined_ever`, whether this
    process took the swarm's state (or found that it held it already, or saw other peers); `joined_this_round`,
    whether this round started from a state adopted from a peer."""

    def __init__(self, names: Sequence[str], outer: OuterOptimizer, sync: OuterSync, round_: int = 0):
        self.names, self.outer, self.sync = list(names), outer, sync
        self.round = round_
        self.synced, self.joined_ever, self.joined_this_round = True, False, False

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What a joiner downloads and a checkpoint keeps: the anchor and the outer-sync state, by name."""
        named = [(f"param:{n}", a) for n, a in zip(self.names, self.outer.anchor, strict=True)]
        return named + [(f"{OUTER_PREFIX}{n}", t) for n, t in self.sync.state_tensors()]

    def layout(self) -> list[tuple[str, tuple[int, ...], str]]:
        """The names, shapes and dtypes of `named_tensors`: what a downloaded snapshot must match."""
        named = self.named_tensors()
        return layout_of([n for n, _ in named], [t.detach().cpu() for _, t in named])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors())

    def take_(self, decision: JoinDecision) -> None:
        """Apply a catch-up's decision (joining.py): its snapshot, if any, and whether we are one of the swarm's."""
        if decision.snapshot is not None:
            self.adopt_(decision.snapshot)
        self.joined_ever = self.joined_ever or decision.member
        self.joined_this_round = decision.snapshot is not None

    def adopt_(self, snapshot: StateSnapshot) -> None:
        """Apply a fully validated snapshot: parameters, outer-sync state, round (all or nothing; where rounds count
        our own outer steps, as in GASLoC, the round only moves forward). The state is then the swarm's."""
        count = len(self.names)
        self.outer.set_params_(snapshot.tensors[:count])
        self.sync.load_state_tensors_(snapshot.tensors[count:])
        self.round = max(self.round, snapshot.round) if self.sync.rounds_count_own_steps else snapshot.round
        self.joined_ever, self.synced = True, True

    def record_step_(self, group_size: int, others_here: int, shown: bool | None) -> None:
        """In step when our group held a majority of the peers of our round or beyond, and our state was the group's
        where its members showed theirs (`shown`, sync/state_evidence.py). Without samples, out of step stays so
        until a state is adopted: a peer that applied its own Δ while the others applied their mean holds other
        parameters even when it averages with them the next round."""
        in_step = 2 * group_size > 1 + others_here
        self.synced = in_step and (shown if shown is not None else self.synced or self.joined_this_round)
