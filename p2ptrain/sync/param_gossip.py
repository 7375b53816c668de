"""A peer's side of gossip: what it offers, how it validates a partner's payload, and how it mixes.

Every peer has a *public value* = base + c: `base` is set by the round loop (the anchor θ_r during the inner
phase, the proposal y while it mixes at the round's end) and `c` accumulates the corrections of exchanges other
peers started with it (folded into the base when the loop takes it). An exchange with weight w between values a
and b moves a by w(b − a) and b by w(a − b), so the sum over the swarm is preserved whoever started it; w is the
smaller of the two ends' own weights (the responder answers the one it uses). Values travel as codec(value − θ_0),
a reference every peer holds (the run's seeded initial parameters), as 16-bit differences by default.

Partners are untrusted (docs/threat-model.md). What a partner sends must decode, be finite and lie within
`max_partner_distance` × our norm, else the exchange fails and the partner is penalised. With `sync.robust` it is then
clipped to τ from our value (maths/robust.py, ClippedGossip), so one exchange moves us by at most w·τ (and not at all
when the partner is clipped hard, an offence: `clip_value`); τ's yardstick is how far our own step moved our base,
mixing excluded: η‖Δ‖ in GASLoC, the last outer step in Mix1. A partner opens a bounded number of exchanges with us per
round (`OfferLimit`).

The exchanges run on sync/exchange_driver.py: each mix we start is a `ParamOffer` (our value, sent to up to
`gossip_peers` partners), and what we answer in a round is a `ParamAnswers` (one exchange at a time, from our public
value as it is when the offer is accepted); `ParamGossip` is the driver's policy for parameter values."""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

import torch
from hivemind.p2p import P2P

from p2ptrain.maths.codecs import choose_codec_for_link, relative_decode, relative_encode
from p2ptrain.maths.drift_excuse import DriftExcuse
from p2ptrain.maths.mixing import consensus_distance, pull_toward_, uniform_weight
from p2ptrain.maths.pacing import LinkSpeeds
from p2ptrain.maths.robust import AdaptiveClip, all_finite, mixing_weight, own_move
from p2ptrain.net.exchange import Payload
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.responder_limits import OfferLimit
from p2ptrain.net.routes import Routes
from p2ptrain.net.wire import payload_bytes
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.contribution import WORK_KEY, Contributions, OwnWork, work_sample
from p2ptrain.sync.exchange_driver import ExchangeDriver, RoundSlots
from p2ptrain.sync.interface import HONEST, Conduct, RoundSync
from p2ptrain.sync.refusals import Refusal
from p2ptrain.tensor_layout import norm
from p2ptrain.timing import POLL_S

logger = logging.getLogger(__name__)

PARAM_CODECS_ADAPTIVE = ("fp16", "int8")  # parameters: dense codecs only (top-k of θ − θ_0 loses too much)
PARAM_CODECS = ("none", "fp16", "int8")  # the codecs an offer of parameters may name
# an exchange that blocks training for less than this fraction of the inner phase is worth waiting for, however it
# compares with our own link: peers on equally fast links can measure speeds up to 1.9x apart from CPU load alone,
# and ranking them by that noise would leave fast peers without partners
NEGLIGIBLE_BLOCKING_FRACTION = 0.1
# a partner is too slow to wait for when an exchange with it would take more than this many times one on our own
# link: equal loopback links measured up to 1.9x apart under CPU load (at 1.25, a fast peer excluded all three others
# and started no exchange); the links the rule is for differ by 10x or more (a 1 Mbit/s home uplink beside 50 Mbit/s)
SLOW_PARTNER_RATIO = 3.0
# Offers one partner may make: accepted ones per our round (an honest partner opens one per its own round; 2 leaves
# room for a partner at twice our pace, or one retry after a failure), and any offers in time (a Mix1 partner not in
# our round yet asks again on round_retry's schedule, at most every POLL_S: half of the rate)
OPENS_PER_ROUND = 2
OFFERS_PER_S = 2 / POLL_S
OFFER_BURST = 32
# Rounds after a jump of our round (`round`) in which partners we clip hard (still clipped) are not penalised: our
# first steps from an adopted or resumed state are no yardstick yet (tests/test_joining.py).
JUMP_GRACE_ROUNDS = 2
# The floor of τ's yardstick, × our value's norm: before our first step (a joiner, a GASLoC responder in its first
# inner phase) partners are clipped to 2e-3 of our norm; fp16 round-off (≤ 2⁻¹¹) always passes.
MIN_OWN_SCALE = 1e-3


