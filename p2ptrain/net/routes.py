"""Who can open a stream to whom, from the reachability peers announce in their records (net/reachability.py).

A peer is reachable *directly* (its record says `direct`, or says nothing yet: peers from before the self-test, or
that have not finished it), *through a relay* (`relay`, with the relay's peer id: streams to it go through that
relay, net/relay.py), or *outbound only* (`outbound`: nobody can open a stream to it; it opens every one itself).
Two peers behind the same NAT (the same public address) reach each other directly on their LAN.

Every peer computes these answers from the same records, so both ends of a pair agree on which of them opens the
pair's stream (`opener`): the one that can reach the other directly, else the one that can reach it through a
relay; a direct path is preferred to a relayed one. Records are untrusted: a record that claims a relay it does not
hold only makes streams to its own peer fail.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Iterable, Sequence

from p2ptrain.net.discovery import PeerRecord

DIRECT, RELAYED, OUTBOUND, UNKNOWN = "direct", "relay", "outbound", ""


@dataclasses.dataclass(frozen=True)
class Presence:
    """How one peer can be reached, as its record (or, for ourselves, our own self-test) says."""

    reach: str = UNKNOWN  # direct | relay | outbound | "" (not known: taken as direct)
    relay_via: str = ""  # reach "relay": the relay's peer id
    seen_as: str = ""  # the public address its connections come from ("" unknown)
    serves: bool = False  # it serves as a relay

    @classmethod
    def of(cls, record: PeerRecord) -> Presence:
        return cls(record.reach, record.relay_via if record.reach == RELAYED else "", record.seen_as, record.relay)

    @property
    def dialable(self) -> bool:
        return self.reach in (DIRECT, UNKNOWN)


@dataclasses.dataclass(frozen=True)
class Route:
    """A stream to a peer that goes through a relay: the relay's peer id and the namespace it serves under."""

    relay: str
    namespace: str
    ticket: str = ""  # ours, in a signed run: a relay passes streams only from peers the run admits


class Routes:
    """The presence of every known peer (ours included) and what follows for opening streams. `update_` takes the
    swarm's records each round; `set_own_` our self-test's result. Without either, every peer counts as direct."""

    def __init__(self, own_id: str, relay_namespace: str = "", ticket: str = ""):
        self.own_id, self.relay_namespace, self.ticket = own_id, relay_namespace, ticket
        self.own = Presence()
        self.known: dict[str, Presence] = {}

    def update_(self, records: Iterable[PeerRecord]) -> None:
        self.known = {r.peer_id: Presence.of(r) for r in records if r.peer_id != self.own_id}

    def set_own_(self, presence: Presence) -> None:
        self.own = presence

    def relays(self) -> list[str]:
        """Peers that announce a relay and that anyone can reach directly (a relay must be public)."""
        return sorted(p for p, presence in self.known.items() if presence.serves and presence.reach == DIRECT)

    def presence(self, peer: str) -> Presence:
        return self.own if peer == self.own_id else self.known.get(peer, Presence())

    def direct(self, a: str, b: str) -> bool:
        """Whether `a` can open a stream to `b` without a relay: `b` is dialable, behind the same NAT as `a`, or `a`
        is `b`'s relay (it holds the connection `b` opened)."""
        pa, pb = self.presence(a), self.presence(b)
        same_nat = bool(pa.seen_as and pa.seen_as == pb.seen_as)
        return pb.dialable or same_nat or (pb.reach == RELAYED and pb.relay_via == a)

    def reachable(self, a: str, b: str) -> bool:
        """Whether `a` can open a stream to `b` at all (directly, or through `b`'s relay)."""
        pb = self.presence(b)
        return self.direct(a, b) or (pb.reach == RELAYED and bool(pb.relay_via))

    def route_to(self, peer: str) -> Route | None:
        """How we open a stream to `peer`: None for directly (also when we cannot: the attempt then fails)."""
        presence = self.presence(peer)
        if self.direct(self.own_id, peer) or presence.reach != RELAYED or not presence.relay_via:
            return None
        return Route(presence.relay_via, self.relay_namespace, self.ticket)

    def pools(self, peers: Sequence[str]) -> list[list[str]]:
        """`peers` we can open streams to, best first: those we reach directly, then those behind relays (gossip
        draws from the second only when the first is used up). Outbound-only peers are in neither: they start
        their exchanges with us."""
        direct = [p for p in peers if self.direct(self.own_id, p)]
        relayed = [p for p in peers if p not in direct and self.reachable(self.own_id, p)]
        return [pool for pool in (direct, relayed) if pool]

    def partners_to_open(self, share: int) -> int:
        """How many gossip partners we open exchanges with in a round where each peer's share is `share`: twice it
        when nobody can open a stream to us directly. Others draw such a peer only once every peer they reach
        directly is used up (`pools`), so it would answer almost no exchanges, and mix about half as often as a
        public peer (a 32-peer netns swarm: 2.1 values a round, its own included, against 3.2); opening its own
        share and the one it is not drawn for, it mixes as often, with no stream through a relay."""
        return share if self.own.dialable else 2 * share

    def best_first(self, records: Sequence[PeerRecord]) -> list[PeerRecord]:
        """The `records` of peers we can open streams to, in their order, those we reach directly first (donors and
        witnesses of a state: a relay passes them only when nobody else can serve)."""
        return sorted([r for r in records if self.reachable(self.own_id, r.peer_id)],
                      key=lambda r: not self.direct(self.own_id, r.peer_id))

    def opener(self, a: str, b: str) -> str | None:
        """Which of `a` and `b` opens their pair's stream (both ends compute the same), or None if neither can:
        a direct path first (the lower peer id when both have one), then a relayed one."""
        low, high = sorted((a, b))
        for can in (self.direct, self.reachable):
            if can(low, high):
                return low
            if can(high, low):
                return high
        return None

    def connected_group(self, members: Sequence[str], seed: str) -> list[str]:
        """The largest set of `members`, found greedily in an order drawn from `seed`, in which every pair has a
        path (`opener`): an all-reduce group whose members all reduce the same inputs. Members left out (two
        outbound-only peers without a relay cannot meet) average alone that round; the seed (run and round)
        changes who each round."""
        order = sorted(set(members))
        random.Random(hashlib.sha256(seed.encode()).digest()).shuffle(order)
        kept: list[str] = []
        for member in order:
            if all(self.opener(member, other) is not None for other in kept):
                kept.append(member)
        return sorted(kept)
