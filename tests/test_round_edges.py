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
    ("none", 0.1, True),  # a blocking all-reduce that took less than a heartbeat
    ("none", 2.0, False),  # one that took longer: the view it read is a whole exchange old
])
def test_a_round_starts_from_the_sync_view_only_when_fresh(overlap: str, read_ago_s: float | None,
                                                           reused: bool) -> None:
    peer = _peer(overlap, read_ago_s)
    view = TrainingPeer._round_start_view(peer)  # type: ignore[arg-type]
    assert (view, peer.reads) == (("view at sync", 0) if reused else ("view read now", 1))


def test_an_all_reduce_peer_waits_for_its_store_only_when_told_to() -> None:
    peer = _peer("delayed", None)
    TrainingPeer.announce(peer, wait=True, phase="joining")  # type: ignore[arg-type]
    TrainingPeer.announce(peer, phase="sync")  # type: ignore[arg-type]
    # a joiner's phase: stored now and waited for; "sync": stored in the background (publish=True), no wait
    assert peer.stored == [(False, {"phase": "joining"}), (True, {"phase": "sync"})]
    assert peer.waited == [pytest.approx(1.0)]


def test_an_all_reduce_peer_publishes_its_round_edges_in_the_background() -> None:
    """The round's start and its sync are stored at once without a wait: an all-reduce expects the peers of its
    round and those a round behind, so a record a moment late is still counted (8 loopback DiLoCo peers waited
    0.14-0.20 s for each of the two stores a round)."""
    peer = _peer("none", None)
    peer.conduct = types.SimpleNamespace(announced_round=lambda round_: round_, served_state=lambda tensors: tensors)
    peer.state = types.SimpleNamespace(round=4, named_tensors=lambda: [])
    peer.config.run = types.SimpleNamespace(run_id="run")
    peer.fingerprint, peer.step_time_s = "f", float("nan")
    peer._inner_steps = lambda: 5
    peer.announce = lambda **fields: TrainingPeer.announce(peer, **fields)  # type: ignore[arg-type]
    TrainingPeer._publish_round_start(peer)  # type: ignore[arg-type]
    assert peer.stored == [(True, {"round": 4, "inner_step": 0, "phase": "inner", "round_eta": 0.0})]
    assert peer.waited == []


def test_a_gossip_peer_never_waits_for_a_store() -> None:
    peer = _peer("none", None, needs_current_swarm=False)
    TrainingPeer.announce(peer, round=3, phase="inner")  # type: ignore[arg-type]
    assert peer.stored == [(True, {"round": 3, "phase": "inner"})] and peer.waited == []
