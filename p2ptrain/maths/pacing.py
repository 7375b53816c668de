"""Heterogeneous links and compute: measured link throughput, inner steps per round, each link's exchange deadline.

Deadlines follow from the payload size and the measured link speed (timing.exchange_deadline_s):
a slow peer takes fewer inner steps so its round (compute + its own transfers) ends with the others'.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from p2ptrain.timing import PRIOR_BYTES_PER_S, exchange_deadline_s

# Compute pacing (`inner_steps_for_pace`): a peer cuts its steps only when its steps take more than this × the
# swarm's median (equal peers sharing 2 cores measured 1.2-1.3 × it now and then, and flipped between 15 and 20 of
# 20 steps at a slack of 1.2) ...
PACE_SLACK = 1.5
# ... and gives up at most this fraction of them: identities that claim fast steps cost an honest peer at most half
PACE_MAX_CUT = 0.5
PACE_MIN_PEERS = 3  # others' step times needed before the swarm's pace is taken as known
OWN_LINK_MIN_PARTNERS = 2  # own link speed: trust measurements once they span this many partners
# exchanges we opened that timed out with this many different partners in a row, none completed between: the end
# those links share, ours, is taken for the slow one (`LinkSpeeds.timed_out_`)
OWN_LINK_TIMEOUT_PARTNERS = 2


class ThroughputEMA:
    """Exponential moving average of one link's throughput in bytes/s, starting from a prior.

    ``smoothing`` is the weight of each new measurement (1.0: keep only the latest). Measurements are averaged
    as transfer *times per byte* so that one fast sample cannot hide a slow link. The prior is only a guess: the
    first completed exchange replaces it (blended into a 20 Mbit/s prior, a 1 Mbit/s link would take several
    exchanges to show, and a paced peer would keep most of its inner steps meanwhile).
    """

    def __init__(self, prior_bytes_per_s: float, smoothing: float = 0.3) -> None:
        if not prior_bytes_per_s > 0.0 or not math.isfinite(prior_bytes_per_s):
            raise ValueError(f"prior throughput must be a positive number of bytes/s, got {prior_bytes_per_s}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self._seconds_per_byte = 1.0 / prior_bytes_per_s
        self.num_measurements = 0
        self.num_completed = 0  # measurements of completed exchanges (the others are timeouts' bounds)

    @property
    def bytes_per_s(self) -> float:
        return 1.0 / self._seconds_per_byte

    def update_(self, payload_bytes: int, elapsed_s: float) -> None:
        """Record an exchange that moved ``payload_bytes`` in ``elapsed_s`` seconds (ignored if either is <= 0)."""
        if payload_bytes <= 0 or not elapsed_s > 0.0 or not math.isfinite(elapsed_s):
            return
        sample = elapsed_s / payload_bytes
        weight = self.smoothing if self.num_completed else 1.0
        self._seconds_per_byte += weight * (sample - self._seconds_per_byte)
        self.num_measurements += 1
        self.num_completed += 1

    def update_timeout_(self, payload_bytes: int, deadline_s: float) -> None:
        """Record an exchange that missed its deadline: the link was at most ``payload_bytes / deadline_s`` fast."""
        if payload_bytes <= 0 or not deadline_s > 0.0:
            return
        self._seconds_per_byte = max(self._seconds_per_byte, deadline_s / payload_bytes)
        self.num_measurements += 1


class LinkSpeeds:
    """The one table of this peer's measured links: a ThroughputEMA per partner (the prior until measured).

    Every exchange a peer starts (parameter gossip and gradient gossip alike) reads its deadline from here and
    records what it measured here, so what one protocol learns about a link serves the other.
    """

    def __init__(self, prior_bytes_per_s: float = PRIOR_BYTES_PER_S) -> None:
        self.prior_bytes_per_s = prior_bytes_per_s
        self.by_partner: dict[str, ThroughputEMA] = {}
        # what a link no exchange has completed on is taken to carry: the prior, or less once time-outs with
        # several partners bounded our own link (`timed_out_`); raised again by what completed exchanges measure
        self.unmeasured_bytes_per_s = prior_bytes_per_s
        # partners (or their hosts, when known) of the time-outs in a row since our last completed exchange
        self.timed_out_with: set[str] = set()

    def to(self, partner: str) -> ThroughputEMA:
        """The link to `partner`, created at the prior if it was never used."""
        return self.by_partner.setdefault(partner, ThroughputEMA(self.prior_bytes_per_s))

    def estimate_bytes_per_s(self, partner: str) -> float:
        link = self.by_partner.get(partner)
        if link is not None and link.num_completed:
            return link.bytes_per_s
        return min(link.bytes_per_s if link is not None else self.prior_bytes_per_s, self.unmeasured_bytes_per_s)

    def completed_(self, partner: str, exchange_bytes: int, elapsed_s: float) -> None:
        """An exchange with `partner` moved `exchange_bytes` (both directions) in `elapsed_s`: that link's speed,
        and a floor under ours (an exchange runs at its slower end's speed) for links not measured yet."""
        link = self.to(partner)
        link.update_(exchange_bytes, elapsed_s)
        if link.num_completed:
            self._own_link_at_least_(link.bytes_per_s)

    def answered_(self, exchange_bytes: int, elapsed_s: float) -> None:
        """An exchange a partner opened with us completed, moving `exchange_bytes` (both directions, ours included:
        the partner committed once it had our payload) within `elapsed_s`: a floor under our own link, as an exchange
        we opened gives one (`completed_`). Three silent identities' time-outs, two in a row with different ones,
        bounded our own link and grew every unmeasured deadline to 10-30 s, while honest partners' exchanges with us
        completed in a tenth of a second."""
        if exchange_bytes > 0 and elapsed_s > 0.0 and math.isfinite(elapsed_s):
            self._own_link_at_least_(exchange_bytes / elapsed_s)

    def _own_link_at_least_(self, bytes_per_s: float) -> None:
        """An exchange completed at `bytes_per_s`: the time-outs before it no longer say our link is slow, and links
        not measured yet are taken to carry that much at least (the prior at most)."""
        self.timed_out_with.clear()
        self.unmeasured_bytes_per_s = min(self.prior_bytes_per_s, max(self.unmeasured_bytes_per_s, bytes_per_s))

    def timed_out_(self, partner: str, exchange_bytes: int, deadline_s: float, bounds_link: bool,
                   claimed_bytes_per_s: float | None = None, host: str | None = None) -> None:
        """An exchange with `partner` moving `exchange_bytes` missed its `deadline_s`. `bounds_link`: the link
        to it is taken to be at most that fast (a caller may not take one time-out for that: the partner may be
        gone), but no slower than `claimed_bytes_per_s` (the speed it announced) while no exchange on it has
        completed: a partner's own time-outs then grow its deadline to what its claim needs and no further (an
        identity announcing 1 Gbit/s that took each offer and never answered grew it 5 s, 20 s, then to the cap).
        Time-outs with OWN_LINK_TIMEOUT_PARTNERS different partners in a row bound our own link: it is what they
        share, and a slow uplink whose every exchange with a partner never measured got the prior's deadline (the
        set-up floor) would otherwise time out forever (a 1.7 Mbit/s peer of a 32-peer swarm: all 25 of its
        exchanges, each with a partner it had not tried). Partners of one `host` (the address it connects from,
        when known) count as one: identities are free, and many of one machine that never answer would otherwise
        take our own link for slow, and grow every unmeasured deadline."""
        if bounds_link:
            link, bound_s = self.to(partner), deadline_s
            if claimed_bytes_per_s and claimed_bytes_per_s > 0 and not link.num_completed and exchange_bytes > 0:
                bound_s = min(deadline_s, exchange_bytes / claimed_bytes_per_s)
            link.update_timeout_(exchange_bytes, bound_s)
        self.timed_out_with.add(host or partner)
        if len(self.timed_out_with) >= OWN_LINK_TIMEOUT_PARTNERS and exchange_bytes > 0 and deadline_s > 0:
            self.unmeasured_bytes_per_s = min(self.unmeasured_bytes_per_s, exchange_bytes / deadline_s)

    def deadline_s(self, partner: str, exchange_bytes: int, safety_factor: float) -> float:
        """How long an exchange moving `exchange_bytes` (both directions) with `partner` may take."""
        return exchange_deadline_s(exchange_bytes, self.estimate_bytes_per_s(partner), safety_factor)

    def measured(self) -> dict[str, float]:
        """Partner → bytes/s for the links measured at least once."""
        return {peer: link.bytes_per_s for peer, link in self.by_partner.items() if link.num_measurements}

    def own_bytes_per_s(self, announced: Mapping[str, float]) -> float:
        """Our link's speed: the fastest exchange throughput measured (an exchange runs at the slower end's
        speed, so the fastest partner bounds ours from below), and at least the prior until links to
        OWN_LINK_MIN_PARTNERS partners are measured: a fast peer whose first partner was slow would otherwise
        take itself for slow, keep choosing slow partners and never learn otherwise.
        `announced` holds partners' own announced speeds."""
        measured = self.measured()
        # a partner that announced a much faster link than we got with it shows that we were the bottleneck
        we_are_the_bottleneck = any(announced.get(peer, 0.0) > 1.5 * speed for peer, speed in measured.items())
        # a time-out only bounds a link from above, so it speaks for our link only while nothing completed
        fastest = self.fastest_measured_bytes_per_s() or max(measured.values(), default=self.prior_bytes_per_s)
        if len(measured) < OWN_LINK_MIN_PARTNERS and not we_are_the_bottleneck:
            return max(fastest, self.prior_bytes_per_s)
        return fastest

    def fastest_measured_bytes_per_s(self) -> float:
        """What we announce: the fastest completed exchange's throughput, 0 before any (never the prior: a slow peer
        announcing the prior would look fast to everyone). A time-out's bound is no measure: one held at a fast
        partner's claim (`timed_out_`) stays at the prior, and a 1 Mbit/s peer took itself for a 20 Mbit/s one."""
        return max((link.bytes_per_s for link in self.by_partner.values() if link.num_completed), default=0.0)


def inner_steps_for_link(round_time_s: float, step_time_s: float, comm_time_s: float, h_min: int, h_max: int) -> int:
    """GASLoC pacing: ``H = clamp(ceil(T_round / t_step) − ceil(T_comm / t_step), h_min, h_max)``.

    ``round_time_s`` is the target round length, ``step_time_s`` this peer's time per inner step and
    ``comm_time_s`` its expected transfer time per round (from :class:`ThroughputEMA`).
    """
    if not 1 <= h_min <= h_max:
        raise ValueError(f"need 1 <= h_min <= h_max, got h_min={h_min}, h_max={h_max}")
    if not step_time_s > 0.0 or not math.isfinite(step_time_s):
        raise ValueError(f"step time must be a positive number of seconds, got {step_time_s}")
    if round_time_s < 0.0 or comm_time_s < 0.0 or math.isnan(round_time_s) or math.isnan(comm_time_s):
        raise ValueError(f"round and comm times must be >= 0, got {round_time_s} and {comm_time_s}")
    if math.isinf(comm_time_s):
        return h_min
    if math.isinf(round_time_s):
        return h_max
    steps = math.ceil(round_time_s / step_time_s) - math.ceil(comm_time_s / step_time_s)
    return max(h_min, min(h_max, steps))


def swarm_step_s(step_times_s: Sequence[float]) -> float:
    """The swarm's pace: the median of the step times other peers announce (finite and positive ones), NaN with
    fewer than PACE_MIN_PEERS. A median: a few liars move it little; many identities are bounded by PACE_MAX_CUT."""
    known = [t for t in step_times_s if t > 0.0 and math.isfinite(t)]
    return statistics.median(known) if len(known) >= PACE_MIN_PEERS else math.nan


def inner_steps_for_pace(steps: int, own_step_s: float, swarm_step_s: float, h_min: int) -> int:
    """GASLoC's round-time rule (docs/algorithms.md) for compute: the target round is `steps` at the swarm's pace,
    so a peer whose steps take longer than PACE_SLACK × the swarm's takes floor(steps × swarm / own) of them, at
    least `h_min` and (1 − PACE_MAX_CUT) × `steps`: its rounds, and its mixes, keep the swarm's pace (on 2 cores
    with 32 peers a few computed 2-3× slower than the rest, did half the rounds, and drifted from the swarm's
    mean). A faster peer, or one that does not know the pace (NaN), keeps `steps`."""
    if not (own_step_s > PACE_SLACK * swarm_step_s and swarm_step_s > 0.0) or not math.isfinite(own_step_s):
        return steps
    # own > swarm here, so the share is under `steps`; h_min ≤ steps (InnerConfig), so the floor is too
    floor = max(h_min, math.ceil((1 - PACE_MAX_CUT) * steps))
    return max(floor, math.floor(steps * swarm_step_s / own_step_s))

