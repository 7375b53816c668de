"""What a peer has done to us: offences raise a decaying score; past a threshold the peer is banned for a while.

Modelled on gossipsub v1.1's peer scoring, reduced to what an open training swarm needs: every offence has a
weight (a malformed or oversize payload costs more than a timeout, which an honest peer on a slow link also
commits); the score halves every `half_life_s`, so honest peers that fail now and then never reach the
threshold; a peer that does is refused for `ban_s`, doubled at each repeat up to `max_ban_s` (a repeat offender
pays more), and the ban is logged once. Keyed by libp2p peer id: what libp2p authenticated, never what a message
claims. Thread-safe: the event loop and the round loop both report offences.

Many offences come once a round (a clipped input, an equivocation), so a ban and the memory of offences last at
least ROUNDS_PER_BAN of our rounds, whatever `ban_s` says: on a swarm of 5-minute rounds a 60 s ban ended before
the attacker's next round, and a score halving every 120 s never summed one clip a round up to a ban.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable

from p2ptrain.errors import ConfigError

logger = logging.getLogger(__name__)

ROUNDS_PER_BAN = 4  # a first ban lasts at least this many of our rounds (and scores halve every twice that)
ROUND_S_SMOOTHING = 0.2  # the weight of the latest round in our rounds' typical length

# offence → weight. A ban takes `ReputationConfig.ban_score` (default 4): four malformed payloads or hard clips, two
# oversize streams, one lying state snapshot or two out of step, but eight timeouts within a half-life.
OFFENCES: dict[str, float] = {
    "timeout": 0.5,  # an exchange that ran past its deadline (honest slow links do this too)
    "slow_send": 1.0,  # a stream that stalled mid-payload while holding one of our slots
    "uncommitted": 0.5,  # an exchange it opened, read our value from, and never committed
    "too_many_opens": 1.0,  # more offers or streams at once (or per round) than a peer may make
    "too_many_requests": 1.0,  # more requests for a sketch of our state than a joiner makes (state_sharing)
    "malformed": 1.0,  # a message we could not parse, or metadata of the wrong types
    "invalid_payload": 1.0,  # tensors that do not decode, do not fit, or are not finite
    "clipped": 1.0,  # a value more than HARD_CLIP_FACTOR (4) × the clipping radius away: not disagreement
    # an all-reduce input beyond FAR_CLIP_FACTOR (64) × the radius, or beyond HARD_CLIP_FACTOR (4) × it pointing
    # against the others' inputs: an attack, banned at once
    "clipped_far": 4.0,
    # an all-reduce input beyond SPREAD (2) × the radius pointing against the others': a second within a half-life
    # bans (2.5, not 2: the first has decayed a little by the next round)
    "reversed": 2.5,
    # a value that is, bit for bit, what the partner sent two or more claimed rounds before (sync/replay_check.py):
    # a second bans
    "replayed": 2.5,
    # an outer gradient under a ten-thousandth of ours: a peer that trains nothing (sync/contribution.py); a third
    # within a half-life bans
    "idle": 1.5,
    "oversize": 2.0,  # more bytes than announced or allowed
    "wrong_state": 4.0,  # a state snapshot that failed corroboration (quorum, sketch or validation loss)
    # a state its round's synced peers do not hold, yet no worse than ours on our batches: what an honest donor serves
    # whose all-reduce split from its round's majority, until its next round shows it (sync/state_evidence.py)
    "unsynced_state": 2.5,  # a second within 88 s bans
    # a state neither held nor outvoted by witnesses, worse than ours on our batches but short of a lie's loss: what
    # an honest peer that averaged alone a few rounds serves; the third within a half-life bans
    "worse_state": 1.5,
    # said it holds an offer we granted no hold, then kept us waiting (net/exchange.py's `UngrantedHold`): a rule of
    # the protocol no honest peer breaks
    "held_ungranted": 4.0,
    "forged_record": 4.0,  # a DHT record for a peer id that is not its signer's, or beyond the time bounds
    "equivocated": 4.0,  # sent members of one all-reduce different values (their reports disagree, no majority)
    # a reduce-scatter's chunk mean that is not the CenteredClip of the inputs its owner reduced, or a sketch of a
    # residual that the input its member sent contradicts (sync/scatter_allreduce.py: exact, once the inputs are seen)
    "false_mean": 4.0,
    "false_sketch": 4.0,
}


@dataclasses.dataclass(frozen=True)
class ReputationConfig:
    """The `reputation` section: when a misbehaving peer is banned, and for how long."""

    ban_score: float = 4.0  # a peer whose score reaches this is banned (see OFFENCES for the weights)
    ban_s: float = 60.0  # first ban; each later ban of the same peer doubles it, up to `max_ban_s`

    def __post_init__(self) -> None:
        if min(self.ban_score, self.ban_s) <= 0:
            raise ConfigError("reputation.ban_score and reputation.ban_s must be > 0")

    @property
    def half_life_s(self) -> float:
        """Scores halve every two first bans: how long an offence is remembered scales with how long it is punished."""
        return 2 * self.ban_s

    @property
    def max_ban_s(self) -> float:
        """The longest ban: sixty first bans (an hour at the default), reached at the seventh ban."""
        return 60 * self.ban_s


@dataclasses.dataclass
class _Standing:
    score: float = 0.0
    scored_at: float = 0.0
    banned_until: float = 0.0
    bans: int = 0
    offences: dict[str, int] = dataclasses.field(default_factory=dict)


class Reputation:
    """Per-peer scores and bans for one peer process; `penalise` reports, `is_banned` is asked before serving."""

    MAX_TRACKED = 10_000  # peers remembered at once: identities are free, memory is not

    def __init__(self, config: ReputationConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 admits: Callable[[str, object], bool] = lambda _peer, _ticket: True):
        self.config = config or ReputationConfig()
        self.clock = clock
        self.admits = admits  # the run's admission (net/admission.py): a signed run refuses peers without ticket
        self.round_s = 0.0  # our rounds' typical wall time (`note_round_s`; 0: none yet)
        self._standing: dict[str, _Standing] = {}
        self._lock = threading.Lock()

    def penalise(self, peer: str, offence: str, detail: str = "") -> bool:
        """Record one offence of `peer`; True if it is (now) banned."""
        weight = OFFENCES[offence]
        now = self.clock()
        with self._lock:
            standing = self._standing_of(peer, now)
            standing.score = self._decayed(standing, now) + weight
            standing.scored_at = now
            standing.offences[offence] = standing.offences.get(offence, 0) + 1
            if standing.banned_until > now:
                return True
            if standing.score < self.config.ban_score:
                return False
            ban_s = min(self.config.max_ban_s, self.config.ban_s * 2 ** standing.bans) * self.stretch()
            standing.banned_until, standing.bans, standing.score = now + ban_s, standing.bans + 1, 0.0
            offences = ", ".join(f"{n}× {o}" for o, n in sorted(standing.offences.items()))
        logger.warning(f"banning peer {peer} for {ban_s:.0f} s ({offences}{'; last: ' + detail if detail else ''})")
        return True

    def note_round_s(self, seconds: float) -> None:
        """Tell the length of the round that just ended (the round loop's wall time)."""
        if math.isfinite(seconds) and seconds > 0:
            self.round_s = seconds if self.round_s == 0 else (
                (1 - ROUND_S_SMOOTHING) * self.round_s + ROUND_S_SMOOTHING * seconds)

    def stretch(self) -> float:
        """How many times longer than configured bans and scores last: ROUNDS_PER_BAN of our rounds over the first
        ban (`reputation.ban_s`), at least 1."""
        return max(1.0, ROUNDS_PER_BAN * self.round_s / self.config.ban_s)

    def refuses(self, peer: str, ticket: object = "") -> bool:
        """Whether to refuse `peer` anything (an exchange, our state): banned, or not admitted to the run (nor by
        the `ticket` its request carries)."""
        return self.is_banned(peer) or not self.admits(peer, ticket)

    def is_banned(self, peer: str) -> bool:
        with self._lock:
            standing = self._standing.get(peer)
            return standing is not None and standing.banned_until > self.clock()

    def score(self, peer: str) -> float:
        with self._lock:
            standing = self._standing.get(peer)
            return 0.0 if standing is None else self._decayed(standing, self.clock())

    def banned(self) -> dict[str, float]:
        """Banned peers → seconds of ban left."""
        now = self.clock()
        with self._lock:
            return {p: s.banned_until - now for p, s in self._standing.items() if s.banned_until > now}

    def offences(self) -> dict[str, dict[str, int]]:
        """Every tracked peer's offence counts (for metrics and status)."""
        with self._lock:
            return {p: dict(s.offences) for p, s in self._standing.items() if s.offences}

    def _decayed(self, standing: _Standing, now: float) -> float:
        half_life_s = self.config.half_life_s * self.stretch()
        return standing.score * math.pow(0.5, max(0.0, now - standing.scored_at) / half_life_s)

    def _standing_of(self, peer: str, now: float) -> _Standing:
        standing = self._standing.get(peer)
        if standing is None:
            if len(self._standing) >= self.MAX_TRACKED:  # forget the least harmful peer that is not banned
                forgettable = [p for p, s in self._standing.items() if s.banned_until <= now]
                if forgettable:
                    del self._standing[min(forgettable, key=lambda p: self._decayed(self._standing[p], now))]
            standing = self._standing[peer] = _Standing(scored_at=now)
        return standing
