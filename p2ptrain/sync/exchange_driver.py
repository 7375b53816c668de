"""The driver of sync/'s pairwise exchanges (parameter gossip, Mix2 gossip, the all-reduces' stages): one loop of
offers, retries, slots, the round gate, deadlines and link measurement, over net/exchange.py's push-pull.

Two kinds of policy plug into it:
- the round says what we send each partner, whether an offer is accepted, at what weight, how a partner's value is
  applied, and when the round closes. Its two sides are Protocols: `OfferingRound` (the exchanges we open) and
  `AnsweringRound` (the offers we answer); a Mix2 round or an all-reduce stage is both (`ExchangeRound`), parameter
  gossip has one object for each mix it starts and one per round for what it answers (param_gossip.py);
- the transport (`ExchangePolicy`) says how a partner's payload is decoded and clipped, what headers carry besides
  the protocol's fields, and what it keeps of a partner's header.
The driver answers offers as the peer's `ExchangeHandler` for the transport's namespace (`serve_exchanges`).
Everything here runs on the peer's event loop; the rounds' methods never await, so each of them is atomic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Collection, Mapping, Sequence
from typing import Any, Protocol

import torch
from hivemind.p2p import P2P, PeerID

from p2ptrain.maths.pacing import LinkSpeeds
from p2ptrain.maths.topology import draw_order_by_host
from p2ptrain.net.exchange import (
    Apply,
    ExchangeRefused,
    OpenExchange,
    Payload,
    UnconfirmedMix,
    UngrantedHold,
    push_pull,
)
from p2ptrain.net.remote_hosts import RemoteHosts
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.responder_limits import OfferLimit
from p2ptrain.net.routes import Routes
from p2ptrain.net.wire import payload_bytes
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.contribution import Contributions, OwnWork, claimed_tokens, sample_length, shown_sample
from p2ptrain.sync.failed_partners import FailedPartners
from p2ptrain.sync.interface import ExchangeRecord, RoundSync
from p2ptrain.sync.refusals import ASK_AGAIN, Refusal
from p2ptrain.sync.relay_retries import RelayRetries
from p2ptrain.sync.replay_check import ReplayCheck
from p2ptrain.sync.round_gate import RoundGate, offered_hold_s
from p2ptrain.sync.round_retry import retry_delay_s
from p2ptrain.tensor_layout import norm
from p2ptrain.timing import SETUP_FLOOR_S

logger = logging.getLogger(__name__)


class Outcome:
    """What an exchange we open ended with, besides the partner's refusal."""

    OK = "ok"
    FAILED = "failed"
    RELAY_FAILED = "relay failed"  # an exchange through a group member's relay failed: asked again (`RelayRetries`)


class RoundClosed(RuntimeError):
    """A commit after the round closed: raised in the servicer's apply, so no ack goes out and neither side mixes."""


