"""A partner's value that repeats, bit for bit, what it sent for an earlier round: a replay.

Honest values change every round: an outer gradient is the work of that round's inner phase, and parameters move
with every outer step (and every mix). A partner whose claimed round advanced while the bytes of its value did not is
replaying. The red team's `replay` sends θ_0, or its first outer gradient, every round: inside the clipping radius,
it was never banned (issue 31 measured +8.8 % honest loss for GASLoC and +5.3 % for DiLoCo over 30 rounds).

Judged per partner and exchange kind (one check per `ExchangeDriver`, which leaves out the stages whose payload is a
token) on the decoded tensors' hash (`allreduce_agreement.value_hash`). Not judged: a claim of a round not after the
last one seen (a responder answers several offers in one round with one value). This catches the exact replay; a
replayer that adds noise to an old value is the wider class of values that do not move as training moves, which
needs a yardstick per partner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from p2ptrain.sync.allreduce_agreement import value_hash

MAX_PARTNERS = 256  # partners remembered (identities are cheap: the one seen least recently goes first)


class ReplayCheck:
    """Per partner, the round it last claimed and the hash of the value it sent for it."""

    def __init__(self, max_partners: int = MAX_PARTNERS):
        self.max_partners = max_partners
        self._last: OrderedDict[str, tuple[int, str]] = OrderedDict()

    def repeats(self, partner: str, claimed_round: object, value: Sequence[torch.Tensor]) -> bool:
        """Whether `value` is, bit for bit, what `partner` sent for an earlier round it claimed; remembers it."""
        if type(claimed_round) is not int:
            return False
        digest = value_hash(value)
        previous = self._last.pop(partner, None)
        if previous is not None and claimed_round <= previous[0]:  # its round again, or an earlier one: no verdict
            self._last[partner] = previous
            return False
        self._last[partner] = (claimed_round, digest)
        while len(self._last) > self.max_partners:
            self._last.popitem(last=False)
        return previous is not None and previous[1] == digest
