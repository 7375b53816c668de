"""The red team's attacks: a `Conduct` (sync/interface.py) that, from a round on, forms what an attacker would send.

A peer built with `HostileConduct` (by `python -m p2ptrain.testnet.red_team`, which the testnet's `adversary:` key
starts) runs the project's own code and lies only where an honest peer forms what it sends (the parameters it
gossips, the outer gradient it hands the gossip or the all-reduce, the snapshot and round it publishes), so it speaks
the protocol perfectly and only its values lie:

- ``aimed``: −7 × its value (parameters or outer gradient): inside the fixed `sync.max_partner_distance` bound of
  10 × the victim's norm, which drives undefended GASLoC to a uniform model;
- ``sign_flip``: −1000 × its value; ``scale``: +1000 × its value;
- ``replay``: a stale value: θ_0 for parameters, the outer gradient of the attack's first round for Δ;
- ``noisy_replay``: the same stale value plus fresh noise one typical step long (as ``push`` measures a step), so
  that no two values are alike and each moves by about a round's step: what the bit-for-bit replay check misses
  (fresh noise for each parameter value sent; one noisy outer gradient a round, the one it also reduces itself);
- ``push``: its value plus PUSH_STEPS × its typical step in one fixed direction, every time: beyond the clipping
  radius τ (2 steps or more) but inside the hard radius where an offence starts (8 × the typical distance), so each
  exchange is clipped to τ without offence and moves its victim by w·τ, always the same way (issue 31's attack
  "aimed inside the clipping radius, over many rounds"). A step is how far its value moved since the last round it
  sent one (parameters), or the outer gradient's length;
- ``nan``: its value with NaN in it;
- ``free_rider``: its outer gradient × FREE_RIDER_SCALE, as if it trained at a millionth of the learning rate (the
  modes that exchange outer gradients, and the work sample GASLoC's headers show; its parameters go out as they
  are). Like every lie here it shapes only what leaves the peer: its own all-reduce reduces its true Δ, so its
  digest differs from the members' and it falls out of step each round it is a member;
- ``state_liar``: announces round +100000 and serves −5 × its anchor as its round-start snapshot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from p2ptrain.errors import UserError
from p2ptrain.sync.interface import NamedTensors, Tensors
from p2ptrain.tensor_layout import distance, norm

VALUE_ATTACKS = ("aimed", "sign_flip", "scale", "replay", "noisy_replay", "nan", "push")
ATTACKS = (*VALUE_ATTACKS, "free_rider", "state_liar")
FREE_RIDER_SCALE = 1e-6
PUSH_STEPS = 3.0  # ``push``'s lie, in typical steps: beyond τ (≥ 2 steps), well inside the hard radius (≥ 8)
PUSH_SEED = 31
NOISE_SEED = 32
LIAR_ROUND_LEAD = 100_000


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
            raise UserError(f"--attack {text!r}: the attack must be one of {', '.join(ATTACKS)} (e.g. aimed@2)")
        if at and not (start.isdigit() and int(start) < 10**6):
            raise UserError(f"--attack {text!r}: write KIND@ROUND with ROUND a round number, e.g. aimed@2")
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


class HostileConduct:
    """Plays `attack` from the peer's round `attack.from_round` on, honest before that (a `Conduct`)."""

    def __init__(self, attack: Attack):
        self.attack = attack
        self.round_of: Callable[[], int] = lambda: 0
        # per channel (sent to partners, handed to hivemind's all-reduce): the outer gradient of the attack's first
        # round, which a replay sends again
        self.first: dict[str, Tensors] = {}
        self.directions: dict[tuple[tuple[int, ...], ...], Tensors] = {}  # ``push``'s one (unit) direction, per layout
        # ``push`` on parameters: (the round, the value first sent in it, the step that round pushes by)
        self.pushed_from: tuple[int, Tensors, float] | None = None
        self.noise = torch.Generator().manual_seed(NOISE_SEED)  # ``noisy_replay``: fresh noise for every value
        # ``noisy_replay`` of an outer gradient: (the round, its lie), one a round, so that what it reduces itself is
        # what it sent (an all-reduce member that reduced another input would fall out of step by its own doing)
        self.noisy_gradient: tuple[int, Tensors] | None = None

    def follow(self, round_of: Callable[[], int]) -> None:
        self.round_of = round_of

    def active(self) -> bool:
        return self.round_of() >= self.attack.from_round

    def lies_about_values(self) -> bool:
        return self.attack.kind in VALUE_ATTACKS and self.active()

    def sent_params(self, value: Tensors, theta0: Tensors) -> Tensors:
        if self.attack.kind == "push" and self.lies_about_values():
            return self._pushed(value, self._param_step(value))
        if self.attack.kind == "noisy_replay" and self.lies_about_values():
            return self._noisy(theta0, self._param_step(value))
        return tampered(self.attack.kind, value, theta0) if self.lies_about_values() else value

    def _param_step(self, value: Tensors) -> float:
        """How far our parameters moved from the first value we sent in an earlier round to the first in this one;
        every value sent in one round pushes by the same step."""
        round_ = self.round_of()
        if self.pushed_from is not None and self.pushed_from[0] == round_:
            return self.pushed_from[2]
        step = distance(value, self.pushed_from[1]) if self.pushed_from is not None else 0.0
        self.pushed_from = (round_, [v.detach().clone() for v in value], step)
        return step

    def _pushed(self, value: Tensors, step: float) -> Tensors:
        shapes = tuple(tuple(v.shape) for v in value)
        if shapes not in self.directions:
            generator = torch.Generator().manual_seed(PUSH_SEED)
            raw = [torch.randn(shape, generator=generator) for shape in shapes]
            self.directions[shapes] = [r / norm(raw) for r in raw]
        return [v + PUSH_STEPS * step * d for v, d in zip(value, self.directions[shapes], strict=True)]

    def _noisy(self, stale: Tensors, step: float) -> Tensors:
        raw = [torch.randn(s.shape, generator=self.noise) for s in stale]
        scale = step / max(norm(raw), 1e-30)
        return [s + scale * r for s, r in zip(stale, raw, strict=True)]

    def sent_outer_gradient(self, value: Tensors) -> Tensors:
        return self._outer_gradient("sent", value)

    def own_outer_gradient(self, value: Tensors) -> Tensors:
        return self._outer_gradient("own", value)

    def _outer_gradient(self, channel: str, value: Tensors) -> Tensors:
        if self.attack.kind == "free_rider" and self.active():
            return [FREE_RIDER_SCALE * v for v in value]
        if not self.lies_about_values():
            return value
        if self.attack.kind == "push":
            return self._pushed(value, norm(value))
        first = self.first.setdefault(channel, [v.detach().clone() for v in value])
        if self.attack.kind == "noisy_replay":
            if self.noisy_gradient is None or self.noisy_gradient[0] != self.round_of():
                self.noisy_gradient = (self.round_of(), self._noisy(first, norm(value)))
            return self.noisy_gradient[1]
        return tampered(self.attack.kind, value, first)

    def announced_round(self, round_: int) -> int:
        lies = self.attack.kind == "state_liar" and self.active()
        return round_ + LIAR_ROUND_LEAD if lies else round_

    def served_state(self, named: NamedTensors) -> NamedTensors:
        if self.attack.kind != "state_liar" or not self.active():
            return named
        return [(n, -5.0 * t if n.startswith("param:") else t) for n, t in named]