class RoundSlots:
    """The driver's bookkeeping of one round's exchanges: who we mixed with, who is in flight, whether it closes.

    Each partner holds at most one slot of `degree_cap` (ours or its offer) and mixes once per round. `round_gap`:
    how many rounds a partner's may be from ours and still be taken (0: ours only)."""

    def __init__(self, round_: int, own_id: str, degree_cap: int, round_gap: int = 0):
        self.round, self.own_id, self.degree_cap, self.round_gap = round_, own_id, degree_cap, round_gap
        self.done: list[str] = []  # partners whose mix is applied, in the order it was
        self.opened: set[str] = set()  # partners whose offer we accepted this round (one each, committed or not)
        self.outgoing: set[str] = set()  # our offers in flight
        self.incoming: dict[str, float] = {}  # accepted offers in flight → when their initiator gives up (monotonic)
        self.offered_bytes: dict[str, int] = {}  # partner → the bytes of its payload we read (exchanges it opened)
        self.answered = [0, 0]  # bytes sent and received in the exchanges partners opened with us and committed
        self.closing = self.closed = False
        self.hold_until = 0.0  # until when (monotonic) partners not yet in this round may hold our offers
        self.give_up_at = 0.0  # until when (monotonic) partners not yet in this round are asked again
        self.idle = asyncio.Event()  # set while no accepted offer is in flight
        self.idle.set()

    def free_slots(self) -> int:
        return self.degree_cap - len(self.done) - len(self.outgoing) - len(self.incoming)

    def reserve_outgoing_(self, partner: str) -> bool:
        """Take a slot for an offer of ours; False when full, closing, or already mixing with `partner`."""
        partnered = partner in self.done or partner in self.outgoing or partner in self.incoming
        if self.closing or self.free_slots() <= 0 or partnered or partner == self.own_id:
            return False
        self.outgoing.add(partner)
        return True

    def accept_(self, sender: str, round_: int, gives_up_at: float) -> str | None:
        """Take a slot for `sender`'s offer, or return why not. One exchange per pair and round: when both offer
        to each other at once, the offer of the lower peer id is the one accepted; a second offer from a partner
        whose first one we accepted (and it did not commit) is one too many."""
        if round_ > self.round + self.round_gap or (self.closing and round_ > self.round):
            return Refusal.WRONG_ROUND  # it is ahead of us: it asks again when we have reached its round
        if round_ < self.round - self.round_gap or self.closing:
            return Refusal.ROUND_OVER
        if sender == self.own_id or sender in self.done or sender in self.incoming or (
                sender in self.outgoing and not sender < self.own_id):
            return Refusal.ALREADY_PARTNERS
        if sender in self.opened:
            return Refusal.TOO_MANY_OFFERS
        if self.free_slots() + (sender in self.outgoing) <= 0:  # our offer to `sender` is about to be refused
            return Refusal.BUSY
        self.opened.add(sender)
        self.incoming[sender] = gives_up_at
        self.idle.clear()
        return None

    def takes_round(self, round_: int) -> bool:
        """Whether a partner's value of round `round_` may be mixed with ours (within `round_gap` of our round)."""
        return abs(round_ - self.round) <= self.round_gap

    def may_apply(self, partner: str) -> bool:
        """Whether a commit from `partner` may still be applied (not after `close_`, not twice)."""
        return not (self.closed or partner in self.done)

    def applied_(self, partner: str, outgoing: bool, sent_bytes: int) -> None:
        """`partner`'s value is applied; an exchange it opened counts its bytes (`sent_bytes`: what we sent it;
        ours are counted where we open them)."""
        self.done.append(partner)
        if not outgoing:
            self.answered[0] += sent_bytes
            self.answered[1] += self.offered_bytes.pop(partner, 0)

    def release_(self, partner: str, outgoing: bool) -> None:
        """An exchange ended (applied or not): free its slot in flight."""
        if outgoing:
            self.outgoing.discard(partner)
        else:
            self.incoming.pop(partner, None)
            if not self.incoming:
                self.idle.set()

    def begin_close_(self) -> float:
        """Refuse offers from now on; return the seconds until accepted ones in flight must have ended."""
        self.closing = True
        return max(self.incoming.values(), default=0.0) - time.monotonic()

    def close_(self) -> None:
        self.closing = self.closed = True


class OfferingRound(Protocol):
    """The initiator's side of a round (a Mix2 round, an all-reduce stage, one parameter mix): what it sends each
    partner and how a partner's answer is applied; the driver keeps its `slots`."""

    round: int
    weight: float  # the mixing weight our offers carry
    keeps_unconfirmed_mix: bool  # whether a partner's value whose ack was lost is applied
    # whether its exchanges carry a value, not a digest's token: they measure the link, and a replay is judged
    measures_link: bool
    sent: list[torch.Tensor]  # our value, the yardstick a partner's is decoded against
    slots: RoundSlots

    @property
    def own_work(self) -> OwnWork | None:  # where partners' values are outer gradients judged for their work: ours
        ...

    def value_for(self, partner: str, codec: str | None) -> tuple[str, Payload]:
        """The codec and payload we send `partner`: in our offer (`codec` None: ours to choose), or in our answer to
        its offer in `codec`; ValueError when our value cannot be sent."""
        ...

    def agree_weight(self, claimed: object) -> float | None:
        """The weight we mix with, given the one the partner's offer or answer carries; None if none can be agreed
        (an offer is then refused, an answer penalised)."""
        ...

    def apply_(self, partner: str, theirs: Sequence[torch.Tensor], outgoing: bool, weight: float) -> None:
        """A committed exchange: apply `theirs` at `weight`; raises RoundClosed once `slots.may_apply` says no."""
        ...

    def release_(self, partner: str, outgoing: bool) -> None:
        """An exchange ended, applied or not (`slots.release_`)."""
        ...