class ParamOffer:
    """One mix we start (the initiator's side): `sent` offered to up to `degree_cap` partners, and the running mix."""
    keeps_unconfirmed_mix = False  # a mix whose ack was lost is not applied (the partner may not have)
    measures_link = True

    def __init__(self, gossip: ParamGossip, round_: int, value: list[torch.Tensor], degree_cap: int):
        self.gossip, self.round, self.sent = gossip, round_, value
        self.own_work = gossip.own_work  # what partners' work samples are judged against (GASLoC), as of this mix
        self.weight = uniform_weight(degree_cap)
        self.slots = RoundSlots(round_, gossip.own_id, degree_cap)
        self.mixed = [v.clone() for v in value]
        self.distances: list[float] = []  # consensus distance to each partner mixed with

    def value_for(self, partner: str, codec: str | None) -> tuple[str, Payload]:
        """Our value as the conduct forms it (anew each offer), in the codec chosen for `partner`'s link."""
        codec = self.gossip.choose_codec(partner)
        payload = relative_encode(self.gossip.outgoing(self.sent), self.gossip.reference, codec)
        self.gossip.last_payload_bytes = payload_bytes(payload)
        return codec, payload

    def agree_weight(self, claimed: object) -> float | None:
        """The smaller of ours and the one the responder says it used: no claim can raise it."""
        return mixing_weight(claimed, self.weight)

    def apply_(self, partner: str, theirs: Sequence[torch.Tensor], outgoing: bool, weight: float) -> None:
        pull_toward_(self.mixed, theirs, self.sent, weight)
        self.distances.append(consensus_distance(self.sent, list(theirs)))
        self.slots.applied_(partner, outgoing, 0)

    def release_(self, partner: str, outgoing: bool) -> None:
        self.slots.release_(partner, outgoing)


class ParamAnswers:
    """What we answer in one of our rounds (the responder's side): one exchange at a time, each partner within its
    share of the round (`OfferLimit`), from our public value as it is when the offer is accepted. Offers of any
    round are taken, or with `same_round_only` (Mix1) those of this round only."""
    # a partner faster than us opens more than its share of our round (a slow or joining peer's round is many of
    # theirs): refused, not penalised; a prober pays for its "uncommitted" opens
    extra_offers_offend = False
    measures_link = True  # answers carry parameters

    def __init__(self, gossip: ParamGossip, round_: int):
        self.gossip, self.round = gossip, round_
        self.slots = RoundSlots(round_, gossip.own_id, degree_cap=0)  # the bytes of the offers we read, only
        self.public: list[torch.Tensor] = []  # our value as answered to the exchange in flight
        self.answered_bytes = 0

    @property
    def sent(self) -> list[torch.Tensor]:
        return self.public

    @property
    def own_work(self) -> OwnWork | None:  # our latest round's work, as partners' samples are judged against it
        return self.gossip.own_work

    def agree_weight(self, claimed: object) -> float | None:
        """The smaller of the offer's weight and our own (we answer which): no claim can raise it."""
        return mixing_weight(claimed, uniform_weight(self.gossip.config.gossip_peers))

    def accept_(self, sender: str, round_: int, gives_up_at: float) -> str | None:
        gossip = self.gossip
        if gossip.same_round_only and round_ != self.round:
            return Refusal.WRONG_ROUND
        with gossip.lock:
            if gossip.answering or gossip.work_due:
                return Refusal.BUSY
            if not gossip.offer_limit.accept(sender, self.round):
                return Refusal.TOO_MANY_OFFERS
            gossip.answering = True
            self.public = gossip.public_value()
        return None

    def value_for(self, partner: str, codec: str | None) -> tuple[str, Payload]:
        """Our public value as accepted, in the codec of the partner's offer."""
        codec = codec or "fp16"
        payload = relative_encode(self.gossip.outgoing(self.public), self.gossip.reference, codec)
        self.answered_bytes = payload_bytes(payload)
        return codec, payload

    def apply_(self, partner: str, theirs: Sequence[torch.Tensor], outgoing: bool, weight: float) -> None:
        traffic = (self.answered_bytes, self.slots.offered_bytes.pop(partner, 0))
        self.gossip.add_correction_(partner, weight, list(theirs), self.public, traffic)

    def release_(self, partner: str, outgoing: bool) -> None:
        self.slots.offered_bytes.pop(partner, None)
        with self.gossip.lock:
            self.gossip.answering = False


