"""The papers' outer rules beside DiLoCo's step, on lists of tensors: GASLoC, and DiLoCoX's delayed outer gradients.

Conventions (docs/algorithms.md): θ is the point an inner phase starts from, Δ = θ − θ' is the outer gradient,
η the outer learning rate, γ the outer momentum. Every function here is pure or mutates only its own state
object; mixing and exchanges are done by the caller (see :mod:`p2ptrain.maths.mixing`). DiLoCo's Nesterov step
is :class:`p2ptrain.maths.outer_optimizer.OuterOptimizer`; Factored Gossip DiLoCo (§3) is that step plus Mix1's
correction (``p2ptrain.sync.factored``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from p2ptrain.errors import StateMismatchError
from p2ptrain.tensor_layout import check_alike

Tensors = list[torch.Tensor]


def _clone(tensors: Sequence[torch.Tensor]) -> Tensors:
    return [t.detach().clone() for t in tensors]


# ---- GASLoC (§2) -------------------------------------------------------------------------------------------------


def propose(theta: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], lr: float) -> Tensors:
    """GASLoC's proposal after the local phase: ``y = θ − η Δ`` (a new list; inputs untouched)."""
    check_alike(theta, delta, "outer gradient")
    return [t.detach().sub(d.to(t.dtype), alpha=lr) for t, d in zip(theta, delta, strict=True)]


# the names of GASLoC's previous iterate in a state or checkpoint (`x_prev:0`, ...), kept only when γ > 0
X_PREV_PREFIX = "x_prev:"


class GaslocState:
    """Per-peer GASLoC state: the previous mixed iterate x (x_0 = θ_0), kept only when γ > 0.

    After the proposals y are mixed into ``x_new``: ``θ_next = x_new + γ (x_new − x_prev)``, then x_prev ← x_new.
    On the complete graph with exact averaging this is DiLoCo's Nesterov step (see tests/test_outer_rules.py).
    With γ 0, θ_next = x_new and x_prev is never read: it is not held (a model's worth of memory, and of every
    state download and checkpoint).
    """

    def __init__(self, theta_initial: Sequence[torch.Tensor], momentum: float) -> None:
        self.momentum = momentum
        self.x_prev: Tensors = _clone(theta_initial) if momentum else []

    def momentum_step(self, x_new: Sequence[torch.Tensor]) -> Tensors:
        """Return θ_next = x_new + γ (x_new − x_prev) and remember x_new as x_prev (with γ 0: x_new)."""
        if not self.momentum:
            return _clone(x_new)
        check_alike(self.x_prev, x_new, "mixed iterate")
        theta_next = [
            x.detach().add(x.detach() - prev, alpha=self.momentum) for x, prev in zip(x_new, self.x_prev, strict=True)
        ]
        self.x_prev = _clone(x_new)
        return theta_next

    def state_dict(self) -> dict[str, object]:
        return {"momentum": self.momentum, "x_prev": _clone(self.x_prev)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        x_prev = state["x_prev"]
        if not isinstance(x_prev, list):
            raise StateMismatchError("x_prev must be a list of tensors")
        check_alike(self.x_prev, x_prev, "stored x_prev")
        self.momentum = float(state["momentum"])  # type: ignore[arg-type]
        self.x_prev = _clone(x_prev)


# ---- DiLoCoX one-step delay (§4) -----------------------------------------------------------------------------------


class DelayedOuterGradient:
    """Which outer gradient to apply at the end of round t when the exchange of Δ_t overlaps round t+1.

    Plain delay applies Δ̄_{t−1}, the mixed result that has just arrived. The eager variant applies
    ``Δ̃_t = Δ̄_{t−1} − w_{t−1} Δ_{t−1} + w_t Δ_t``: its own contribution is current, the others' one round late, and
    the share of Δ_{t−1} it applied a round ago is taken back now that the mean holding it has arrived. ``w`` is the
    weight of the peer's own Δ in what it applies at once: 1/M for DiLoCoX's eager rule (an all-reduce over M peers),
    1 for `sync.overlap: local` (local SGD whose average lands a round late). A failed exchange (``mixed_prev=None``)
    counts as mixing with nobody (Δ̄_{t−1} = Δ_{t−1}); in the first round nothing is pending. Summed over rounds,
    eager bookkeeping applies every mean once and only the last own Δ beside them, whatever the weights were.
    """

    def __init__(self, eager: bool) -> None:
        self.eager = eager
        self.own_prev: Tensors | None = None
        self.applied_own: Tensors | None = None  # eager: w_{t−1} Δ_{t−1}, applied before its mean arrived

    def outer_gradient_(
        self, own_delta: Sequence[torch.Tensor], mixed_prev: Sequence[torch.Tensor] | None, own_weight: float
    ) -> Tensors | None:
        """Return the outer gradient to apply now (None: nothing to apply yet) and remember Δ_t."""
        if not 0.0 < own_weight <= 1.0:
            raise ValueError(f"own_weight must be in (0, 1], got {own_weight}")
        own_prev = self.own_prev
        if own_prev is not None:
            check_alike(own_prev, own_delta, "outer gradient")
        if mixed_prev is not None:
            check_alike(own_delta, mixed_prev, "mixed outer gradient")
        base = _clone(mixed_prev) if mixed_prev is not None else own_prev
        self.own_prev = _clone(own_delta)
        if not self.eager:
            return base
        start = base if base is not None else [torch.zeros_like(d) for d in own_delta]
        if self.applied_own is not None:
            start = [s - a for s, a in zip(start, self.applied_own, strict=True)]
        self.applied_own = [d.detach() * own_weight for d in own_delta]
        return [s + a for s, a in zip(start, self.applied_own, strict=True)]

    def unsettled(self) -> Tensors | None:
        """The own share applied before its mean arrived (eager: w_{t−1} Δ_{t−1}; None: nothing pending). Without
        outer momentum, anchor + η × this is the point the peer holds in common with its Mix2 group."""
        return self.applied_own
