"""Outer steps on lists of tensors: DiLoCo's Nesterov step, GASLoC, Factored Gossip DiLoCo, delayed outer gradients.

Conventions (ALGORITHMS.md): θ is the point an inner phase starts from, Δ = θ − θ' is the outer gradient,
η the outer learning rate, γ the outer momentum. Every function here is pure or mutates only its own state
object; mixing and exchanges are done by the caller (see :mod:`p2ptrain.maths.mixing`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from p2ptrain.errors import StateMismatchError
from p2ptrain.tensor_layout import check_alike

Tensors = list[torch.Tensor]


def _clone(tensors: Sequence[torch.Tensor]) -> Tensors:
    return [t.detach().clone() for t in tensors]


# ---- DiLoCo: Nesterov SGD on the outer gradient ------------------------------------------------------------------


def nesterov_update(
    grad: Sequence[torch.Tensor], momentum_buf: Sequence[torch.Tensor] | None, lr: float, momentum: float
) -> tuple[Tensors, Tensors]:
    """The outer optimizer as a function of its state: returns ``(update, new_momentum_buf)``; θ⁺ = θ + update.

    Same maths as ``torch.optim.SGD(lr, momentum, nesterov=True)`` with no dampening or weight decay:
    ``buf ← γ·buf + g`` (``buf = g`` on the first step, i.e. ``momentum_buf=None``), ``update = −η (g + γ·buf)``.
    """
    if momentum_buf is None:
        new_buf = _clone(grad)
    else:
        check_alike(grad, momentum_buf, "momentum buffer")
        new_buf = [b.mul(momentum).add_(g) for b, g in zip(momentum_buf, grad, strict=True)]
    update = [g.add(b, alpha=momentum).mul_(-lr) for g, b in zip(grad, new_buf, strict=True)]
    return update, new_buf


class NesterovState:
    """DiLoCo's outer optimizer state (the momentum buffer), checkpointable."""

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr = lr
        self.momentum = momentum
        self.momentum_buf: Tensors | None = None

    def step_(self, theta: list[torch.Tensor], outer_grad: Sequence[torch.Tensor]) -> None:
        """In place: θ ← θ − η (g + γ·buf) with g the (mixed) outer gradient."""
        check_alike(theta, outer_grad, "outer gradient")
        update, self.momentum_buf = nesterov_update(outer_grad, self.momentum_buf, self.lr, self.momentum)
        with torch.no_grad():
            for param, change in zip(theta, update, strict=True):
                param.add_(change.to(param.dtype))

    def state_dict(self) -> dict[str, object]:
        return {"momentum_buf": None if self.momentum_buf is None else _clone(self.momentum_buf)}

    def load_state_dict(self, state: dict[str, object], like: Sequence[torch.Tensor]) -> None:
        buf = state["momentum_buf"]
        if buf is not None:
            if not isinstance(buf, list):
                raise StateMismatchError("momentum_buf must be a list of tensors")
            check_alike(like, buf, "stored momentum buffer")
            buf = _clone(buf)
        self.momentum_buf = buf


# ---- GASLoC (§2) -------------------------------------------------------------------------------------------------


def propose(theta: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], lr: float) -> Tensors:
    """GASLoC's proposal after the local phase: ``y = θ − η Δ`` (a new list; inputs untouched)."""
    check_alike(theta, delta, "outer gradient")
    return [t.detach().sub(d.to(t.dtype), alpha=lr) for t, d in zip(theta, delta, strict=True)]


class GaslocState:
    """Per-peer GASLoC state: the previous mixed iterate x (x_0 = θ_0).

    After the proposals y are mixed into ``x_new``: ``θ_next = x_new + γ (x_new − x_prev)``, then x_prev ← x_new.
    On the complete graph with exact averaging this is DiLoCo's Nesterov step (see tests/test_gasloc.py).
    """

    def __init__(self, theta_initial: Sequence[torch.Tensor], momentum: float) -> None:
        self.momentum = momentum
        self.x_prev: Tensors = _clone(theta_initial)

    def reset_(self, theta: Sequence[torch.Tensor]) -> None:
        """Forget momentum (x_prev ← θ): used when a peer adopts another peer's parameters."""
        check_alike(self.x_prev, theta, "parameters")
        self.x_prev = _clone(theta)

    def momentum_step(self, x_new: Sequence[torch.Tensor]) -> Tensors:
        """Return θ_next = x_new + γ (x_new − x_prev) and remember x_new as x_prev."""
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


# ---- Factored Gossip DiLoCo (§3) -----------------------------------------------------------------------------------


def mix1_correction(
    theta: Sequence[torch.Tensor], partner_thetas: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]
) -> Tensors:
    """Mix1's correction ``c = Σ_j W1_ij θ_j − θ_i = Σ_j w_j (θ_j − θ_i)`` from round-t (frozen) parameters.

    No partners (a failed or skipped Mix1) gives c = 0.
    """
    if len(partner_thetas) != len(weights):
        raise ValueError(f"got {len(partner_thetas)} partners but {len(weights)} weights")
    correction = [torch.zeros_like(t, dtype=torch.float32) for t in theta]
    for position, (partner, weight) in enumerate(zip(partner_thetas, weights, strict=True)):
        check_alike(theta, partner, f"partner {position}")
        for c, own, other in zip(correction, theta, partner, strict=True):
            c.add_(other.float() - own.float(), alpha=weight)
    return correction


def factored_step_(
    theta: list[torch.Tensor],
    correction: Sequence[torch.Tensor],
    mixed_delta: Sequence[torch.Tensor],
    outer: NesterovState,
) -> None:
    """In place: θ⁺ = θ + c + OuterOpt(mixed Δ), with OuterOpt DiLoCo's Nesterov step (state in ``outer``)."""
    check_alike(theta, correction, "Mix1 correction")
    check_alike(theta, mixed_delta, "mixed outer gradient")
    update, outer.momentum_buf = nesterov_update(mixed_delta, outer.momentum_buf, outer.lr, outer.momentum)
    with torch.no_grad():
        for param, c, change in zip(theta, correction, update, strict=True):
            param.add_((c + change).to(param.dtype))


# ---- DiLoCoX one-step delay (§4) -----------------------------------------------------------------------------------


class DelayedOuterGradient:
    """Which outer gradient to apply at the end of round t when the exchange of Δ_t overlaps round t+1.

    Plain delay applies Δ̄_{t−1}, the mixed result that has just arrived. The eager variant applies
    ``Δ̃_t = Δ̄_{t−1} + w (Δ_t − Δ_{t−1})``: its own contribution is current, the others' one round late.
    ``w`` is the weight of the peer's own Δ in the mix (1/M for an all-reduce over M peers, w_ii for gossip),
    assumed constant across rounds. A failed exchange (``mixed_prev=None``) counts as mixing with nobody
    (Δ̄_{t−1} = Δ_{t−1}, the identity); in the first round nothing is pending and Δ_{−1} = 0.
    When every exchange succeeds, eager bookkeeping applies each own Δ with total weight exactly w, as the
    synchronous mix does.
    """

    def __init__(self, eager: bool) -> None:
        self.eager = eager
        self.own_prev: Tensors | None = None

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
        previous = own_prev if own_prev is not None else [torch.zeros_like(d) for d in own_delta]
        start = base if base is not None else [torch.zeros_like(d) for d in own_delta]
        return [s.add(d - p, alpha=own_weight) for s, d, p in zip(start, own_delta, previous, strict=True)]
