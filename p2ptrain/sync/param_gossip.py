"""A peer's side of gossip: what it offers, how it validates a partner's payload, and how it mixes.

Every peer has a *public value* = base + c: `base` is set by the round loop (the anchor θ_r during the inner
phase, the proposal y while it mixes at the round's end) and `c` accumulates the corrections of exchanges other
peers started with it (folded into the base when the loop takes it). An exchange with weight w between values a
and b moves a by w(b − a) and b by w(a − b), so the sum over the swarm is preserved whoever started it; w is the
smaller of the two ends' own weights (the responder answers the one it uses). Values travel as codec(value − θ_0),
a reference every peer holds (the run's seeded initial parameters), as 16-bit differences by default.

Partners are untrusted (docs/threat-model.md). What a partner sends must decode, be finite and lie within
`max_partner_distance` × our norm, else the exchange fails and the partner is penalised. With `sync.robust` it is
then clipped to τ from our value (maths/robust.py, ClippedGossip), so one exchange moves us by at most w·τ; τ's
yardstick is how far our own step moved our base, mixing excluded: η‖Δ‖ in GASLoC, the last outer step in Mix1.
A partner opens a bounded number of exchanges with us per round (`OfferLimit`)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID

from p2ptrain.maths.codecs import choose_codec_for_link, relative_decode, relative_encode
from p2ptrain.maths.drift_excuse import DriftExcuse
from p2ptrain.maths.mixing import consensus_distance, pull_toward_, uniform_weight
from p2ptrain.maths.pacing import LinkSpeeds
from p2ptrain.maths.robust import AdaptiveClip, agreed_weight, all_finite, own_move
from p2ptrain.maths.topology import draw_partners
from p2ptrain.net.exchange import Apply, ExchangeRefused, JudgedAtOnce, OpenExchange, Payload, push_pull
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.responder_limits import OfferLimit
from p2ptrain.net.routes import Routes
from p2ptrain.net.wire import WireError, payload_bytes
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.interface import HONEST, Conduct, ExchangeRecord, RoundSync
from p2ptrain.sync.refusals import Refusal
from p2ptrain.tensor_layout import norm
from p2ptrain.timing import POLL_S

logger = logging.getLogger(__name__)

PARAM_CODECS_ADAPTIVE = ("fp16", "int8")  # parameters: dense codecs only (top-k of θ − θ_0 loses too much)
# an exchange that blocks training for less than this fraction of the inner phase is worth waiting for, however it
# compares with our own link: peers on equally fast links can measure speeds 30 % apart from CPU load alone, and
# ranking them by that noise would leave fast peers without partners
NEGLIGIBLE_BLOCKING_FRACTION = 0.1
# Offers one partner may make: accepted ones per our round (an honest partner opens one per its own round; 2 leaves
# room for a partner at twice our pace, or one retry after a failure), and any offers in time (a Mix1 partner asks
# again every POLL_S while we have not reached its round: it uses half of the rate)
OPENS_PER_ROUND = 2
OFFERS_PER_S, OFFER_BURST = 2 / POLL_S, 32
# rounds after a jump of our round (`round`) in which partners we clip hard (still clipped) are not penalised: our first
JUMP_GRACE_ROUNDS = 2  # steps from an adopted or resumed state are no yardstick yet (tests/test_joining.py)
# The floor of τ's yardstick, × our value's norm: before our first step (a joiner, a GASLoC responder in its first
MIN_OWN_SCALE = 1e-3  # inner phase) partners are clipped to 2e-3 of our norm; fp16 round-off (≤ 2⁻¹¹) always passes


class _Exchange:
    """One accepted incoming exchange (the responder's side)."""

    def __init__(self, mixer: ParamGossip, sender: str, weight: float, public: list[torch.Tensor],
                 header: dict[str, Any]):
        self.mixer, self.sender, self.weight, self.public = mixer, sender, weight, public
        self.codec = str(header.get("codec", "fp16"))
        self.payload = relative_encode(mixer.outgoing(public), mixer.reference, self.codec)
        self.header = {"codec": self.codec, "round": mixer.round, "weight": weight}

    def validate(self, partner_header: dict[str, Any], partner_payload: Payload) -> Apply:
        partner = self.mixer.decode_partner(partner_header, partner_payload, own=self.public)
        partner = self.mixer.clip_partner(self.sender, partner, self.public, partner_header.get("round"))
        traffic = (payload_bytes(self.payload), payload_bytes(partner_payload))
        return lambda: self.mixer.add_correction_(self.weight, partner, self.public, traffic)

    def close(self) -> None:
        self.mixer.release_responder()


class ParamGossip(JudgedAtOnce):  # a Mix1 partner not in our round asks again
    """Offers and answers pairwise exchanges of one kind of value ("gasloc" proposals or "mix1" parameters).

    `links` is the peer's one table of measured links (shared with its gradient gossip, if any); `reputation` the
    peer's one record of offences (the exchange servicer refuses the peers it bans)."""

    def __init__(self, p2p: P2P, run_id: str, fingerprint: str, kind: str, reference: Sequence[torch.Tensor],
                 config: SyncConfig, seed: int, same_round_only: bool = False, overlapped: bool = False,
                 links: LinkSpeeds | None = None, reputation: Reputation | None = None, routes: Routes | None = None,
                 conduct: Conduct = HONEST):
        self.p2p, self.run_id, self.fingerprint, self.kind, self.config = p2p, run_id, fingerprint, kind, config
        self.routes = routes if routes is not None else Routes("")  # who we can open streams to, and how
        self.namespace = f"{run_id}.{kind}"
        self.chunk_timeout_s = config.state_download_timeout_s
        self.same_round_only = same_round_only  # Mix1: mix round-t values only (no staleness)
        self.overlapped = overlapped  # Mix1: our exchanges run during the inner phase (GASLoC's block training)
        self.reference = [t.detach().float().cpu().clone() for t in reference]
        self.raw_bytes = sum(t.numel() * 4 for t in self.reference)
        self.max_payload_bytes = self.raw_bytes + 2**20
        self.rng, self._lock, self.conduct = random.Random(seed), threading.Lock(), conduct  # forms what we send
        self._round, self._quiet_until = 0, 0  # our round; penalties for hard clips resume at `_quiet_until`
        self._base = [t.clone() for t in self.reference]
        self._base_moved: float | None = None  # how far the latest `set_base_` moved the base (None: first one)
        self._base_set = False
        self._mix_shift: list[torch.Tensor] | None = None  # Σ (mixed − value) of our mixes since the last base
        self._correction = [torch.zeros_like(t) for t in self.reference]
        self._responding = self._waiting_for_round = False
        self.give_up_at = 0.0  # `mix` stops waiting for partners to reach its round at this time.monotonic()
        self.links = links if links is not None else LinkSpeeds()
        self.incoming = RoundSync(group_size=0)  # what exchanges others started with us did this round
        self.budget_s = float("inf")  # time an exchange may take without delaying training (adaptive codec)
        self.last_payload_bytes = self.raw_bytes // 2  # one direction of our latest exchange (fp16 until then)
        self.announced: dict[str, float] = {}  # peers' announced link speeds, as of our latest mix
        self.reputation = reputation if reputation is not None else Reputation()
        self.clip = AdaptiveClip(config.param_clip_multiplier, excuse=DriftExcuse()) if config.robust else None
        self.own_scale: float | None = None  # the base's latest move as of our latest mix (see `yardstick`)
        self.offer_limit = OfferLimit(OPENS_PER_ROUND, OFFERS_PER_S, OFFER_BURST)

    @property
    def round(self) -> int:
        return self._round

    @round.setter
    def round(self, value: int) -> None:
        """Our round; one that jumps (a state adopted, a checkpoint resumed) restarts us as a new mixer (no yardstick
        until our next step) and holds back penalties for JUMP_GRACE_ROUNDS. Set by the round loop."""
        if value not in (self._round, self._round + 1):
            with self._lock:
                self._base_set, self._quiet_until = False, value + JUMP_GRACE_ROUNDS
        self._round = value

    # ---- the public value ----------------------------------------------------------------------------------------
    def set_base_(self, base: Sequence[torch.Tensor]) -> None:
        """Set the base of our public value (called by the round loop only). Remembers how far our own step moved
        it: the move less what mixing did since the last base (corrections taken, `mix`'s pulls), which a partner
        could otherwise inflate round after round to widen our clipping radius."""
        new = [t.detach().float().cpu().clone() for t in base]
        with self._lock:
            old, shift = self._base, self._mix_shift
        moved = own_move(new, old, shift) if self._base_set else math.inf
        with self._lock:
            self._base, self._base_set, self._mix_shift = new, True, None
            self._base_moved = moved if math.isfinite(moved) else None

    def take_correction_(self) -> list[torch.Tensor]:
        """Return and reset c (what others' exchanges moved our value by since the last call). c is folded into
        the base: our public value stays the same until the round loop sets a new base."""
        with self._lock:
            correction, self._correction = self._correction, [torch.zeros_like(t) for t in self.reference]
            for b, c in zip(self._base, correction, strict=True):
                b.add_(c)
            return correction

    def take_incoming_stats(self) -> RoundSync:
        with self._lock:
            stats, self.incoming = self.incoming, RoundSync(group_size=0)
            return stats

    def add_correction_(self, weight: float, partner: list[torch.Tensor], ours: list[torch.Tensor],
                        traffic: tuple[int, int] = (0, 0)) -> None:
        """Mix a committed exchange a partner opened; `traffic`: the bytes we sent and received in it."""
        with self._lock:
            pull_toward_(self._correction, partner, ours, weight)
            self.incoming.group_size += 1
            self.incoming.bytes_sent += traffic[0]
            self.incoming.bytes_received += traffic[1]
            self.incoming.consensus_distance.append(consensus_distance(ours, partner))

    # ---- responder -----------------------------------------------------------------------------------------------
    def open(self, header: dict[str, Any]) -> OpenExchange | str:
        """Accept an offer from a peer of this run and model, one at a time and within its share of offers; refuse
        anything else at once. We mix with the smaller of the offer's weight and our own, and answer which."""
        if header.get("run_id") != self.run_id or header.get("fingerprint") != self.fingerprint:
            return Refusal.OTHER_RUN
        if header.get("kind") != self.kind or header.get("codec") not in ("none", "fp16", "int8"):
            return Refusal.UNSUPPORTED
        offered = header.get("weight")
        if not isinstance(offered, float) or not 0 < offered <= 0.5:
            return Refusal.BAD_WEIGHT
        sender = str(header.get("sender", ""))
        if not self.offer_limit.offer(sender):
            return self._too_many(sender, "offers arrive faster than any partner needs")
        with self._lock:
            if self.same_round_only and header.get("round") != self.round:
                return Refusal.WRONG_ROUND
            if self._responding:
                return Refusal.BUSY
            within_share = self.offer_limit.accept(sender, self.round)
            self._responding = within_share
            public = [b + c for b, c in zip(self._base, self._correction, strict=True)] if within_share else []
        # refused, not penalised: a partner faster than us opens more per our round (a slow or joining peer's round
        if not within_share:  # is many of theirs); a prober pays for "uncommitted" opens
            return Refusal.TOO_MANY_OFFERS
        weight = min(offered, uniform_weight(self.config.gossip_peers))
        try:
            return _Exchange(self, sender, weight, public, header)
        except ValueError as e:  # our own value is not finite (or what `outgoing` formed does not encode)
            logger.warning(f"not answering {sender}: our value cannot be sent ({e})")
            self.release_responder()
            return Refusal.NO_VALUE

    def _too_many(self, sender: str, detail: str) -> str:
        self.reputation.penalise(sender, "too_many_opens", detail)
        return Refusal.TOO_MANY_OFFERS

    def release_responder(self) -> None:
        with self._lock:
            self._responding = False

    def decode_partner(self, header: dict[str, Any], payload: Payload, own: list[torch.Tensor]) -> list[torch.Tensor]:
        """The partner's value, or ValueError if it does not decode, does not fit, or is implausibly far."""
        partner = relative_decode(payload, self.reference, str(header.get("codec", "fp16")))
        far = consensus_distance(own, partner)
        if not far <= self.config.max_partner_distance:
            raise ValueError(f"partner is {far:.3g}× our norm away (bound {self.config.max_partner_distance})")
        return partner

    # ---- robust mixing ---------------------------------------------------------------------------------------------
    def outgoing(self, value: list[torch.Tensor]) -> list[torch.Tensor]:
        """What we send for `value`, as the peer's conduct forms it: every value we send, as initiator or responder."""
        return self.conduct.sent_params(value, self.reference)

    def yardstick(self) -> float | None:
        """How far our value moved at its latest step: as of our latest mix, or before any, the base's latest move
        (None until the base has moved once: the first round after we started or joined)."""
        with self._lock:
            return self.own_scale if self.own_scale is not None else self._base_moved

    def clip_radius(self, own: Sequence[torch.Tensor]) -> float:
        """τ: the farthest a partner's value may be from `own` before it is clipped (inf with `robust: false`)."""
        if self.clip is None:
            return math.inf
        return self.clip.radius(max(self.yardstick() or 0.0, MIN_OWN_SCALE * norm(own)))

    def clip_partner(self, partner_id: str, theirs: list[torch.Tensor], own: list[torch.Tensor],
                     their_round: object = None) -> list[torch.Tensor]:
        """own + clip(theirs − own, τ); a hard clip is penalised once τ has a yardstick (before our first step honest
        partners may well be far) unless drift explains it (`their_round`: its header's claim; maths/drift_excuse)."""
        if self.clip is None:
            return theirs
        known = self.yardstick()
        scale = max(known or 0.0, MIN_OWN_SCALE * norm(own))
        clipped, gap, hard = self.clip.clip(partner_id, theirs, own, scale, (self._round, their_round))
        if hard and known is not None and self._round >= self._quiet_until:
            self.reputation.penalise(partner_id, "clipped",
                                     f"{gap:.3g} away, offences from {self.clip.hard_radius(scale):.3g}")
        return clipped

    # ---- initiator and links ---------------------------------------------------------------------------------------
    def choose_codec(self, partner: str) -> str:
        if self.config.param_codec != "adaptive":
            return self.config.param_codec
        budget_s = self.budget_s if self.budget_s < float("inf") else 60.0
        # the EMA is both directions' bytes over the exchange's time (they travel one after the other): on a
        # symmetric link one direction's payload fits the budget when twice its bytes fit at the EMA's rate
        one_way_bytes_per_s = self.links.estimate_bytes_per_s(partner) / 2
        return choose_codec_for_link(self.raw_bytes, one_way_bytes_per_s, budget_s, PARAM_CODECS_ADAPTIVE).name

    def own_link_bytes_per_s(self) -> float:
        return self.links.own_bytes_per_s(self.announced)

    def expected_exchange_s(self, partner_bytes_per_s: float = 0.0) -> float:
        """Seconds one exchange of our usual payload should take with a partner that announced this speed
        (0: unknown, taken as ours)."""
        own = self.own_link_bytes_per_s()
        speed = min(own, partner_bytes_per_s) if partner_bytes_per_s > 0 else own
        return 2 * self.last_payload_bytes / speed

    def partners_worth_waiting_for(self, live_peers: list[str], links: dict[str, float]) -> list[str]:
        """GASLoC's heterogeneity rule (ours): we start exchanges only with peers whose link lets the exchange
        end within 1.25 × an exchange on our own link or within a tenth of the inner phase (or, when our
        exchanges overlap the inner phase as Mix1's do, within that phase). Slower peers are not dropped from the
        graph: they start exchanges with us, which we answer in the background while we train, so fast peers
        never wait for a slow one and a slow one waits only for its own link. A peer that announced no speed (it
        completed no exchange it started) is judged by what we measured with it, if anything."""
        phase_s = self.budget_s if self.budget_s < float("inf") else 0.0
        hidden_s = phase_s if self.overlapped else NEGLIGIBLE_BLOCKING_FRACTION * phase_s
        limit = max(hidden_s, 1.25 * self.expected_exchange_s())
        return [p for p in live_peers if self.expected_exchange_s(links.get(p) or self.links.measured().get(p, 0.0))
                <= limit]

    def mix(self, value: list[torch.Tensor], live_peers: list[str], round_: int, patience_s: float = 0.0,
            links: dict[str, float] | None = None) -> Coroutine[Any, Any, tuple[list[torch.Tensor], RoundSync]]:
        """Exchange `value` with up to `gossip_peers` random live peers; return value + Σ w (partner − value), each
        partner's value clipped (`clip_partner`) and w the weight both ends agreed on. Busy or refusing peers are
        skipped, banned ones never asked; those not yet in our round (Mix1) are asked again every POLL_S for
        up to `patience_s` seconds. Peers too slow to wait for (`links`: announced speeds) and peers nobody can reach
        start exchanges with us instead; peers behind relays are drawn once direct ones are used up (`Routes.pools`).
        A value that is not finite is not mixed (nor sent): it comes back unchanged, with a warning. τ's yardstick
        is taken now, not when the coroutine runs: an overlapped mix runs after the round loop moved the base on."""
        with self._lock:
            self.own_scale = self._base_moved
        return self._mix(value, live_peers, round_, patience_s, links)

    async def _mix(self, value: list[torch.Tensor], live_peers: list[str], round_: int, patience_s: float,
                   links: dict[str, float] | None) -> tuple[list[torch.Tensor], RoundSync]:
        if not all_finite(value):
            logger.warning(f"round {round_}: our value is not finite; not mixing it this round")
            return [v.clone() for v in value], RoundSync(group_size=1)
        pools = self.routes.pools(self._eligible(live_peers, links, round_)) or [[]]
        live_peers, k = pools.pop(0), self.config.gossip_peers
        mixed, stats, tried = [v.clone() for v in value], RoundSync(group_size=1), set[str]()
        self.give_up_at = time.monotonic() + patience_s
        while len(stats.partners) < k:
            candidates = draw_partners(live_peers, 1, self.rng, exclude=tried | set(stats.partners))
            if not candidates and pools:  # every direct partner tried: those behind relays next
                live_peers = pools.pop(0)
                continue
            if not candidates:
                if time.monotonic() >= self.give_up_at or not self._waiting_for_round:
                    break
                tried, self._waiting_for_round = set(), False
                await asyncio.sleep(POLL_S)  # gossip peers do not end their rounds together: no quick asks
                continue
            tried.add(candidates[0])
            result = await self._exchange_with(candidates[0], value, uniform_weight(k), round_, stats)
            if result is not None:
                pull_toward_(mixed, result[0], value, result[1])
        if stats.partners:
            self._remember_shift_(mixed, value)
        stats.link_bytes_per_s = self.links.fastest_measured_bytes_per_s()
        stats.expected_blocking_s = k * self.expected_exchange_s()
        fastest = max([self.own_link_bytes_per_s(), *(links or {}).values()])
        stats.swarm_blocking_s = k * 2 * self.last_payload_bytes / fastest
        return mixed, stats

    def _remember_shift_(self, mixed: list[torch.Tensor], value: list[torch.Tensor]) -> None:
        with self._lock:
            self._mix_shift = shift = self._mix_shift or [torch.zeros_like(v) for v in value]
            for s, m, v in zip(shift, mixed, value, strict=True):
                s.add_(m - v)

    def _eligible(self, live_peers: list[str], links: dict[str, float] | None, round_: int) -> list[str]:
        """The live peers we may start exchanges with: not banned, and fast enough to wait for (with `links`)."""
        live_peers = [p for p in live_peers if not self.reputation.is_banned(p)]
        if links is None:
            return live_peers
        self.announced = links
        eligible = self.partners_worth_waiting_for(live_peers, links)
        logger.debug(f"round {round_}: {len(eligible)} of {len(live_peers)} live peers are fast enough to wait for"
                     f" (own link {self.own_link_bytes_per_s():.3g} B/s, links {links})")
        return eligible

    async def _exchange_with(self, partner: str, value: list[torch.Tensor], weight: float, round_: int,
                             stats: RoundSync) -> tuple[list[torch.Tensor], float] | None:
        """One exchange we start: (what to mix in place of the partner's value, the weight both ends use)."""
        codec = self.choose_codec(partner)
        try:
            payload = relative_encode(self.outgoing(value), self.reference, codec)
        except ValueError as e:  # what `outgoing` formed is not finite
            logger.warning(f"not offering to {partner}: our value cannot be sent ({e})")
            return None
        nbytes = self.last_payload_bytes = payload_bytes(payload)
        link = self.links.to(partner)
        deadline_s = self.links.deadline_s(partner, 2 * nbytes, self.config.exchange_safety_factor)
        header = {"run_id": self.run_id, "fingerprint": self.fingerprint, "kind": self.kind, "round": round_,
                  "codec": codec, "weight": weight}
        received: list[tuple[list[torch.Tensor], float]] = []
        started = time.monotonic()
        try:
            outcome = await push_pull(self.p2p, PeerID.from_base58(partner), self.namespace, header, payload,
                                      self._validator(partner, value, weight, received), self.max_payload_bytes,
                                      deadline_s, self.routes.route_to(partner))
        except ExchangeRefused as e:
            logger.debug(f"{partner} refused: {e}")
            if str(e) == Refusal.WRONG_ROUND:
                self._waiting_for_round = True
            else:
                stats.refused += 1
            return None
        except (WireError, ValueError, asyncio.TimeoutError, TimeoutError, OSError, Exception) as e:  # noqa: B014
            logger.info(f"exchange with {partner} failed: {e!r}")
            stats.failed += 1
            link.update_timeout_(2 * nbytes, time.monotonic() - started)
            return None
        outcome.apply()
        link.update_(outcome.bytes_sent + outcome.bytes_received, outcome.seconds)
        stats.add_exchange_(ExchangeRecord(partner, codec, outcome.bytes_sent, outcome.bytes_received,
                                           outcome.seconds))
        stats.consensus_distance.append(consensus_distance(value, received[0][0]))
        return received[0]

    def _validator(self, partner: str, value: list[torch.Tensor], weight: float,
                   received: list[tuple[list[torch.Tensor], float]]) -> Callable[[dict[str, Any], Payload], Apply]:
        """Checks the partner's answer (penalising one that does not validate); its apply keeps what to mix."""
        def validate(answer: dict[str, Any], partner_payload: Payload) -> Apply:
            try:
                used = agreed_weight(weight, answer.get("weight", weight))
                theirs = self.decode_partner(answer, partner_payload, own=value)
            except ValueError as e:
                self.reputation.penalise(partner, "invalid_payload", str(e))
                raise
            theirs = self.clip_partner(partner, theirs, value, answer.get("round"))
            return lambda: received.append((theirs, used))

        return validate