class AnsweringRound(Protocol):
    """The responder's side of a round: which offers it takes, what it answers, and how it applies them."""

    round: int
    extra_offers_offend: bool  # whether an offer beyond a partner's share is an offence (else only refused)
    measures_link: bool  # as OfferingRound's: whether a replay of a partner's value is judged
    slots: RoundSlots

    @property
    def own_work(self) -> OwnWork | None:  # as OfferingRound's
        ...

    @property
    def sent(self) -> list[torch.Tensor]:  # our value as answered, the yardstick a partner's is decoded against
        ...

    def value_for(self, partner: str, codec: str | None) -> tuple[str, Payload]: ...

    def agree_weight(self, claimed: object) -> float | None: ...

    def accept_(self, sender: str, round_: int, gives_up_at: float) -> str | None:
        """Take `sender`'s offer of round `round_` (a slot, a share), or say why not."""
        ...

    def apply_(self, partner: str, theirs: Sequence[torch.Tensor], outgoing: bool, weight: float) -> None: ...

    def release_(self, partner: str, outgoing: bool) -> None: ...


class ExchangeRound(OfferingRound, AnsweringRound, Protocol):
    """A round both ends of which are this one object (Mix2, an all-reduce stage): the same value for every
    partner, one exchange per pair, and a close."""

    def close_(self) -> list[torch.Tensor] | None:
        """Close for good; what the round mixed (None: nothing)."""
        ...


class GroupRound(ExchangeRound, Protocol):
    """A stage of an all-reduce: it learns how each exchange it opened ended."""

    def ended_(self, partner: str, outcome: str) -> None: ...


class ExchangePolicy(Protocol):
    """What a transport says about the values its rounds exchange."""

    def decode_partner(self, rnd: Any, header: dict[str, Any], payload: Payload) -> list[torch.Tensor]:
        """The partner's value, or ValueError if it is unfit (the initiator then penalises the partner)."""
        ...

    def clip_partner(self, rnd: Any, partner: str, theirs: list[torch.Tensor],
                     header: dict[str, Any]) -> list[torch.Tensor]:
        """What we apply in place of the partner's decoded value (`header`: its claims, for an excuse)."""
        ...

    def stand_in(self, rnd: Any, partner: str, theirs: list[torch.Tensor]) -> list[torch.Tensor]:
        """What we apply in place of a value that showed no work (idle or replayed: `ExchangeDriver.judge_value`)."""
        ...

    def note_partner(self, rnd: Any, partner: str, header: dict[str, Any]) -> None:
        """A partner's header, once its payload passed the checks (unverified claims)."""
        ...

    def header_extra(self) -> dict[str, Any]:
        """Fields added to every header we send, offers and answers."""
        ...


def same_round(rnd: OfferingRound, header: dict[str, Any]) -> None:
    """ValueError unless the partner's answer is for a round we take (a stage's exchanges are of that stage only;
    a gossip Mix2 may take rounds within its `round_gap`)."""
    their_round = header.get("round")
    if type(their_round) is not int or not rnd.slots.takes_round(their_round):
        raise ValueError(f"partner answered for round {their_round}, not {rnd.round}"
                         + (f" ± {rnd.slots.round_gap}" if rnd.slots.round_gap else ""))