class ParamGossip:
    """Offers and answers pairwise exchanges of one kind of value ("gasloc" proposals or "mix1" parameters): `mix`
    runs one mix of ours; its `driver` answers offers (`serve_exchanges(p2p, gossip.driver)`) and makes ours.

    `links` is the peer's one table of measured links (shared with its gradient gossip, if any); `reputation` the
    peer's one record of offences (the exchange servicer refuses the peers it bans); `contributions` its one ledger
    of the work partners' values showed (GASLoC's, `show_work_`)."""

    def __init__(self, p2p: P2P, run_id: str, fingerprint: str, kind: str, reference: Sequence[torch.Tensor],
                 config: SyncConfig, seed: int, same_round_only: bool = False, overlapped: bool = False,
                 links: LinkSpeeds | None = None, reputation: Reputation | None = None, routes: Routes | None = None,
                 conduct: Conduct = HONEST, contributions: Contributions | None = None, shows_work: bool = False):
        self.p2p, self.run_id, self.fingerprint, self.kind, self.config = p2p, run_id, fingerprint, kind, config
        self.shows_work = shows_work  # GASLoC: our values show our work (`show_work_`); Mix1's do not
        self.same_round_only = same_round_only  # Mix1: mix round-t values only (no staleness)
        self.overlapped = overlapped  # Mix1: our exchanges run during the inner phase (GASLoC's block training)
        self.reference = [t.detach().float().cpu().clone() for t in reference]
        self.raw_bytes = sum(t.numel() * 4 for t in self.reference)
        self.rng, self.lock, self.conduct = random.Random(seed), threading.Lock(), conduct  # forms what we send
        self._round, self._quiet_until = 0, 0  # our round; penalties for hard clips resume at `_quiet_until`
        self._base = [t.clone() for t in self.reference]
        self._base_moved: float | None = None  # how far the latest `set_base_` moved the base (None: first one)
        self._base_set = False
        self._mix_shift: list[torch.Tensor] | None = None  # Σ (mixed − value) of our mixes since the last base
        self._correction = [torch.zeros_like(t) for t in self.reference]
        self.answering = False  # an exchange a partner opened is in flight (we answer one at a time)
        self.incoming = RoundSync(group_size=0)  # what exchanges others started with us did this round
        self.budget_s = float("inf")  # time an exchange may take without delaying training (adaptive codec)
        self.last_payload_bytes = self.raw_bytes // 2  # one direction of our latest exchange (fp16 until then)
        self.announced: dict[str, float] = {}  # peers' announced link speeds, as of our latest mix
        self.reputation = reputation if reputation is not None else Reputation()
        self.clip = AdaptiveClip(config.param_clip_multiplier, excuse=DriftExcuse()) if config.robust else None
        self.own_scale: float | None = None  # the base's latest move as of our latest mix (see `yardstick`)
        self.offer_limit = OfferLimit(OPENS_PER_ROUND, OFFERS_PER_S, OFFER_BURST)
        self.own_work: OwnWork | None = None  # our latest round's work, once shown (`show_work_`)
        self._shown: dict[str, Any] = {}  # what our headers show of it
        # our round jumped (a state adopted, a checkpoint resumed) since our latest sample, if any: we answer no offer
        # until our next step shows our work, as an old sample shown for a later round is a replay to partners, and
        # none at all idle (a fresh peer's first round is spared: partners judge its first value as a joiner's)
        self.work_due = False
        self.driver = ExchangeDriver(p2p, run_id, fingerprint, kind, config, self, PARAM_CODECS,
                                     self.raw_bytes + 2**20, links, self.reputation, routes,
                                     offer_limit=self.offer_limit, holds_offers=False,  # any round, or Mix1's only
                                     contributions=contributions)
        self.own_id, self.links, self.routes = self.driver.own_id, self.driver.links, self.driver.routes
        self.driver.current = ParamAnswers(self, 0)
        self._offer: ParamOffer | None = None  # the latest mix we started

    @property
    def round(self) -> int:
        return self._round

    @round.setter
    def round(self, value: int) -> None:
        """Our round; one that jumps (a state adopted, a checkpoint resumed) restarts us as a new mixer (no yardstick
        until our next step) and holds back penalties for JUMP_GRACE_ROUNDS. Set by the round loop."""
        if value not in (self._round, self._round + 1):
            with self.lock:
                self._base_set, self._quiet_until = False, value + JUMP_GRACE_ROUNDS
                self.work_due = self.shows_work  # our latest work sample, if any, is of a state we left
        if value != self._round:
            self.driver.current = ParamAnswers(self, value)
        self._round = value

    @property
    def give_up_at(self) -> float:
        """When (time.monotonic()) our latest mix stops asking partners not yet in its round again."""
        return self._offer.slots.give_up_at if self._offer is not None else 0.0

    @give_up_at.setter
    def give_up_at(self, when: float) -> None:
        if self._offer is not None:
            self._offer.slots.give_up_at = when

    # ---- the public value ----------------------------------------------------------------------------------------
    def set_base_(self, base: Sequence[torch.Tensor]) -> None:
        """Set the base of our public value (called by the round loop only). Remembers how far our own step moved
        it: the move less what mixing did since the last base (corrections taken, `mix`'s pulls), which a partner
        could otherwise inflate round after round to widen our clipping radius."""
        new = [t.detach().float().cpu().clone() for t in base]
        with self.lock:
            old, shift = self._base, self._mix_shift
        moved = own_move(new, old, shift) if self._base_set else math.inf
        with self.lock:
            self._base, self._base_set, self._mix_shift = new, True, None
            self._base_moved = moved if math.isfinite(moved) else None

    def take_correction_(self) -> list[torch.Tensor]:
        """Return and reset c (what others' exchanges moved our value by since the last call). c is folded into
        the base: our public value stays the same until the round loop sets a new base."""
        with self.lock:
            correction, self._correction = self._correction, [torch.zeros_like(t) for t in self.reference]
            for b, c in zip(self._base, correction, strict=True):
                b.add_(c)
            return correction

    def public_value(self) -> list[torch.Tensor]:
        """base + c: what we answer with now (call with `lock` held)."""
        return [b + c for b, c in zip(self._base, self._correction, strict=True)]

    def take_incoming_stats(self) -> RoundSync:
        with self.lock:
            stats, self.incoming = self.incoming, RoundSync(group_size=0)
            return stats

    def add_correction_(self, sender: str, weight: float, partner: list[torch.Tensor], ours: list[torch.Tensor],
                        traffic: tuple[int, int] = (0, 0)) -> None:
        """Mix a committed exchange `sender` opened; `traffic`: the bytes we sent and received in it."""
        with self.lock:
            pull_toward_(self._correction, partner, ours, weight)
            self.incoming.answered.append(sender)
            self.incoming.bytes_sent += traffic[0]
            self.incoming.bytes_received += traffic[1]
            self.incoming.consensus_distance.append(consensus_distance(ours, partner))

    # ---- the driver's policy: what a partner's value must be -------------------------------------------------
    def decode_partner(self, rnd: ParamOffer | ParamAnswers, header: dict[str, Any],
                       payload: Payload) -> list[torch.Tensor]:
        """The partner's value, or ValueError if it does not decode, does not fit, or is implausibly far."""
        partner = relative_decode(payload, self.reference, str(header.get("codec", "fp16")))
        far = consensus_distance(rnd.sent, partner)
        if not far <= self.config.max_partner_distance:
            raise ValueError(f"partner is {far:.3g}× our norm away (bound {self.config.max_partner_distance})")
        return partner

    def clip_partner(self, rnd: ParamOffer | ParamAnswers, partner: str, theirs: list[torch.Tensor],
                     header: dict[str, Any]) -> list[torch.Tensor]:
        return self.clip_value(partner, theirs, rnd.sent, header.get("round"))

    def stand_in(self, rnd: ParamOffer | ParamAnswers, partner: str,
                 theirs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Our own value for a partner's that showed no work (a free rider's, one that replays): not mixed."""
        return [o.clone() for o in rnd.sent]

    def note_partner(self, rnd: ParamOffer | ParamAnswers, partner: str, header: dict[str, Any]) -> None:
        """Nothing of a partner's header is kept (its round claim only excuses drift, `clip_value`; its work sample
        and tokens are judged by the driver)."""

    def header_extra(self) -> dict[str, Any]:
        """The work sample and tokens of our latest round (`show_work_`), if we show one."""
        with self.lock:
            return dict(self._shown)

    # ---- the work a value shows (sync/contribution.py) --------------------------------------------------------
    def show_work_(self, outer_gradient: Sequence[torch.Tensor], tokens: int) -> None:
        """Our latest round's outer gradient and the tokens it trained: every header we send from now on shows its
        work sample (as the peer's conduct forms the outer gradients it sends), and partners' samples are judged
        against our own. GASLoC's round loop calls this (`shows_work`); Mix1 shows none (Factored's Mix2 judges
        the round's Δ)."""
        own_gradient = list(outer_gradient)
        own = work_sample(own_gradient, self.run_id)
        sent_gradient = self.conduct.sent_outer_gradient(own_gradient)
        sent = own if sent_gradient is own_gradient else work_sample(sent_gradient, self.run_id)
        with self.lock:
            self.own_work = OwnWork.of_sample(own, tokens)
            self._shown, self.work_due = {WORK_KEY: sent, "tokens": tokens}, False

    # ---- robust mixing ---------------------------------------------------------------------------------------------
    def outgoing(self, value: list[torch.Tensor]) -> list[torch.Tensor]:
        """What we send for `value`, as the peer's conduct forms it: every value we send, as initiator or responder."""
        return self.conduct.sent_params(value, self.reference)

    def yardstick(self) -> float | None:
        """How far our value moved at its latest step: as of our latest mix, or before any, the base's latest move
        (None until the base has moved once: the first round after we started or joined)."""
        with self.lock:
            return self.own_scale if self.own_scale is not None else self._base_moved

    def clip_radius(self, own: Sequence[torch.Tensor]) -> float:
        """τ: the farthest a partner's value may be from `own` before it is clipped (inf with `robust: false`)."""
        if self.clip is None:
            return math.inf
        return self.clip.radius(max(self.yardstick() or 0.0, MIN_OWN_SCALE * norm(own)))

    def clip_value(self, partner_id: str, theirs: list[torch.Tensor], own: list[torch.Tensor],
                   their_round: object = None) -> list[torch.Tensor]:
        """own + clip(theirs − own, τ); a hard clip is penalised once τ has a yardstick (before our first step honest
        partners may well be far) unless drift explains it (`their_round`: its header's claim; maths/drift_excuse),
        and a penalised value is not mixed at all: `own` stands in for it."""
        if self.clip is None:
            return theirs
        known = self.yardstick()
        scale = max(known or 0.0, MIN_OWN_SCALE * norm(own))
        judged = known is not None and self._round >= self._quiet_until
        clipped, gap, hard = self.clip.clip(partner_id, theirs, own, scale, (self._round, their_round), judged)
        if hard:
            self.reputation.penalise(partner_id, "clipped",
                                     f"{gap:.3g} away, offences from {self.clip.hard_radius(scale):.3g}, or from "
                                     f"{self.clip.held_radius(scale):.3g} for a run of clips not closing in")
            return [o.clone() for o in own]
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
        end within `SLOW_PARTNER_RATIO` × an exchange on our own link or within a tenth of the inner phase (or, when our
        exchanges overlap the inner phase as Mix1's do, within that phase). Slower peers are not dropped from the
        graph: they start exchanges with us, which we answer in the background while we train, so fast peers
        never wait for a slow one and a slow one waits only for its own link. A peer that announced no speed (it
        completed no exchange it started) is judged by what we measured with it, if anything."""
        phase_s = self.budget_s if self.budget_s < float("inf") else 0.0
        hidden_s = phase_s if self.overlapped else NEGLIGIBLE_BLOCKING_FRACTION * phase_s
        limit = max(hidden_s, SLOW_PARTNER_RATIO * self.expected_exchange_s())
        return [p for p in live_peers if self.expected_exchange_s(links.get(p) or self.links.measured().get(p, 0.0))
                <= limit]

    def mix(self, value: list[torch.Tensor], live_peers: list[str], round_: int, patience_s: float = 0.0,
            links: dict[str, float] | None = None) -> Coroutine[Any, Any, tuple[list[torch.Tensor], RoundSync]]:
        """Exchange `value` with up to `gossip_peers` random live peers; return value + Σ w (partner − value), each
        partner's value clipped (`clip_value`) and w the weight both ends agreed on. Busy or refusing peers are
        skipped, banned ones never asked; those not yet in our round (Mix1) are asked again (`retry_delay_s`) for
        up to `patience_s` seconds, or until `give_up_at` is moved. Peers too slow to wait for (`links`: announced
        speeds) and peers nobody can reach start exchanges with us instead; peers behind relays are drawn once direct
        ones are used up (`Routes.pools`), and draw twice `gossip_peers` partners themselves
        (`Routes.partners_to_open`).
        A value that is not finite is not mixed (nor sent): it comes back unchanged, with a warning. τ's yardstick
        is taken now, not when the coroutine runs: an overlapped mix runs after the round loop moved the base on."""
        with self.lock:
            self.own_scale = self._base_moved
        return self._mix(value, live_peers, round_, patience_s, links)

    async def _mix(self, value: list[torch.Tensor], live_peers: list[str], round_: int, patience_s: float,
                   links: dict[str, float] | None) -> tuple[list[torch.Tensor], RoundSync]:
        if not all_finite(value):
            logger.warning(f"round {round_}: our value is not finite; not mixing it this round")
            return [v.clone() for v in value], RoundSync(group_size=1)
        k = self.routes.partners_to_open(self.config.gossip_peers)
        offer = self._offer = ParamOffer(self, round_, value, k)
        stats = RoundSync(group_size=1)
        await self.driver.open_in_turn(offer, self._eligible(live_peers, links, round_), patience_s, stats, self.rng,
                                       announced=links)
        stats.consensus_distance.extend(offer.distances)
        if offer.slots.done:
            self._remember_shift_(offer.mixed, value)
        stats.link_bytes_per_s = self.links.fastest_measured_bytes_per_s()
        stats.expected_blocking_s = k * self.expected_exchange_s()
        fastest = max([self.own_link_bytes_per_s(), *(links or {}).values()])
        stats.swarm_blocking_s = k * 2 * self.last_payload_bytes / fastest
        return offer.mixed, stats

    def _remember_shift_(self, mixed: list[torch.Tensor], value: list[torch.Tensor]) -> None:
        with self.lock:
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
