"""Peers launched together begin round 0 together (swarm_start.py): a fresh peer waits for `run.min_peers`, at most
`run.min_peers_wait_s`, and never for a swarm that already started."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from p2ptrain.config import RunConfig
from p2ptrain.net.discovery import PeerRecord, SwarmView
from p2ptrain.swarm_start import START_LEAD_POLLS, wait_for_peers
from p2ptrain.timing import MAX_CLOCK_SKEW_S


def record(peer: str, round_: int = 0, phase: str = "joining", starts_at: float = 0.0) -> PeerRecord:
    return PeerRecord(peer_id=peer, round=round_, inner_step=0, phase=phase, round_eta=0.0, starts_at=starts_at)


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


POLL_S = 0.25


class Clock(threading.Event):
    """A stop event whose waits return at once and move a DHT clock on by their timeout (never set unless told)."""

    def __init__(self, now: float = 1000.0) -> None:
        super().__init__()
        self.now = now

    def wait(self, timeout: float | None = None) -> bool:
        self.now += timeout or 0.0
        return self.is_set()

    def dht_time(self) -> float:
        return self.now


def wait(swarm: Callable[[], SwarmView], min_peers: int, wait_s: float = 30.0, clock: Clock | None = None,
         proposed: list[float] | None = None, stop: threading.Event | None = None) -> int:
    """wait_for_peers on `clock` (or, with `stop`, on the real clock, polling every 0.01 s)."""
    clock = clock or Clock()
    on_wait = swarm.on_wait if isinstance(swarm, Arrivals) else (lambda: None)
    return wait_for_peers(swarm, RunConfig(min_peers=min_peers, min_peers_wait_s=wait_s), stop or clock,
                          poll_s=0.01 if stop else POLL_S, in_round_0=on_wait,
                          propose=(proposed if proposed is not None else []).append,
                          now=time.time if stop else clock.dht_time)


def test_a_fresh_peer_waits_until_it_sees_min_peers_and_says_it_is_in_round_0_while_it_waits(
        caplog: pytest.LogCaptureFixture) -> None:
    swarm, clock, proposed = Arrivals(total=4), Clock(), []
    with caplog.at_level(logging.INFO, logger="p2ptrain.swarm_start"):
        assert wait(swarm, min_peers=5, clock=clock, proposed=proposed) == 5
    assert swarm.waited_at == 1  # in round 0 from the first read on, said once
    # the fifth read shows them all: it names a start two polls on, and starts then
    assert proposed == [1000.0 + 4 * POLL_S + START_LEAD_POLLS * POLL_S] and clock.now == proposed[0]
    assert swarm.reads == 5 + START_LEAD_POLLS
    assert "waiting for 5 peers to start together (1 so far" in caplog.text and "5 peers are here" in caplog.text


def test_no_wait_without_min_peers_nor_for_a_swarm_that_already_started() -> None:
    alone = Arrivals(total=0)
    assert wait(alone, min_peers=1) == 1 and alone.reads == 0  # the default reads nothing
    started = Arrivals(total=1, round_=3)  # a peer past round 0: join it now, however few are here
    started.reads = 1  # seen at the first read: we join as any late peer does, never saying we are in round 0
    assert wait(started, min_peers=8) == 2 and started.waited_at == -1 and started.reads == 2
    last_to_arrive, clock = Arrivals(total=4), Clock()
    last_to_arrive.reads = 4  # its first read shows the 4 others: in round 0 with them, it names a start
    assert wait(last_to_arrive, min_peers=5, clock=clock) == 5 and last_to_arrive.waited_at == 5
    assert clock.now == 1000.0 + START_LEAD_POLLS * POLL_S


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


def test_every_peer_starts_at_the_earliest_start_a_peer_of_round_0_named() -> None:
    """Released by its own read, each peer started up to a poll after another: a GASLoC peer of tiny rounds ran 3
    before the other began, which then joined it by download, rounds skipped (CI, 3 runs). A named start time is
    one moment for all."""
    clock, proposed = Clock(), []
    other = record("first", 0, "inner", starts_at=1000.0 + POLL_S)  # it saw us a poll ago
    assert wait(lambda: SwarmView("me", [other]), min_peers=2, clock=clock, proposed=proposed) == 2
    assert proposed == [1000.0 + START_LEAD_POLLS * POLL_S] and clock.now == 1000.0 + POLL_S  # theirs, not ours
    # one named before we see min_peers is the start of peers that saw us all: we start with them
    clock, proposed = Clock(), []
    assert wait(lambda: SwarmView("me", [record("first", 0, "inner", starts_at=1000.0 + POLL_S)]), min_peers=5,
                clock=clock, proposed=proposed) == 2
    assert proposed == [] and clock.now == 1000.0 + POLL_S


def test_a_named_start_is_a_claim_bounded_ahead_and_one_in_the_past_starts_us_at_once() -> None:
    far = 1000.0 + START_LEAD_POLLS * POLL_S + MAX_CLOCK_SKEW_S + 1  # further ahead than an honest peer names
    clock = Clock()
    assert wait(lambda: SwarmView("me", [record("liar", 0, "inner", starts_at=far)]), min_peers=2, clock=clock) == 2
    assert clock.now == 1000.0 + START_LEAD_POLLS * POLL_S  # our own start: the claim held nobody back
    clock = Clock()
    assert wait(lambda: SwarmView("me", [record("liar", 0, "inner", starts_at=far)]), min_peers=3, wait_s=0.0,
                clock=clock) == 2  # not seen min_peers: the wait ends as it would without the claim
    clock = Clock()  # peers of round 0 that started already: as a late peer joins
    assert wait(lambda: SwarmView("me", [record("early", 0, "inner", starts_at=990.0)]), min_peers=5,
                clock=clock) == 2 and clock.now == 1000.0




def test_a_peer_that_has_not_said_it_begins_round_0_is_waited_for() -> None:
    """Its record is there, but its first read of the swarm is not done: released without it, we ran 3 tiny GASLoC
    rounds before that read, which then found a swarm past round 0 and joined it by download, rounds skipped (CI)."""
    reads, said, proposed, clock = [], [], [], Clock()

    def swarm() -> SwarmView:
        reads.append(len(reads) + 1)
        return SwarmView("me", [record("slow-reader", 0, "joining" if len(reads) < 3 else "inner")])

    assert wait_for_peers(swarm, RunConfig(min_peers=2, min_peers_wait_s=30.0), clock, poll_s=POLL_S,
                          in_round_0=lambda: said.append(len(reads)), propose=proposed.append,
                          now=clock.dht_time) == 2
    assert said == [1] and proposed == [1000.0 + 2 * POLL_S + START_LEAD_POLLS * POLL_S]  # named by the third read