def transfer_s(answer: dict[str, Any], seconds: float) -> float | None:
    """An exchange's transfer time: its `seconds` less what the responder says it held our offer (its word: it may
    halve the time at most, or the exchange measures nothing; so a lie fakes a link twice as fast at most)."""
    if type(held_s := answer.get("held_s", 0.0)) is not float or not 0.0 <= held_s <= seconds / 2:
        return None
    return seconds - held_s


class Incoming:
    """The responder's side of one accepted exchange: answers with our payload, applies on commit at `weight`."""

    def __init__(self, driver: ExchangeDriver, rnd: AnsweringRound, sender: str, codec: str, weight: float):
        self.driver, self.rnd, self.sender, self.weight = driver, rnd, sender, weight
        self.opened = time.monotonic()
        codec, self.payload = rnd.value_for(sender, codec)
        self.header = {"codec": codec, "round": rnd.round, "weight": weight, **driver.policy.header_extra()}

    def validate(self, partner_header: dict[str, Any], partner_payload: Payload) -> Apply:
        policy = self.driver.policy
        theirs = policy.decode_partner(self.rnd, partner_header, partner_payload)
        theirs = self.driver.value_to_apply(self.rnd, self.sender, partner_header, theirs)
        policy.note_partner(self.rnd, self.sender, partner_header)
        self.rnd.slots.offered_bytes[self.sender] = payload_bytes(partner_payload)
        self.driver.failed_partners.reached_(self.sender)  # its whole payload reached us: it is not cut off
        exchange_bytes = payload_bytes(partner_payload) + payload_bytes(self.payload)

        def apply() -> None:  # on its commit, once it had our payload too
            self.rnd.apply_(self.sender, theirs, outgoing=False, weight=self.weight)
            if self.rnd.measures_link:
                self.driver.links.answered_(exchange_bytes, time.monotonic() - self.opened)
        return apply

    def close(self) -> None:
        self.rnd.release_(self.sender, outgoing=False)


