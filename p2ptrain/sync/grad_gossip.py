"""Factored's Mix2 as gossip: each peer swaps one compressed outer gradient with 1–2 random peers of its round.

At the end of round t peer i computes, once, s_i = decode(codec(β·e_i + Δ_i)) (error feedback's prepare step)
and keeps the encoded payload: every partner gets the same bytes and decodes them with the same function, so
what it mixes is s_i bit for bit. An exchange between i and j moves m_i by w(s_j − s_i) and m_j by w(s_i − s_j),
always from the original s values, with w = 1/(D+1) and each peer in at most D = mix2_group_size − 1 exchanges of
the round (those it starts plus those it accepts). The round's mixing matrix is then symmetric, doubly stochastic
and nonnegative, so Σ_i m_i = Σ_i s_i.

If at least one exchange completed, the peer applies m_i and commits e_i ← β·e_i + Δ_i − s_i; if none did, it
applies its exact Δ_i and keeps e_i (nothing sent, nothing subtracted). Exchanges use net/exchange.py's push-pull
protocol, so a refused, failed or invalid exchange changes nothing on either side. Closing a round is atomic:
offers are refused from then on, accepted ones in flight get until their initiator's deadline, and a commit that
arrives later raises instead of mixing (the partner then gets no ack and does not mix either).

The error-feedback buffers are outer state (`state_tensors`): checkpoints keep them, and a joiner starts from its
donor's (so the donor's unsent remainder is held twice for a while: a one-off bias of at most ‖e‖/N per joiner).
Everything here runs on the peer's event loop; `Mix2Round`'s methods never await, so each of them is atomic.

Partners are untrusted (issue 9): a partner's s must decode, be finite and lie within `max_partner_distance` × ‖s_i‖
of ours (else the exchange fails and, on our side as initiator, the partner is penalised); with `sync.robust` it is
then clipped to τ from s_i (maths/robust.py, τ's yardstick ‖s_i‖), so an exchange moves m_i by at most w·τ, and a
partner clipped hard is penalised. A partner opens at most one exchange with us per round, committed or not. The s
we send is formed by `outgoing`. Clipping gives up the exact Σ_i m_i = Σ_i s_i for pairs farther apart than τ.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Sequence
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID

from p2ptrain.maths.codecs import Codec, ErrorFeedback, compress_all, decode_all, get_codec
from p2ptrain.maths.mixing import consensus_distance, pull_toward_, uniform_weight
from p2ptrain.maths.pacing import LinkSpeeds
from p2ptrain.maths.robust import AdaptiveClip
from p2ptrain.maths.topology import draw_partners
from p2ptrain.net.exchange import Apply, ExchangeRefused, OpenExchange, Payload, push_pull
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.routes import Routes
from p2ptrain.net.wire import payload_bytes
from p2ptrain.sync.config import GRAD_CODECS, SPARSE_GRAD_CODECS, SyncConfig
from p2ptrain.sync.interface import HONEST, Conduct, ExchangeRecord, RoundSync
from p2ptrain.sync.param_gossip import TOO_MANY_OFFERS, WRONG_ROUND
from p2ptrain.sync.round_gate import LEAVING, RoundGate, offered_hold_s
from p2ptrain.sync.round_retry import retry_delay_s
from p2ptrain.tensor_layout import norm

logger = logging.getLogger(__name__)

KIND = "mix2"
ROUND_OVER = "round over"  # the responder's Mix2 of that round has closed (or it is already past that round)
ALREADY_PARTNERS = "already partners"  # mixed, mixing, or the partner's own offer to us is the one that counts
# refusals after which an offer is made again (`retry_delay_s`, up to the round's patience): the partner has not
# reached our round, or its offer to us crossed ours and may itself have been refused as not in our round yet
ASK_AGAIN = (WRONG_ROUND, ALREADY_PARTNERS)


def outer_gradient_codec(config: SyncConfig) -> Codec:
    """The codec `sync.grad_codec` names, with its options (`topk_density`, `topk_chunk_size`, `sparse_bits`)."""
    sparse = config.grad_codec in SPARSE_GRAD_CODECS
    options: dict[str, Any] = {"density": config.topk_density, "chunk_size": config.topk_chunk_size} if sparse else {}
    if config.grad_codec == "sparse":
        options["bits"] = config.sparse_bits
    return get_codec(config.grad_codec, **options)


def transfer_s(answer: dict[str, Any], seconds: float) -> float | None:
    """An exchange's transfer time: its `seconds` less what the responder says it held our offer (its word: it may
    halve the time at most, or the exchange measures nothing; so a lie fakes a link twice as fast at most)."""
    if type(held_s := answer.get("held_s", 0.0)) is not float or not 0.0 <= held_s <= seconds / 2:
        return None
    return seconds - held_s


class RoundClosed(RuntimeError):
    """A commit after the round closed: raised in the servicer's apply, so no ack goes out and neither side mixes."""


