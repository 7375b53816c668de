"""The red team: a training peer that turns hostile, built from the project's own modules.

`p2ptrain peer --red-team KIND[@ROUND]` (a hidden option, used by the testnet's `adversary:` key) runs an
ordinary peer that, from round ROUND on, sends what an attacker would. Every attack goes through the one point
where an honest peer forms what it sends (`ParamGossip.outgoing`, `GradGossip.outgoing`, the outer gradient it
hands the all-reduce, the snapshot and round it publishes), so the attacker speaks the protocol perfectly and
only its values lie:

- ``aimed``: −7 × its value (parameters or outer gradient): inside the fixed `sync.max_partner_distance` bound of
  10 × the victim's norm, the attack that took GASLoC to a uniform model before the defences;
- ``sign_flip``: −1000 × its value; ``scale``: +1000 × its value;
- ``replay``: a stale value: θ_0 for parameters, the outer gradient of the attack's first round for Δ;
- ``nan``: its value with NaN in it;
- ``state_liar``: announces round +100000 and serves −5 × its anchor as its round-start snapshot.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from p2ptrain.errors import UserError

if TYPE_CHECKING:
    from p2ptrain.peer import TrainingPeer

logger = logging.getLogger(__name__)

VALUE_ATTACKS = ("aimed", "sign_flip", "scale", "replay", "nan")
ATTACKS = (*VALUE_ATTACKS, "state_liar")
LIAR_ROUND_LEAD = 100_000
Tensors = list[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Attack:
    """What a red-team peer does, and from which of its rounds on."""

    kind: str
    from_round: int = 0

    @classmethod
    def parse(cls, text: str) -> Attack:
        """``KIND`` or ``KIND@ROUND``; a one-line UserError otherwise."""
        kind, at, start = text.partition("@")
        if kind not in ATTACKS:
            raise UserError(f"--red-team {text!r}: the attack must be one of {', '.join(ATTACKS)} (e.g. aimed@2)")
        if at and not (start.isdigit() and int(start) < 10**6):
            raise UserError(f"--red-team {text!r}: write KIND@ROUND with ROUND a round number, e.g. aimed@2")
        return cls(kind, int(start or 0))


def tampered(kind: str, value: Tensors, stale: Tensors) -> Tensors:
    """The lie one value attack tells about `value` (`stale`: what a replay sends)."""
    if kind == "aimed":
        return [-7.0 * v for v in value]
    if kind == "sign_flip":
        return [-1000.0 * v for v in value]
    if kind == "scale":
        return [1000.0 * v for v in value]
    if kind == "replay":
        return [s.clone() for s in stale]
    if kind == "nan":
        return [v.clone().fill_(float("nan")) for v in value]
    raise ValueError(f"not a value attack: {kind!r}")


def install_attack(peer: TrainingPeer, attack: Attack) -> None:
    """Turn `peer` hostile from `attack.from_round` on (its honest behaviour before that)."""
    from p2ptrain.sync.exchange_allreduce import ExchangeAllReduce
    from p2ptrain.sync.grad_gossip import GradGossip
    from p2ptrain.sync.param_gossip import ParamGossip

    logger.warning(f"red team: this peer plays {attack.kind!r} from round {attack.from_round} on")
    active: Callable[[], bool] = lambda: peer.round >= attack.from_round  # noqa: E731
    if attack.kind == "state_liar":
        _lie_about_state(peer, active)
        return
    transports = _transports(peer.sync, (ParamGossip, GradGossip, ExchangeAllReduce))  # each has an `outgoing`
    for transport in transports:
        stale = [r.clone() for r in transport.reference] if isinstance(transport, ParamGossip) else None
        _wrap(transport, "outgoing", attack.kind, active, stale)
    if not transports:  # hivemind's all-reduce of outer gradients: lie in the Δ it hands the averager
        _wrap(peer.outer, "outer_gradient", attack.kind, active, None)


def _transports(owner: object, kinds: tuple[type, ...], depth: int = 3) -> list[Any]:
    """The exchange transports `owner` holds, directly or through its parts (Mix2, an averager), once each."""
    found: list[Any] = []
    for value in vars(owner).values() if hasattr(owner, "__dict__") else ():
        if isinstance(value, kinds):
            found.append(value)
        elif depth > 1 and type(value).__module__.startswith("p2ptrain.sync"):
            found += _transports(value, kinds, depth - 1)
    return list({id(t): t for t in found}.values())


def _wrap(target: Any, method: str, kind: str, active: Callable[[], bool], stale: Tensors | None) -> None:
    """Replace `target.method` (returning a list of tensors) by the attack's lie while `active()`."""
    honest = getattr(target, method)
    first: list[Tensors] = []

    def lying(*args: Any, **kwargs: Any) -> Tensors:
        value = honest(*args, **kwargs)
        if not active():
            return value
        if not first:
            first.append([v.detach().clone() for v in value])
        return tampered(kind, value, stale if stale is not None else first[0])

    setattr(target, method, lying)


def _lie_about_state(peer: TrainingPeer, active: Callable[[], bool]) -> None:
    """Announce a far-ahead round and serve a poisoned round-start snapshot under it."""
    honest_publish = peer._publish_round_start
    honest_state = peer._named_state

    def poisoned_state(self: TrainingPeer) -> list[tuple[str, torch.Tensor]]:
        named = honest_state()
        if not active():
            return named
        return [(n, -5.0 * t if n.startswith("param:") else t) for n, t in named]

    def lying_publish(self: TrainingPeer) -> None:
        if not active():
            honest_publish()
            return
        true_round = self.round
        self.round = true_round + LIAR_ROUND_LEAD
        try:
            honest_publish()  # snapshot and announcement both carry the lie
        finally:
            self.round = true_round

    peer._named_state = types.MethodType(poisoned_state, peer)  # type: ignore[method-assign]
    peer._publish_round_start = types.MethodType(lying_publish, peer)  # type: ignore[method-assign]
