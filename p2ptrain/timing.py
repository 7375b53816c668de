"""The one table of timing: a few base quantities, each with its unit and reason, and the timeouts derived from them.

Internal timeouts are not guessed one by one: each follows from what it waits for. What moves bytes gets
`SETUP_FLOOR_S` plus the bytes over a link speed (measured, or the slowest we serve); what waits on a local
process or the DHT gets `PATIENCE_S`; background chores run every `TICK_S`; a thread that cannot be woken looks
again every `POLL_S`. The user's knobs (`sync.matchmaking_s`, `network.heartbeat_s`, ...) enter as arguments.
docs/timing.md lists the knobs that remain and how the others are derived.

The package's ground floor: it imports nothing of the package but `p2ptrain.errors`, so maths/ and net/ both use it.
"""

from __future__ import annotations

# --- base quantities ---------------------------------------------------------------------------------------------
# s: what no network deadline goes below, since it does not scale with bytes: connection set-up, round trips,
# scheduling and GC pauses on a busy CPU
SETUP_FLOOR_S = 5.0
# bytes/s: the slowest link we serve (0.5 Mbit/s, below any home upload a peer can train with): a responder, a donor
# or an initiator slower than this is cut off
SLOWEST_LINK_BYTES_PER_S = 64 * 1024
# bytes/s: a home uplink (20 Mbit/s), assumed for a partner until an exchange with it is measured
PRIOR_BYTES_PER_S = 2.5e6
# s: how long a silent party is waited for before it is given up: our own daemons (p2pd, hivemind's DHT and
# averager processes) starting or answering, a DHT read or store, a relayed circuit nobody writes to
PATIENCE_S = 30.0
# s: a background chore's period (the heartbeat's default, a GC pass, a look at the parent process); a record
# published now has reached the others' next read about this much later
TICK_S = 1.0
# s: how often a wait that nothing can wake looks again (a partner not yet in our round, a relay connection)
POLL_S = 0.25
# s: one TCP dial over the internet: a round trip or two, and one lost SYN (retransmitted after 1 s); behind a NAT
# that drops unsolicited packets the dial takes all of it
DIAL_S = 3.0
# s: how far two honest machines' clocks may disagree (hivemind's DHT time is each machine's own clock)
MAX_CLOCK_SKEW_S = 30.0
# s: a local task silent this long is taken for hung: a node's worker at a step or between rounds, a measuring
# subprocess (both may legitimately take minutes: a checkpoint, a model built on a slow disk)
HUNG_AFTER_S = 600.0

# --- derived quantities ------------------------------------------------------------------------------------------
# s: what a step that normally takes well under a tick is given before it counts as late: a DHT store, a
# witness's sketch, a callback on a busy event loop, a small join, a process's exit after SIGTERM
BRIEF_S = 2 * TICK_S
# s: how long processes launched together may take to come up together (containers on busy cores, volunteers
# started by hand): a fresh peer's wait for `run.min_peers`, a testbed's wait for its bootstrap
LAUNCH_S = 4 * PATIENCE_S
# s: how long one step of a transfer may take before it is abandoned: an all-reduce, one chunk of a state download
TRANSFER_PATIENCE_S = 2 * PATIENCE_S
# s: a poll that costs a subprocess or a file read each time (`docker ps`, a child's metrics file, an owner's pid)
SLOW_POLL_S = 2 * POLL_S


def transfer_s(nbytes: float, bytes_per_s: float = SLOWEST_LINK_BYTES_PER_S, floor_s: float = SETUP_FLOOR_S) -> float:
    """How long `nbytes` may take on a link of `bytes_per_s` (the slowest we serve, by default): the set-up floor,
    then the bytes at that speed. What a responder grants an initiator, and a donor a joiner."""
    return floor_s + nbytes / bytes_per_s


def exchange_deadline_s(payload_bytes: int, throughput_bytes_per_s: float, safety_factor: float,
                        floor_s: float = SETUP_FLOOR_S) -> float:
    """Deadline for one exchange on a link of measured speed: ``max(floor_s, safety_factor × bytes / throughput)``."""
    if not throughput_bytes_per_s > 0.0:
        raise ValueError(f"throughput must be > 0 bytes/s, got {throughput_bytes_per_s}")
    if safety_factor < 1.0 or floor_s < 0.0:
        raise ValueError(f"need safety_factor >= 1 and floor_s >= 0, got {safety_factor} and {floor_s}")
    return max(floor_s, safety_factor * payload_bytes / throughput_bytes_per_s)


def matchmaking_bound_s(matchmaking_s: float) -> float:
    """How long an all-reduce's matchmaking may take: its two stages, each waiting at most `sync.matchmaking_s`,
    and a tick for a record to be published and read (also each question to hivemind's averager process)."""
    return 2 * matchmaking_s + TICK_S


def allreduce_bound_s(matchmaking_s: float, allreduce_timeout_s: float) -> float:
    """The longest an all-reduce step may take before the peer stops waiting for it: its matchmaking, the
    all-reduce itself, and the set-up floor beyond both of its own timeouts."""
    return matchmaking_bound_s(matchmaking_s) + allreduce_timeout_s + SETUP_FLOOR_S


def relay_lease_s(heartbeat_s: float) -> float:
    """How long a relay slot lasts after its last renewal: ten heartbeats (peers renew every third of it), at
    least the set-up floor."""
    return max(SETUP_FLOOR_S, 10 * heartbeat_s)


def reachability_retry_s(heartbeat_s: float) -> float:
    """How often an unanswered reachability test is asked again, and an outbound-only peer looks for a relay:
    every five heartbeats, at least the set-up floor."""
    return max(SETUP_FLOOR_S, 5 * heartbeat_s)