class Mix2Round:
    """One peer's Mix2 of one round: its s and payload, the running mix m, and who it is mixing with."""
    keeps_unconfirmed_mix = False  # a gossip mix whose ack was lost is not applied (the partner may not have)

    def __init__(self, round_: int, own_id: str, sent: list[torch.Tensor], payload: Payload, codec: str,
                 degree_cap: int, own_scale: float | None = None):
        self.round, self.own_id, self.sent, self.payload, self.codec = round_, own_id, sent, payload, codec
        self.degree_cap = degree_cap
        self.weight = uniform_weight(degree_cap)
        self.own_scale = own_scale if own_scale is not None else norm(sent)  # τ's yardstick: ‖s_i‖
        self.mixed = [s.clone() for s in sent]
        self.done: list[str] = []  # partners whose mix is applied, in the order it was
        self.opened: set[str] = set()  # partners whose offer we accepted this round (one each, committed or not)
        self.outgoing: set[str] = set()  # our offers in flight
        self.incoming: dict[str, float] = {}  # accepted offers in flight → when their initiator gives up (monotonic)
        self.offered_bytes: dict[str, int] = {}  # partner → the bytes of its payload we read (exchanges it opened)
        self.answered = [0, 0]  # bytes sent and received in the exchanges partners opened with us and committed
        self.closing = self.closed = False
        self.hold_until = 0.0  # until when (monotonic) partners not yet in this round may hold our offers
        self.idle = asyncio.Event()  # set while no accepted offer is in flight
        self.idle.set()

    def payload_for(self, partner: str) -> Payload:
        """What we send `partner` (the same s to every partner here; a reduce-scatter sends each its chunk)."""
        return self.payload

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
        if round_ > self.round:
            return WRONG_ROUND  # it is ahead of us: it asks again when we have reached its round
        if round_ < self.round or self.closing:
            return ROUND_OVER
        if sender == self.own_id or sender in self.done or sender in self.incoming or (
                sender in self.outgoing and not sender < self.own_id):
            return ALREADY_PARTNERS
        if sender in self.opened:
            return TOO_MANY_OFFERS
        if self.free_slots() + (sender in self.outgoing) <= 0:  # our offer to `sender` is about to be refused
            return "busy"
        self.opened.add(sender)
        self.incoming[sender] = gives_up_at
        self.idle.clear()
        return None

    def apply_(self, partner: str, theirs: Sequence[torch.Tensor], outgoing: bool) -> None:
        """A completed exchange: m ← m + w(s_partner − s). Raises RoundClosed after `close_` (nothing changes)."""
        if self.closed or partner in self.done:
            raise RoundClosed(f"round {self.round}'s Mix2 closed (or mixed with {partner}) before this commit")
        pull_toward_(self.mixed, theirs, self.sent, self.weight)
        self.done.append(partner)
        self.count_answered_(partner, outgoing)
        self.release_(partner, outgoing)

    def count_answered_(self, partner: str, outgoing: bool) -> None:
        """Count the bytes of a committed exchange `partner` opened (ours are counted where we open them)."""
        if not outgoing:
            self.answered[0] += payload_bytes(self.payload_for(partner))
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

    def close_(self) -> list[torch.Tensor] | None:
        """Close for good: m, or None when no exchange completed (the caller then applies its own Δ)."""
        self.closing = self.closed = True
        return self.mixed if self.done else None


