"""What a responder grants initiators it does not know: deadlines from the bytes at stake, slots per peer, and how
often each peer may ask (exchanges it opens, sketches of our state it requests)."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable

from p2ptrain.timing import SETUP_FLOOR_S, SLOWEST_LINK_BYTES_PER_S, transfer_s


@dataclasses.dataclass(frozen=True)
class ResponderLimits:
    """What a responder grants initiators: every deadline follows from the bytes at stake (timing.transfer_s)."""

    min_bytes_per_s: float = SLOWEST_LINK_BYTES_PER_S  # the slowest initiator we serve: slower ones are dropped
    floor_s: float = SETUP_FLOOR_S  # added to every deadline (and a refusal's drain)
    per_peer: int = 2  # exchanges open at once with one peer id; a third is refused and is an offence
    # exchanges open at once with the peers of one host (net/remote_hosts.py): beyond, refused as busy, no offence
    # (the peers of one home share its address)
    per_host: int = 8
    total: int = 32  # exchanges open at once in all; beyond, offers are refused as "busy"

    def __post_init__(self) -> None:
        if min(self.min_bytes_per_s, self.floor_s) <= 0 or min(self.per_peer, self.per_host, self.total) < 1:
            raise ValueError("responder limits: min_bytes_per_s and floor_s must be > 0, per_peer, per_host and "
                             "total >= 1")

    def transfer_s(self, nbytes: int) -> float:
        """The time `nbytes` may take to reach us, or to be taken from us."""
        return transfer_s(nbytes, self.min_bytes_per_s, self.floor_s)


class Slots:
    """Inbound exchanges open at once, per remote peer id, per host and in all, and refused streams still draining.
    A refusal for capacity (in all, or the host's share) starts with "busy" and is no offence."""

    def __init__(self, limits: ResponderLimits):
        self.limits, self.held = limits, collections.Counter[str]()
        self.held_by_host = collections.Counter[str]()
        self.refused_draining = 0  # refused streams we still read (and drop) from

    def take(self, peer: str, host: str | None = None) -> str | None:
        """Hold a slot for `peer` connecting from `host` (None: no host cap); or the reason it gets none."""
        if self.held[peer] >= self.limits.per_peer:
            return f"more than {self.limits.per_peer} exchanges at once"
        if self.held.total() >= self.limits.total:
            return "busy"
        if host is not None and self.held_by_host[host] >= self.limits.per_host:
            return f"busy: {self.limits.per_host} exchanges with its host at once"
        self.held[peer] += 1
        if host is not None:
            self.held_by_host[host] += 1
        return None

    def give_back(self, peer: str, host: str | None = None) -> None:
        for counter, key in ((self.held, peer), (self.held_by_host, host)):
            if key is not None:
                counter[key] -= 1
                if not counter[key]:
                    del counter[key]


class RateLimit:
    """A token bucket per peer: requests at `rate_per_s` on average, in bursts of up to `burst`. Peers are keyed by
    what libp2p authenticated; the least recently seen are forgotten past `max_peers` (memory stays bounded)."""

    def __init__(self, rate_per_s: float, burst: float, max_peers: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        if rate_per_s <= 0 or burst < 1 or max_peers < 1:
            raise ValueError(f"need rate_per_s > 0, burst >= 1 and max_peers >= 1, got {rate_per_s}, {burst}, "
                             f"{max_peers}")
        self.rate_per_s, self.burst, self.max_peers, self.clock = rate_per_s, burst, max_peers, clock
        self._tokens: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer → (tokens, as of when)

    def take(self, peer: str) -> bool:
        """Take one token for a request from `peer`; False when it has none left (the request is to be refused)."""
        now = self.clock()
        tokens, then = self._tokens.pop(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate_per_s)
        allowed = tokens >= 1.0
        self._tokens[peer] = (tokens - allowed, now)
        while len(self._tokens) > self.max_peers:
            self.forget_(next(iter(self._tokens)))
        return allowed

    def forget_(self, peer: str) -> None:
        self._tokens.pop(peer, None)


class OfferLimit(RateLimit):
    """How often each partner may open exchanges with us: at most `per_round` accepted offers in one of our rounds,
    and offers of any outcome at `rate_per_s` on average with bursts of `burst` (the token bucket)."""

    def __init__(self, per_round: int, rate_per_s: float, burst: float, max_partners: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        if per_round < 1:
            raise ValueError(f"need per_round >= 1, got {per_round}")
        super().__init__(rate_per_s, burst, max_partners, clock)
        self.per_round = per_round
        self._accepted: dict[str, tuple[int, int]] = {}  # partner → (our round, offers accepted in it)

    def offer(self, partner: str) -> bool:
        """Take one token for an offer from `partner`; False when it has none left (the offer is to be refused)."""
        return self.take(partner)

    def forget_(self, peer: str) -> None:
        super().forget_(peer)
        self._accepted.pop(peer, None)

    def accept(self, partner: str, round_: int) -> bool:
        """Count an offer about to be accepted in our round `round_`; False when `partner` has used its share."""
        counted_round, count = self._accepted.get(partner, (round_, 0))
        count = count if counted_round == round_ else 0
        if count >= self.per_round:
            return False
        self._accepted[partner] = (round_, count + 1)
        return True
