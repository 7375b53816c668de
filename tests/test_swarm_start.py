"""Peers launched together begin round 0 together (swarm_start.py): a fresh peer waits for `run.min_peers`, at most
`run.min_peers_wait_s`, and never for a swarm that already started."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from p2ptrain.config import RunConfig
from p2ptrain.net.discovery import PeerRecord, SwarmView
from p2ptrain.swarm_start import wait_for_peers


def record(peer: str, round_: int = 0, phase: str = "joining") -> PeerRecord:
    return PeerRecord(peer_id=peer, round=round_, inner_step=0, phase=phase, round_eta=0.0)


class Arrivals:
    """A swarm read in which one more peer has arrived at each read, up to `total` others."""

    def __init__(self, total: int, round_: int = 0):
        self.total, self.round, self.reads, self.waited_at = total, round_, 0, -1

    def __call__(self) -> SwarmView:
        self.reads += 1
        # each arrived peer has read the swarm and said it begins round 0 (its phase no longer 'joining')
        return SwarmView("me", [record(f"p{i}", self.round, "inner") for i in range(min(self.reads - 1, self.total))])

    def on_wait(self) -> None:
        self.waited_at = self.reads


def wait(swarm: Arrivals, min_peers: int, wait_s: float = 30.0, stop: threading.Event | None = None) -> int:
    return wait_for_peers(swarm, RunConfig(min_peers=min_peers, min_peers_wait_s=wait_s), stop or threading.Event(),
                          poll_s=0.01, in_round_0=swarm.on_wait)


def test_a_fresh_peer_waits_until_it_sees_min_peers_and_says_it_is_in_round_0_while_it_waits(
        caplog: pytest.LogCaptureFixture) -> None:
    swarm = Arrivals(total=4)
    with caplog.at_level(logging.INFO, logger="p2ptrain.swarm_start"):
        assert wait(swarm, min_peers=5) == 5
    assert swarm.reads == 5 and swarm.waited_at == 1  # in round 0 from the first read on, said once
    assert "waiting for 5 peers to start together (1 so far" in caplog.text and "5 peers are here" in caplog.text


def test_no_wait_without_min_peers_nor_for_a_swarm_that_already_started() -> None:
    alone = Arrivals(total=0)
    assert wait(alone, min_peers=1) == 1 and alone.reads == 0  # the default reads nothing
    started = Arrivals(total=1, round_=3)  # a peer past round 0: join it now, however few are here
    started.reads = 1  # seen at the first read: we join as any late peer does, never saying we are in round 0
    assert wait(started, min_peers=8) == 2 and started.waited_at == -1 and started.reads == 2
    last_to_arrive = Arrivals(total=4)
    last_to_arrive.reads = 4  # its first read shows the 4 others: it starts at once, in round 0 with them
    assert wait(last_to_arrive, min_peers=5) == 5 and last_to_arrive.waited_at == 5


def test_the_wait_ends_after_min_peers_wait_s_or_on_stop_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    few = Arrivals(total=1)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="p2ptrain.swarm_start"):
        assert wait(few, min_peers=5, wait_s=0.2) == 2
    assert 0.2 <= time.monotonic() - started < 5
    assert "starting with 2 of the 5 peers run.min_peers waits for" in caplog.text
    stop = threading.Event()
    stop.set()
    assert wait(Arrivals(total=1), min_peers=5, stop=stop) <= 2  # Ctrl-C while waiting: no wait_s to sit out


class RecordedStop(threading.Event):
    """A stop event that records each wait on it and returns at once."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return self.is_set()


def test_a_released_peer_gives_the_others_one_poll_to_see_it_before_it_starts() -> None:
    """The others see its record at their next read: released at once, a GASLoC peer ran 4 rounds before they began
    their first (test_gasloc_overlap.py's swarm, 2 of 3 runs)."""
    last_to_arrive, stop = Arrivals(total=4), RecordedStop()
    last_to_arrive.reads = 4  # its first read shows the 4 others
    assert wait(last_to_arrive, min_peers=5, stop=stop) == 5 and stop.waits == [0.01]
    # released by its fifth read, a poll on: the last one's read may have missed it (CI: released half a second
    # apart, the first ran 3 tiny GASLoC rounds before the other began)
    first, stop = Arrivals(total=4), RecordedStop()
    assert wait(first, min_peers=5, stop=stop) == 5 and stop.waits == [0.01] * 5


def test_a_peer_that_has_not_said_it_begins_round_0_is_waited_for() -> None:
    """Its record is there, but its first read of the swarm is not done: released without it, we ran 3 tiny GASLoC
    rounds before that read, which then found a swarm past round 0 and joined it by download, rounds skipped (CI)."""
    reads = []

    def swarm() -> SwarmView:
        reads.append(len(reads) + 1)
        return SwarmView("me", [record("slow-reader", 0, "joining" if len(reads) < 3 else "inner")])

    said = []
    assert wait_for_peers(swarm, RunConfig(min_peers=2, min_peers_wait_s=30.0), threading.Event(), poll_s=0.01,
                          in_round_0=lambda: said.append(len(reads))) == 2
    assert len(reads) == 3 and said == [1]  # released by the read that shows it said so
