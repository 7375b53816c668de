"""Who opens a stream to whom, from the reachability in peers' records (net/routes.py): pure, no network."""

from __future__ import annotations

import itertools

import pytest
from pydantic.v1 import ValidationError

from p2ptrain.net.discovery import PeerRecord
from p2ptrain.net.routes import DIRECT, OUTBOUND, RELAYED, Presence, Route, Routes

PUBLIC_A, PUBLIC_B, NAT_C, NAT_D, OUT_E, OUT_F, LAN_G = "QmA", "QmB", "QmC", "QmD", "QmE", "QmF", "QmG"


def record(peer: str, reach: str = "", relay_via: str = "", seen_as: str = "", relay: bool = False) -> PeerRecord:
    return PeerRecord(peer_id=peer, round=0, inner_step=0, phase="inner", round_eta=0.0, reach=reach,
                      relay_via=relay_via, seen_as=seen_as, relay=relay)


SWARM = [record(PUBLIC_A, DIRECT, seen_as="1.1.1.1", relay=True), record(PUBLIC_B, DIRECT, seen_as="2.2.2.2"),
         record(NAT_C, RELAYED, PUBLIC_A, "3.3.3.3"), record(NAT_D, RELAYED, PUBLIC_A, "4.4.4.4"),
         record(OUT_E, OUTBOUND, seen_as="5.5.5.5"), record(OUT_F, OUTBOUND, seen_as="6.6.6.6"),
         record(LAN_G, OUTBOUND, seen_as="3.3.3.3")]  # behind the same NAT as C


def routes_of(me: str) -> Routes:
    routes = Routes(me, "p2ptrain.relay")
    routes.update_(SWARM)
    routes.set_own_(Presence.of(next(r for r in SWARM if r.peer_id == me)))
    return routes


def test_direct_relayed_and_outbound_peers_and_same_nat_lan_paths() -> None:
    routes = routes_of(NAT_C)
    assert routes.direct(NAT_C, PUBLIC_A) and routes.direct(OUT_E, PUBLIC_B)
    assert not routes.direct(PUBLIC_B, NAT_C) and routes.reachable(PUBLIC_B, NAT_C)  # through its relay A
    assert not routes.reachable(PUBLIC_A, OUT_E) and not routes.reachable(NAT_C, OUT_F)
    assert routes.direct(NAT_C, LAN_G) and routes.direct(LAN_G, NAT_C)  # one NAT, one LAN
    assert routes.route_to(PUBLIC_B) is None  # direct
    assert routes.route_to(NAT_D) == Route(PUBLIC_A, "p2ptrain.relay")
    assert routes.route_to(LAN_G) is None
    assert routes.direct(PUBLIC_A, NAT_C)  # its relay holds the connection it opened
    assert routes.relays() == [PUBLIC_A]


def test_peers_without_a_reachability_yet_count_as_direct() -> None:
    routes = Routes("QmX")
    routes.update_([record("QmY"), record("QmZ", OUTBOUND)])
    assert routes.direct("QmX", "QmY") and routes.opener("QmX", "QmY") == "QmX"
    assert routes.opener("QmX", "QmZ") == "QmZ"  # the outbound-only one opens (it reaches X: unknown = direct)
    assert routes.route_to("QmUnknown") is None


def test_both_ends_of_every_pair_agree_on_its_opener_and_prefer_direct_paths() -> None:
    peers = [r.peer_id for r in SWARM]
    for a, b in itertools.combinations(peers, 2):
        assert routes_of(a).opener(a, b) == routes_of(b).opener(b, a)
    routes = routes_of(PUBLIC_A)
    assert routes.opener(PUBLIC_A, PUBLIC_B) == PUBLIC_A  # both public: the lower id, as before
    assert routes.opener(PUBLIC_B, NAT_C) == NAT_C  # the NATed peer opens (directly) rather than via its relay
    assert routes.opener(OUT_E, PUBLIC_A) == OUT_E
    assert routes.opener(NAT_C, NAT_D) == NAT_C  # both behind NAT: the lower id, through the other's relay
    assert routes.opener(NAT_D, OUT_E) == OUT_E  # E reaches D through D's relay; D cannot reach E at all
    assert routes.opener(OUT_E, OUT_F) is None  # no path


def test_gossip_pools_put_direct_peers_first_and_leave_outbound_ones_out() -> None:
    routes = routes_of(PUBLIC_B)
    assert routes.pools([PUBLIC_A, NAT_C, OUT_E, NAT_D]) == [[PUBLIC_A], [NAT_C, NAT_D]]
    assert routes_of(PUBLIC_A).pools([NAT_C, OUT_E, NAT_D]) == [[NAT_C, NAT_D]]  # the relay reaches its clients
    assert routes.pools([OUT_E, OUT_F]) == []
    donors = routes.best_first([r for r in SWARM if r.peer_id != PUBLIC_B])
    assert [r.peer_id for r in donors] == [PUBLIC_A, NAT_C, NAT_D]  # direct first; outbound-only ones are no donors


@pytest.mark.parametrize("seed", [f"run/{r}" for r in range(20)])
def test_an_all_reduce_group_keeps_only_members_that_can_all_meet(seed: str) -> None:
    routes = routes_of(PUBLIC_A)
    members = [PUBLIC_A, PUBLIC_B, NAT_C, OUT_E, OUT_F]
    group = routes.connected_group(members, seed)
    assert all(routes.opener(a, b) is not None for a, b in itertools.combinations(group, 2))
    assert {PUBLIC_A, PUBLIC_B, NAT_C} <= set(group) and len({OUT_E, OUT_F} & set(group)) == 1
    assert group == routes_of(OUT_E).connected_group(members, seed)  # every member draws the same group


def test_every_outbound_only_member_gets_rounds_in_the_group() -> None:
    routes = routes_of(PUBLIC_A)
    kept = [routes.connected_group([PUBLIC_A, OUT_E, OUT_F], f"run/{r}") for r in range(40)]
    assert 10 <= sum(OUT_E in g for g in kept) <= 30 and all(len(g) == 2 for g in kept)


@pytest.mark.parametrize("fields", [{"reach": "public"}, {"relay_via": "0OIl"}, {"relay_via": "Q" * 65},
                                    {"seen_as": "1.2.3.4; rm -rf"}, {"seen_as": "1" * 46}, {"relay": "yes"}])
def test_records_refuse_malformed_reachability(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        PeerRecord.parse_obj(dict(record("QmA").dict(), **fields))


def test_a_peer_nobody_opens_to_directly_opens_twice_its_share_of_exchanges() -> None:
    """Others draw relayed peers only once every direct one is used up (`pools`), so a NATed peer answers almost
    no exchanges; it opens its own share and the one it is not drawn for (the draws of a 32-peer netns swarm)."""
    assert routes_of(PUBLIC_A).partners_to_open(1) == 1
    assert routes_of(NAT_C).partners_to_open(1) == 2
    assert routes_of(OUT_E).partners_to_open(2) == 4
    assert Routes("QmNew").partners_to_open(1) == 1  # before our self-test: taken as direct
