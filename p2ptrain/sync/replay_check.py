"""A partner's value that repeats, bit for bit, what it sent for an earlier round: a replay.

Honest values change every round: an outer gradient is the work of that round's inner phase, and parameters move
with every outer step (and every mix). A partner whose claimed round advanced by ROUNDS_APART while the bytes of its
value did not is replaying. The red team's `replay` sends θ_0, or its first outer gradient, every round: inside the
clipping radius, it was never banned (issue 31 measured +8.8 % honest loss for GASLoC and +5.3 % for DiLoCo over 30
rounds).

Judged per partner and exchange kind (one check per `ExchangeDriver`, which leaves out the stages whose payload is a
token) on the decoded tensors' hash (`allreduce_agreement.value_hash`). Not judged: a claim of a round before the
last one seen. This catches the exact replay; a replayer that adds noise to an old value is the wider class of
values that do not move as training moves, which needs a yardstick per partner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from p2ptrain.sync.allreduce_agreement import value_hash

MAX_PARTNERS = 256  # partners remembered (identities are cheap: the one seen least recently goes first)
# a value may honestly stand for two claimed rounds in a row: a GASLoC peer answers with its new anchor from its
# round's last outer step on, and its round counter moves on before its next round's first mix changes the value
ROUNDS_APART = 2


class ReplayCheck:
    """Per partner, the last value it sent (its hash) and the round it first claimed for it."""

    def __init__(self, max_partners: int = MAX_PARTNERS):
        self.max_partners = max_partners
        self._last: OrderedDict[str, tuple[int, str]] = OrderedDict()

    def repeats(self, partner: str, claimed_round: object, value: Sequence[torch.Tensor]) -> bool:
        """Whether `value` is, bit for bit, what `partner` sent for a round ROUNDS_APART or more before the one it
        claims now; remembers it."""
        if type(claimed_round) is not int:
            return False
        digest = value_hash(value)
        previous = self._last.pop(partner, None)
        if previous is not None and (previous[1] == digest or claimed_round < previous[0]):
            self._last[partner] = previous  # the same value since that round, or a claim that goes back
            return previous[1] == digest and claimed_round >= previous[0] + ROUNDS_APART
        self._last[partner] = (claimed_round, digest)
        while len(self._last) > self.max_partners:
            self._last.popitem(last=False)
        return False
