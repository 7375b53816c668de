"""What a responder grants initiators it does not know: deadlines from the bytes at stake, and slots per peer."""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class ResponderLimits:
    """What a responder grants initiators: every deadline follows from the bytes at stake and these two knobs."""

    min_bytes_per_s: float = 64 * 1024  # the slowest initiator we serve (0.5 Mbit/s): slower ones are dropped
    floor_s: float = 5.0  # added to every deadline: connection set-up, scheduling and GC pauses
    per_peer: int = 2  # exchanges open at once with one peer id; a third is refused and is an offence
    total: int = 32  # exchanges open at once in all; beyond, offers are refused as "busy"

    def __post_init__(self) -> None:
        if min(self.min_bytes_per_s, self.floor_s) <= 0 or min(self.per_peer, self.total) < 1:
            raise ValueError("responder limits: min_bytes_per_s and floor_s must be > 0, per_peer and total >= 1")

    def transfer_s(self, nbytes: int) -> float:
        """The time `nbytes` may take to reach us, or to be taken from us."""
        return self.floor_s + nbytes / self.min_bytes_per_s


class Slots:
    """Inbound exchanges open at once, per remote peer id and in all, and refused streams still draining."""

    def __init__(self, limits: ResponderLimits):
        self.limits, self.held = limits, collections.Counter[str]()
        self.refused_draining = 0  # refused streams we still read (and drop) from

    def take(self, peer: str) -> str | None:
        """Hold a slot for `peer`; or the reason it gets none."""
        if self.held[peer] >= self.limits.per_peer:
            return f"more than {self.limits.per_peer} exchanges at once"
        if self.held.total() >= self.limits.total:
            return "busy"
        self.held[peer] += 1
        return None

    def give_back(self, peer: str) -> None:
        self.held[peer] -= 1
        if not self.held[peer]:
            del self.held[peer]