class ExchangeDriver:
    """One kind of round exchange for one peer (`kind`: "mix2", "allreduce.diloco", ...): `open` and `hold` answer
    offers for the current round, `open_in_turn` and `open_all` make ours, `close_round` ends a round.

    `p2p` None makes a driver of no exchanges (a policy's maths alone, as benchmarks' in-process simulations use it).
    `links` is the peer's one table of measured links, `reputation` its one record of offences, `routes` who it can
    open streams to and how; `codecs` the codecs offers may name. `offer_limit`, if any, is each partner's token
    bucket of offers (one over it is penalised); `holds_offers` whether an offer for a round we are about to reach
    is held (round_gate.py) rather than judged at once."""

    def __init__(self, p2p: P2P | None, run_id: str, fingerprint: str, kind: str, config: SyncConfig,
                 policy: ExchangePolicy, codecs: Collection[str], max_payload_bytes: int,
                 links: LinkSpeeds | None = None, reputation: Reputation | None = None, routes: Routes | None = None,
                 offer_limit: OfferLimit | None = None, holds_offers: bool = True,
                 contributions: Contributions | None = None):
        self.p2p, self.run_id, self.fingerprint, self.kind, self.config = p2p, run_id, fingerprint, kind, config
        self.policy, self.codecs, self.max_payload_bytes = policy, codecs, max_payload_bytes
        self.own_id = p2p.peer_id.to_base58() if p2p is not None else ""  # None: a policy's maths, no exchanges
        self.namespace, self.chunk_timeout_s = f"{run_id}.{kind}", config.state_download_timeout_s
        self.links = links if links is not None else LinkSpeeds()
        self.reputation = reputation if reputation is not None else Reputation()
        self.routes = routes if routes is not None else Routes("")
        self.gate = RoundGate()  # the round we are in, and offers held for the next one
        self.relay_retries = RelayRetries()  # group members whose relay route fails: asked again in one round only
        self.failed_partners = FailedPartners()  # gossip partners whose exchange failed: not drawn for a few rounds
        self.replays = ReplayCheck()  # partners' values, to tell one sent again for a later round
        self.work_replays = ReplayCheck()  # and their work samples (GASLoC's headers)
        # what partners' outer gradients showed of their work: the peer's one ledger, where it keeps one
        self.contributions = contributions if contributions is not None else Contributions()
        self.offer_limit, self.holds_offers = offer_limit, holds_offers
        self._current: Any = None

    def value_to_apply(self, rnd: AnsweringRound | OfferingRound, partner: str, header: dict[str, Any],
                       theirs: list[torch.Tensor]) -> list[torch.Tensor]:
        """What we apply for a partner's decoded value, either end of an exchange: the policy's `clip_partner` of
        it, or its `stand_in` where the value showed no work (`judge_value`)."""
        if self.judge_value(rnd, partner, header, theirs):
            return self.policy.clip_partner(rnd, partner, theirs, header)
        return self.policy.stand_in(rnd, partner, theirs)

    def judge_value(self, rnd: AnsweringRound | OfferingRound, partner: str, header: dict[str, Any],
                    theirs: Sequence[torch.Tensor]) -> bool:
        """With `sync.robust`: a value the partner sent, bit for bit, for an earlier round it claimed is an offence
        (`replay_check`); an outer gradient far shorter than ours (for parameters, the sample of one its header shows)
        is one too, and otherwise verifies the tokens the partner claims for it (`contribution`). A stage whose
        payload is a token (an all-reduce's confirmation: the digest is in the header) is not judged. False: the
        value showed no work, and the policy's `stand_in` is applied for it: a gossip partner's is not mixed, an
        all-reduce member's is reduced as it came (every member must reduce the same inputs; the reduce leaves an
        idle one out)."""
        if not self.config.robust or not rnd.measures_link:
            return True
        claimed_round = header.get("round")
        replayed = self.replays.repeats(partner, claimed_round, theirs)
        if replayed:
            self.reputation.penalise(partner, "replayed", f"its value for round {claimed_round} is the one it "
                                                          f"sent for an earlier round, bit for bit")
        own = rnd.own_work
        if own is None or type(claimed_round) is not int:
            return not replayed
        if own.sample is None:
            theirs_norm = norm(theirs)
        else:  # parameters: the sample of an outer gradient the header shows (none valid: no work shown)
            sample = shown_sample(header)
            replayed = self._replays_work_sample(partner, claimed_round, sample) or replayed
            theirs_norm = sample_length(sample) if sample is not None else 0.0
        if self.contributions.judge_(partner, claimed_round, claimed_tokens(header), theirs_norm, own.norm,
                                     own.tokens, replayed):
            shown = "outer gradient" if own.sample is None else "outer gradient's sample"
            self.reputation.penalise(partner, "idle", f"its {shown} for round {claimed_round} is "
                                                      f"{theirs_norm:.3g} long, ours {own.norm:.3g}: no training")
            return False
        return not replayed

    def _replays_work_sample(self, partner: str, claimed_round: int, sample: list[float] | None) -> bool:
        """Whether the work sample a partner's header shows is, bit for bit, one it showed for an earlier round (an
        offence, as a replayed value is): a stale Δ. A sample of zeros (a round that took no step) is idle, not this."""
        if sample is None or not any(sample):
            return False
        if not self.work_replays.repeats(partner, claimed_round, [torch.tensor(sample, dtype=torch.float64)]):
            return False
        self.reputation.penalise(partner, "replayed", f"its work sample for round {claimed_round} is the one it "
                                                      f"showed for an earlier round, bit for bit")
        return True

    @property
    def current(self) -> Any:  # the latest round (closed once its exchange returned)
        return self._current

    @current.setter
    def current(self, rnd: AnsweringRound) -> None:
        self._current = rnd
        self.gate.advance_(rnd.round)

    # ---- responder ------------------------------------------------------------------------------------------------
    def hold(self, header: dict[str, Any]) -> Awaitable[Any] | None:
        """Hold an offer for a round we are a moment from reaching (round_gate.py), at most our patience."""
        round_, hold_s = header.get("round"), offered_hold_s(header, self.config.matchmaking_s)
        if not self.holds_offers or type(round_) is not int or hold_s <= 0 or not self.gate.may_hold(round_):
            return None
        slots = self.current.slots if self.current is not None else None
        if slots is not None and not slots.closing and slots.takes_round(round_):
            return None  # our open round takes it now
        return self.gate.wait_for(round_, hold_s)

    def open(self, header: dict[str, Any]) -> OpenExchange | str:
        """Accept an offer for our current round once its value is set, as the round allows; refuse anything else.

        Offers name their sender (one exchange per pair and round) and their deadline (how long our close waits
        for them); both are the initiator's word, and the deadline is capped by `allreduce_timeout_s`."""
        if header.get("run_id") != self.run_id or header.get("fingerprint") != self.fingerprint:
            return Refusal.OTHER_RUN
        if header.get("kind") != self.kind or header.get("codec") not in self.codecs:
            return Refusal.UNSUPPORTED
        sender, round_, deadline_s = header.get("sender"), header.get("round"), header.get("deadline_s")
        if not isinstance(sender, str) or not isinstance(round_, int) or not isinstance(deadline_s, (int, float)):
            return Refusal.MALFORMED
        rnd = self.current
        if rnd is None or (self.gate.closed and round_ > rnd.round):  # no value for that round, nor will there be
            return Refusal.LEAVING if self.gate.closed else Refusal.WRONG_ROUND  # the initiator asks again
        weight = rnd.agree_weight(header.get("weight"))
        if weight is None:
            return Refusal.BAD_WEIGHT
        if self.offer_limit is not None and not self.offer_limit.offer(sender):
            self.reputation.penalise(sender, "too_many_opens", "offers arrive faster than any partner needs")
            return Refusal.TOO_MANY_OFFERS
        gives_up_at = time.monotonic() + min(max(0.0, float(deadline_s)), self.config.allreduce_timeout_s)
        refusal = rnd.accept_(sender, round_, gives_up_at)
        if refusal == Refusal.TOO_MANY_OFFERS and rnd.extra_offers_offend:
            self.reputation.penalise(sender, "too_many_opens", f"a second exchange opened in round {round_}")
        if refusal is not None:
            return refusal
        try:
            return Incoming(self, rnd, sender, str(header["codec"]), weight)
        except ValueError as e:  # our own value is not finite (or what the conduct formed does not encode)
            logger.warning(f"not answering {sender}: our value cannot be sent ({e})")
            rnd.release_(sender, outgoing=False)
            return Refusal.NO_VALUE

    # ---- initiator ------------------------------------------------------------------------------------------------
    async def open_in_turn(self, rnd: OfferingRound, live_peers: list[str], patience_s: float, stats: RoundSync,
                           rng: random.Random, announced: Mapping[str, float] | None = None) -> None:
        """Offer our payload to random live peers (a host's identities counted as one: `draw_order_by_host`), one
        after another, until the round's slots are taken or nobody is left to ask: those we reach directly first,
        then those behind relays; peers nobody can reach offer theirs to us instead. Those not in our round yet are
        asked again (`retry_delay_s`) up to `patience_s`, or until `rnd.slots.give_up_at` if the round's owner moves
        it. Peers whose last exchanges we opened failed sit out a few rounds (`FailedPartners`), and once failed
        exchanges took `SETUP_FLOOR_S` of this round, it opens no more: at a cut, the first dead partner costs the
        round its deadline, a second one nothing. `announced`: partners' announced link speeds, what their time-outs
        may bound their links to at the slowest (`LinkSpeeds.timed_out_`)."""
        rnd.slots.give_up_at, attempt, failing_s = time.monotonic() + patience_s, 0, 0.0
        candidates = self.failed_partners.drawable([p for p in live_peers if not self.reputation.is_banned(p)],
                                                   rnd.round)
        while candidates and rnd.slots.free_slots() > 0:
            later, hosts = [], await self._hosts_of(candidates)
            for partner in [p for pool in self.routes.pools(candidates)
                            for p in draw_order_by_host(pool, hosts, rng)]:
                if failing_s >= SETUP_FLOOR_S:
                    return
                if not rnd.slots.reserve_outgoing_(partner):
                    continue
                started = time.monotonic()
                outcome = await self.exchange_with(rnd, partner, stats,
                                                   slow_if_timed_out=self.failed_partners.failed_before(partner),
                                                   claimed_bytes_per_s=(announced or {}).get(partner))
                if outcome in ASK_AGAIN:
                    later.append(partner)
                elif outcome == Outcome.FAILED:
                    self.failed_partners.failed_(partner, rnd.round)
                    failing_s += time.monotonic() - started
                elif outcome == Outcome.OK:
                    self.failed_partners.reached_(partner)
            if not later or time.monotonic() >= rnd.slots.give_up_at:
                return
            candidates = later
            await asyncio.sleep(retry_delay_s(attempt))
            attempt += 1

    async def open_all(self, rnd: GroupRound, members: list[str], patience_s: float, stats: RoundSync,
                       round_: int) -> None:
        """Open exchanges with all of `members` at once (of round `round_`); a member a moment from our stage holds
        our offer until it gets there (round_gate.py), and one that refuses it as not in its stage yet, or whose
        relay failed for the first round, is asked again (`retry_delay_s`), for up to `patience_s` in all."""
        give_up_at, attempt = time.monotonic() + patience_s, 0
        rnd.slots.hold_until = give_up_at
        candidates = sorted(p for p in members if not self.reputation.is_banned(p))
        while candidates:
            reserved = [p for p in candidates if rnd.slots.reserve_outgoing_(p)]
            outcomes = await asyncio.gather(*(self._exchange_in_group(rnd, p, stats, round_) for p in reserved))
            candidates = [p for p, outcome in zip(reserved, outcomes, strict=True)
                          if outcome in ASK_AGAIN or outcome == Outcome.RELAY_FAILED]
            if not candidates or time.monotonic() >= give_up_at:
                return
            await asyncio.sleep(retry_delay_s(attempt))
            attempt += 1

    async def _exchange_in_group(self, rnd: GroupRound, partner: str, stats: RoundSync, round_: int) -> str:
        """One exchange we open with a group member; a failure through its relay is RELAY_FAILED in the first round it
        fails (`RelayRetries`). The round learns how it ended."""
        outcome = await self.exchange_with(rnd, partner, stats)
        if outcome == Outcome.OK:
            self.relay_retries.reached_(partner)
        elif outcome == Outcome.FAILED and self.routes.route_to(partner) is not None and \
                self.relay_retries.ask_again_(partner, round_):
            outcome = Outcome.RELAY_FAILED
        rnd.ended_(partner, outcome)
        return outcome

    async def exchange_with(self, rnd: OfferingRound, partner: str, stats: RoundSync,
                            slow_if_timed_out: bool = True, claimed_bytes_per_s: float | None = None) -> str:
        """One exchange we start (its slot is reserved); returns OK, FAILED, NO_VALUE or the partner's refusal.
        `slow_if_timed_out`: a time-out bounds the link's speed (the next deadline grows). Gossip takes only a second
        time-out in a row for that: one is as likely a partner gone or a connection gone stale at a cut.
        `claimed_bytes_per_s`: the partner's announced speed, below which a time-out on a direct route does not
        bound its link (`LinkSpeeds.timed_out_`); a relay's route is as slow as the relay, whatever it says."""
        try:
            codec, ours = rnd.value_for(partner, None)
        except ValueError as e:  # what the conduct formed is not finite
            logger.warning(f"not offering to {partner}: our value cannot be sent ({e})")
            rnd.release_(partner, outgoing=True)
            return Refusal.NO_VALUE
        nbytes, hold_s = payload_bytes(ours), max(0.0, rnd.slots.hold_until - time.monotonic())
        deadline_s = min(self.config.allreduce_timeout_s,
                         self.links.deadline_s(partner, 2 * nbytes, self.config.exchange_safety_factor))
        header = {"run_id": self.run_id, "fingerprint": self.fingerprint, "kind": self.kind, "round": rnd.round,
                  "codec": codec, "weight": rnd.weight, "sender": self.own_id, "deadline_s": deadline_s,
                  **self.policy.header_extra()}

        def validate(answer: dict[str, Any], payload: Payload) -> Apply:
            try:
                if (weight := rnd.agree_weight(answer.get("weight", rnd.weight))) is None:
                    raise ValueError(f"partner answered the mixing weight {answer.get('weight')!r}")
                theirs = self.policy.decode_partner(rnd, answer, payload)
            except ValueError as e:
                self.reputation.penalise(partner, "invalid_payload", str(e))
                raise
            theirs = self.value_to_apply(rnd, partner, answer, theirs)
            self.policy.note_partner(rnd, partner, answer)
            return lambda: rnd.apply_(partner, theirs, outgoing=True, weight=weight)

        try:
            if self.p2p is None:
                raise RuntimeError("this driver has no P2P: it makes no exchanges")
            outcome = await push_pull(self.p2p, PeerID.from_base58(partner), self.namespace, header, ours,
                                      validate, self.max_payload_bytes, deadline_s, self.routes.route_to(partner),
                                      hold_s, keep_unconfirmed=rnd.keeps_unconfirmed_mix, ticket=self.routes.ticket)
            outcome.apply()
        except ExchangeRefused as e:
            logger.debug(f"{partner} refused round {rnd.round}'s {self.kind}: {e}")
            stats.refused += int(str(e) not in ASK_AGAIN)
            return str(e)
        except UngrantedHold as e:
            self.reputation.penalise(partner, "held_ungranted", str(e))
            stats.failed += 1
            return Outcome.FAILED
        except Exception as e:  # WireError, ValueError, timeouts, P2P errors: nothing was applied here
            logger.info(f"{self.kind} exchange with {partner} failed: {e!r}")
            stats.failed += 1
            # a missing ack after both payloads crossed (UnconfirmedMix) says nothing of the link's speed; taken for
            # a bound, one lost ack made two fast peers look slow to each other for good (neither asked again)
            timed_out = getattr(e, "timed_out", isinstance(e, (asyncio.TimeoutError, TimeoutError)))
            if timed_out and rnd.measures_link and not isinstance(e, UnconfirmedMix):
                claimed = claimed_bytes_per_s if self.routes.route_to(partner) is None else None
                self.links.timed_out_(partner, 2 * nbytes, deadline_s, bounds_link=slow_if_timed_out,
                                      claimed_bytes_per_s=claimed, host=(await self._hosts_of([partner])).get(partner))
            return Outcome.FAILED
        finally:
            rnd.release_(partner, outgoing=True)
        measured_s = transfer_s(outcome.partner_header, outcome.seconds)
        if rnd.measures_link and measured_s is not None and outcome.confirmed:
            self.links.completed_(partner, outcome.bytes_sent + outcome.bytes_received, measured_s)
        stats.add_exchange_(ExchangeRecord(partner, codec, outcome.bytes_sent, outcome.bytes_received,
                                           outcome.seconds))
        return Outcome.OK

    async def _hosts_of(self, peers: list[str]) -> dict[str, str | None]:
        """The host each of `peers` connects from, as far as our connections say (`RemoteHosts`; none without a
        P2P)."""
        return await RemoteHosts.of(self.p2p).hosts_of(peers) if self.p2p is not None else {}

    # ---- the round's end ------------------------------------------------------------------------------------------
    async def close_round(self, rnd: ExchangeRound, stats: RoundSync) -> list[torch.Tensor] | None:
        """Refuse offers from now on, give accepted exchanges in flight the time they have, then close the round:
        what it mixed (`rnd.close_()`); the bytes of the exchanges partners opened are added to `stats`."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(rnd.slots.idle.wait(), max(0.0, rnd.slots.begin_close_()))
        mixed = rnd.close_()
        stats.bytes_sent += rnd.slots.answered[0]
        stats.bytes_received += rnd.slots.answered[1]
        return mixed
