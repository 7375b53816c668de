"""When a gossip partner clipped hard is no offender: honest peers that drifted apart, closing in again.

A hard clip (a partner beyond `HARD_CLIP_FACTOR × spread × typical`, see `maths/robust.py`) is an offence, and
offences get a peer banned. Gossiped parameters persist between exchanges, and two honest GASLoC peers drift far
apart when they stop mixing: one stalls (on an exchange with a peer that has just left), the other's offers are
refused (too many per the stalled peer's round) and it trains alone for many rounds. When they meet again they are
far apart and clip each other hard several times; counted as offences, those clips would ban honest peers.

The excuse: a run of hard clips with one partner is excused when its first gap is explained by drift, the rounds
both sides took since their latest exchange in step (within the hard radius), or since round 0 if they never had
one: every peer's value began as the run's initial state (ours, counted here; theirs, as the partner's header
claims, capped at MAX_DRIFT_ROUNDS, since a claim is unverified), times the typical honest distance. A clipped
exchange is no new start: it moves each side by w·τ at most, so a peer that started late (its round 0 ran while
the others trained eight rounds) is still as far as those rounds made it when it next meets them. While the run
lasts, each further clip is excused only if the partner came CLOSING_MARGIN × τ closer than the run's closest so
far: clipped mixing pulls honest partners together by about τ per exchange. So:
- a partner met far away with no drift to explain it (in step at our previous exchange, or met at round 0) pays
  from the first clip, and for every clip of that run, closing in or not (an attacker that follows our value from
  afar, −7 × ours, closes in as we move);
- a partner that holds its distance, grows it, or wanders pays;
- a drifted partner closing in steadily is clipped each time and is not banned for it. It moves us by at most
  w·τ per exchange, as any partner just inside the offence threshold can, unbanned, every time.
A run ends when the partner is back within the hard radius.

Closer in, a partner clipped beyond the held radius (half the hard radius; `maths/robust.py`) is held apart: honest
partners there close in as above, while a stale value (θ_0 with fresh noise each time, a replay the bit-for-bit check
cannot see) holds its distance or grows it, and moved each honest GASLoC peer by w·τ toward θ_0 in every exchange,
never penalised (real path, 1 of 4, 30 rounds: +6.4 % honest loss). So a run of clips beyond the held radius counts
as above from its third clip on: the first FREE_HELD_CLIPS are free (an honest gap wavers by a few tenths of τ), each
later one must be a new closest. Honest partners of six real-path runs were never clipped beyond 2.5 τ.

A clip is evidence of closing in or not only once a side has trained since the run's latest clip: a second exchange
in the same pair of rounds (both sides offered at once, or one did not commit) finds the gap as it was, and repeats
that clip's verdict unless the gap grew. Counted anew, it made a late-started honest peer an offender (CI on
1d16960: the same 5.3 τ gap at rounds (8, 1) twice, the third clip of its run).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

MAX_DRIFT_ROUNDS = 32  # the most rounds since our previous exchange that a partner's claimed round may add
CLOSING_MARGIN = 0.1  # × τ: how much closer than the run's closest a partner clipped hard must come to be excused
FREE_HELD_CLIPS = 2  # clips of a run within the hard radius excused without closing in


@dataclasses.dataclass
class _Run:
    closest: float
    excused: bool  # its first gap was explained by drift
    latest: float  # the gap at its latest counted clip
    rounds: tuple[int, int] | None  # (our round, its claimed round) there
    verdict: bool  # whether that clip was excused
    clips: int = 1


class DriftExcuse:
    """Per partner: the rounds of our latest exchange in step, and the current run of hard clips."""

    def __init__(self, max_partners: int = 64):
        self.max_partners = max_partners
        self._rounds: OrderedDict[str, tuple[int, int]] = OrderedDict()  # partner → (our round, its claimed round)
        self._runs: OrderedDict[str, _Run] = OrderedDict()

    def drift_rounds(self, partner_id: str, rounds: tuple[int, object] | None) -> int:
        """Rounds both sides took since our latest exchange in step with `partner_id`, or since round 0 if none
        (0 for a claim that is no round)."""
        now = _both_rounds(rounds)
        if now is None:
            return 0
        ours_then, theirs_then = self._rounds.get(partner_id, (0, 0))
        ours = min(max(0, now[0] - ours_then), MAX_DRIFT_ROUNDS)
        theirs = min(max(0, now[1] - theirs_then), MAX_DRIFT_ROUNDS)
        return ours + theirs

    def excused(self, partner_id: str, gap: float, hard_radius: float, radius: float, typical: float,
                rounds: tuple[int, object] | None, held_radius: float) -> bool:
        """Whether this exchange's clip is no offence: one within `held_radius` (at most `hard_radius`) never is
        one, and one within `hard_radius` only once its run outlasts FREE_HELD_CLIPS without closing in."""
        run = self._runs.pop(partner_id, None)
        now = _both_rounds(rounds)
        if gap <= hard_radius and now is not None:
            _remember(self._rounds, partner_id, now, self.max_partners)  # in step, for the drift of a later run
        if gap <= min(held_radius, hard_radius):
            return True
        if run is None:
            drift = self.drift_rounds(partner_id, rounds)
            excused = gap <= hard_radius + drift * typical
            _remember(self._runs, partner_id, _Run(gap, excused, gap, now, excused), self.max_partners)
            return excused
        _remember(self._runs, partner_id, run, self.max_partners)
        if now is not None and now == run.rounds and gap <= run.latest + CLOSING_MARGIN * radius:
            return run.verdict  # nobody trained since its latest clip: the same evidence again
        closing = gap <= run.closest - CLOSING_MARGIN * radius
        run.closest, run.clips, run.latest, run.rounds = min(run.closest, gap), run.clips + 1, gap, now
        run.verdict = (gap <= hard_radius and run.clips <= FREE_HELD_CLIPS) or (run.excused and closing)
        return run.verdict


def _both_rounds(rounds: tuple[int, object] | None) -> tuple[int, int] | None:
    """(our round, the partner's claimed round), or None if we were given none or its claim is no round."""
    claimed = claimed_round(rounds[1]) if rounds is not None else None
    return None if rounds is None or claimed is None else (rounds[0], claimed)


def claimed_round(value: object) -> int | None:
    """A partner's header round as a round, or None (a claim that is not a plausible round excuses nothing)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**40 else None


def _remember(table: OrderedDict, key: str, value: object, limit: int) -> None:
    table.pop(key, None)
    table[key] = value
    while len(table) > limit:
        table.popitem(last=False)