class _Incoming:
    """The responder's side of one accepted exchange: answers with our payload, mixes on commit."""

    def __init__(self, gossip: GradGossip, rnd: Mix2Round, sender: str):
        self.gossip, self.rnd, self.sender = gossip, rnd, sender
        self.header = {"codec": rnd.codec, "round": rnd.round, **gossip.header_extra()}
        self.payload = rnd.payload_for(sender)

    def validate(self, partner_header: dict[str, Any], partner_payload: Payload) -> Apply:
        theirs = self.gossip.decode_partner(self.rnd, partner_header, partner_payload)
        theirs = self.gossip.clip_partner(self.rnd, self.sender, theirs)
        self.gossip.note_partner(self.rnd, self.sender, partner_header)
        self.rnd.offered_bytes[self.sender] = payload_bytes(partner_payload)
        return lambda: self.rnd.apply_(self.sender, theirs, outgoing=False)

    def close(self) -> None:
        self.rnd.release_(self.sender, outgoing=False)


class GradGossip:
    """Mix2 over gossip for one peer: `open` answers offers, `mix` runs a round's Mix2 (async, on the event loop)."""

    def __init__(self, p2p: P2P, run_id: str, fingerprint: str, like: Sequence[torch.Tensor], config: SyncConfig,
                 seed: int, links: LinkSpeeds | None = None, reputation: Reputation | None = None,
                 kind: str = KIND, error_feedback_decay: float | None = None, routes: Routes | None = None,
                 conduct: Conduct = HONEST):
        self.p2p, self.run_id, self.fingerprint, self.config, self.kind = p2p, run_id, fingerprint, config, kind
        self.routes = routes if routes is not None else Routes("")  # who we can open streams to, and how
        self.own_id, self.conduct = p2p.peer_id.to_base58(), conduct  # the conduct forms the s we send
        self.degree_cap = config.mix2_group_size - 1
        decay = config.error_feedback_decay if error_feedback_decay is None else error_feedback_decay
        self.feedback = ErrorFeedback(outer_gradient_codec(config), like, decay)
        self.max_payload_bytes, self.rng = sum(t.numel() * 4 for t in like) + 2**20, random.Random(seed)
        self.links = links if links is not None else LinkSpeeds()  # the peer's one table, shared with Mix1
        self.gate = RoundGate()  # the round we are in, and offers held for the next one
        self._current: Mix2Round | None = None
        self.namespace, self.chunk_timeout_s = f"{run_id}.{kind}", config.state_download_timeout_s
        self.reputation = reputation if reputation is not None else Reputation()  # the peer's one record of offences
        self.clip = AdaptiveClip(config.clip_multiplier) if config.robust else None

    @property
    def current(self) -> Mix2Round | None:  # the latest round's Mix2 (closed once `mix` returned)
        return self._current

    @current.setter
    def current(self, rnd: Mix2Round) -> None:
        self._current = rnd
        self.gate.advance_(rnd.round)

    # ---- one round ------------------------------------------------------------------------------------------------
    async def mix(self, delta: Sequence[torch.Tensor], live_peers: Sequence[str], round_: int,
                  patience_s: float) -> tuple[list[torch.Tensor], RoundSync]:
        """Blocking Mix2 of round `round_`: m (or Δ itself when no exchange completed) and what it cost.

        Peers not yet in our round are asked again (`retry_delay_s`) for up to `patience_s` seconds."""
        try:  # the codec's top-k over the whole model runs off the event loop, which keeps answering others
            payload, sent, scale = await asyncio.get_running_loop().run_in_executor(None, self._prepare, delta)
        except ValueError as e:  # non-finite Δ: nothing can be sent
            logger.warning(f"round {round_}: not mixing this outer gradient ({e})")
            return list(delta), RoundSync(codec=self.feedback.codec.name)
        rnd = self.current = Mix2Round(round_, self.own_id, sent, payload, self.feedback.codec.name, self.degree_cap,
                                       scale)
        stats = RoundSync(codec=rnd.codec)
        await self._initiate_all(rnd, list(live_peers), patience_s, stats)
        with contextlib.suppress(asyncio.TimeoutError):  # give accepted exchanges in flight the time they have
            await asyncio.wait_for(rnd.idle.wait(), max(0.0, rnd.begin_close_()))
        mixed = rnd.close_()
        stats.group_size = 1 + len(rnd.done)
        stats.bytes_sent += rnd.answered[0]
        stats.bytes_received += rnd.answered[1]
        if mixed is None:
            return list(delta), stats
        self.feedback.commit_(sent)
        return mixed, stats

    def _prepare(self, delta: Sequence[torch.Tensor]) -> tuple[Payload, list[torch.Tensor], float]:
        """(the payload we send, our s, ‖s‖); raises ValueError for a non-finite Δ."""
        payload, sent = self.feedback.prepare(delta)
        shown = self.outgoing(sent)
        if shown is not sent:  # an override formed something else: send that
            payload = compress_all(self.feedback.codec, shown)
        return payload, sent, norm(sent)

    async def _initiate_all(self, rnd: Mix2Round, live_peers: list[str], patience_s: float,
                            stats: RoundSync) -> None:
        """Offer our payload to random live peers until our D slots are taken or nobody is left to ask: those we
        reach directly first, then those behind relays; peers nobody can reach offer theirs to us instead."""
        give_up_at, attempt = time.monotonic() + patience_s, 0
        candidates = [p for p in live_peers if not self.reputation.is_banned(p)]
        while candidates and rnd.free_slots() > 0:
            later = []
            for partner in [p for pool in self.routes.pools(candidates)
                            for p in draw_partners(pool, len(pool), self.rng, exclude=set())]:
                if rnd.reserve_outgoing_(partner) and await self._exchange_with(rnd, partner, stats) in ASK_AGAIN:
                    later.append(partner)
            if not later or time.monotonic() >= give_up_at:
                return
            candidates = later
            await asyncio.sleep(retry_delay_s(attempt))
            attempt += 1

    async def _exchange_with(self, rnd: Mix2Round, partner: str, stats: RoundSync) -> str:
        """One exchange we start (its slot is reserved); returns "ok", "failed" or the partner's refusal."""
        ours = rnd.payload_for(partner)
        nbytes, hold_s = payload_bytes(ours), max(0.0, rnd.hold_until - time.monotonic())
        link = self.links.to(partner)
        deadline_s = min(self.config.allreduce_timeout_s,
                         self.links.deadline_s(partner, 2 * nbytes, self.config.exchange_safety_factor))
        header = {"run_id": self.run_id, "fingerprint": self.fingerprint, "kind": self.kind, "round": rnd.round,
                  "codec": rnd.codec, "weight": rnd.weight, "sender": self.own_id, "deadline_s": deadline_s,
                  **self.header_extra()}

        def validate(answer: dict[str, Any], payload: Payload) -> Apply:
            try:
                if answer.get("round") != rnd.round:
                    raise ValueError(f"partner answered for round {answer.get('round')}, not {rnd.round}")
                theirs = self.decode_partner(rnd, answer, payload)
            except ValueError as e:
                self.reputation.penalise(partner, "invalid_payload", str(e))
                raise
            theirs = self.clip_partner(rnd, partner, theirs)
            self.note_partner(rnd, partner, answer)
            return lambda: rnd.apply_(partner, theirs, outgoing=True)

        try:
            outcome = await push_pull(self.p2p, PeerID.from_base58(partner), self.namespace, header, ours,
                                      validate, self.max_payload_bytes, deadline_s, self.routes.route_to(partner),
                                      hold_s, keep_unconfirmed=rnd.keeps_unconfirmed_mix)
            outcome.apply()
        except ExchangeRefused as e:
            logger.debug(f"{partner} refused round {rnd.round}'s {self.kind}: {e}")
            stats.refused += int(str(e) not in ASK_AGAIN)
            return str(e)
        except Exception as e:  # WireError, ValueError, timeouts, P2P errors: nothing was applied here
            logger.info(f"{self.kind} exchange with {partner} failed: {e!r}")
            stats.failed += 1
            if getattr(e, "timed_out", isinstance(e, (asyncio.TimeoutError, TimeoutError))) and self.measures_link(rnd):
                link.update_timeout_(2 * nbytes, deadline_s)
            return "failed"
        finally:
            rnd.release_(partner, outgoing=True)
        measured_s = transfer_s(outcome.partner_header, outcome.seconds)
        if self.measures_link(rnd) and measured_s is not None and outcome.confirmed:
            link.update_(outcome.bytes_sent + outcome.bytes_received, measured_s)
        stats.add_exchange_(ExchangeRecord(partner, rnd.codec, outcome.bytes_sent, outcome.bytes_received,
                                           outcome.seconds))
        return "ok"

    # ---- responder ------------------------------------------------------------------------------------------------
    def hold(self, header: dict[str, Any]) -> Awaitable[Any] | None:
        """Hold an offer for a round we are a moment from reaching (round_gate.py), at most our patience."""
        round_, hold_s = header.get("round"), offered_hold_s(header, self.config.matchmaking_s)
        if type(round_) is not int or hold_s <= 0 or not self.gate.may_hold(round_):
            return None
        return self.gate.wait_for(round_, hold_s)

    def open(self, header: dict[str, Any]) -> OpenExchange | str:
        """Accept an offer for our current round once our s is set, within our degree cap; refuse anything else.

        Offers name their sender (one exchange per pair and round) and their deadline (how long our close waits
        for them); both are the initiator's word, and the deadline is capped by `allreduce_timeout_s`."""
        if header.get("run_id") != self.run_id or header.get("fingerprint") != self.fingerprint:
            return "another run or model"
        if header.get("kind") != self.kind or header.get("codec") not in GRAD_CODECS:
            return "unsupported exchange"
        sender, round_, deadline_s = header.get("sender"), header.get("round"), header.get("deadline_s")
        if not isinstance(sender, str) or not isinstance(round_, int) or not isinstance(deadline_s, (int, float)):
            return "malformed offer"
        rnd = self.current
        if rnd is None or round_ > rnd.round:  # our s for that round is not set yet: the initiator asks again
            return LEAVING if self.gate.closed else WRONG_ROUND  # unless we shut down
        if header.get("weight") != rnd.weight:
            return "bad mixing weight"
        gives_up_at = time.monotonic() + min(max(0.0, float(deadline_s)), self.config.allreduce_timeout_s)
        refusal = rnd.accept_(sender, round_, gives_up_at)
        if refusal == TOO_MANY_OFFERS:
            self.reputation.penalise(sender, "too_many_opens", f"a second exchange opened in round {round_}")
        return refusal if refusal is not None else _Incoming(self, rnd, sender)

    def decode_partner(self, rnd: Mix2Round, header: dict[str, Any], payload: Payload) -> list[torch.Tensor]:
        """The partner's s, or ValueError if it does not decode, does not fit our shapes, or is implausibly far."""
        theirs = [t.float() for t in decode_all(str(header.get("codec")), payload, like=rnd.sent)]
        distance = consensus_distance(rnd.sent, theirs)
        if not distance <= self.config.max_partner_distance:
            raise ValueError(f"partner's outer gradient is {distance:.3g}× ours away "
                             f"(bound {self.config.max_partner_distance})")
        return theirs

    def measures_link(self, rnd: Mix2Round) -> bool:
        """Whether a round's exchanges measure the link (they carry a payload, not a digest: a few bytes in a round
        trip would read as a slow link and stretch every later deadline; the all-reduce's confirmations do not)."""
        return True

    # ---- what else a header carries (nothing here; the all-reduce adds its agreement check) -------------------------
    def header_extra(self) -> dict[str, Any]:
        """Fields added to every header we send, offers and answers."""
        return {}

    def note_partner(self, rnd: Mix2Round, partner: str, header: dict[str, Any]) -> None:
        """A partner's header, once its payload passed the checks (unverified claims)."""

    # ---- robust mixing ---------------------------------------------------------------------------------------------
    def outgoing(self, sent: list[torch.Tensor]) -> list[torch.Tensor]:
        """What we send for our s, as the peer's conduct forms it: the s every partner receives (once a round)."""
        return self.conduct.sent_outer_gradient(sent)

    def clip_partner(self, rnd: Mix2Round, partner: str, theirs: list[torch.Tensor]) -> list[torch.Tensor]:
        """What we mix in place of the partner's s: s_i + clip(s_j − s_i, τ); a partner clipped hard is penalised."""
        if self.clip is None:
            return theirs
        clipped, gap, hard = self.clip.clip(partner, theirs, rnd.sent, rnd.own_scale)
        if hard and rnd.own_scale > 0:
            self.reputation.penalise(partner, "clipped", f"outer gradient {gap:.3g} from ours, ‖ours‖ "
                                                         f"{rnd.own_scale:.3g}")
        return clipped

    # ---- outer state ----------------------------------------------------------------------------------------------
    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"error_feedback:{i}", e) for i, e in enumerate(self.feedback.residual)]

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        self.feedback.load_state_dict({"decay": self.feedback.decay, "residual": list(tensors)})
