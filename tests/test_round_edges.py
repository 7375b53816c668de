"""What a peer does at a round's edges: when it reads the swarm from the DHT, and when it waits for a store."""

from __future__ import annotations

import time
import types

import pytest

from p2ptrain.peer import TrainingPeer


def _peer(overlap: str, read_ago_s: float | None, needs_current_swarm: bool = True) -> types.SimpleNamespace:
    network = types.SimpleNamespace(heartbeat_s=0.5)
    peer = types.SimpleNamespace(config=types.SimpleNamespace(sync=types.SimpleNamespace(overlap=overlap),
                                                              network=network),
                                 sync=types.SimpleNamespace(needs_current_swarm=needs_current_swarm),
                                 reads=0, stored=[], waited=[])
    peer._sync_view = (-float("inf"), None) if read_ago_s is None else (time.monotonic() - read_ago_s, "view at sync")

    def swarm() -> str:
        peer.reads += 1
        return "view read now"

    peer.swarm = swarm
    peer.announcer = types.SimpleNamespace(update=lambda publish, **fields: peer.stored.append((publish, fields)),
                                           publish=lambda timeout_s: peer.waited.append(timeout_s))
    return peer


@pytest.mark.parametrize(("overlap", "read_ago_s", "reused"), [
    ("delayed", 0.1, True),  # the overlapped sync returned at once: the records read for it are still the swarm's
    ("delayed", 2.0, False),  # older than a heartbeat: read again
    ("delayed", None, False),  # the first round: nothing read yet
    ("none", 0.1, False),  # a blocking all-reduce: the view it read is a whole exchange old
])
def test_a_round_starts_from_the_sync_view_only_when_overlapped_and_fresh(overlap: str, read_ago_s: float | None,
                                                                        reused: bool) -> None:
    peer = _peer(overlap, read_ago_s)
    view = TrainingPeer._round_start_view(peer)  # type: ignore[arg-type]
    assert (view, peer.reads) == (("view at sync", 0) if reused else ("view read now", 1))


def test_an_all_reduce_peer_waits_for_its_store_unless_told_not_to() -> None:
    peer = _peer("delayed", None)
    TrainingPeer.announce(peer, round=3, phase="inner")  # type: ignore[arg-type]
    TrainingPeer.announce(peer, wait=False, phase="sync")  # type: ignore[arg-type]
    # the round's start: stored now and waited for; "sync": stored in the background (publish=True), no wait
    assert peer.stored == [(False, {"round": 3, "phase": "inner"}), (True, {"phase": "sync"})]
    assert peer.waited == [pytest.approx(1.0)]


def test_a_gossip_peer_never_waits_for_a_store() -> None:
    peer = _peer("none", None, needs_current_swarm=False)
    TrainingPeer.announce(peer, round=3, phase="inner")  # type: ignore[arg-type]
    assert peer.stored == [(True, {"round": 3, "phase": "inner"})] and peer.waited == []
