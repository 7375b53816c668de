"""Starting together: peers launched at once (a testnet, an organiser's first volunteers) begin round 0 together.

Peers that start a second apart see different swarms when their first round syncs: the first to sync sees only the
records stored so far, so the members of round 0 expect different groups, average different inputs, and the swarm
spends its first rounds realigning by state downloads (even peers started within half a second form round-0 groups
of different sizes). With `run.min_peers` a fresh peer waits before its first round until it sees that many peers
of the run (itself included) that said they begin round 0, at most `run.min_peers_wait_s`. From its first look it
says it is in round 0 (its record and round-0 snapshot), so a peer released a moment before it counts it in round
0's group and waits for it (`sync.matchmaking_s` at most); it must then run round 0, not wait for round 1
(joining.py).

Released by its own read, each peer would start up to a poll apart from the others, and gossip rounds have no gate
that would hold the first back: a GASLoC peer of tiny rounds ran 3 of them before the other began, which then
joined it by download, rounds skipped (CI, 3 runs). So the first to see them all names a start time
START_LEAD_POLLS polls ahead in its record (`starts_at`, DHT time); every peer starts at the earliest it reads, and
the lead gives every peer's reads time to find it: peers on one clock start together, others as far apart as their
clocks. A swarm already past round 0 is joined at once: the wait is for a start, not a quorum.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from hivemind.utils import get_dht_time

from p2ptrain.config import RunConfig
from p2ptrain.net.discovery import PeerRecord, SwarmView
from p2ptrain.timing import MAX_CLOCK_SKEW_S

logger = logging.getLogger(__name__)

START_LEAD_POLLS = 2  # one for our record to be stored, one for the others' next read to find it


def wait_for_peers(swarm: Callable[[], SwarmView], run: RunConfig, stop: threading.Event, poll_s: float,
                   in_round_0: Callable[[], None], propose: Callable[[float], None],
                   now: Callable[[], float] = get_dht_time) -> int:
    """Read `swarm()` every `poll_s` until it shows `run.min_peers` − 1 other peers that said they begin round 0
    (their phase no longer 'joining'), then wait for the start time: the earliest a peer of round 0 named, or ours,
    `propose`d then. Ends at once when a peer is past round 0, or after `run.min_peers_wait_s`, or on `stop`.
    Unless the swarm already started, `in_round_0` is called once, at the first read: it says we are in round 0
    with the others. `now`: DHT time. Returns how many peers (us included) the last read showed in round 0 with us,
    or in all once the swarm started."""
    if run.min_peers <= 1:
        return 1
    deadline, said_so, waited = time.monotonic() + run.min_peers_wait_s, False, False
    ours = math.inf  # the start time we named
    while True:
        others = swarm().others
        if any(r.round > 0 for r in others):  # a swarm that started: joined as any late peer joins
            seen = 1 + len(others)
            break
        if not said_so:
            in_round_0()
            said_so = True
        # those that said they begin round 0: one still 'joining' has not read the swarm yet, and if its first read
        # finds us past round 0 it joins as a late peer, by download
        seen = 1 + sum(r.phase != "joining" for r in others)
        at = now()
        if seen >= run.min_peers and ours == math.inf:
            ours = at + START_LEAD_POLLS * poll_s
            propose(ours)
        start = min(ours, named_start(others, at, poll_s))
        if start <= at:
            break
        if stop.is_set() or (time.monotonic() >= deadline and seen < run.min_peers):  # else: a start is named
            logger.warning(f"starting with {seen} of the {run.min_peers} peers run.min_peers waits for: the others "
                           f"did not show up within {run.min_peers_wait_s:g} s")
            return seen
        if not waited:
            logger.info(f"waiting for {run.min_peers} peers to start together ({seen} so far, at most "
                        f"{run.min_peers_wait_s:g} s)")
            waited = True
        stop.wait(min(poll_s, start - at))
    if waited:
        logger.info(f"{seen} peers are here: starting")
    return seen


def named_start(others: list[PeerRecord], at: float, poll_s: float) -> float:
    """The earliest start time a peer of round 0 named (inf if none). A claim: one further ahead than an honest
    peer names (the lead, on a clock off by up to MAX_CLOCK_SKEW_S) is no honest peer's and is left out; an earlier
    one, even in the past, only starts us as a peer without `run.min_peers` would."""
    latest = at + START_LEAD_POLLS * poll_s + MAX_CLOCK_SKEW_S
    return min((r.starts_at for r in others if r.round == 0 and 0 < r.starts_at <= latest), default=math.inf)
