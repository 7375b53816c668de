"""Starting together: peers launched at once (a testnet, an organiser's first volunteers) begin round 0 together.

Peers that start a second apart see different swarms when their first round syncs: the first to sync sees only the
records stored so far, so the members of round 0 expect different groups, average different inputs, and the swarm
spends its first rounds realigning by state downloads (even peers started within half a second form round-0 groups
of different sizes). With `run.min_peers` a fresh peer waits before its first round
until it sees that many peers of the run (itself included) that said they begin round 0, at most
`run.min_peers_wait_s`. From its first look it says it is in round 0 (its record and round-0 snapshot), so a peer
released a moment before it counts it in round 0's group and waits for it (`sync.matchmaking_s` at most); it
must then run round 0, not wait for round 1 (joining.py). A released peer waits one poll, the time the others
need to see it: gossip rounds have no gate that would hold it back for them. A swarm already past round 0 is
joined at once: the wait is for a start, not a quorum.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from p2ptrain.config import RunConfig
from p2ptrain.net.discovery import SwarmView

logger = logging.getLogger(__name__)


def wait_for_peers(swarm: Callable[[], SwarmView], run: RunConfig, stop: threading.Event, poll_s: float,
                   in_round_0: Callable[[], None]) -> int:
    """Read `swarm()` every `poll_s` until it shows `run.min_peers` − 1 other peers that said they begin round 0
    (their phase no longer 'joining'), or one of them past round 0, or `run.min_peers_wait_s` passed, or `stop` is
    set. Unless the swarm already started, `in_round_0` is called once, at the first read: it says we are in round
    0 with the others. Returns how many peers (us included) the last read showed in round 0 with us, or in all once
    the swarm started."""
    if run.min_peers <= 1:
        return 1
    deadline, said_so, waited = time.monotonic() + run.min_peers_wait_s, False, False
    while True:
        others = swarm().others
        if any(r.round > 0 for r in others):  # a swarm that started: joined as any late peer joins
            seen = 1 + len(others)
            break
        first_read = not said_so
        if first_read:
            in_round_0()
            said_so = True
        # those that said they begin round 0: one still 'joining' has not read the swarm yet, and if its first read
        # finds us past round 0 it joins as a late peer, by download (a CI run: a GASLoC peer 3 tiny rounds ahead)
        seen = 1 + sum(r.phase != "joining" for r in others)
        if seen >= run.min_peers:
            # a poll on, the others' reads have seen ours: the last to come is seen by those waiting for it, and
            # the first released by its read is seen by one whose latest read missed it (a CI run: released half a
            # second apart, the first ran 3 tiny GASLoC rounds, and the other joined it by download)
            stop.wait(poll_s)
            break
        if time.monotonic() >= deadline or stop.is_set():
            logger.warning(f"starting with {seen} of the {run.min_peers} peers run.min_peers waits for: the others "
                           f"did not show up within {run.min_peers_wait_s:g} s")
            return seen
        if not waited:
            logger.info(f"waiting for {run.min_peers} peers to start together ({seen} so far, at most "
                        f"{run.min_peers_wait_s:g} s)")
            waited = True
        stop.wait(poll_s)
    if waited:
        logger.info(f"{seen} peers are here: starting")
    return seen
