"""Factored's Mix2 as gossip: each peer swaps one compressed outer gradient with 1–2 random peers of its round
(or, with `sync.mix2_round_gap`, of a round that near).

At the end of round t peer i computes, once, s_i = decode(codec(β·e_i + Δ_i)) (error feedback's prepare step)
and keeps the encoded payload: every partner gets the same bytes and decodes them with the same function, so
what it mixes is s_i bit for bit. An exchange between i and j moves m_i by w(s_j − s_i) and m_j by w(s_i − s_j),
always from the original s values, with w = 1/(D+1) and each peer in at most D = mix2_group_size − 1 exchanges of
the round (those it starts plus those it accepts). The round's mixing matrix is then symmetric, doubly stochastic
and nonnegative, so Σ_i m_i = Σ_i s_i.

If at least one exchange completed, the peer applies m_i and commits e_i ← β·e_i + Δ_i − s_i; if none did, it
applies its exact Δ_i and keeps e_i (nothing sent, nothing subtracted). Exchanges run through
sync/exchange_driver.py over net/exchange.py's push-pull protocol, so a refused, failed or invalid exchange changes
nothing on either side. Closing a round is atomic: offers are refused from then on, accepted ones in flight get until
their initiator's deadline, and a commit that arrives later raises instead of mixing (the partner then gets no ack
and does not mix either).

The error-feedback buffers are outer state (`state_tensors`): checkpoints keep them, and a joiner starts from its
donor's (so the donor's unsent remainder is held twice for a while: a one-off bias of at most ‖e‖/N per joiner).
Everything here runs on the peer's event loop; `Mix2Round`'s methods never await, so each of them is atomic.

Partners are untrusted (docs/threat-model.md): a partner's s must decode, be finite and lie within
`max_partner_distance` × ‖s_i‖ of ours (else the exchange fails and, on our side as initiator, the partner is
penalised); with `sync.robust` it is then clipped to τ from s_i (maths/robust.py, τ's yardstick ‖s_i‖), so an exchange
moves m_i by at most w·τ, and a partner clipped hard is penalised and not mixed. A partner opens at most one exchange
with us per round, committed or not. The s we send is formed by `outgoing`. Clipping gives up the exact Σ_i m_i = Σ_i
s_i for pairs farther apart than τ.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.p2p import P2P

from p2ptrain.maths.codecs import ErrorFeedback, decode_all
from p2ptrain.maths.mixing import consensus_distance, pull_toward_, uniform_weight
from p2ptrain.maths.pacing import LinkSpeeds
from p2ptrain.maths.robust import AdaptiveClip
from p2ptrain.net.exchange import Payload
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.routes import Routes
from p2ptrain.net.wire import payload_bytes
from p2ptrain.sync.config import GRAD_CODECS, SyncConfig
from p2ptrain.sync.contribution import Contributions, OwnWork
from p2ptrain.sync.exchange_driver import ExchangeDriver, RoundClosed, RoundSlots, same_round
from p2ptrain.sync.interface import HONEST, Conduct, RoundSync
from p2ptrain.sync.outer_gradient_payload import outer_gradient_codec, prepare_payload
from p2ptrain.tensor_layout import norm
from p2ptrain.timing import POLL_S

logger = logging.getLogger(__name__)

KIND = "mix2"


class Mix2Round:
    """One peer's Mix2 of one round: its s and payload, the running mix m; `slots`: who it is mixing with."""
    extra_offers_offend = True  # one exchange per pair and round
    keeps_unconfirmed_mix = False  # a gossip mix whose ack was lost is not applied (the partner may not have)
    measures_link = True  # its exchanges carry a payload

    def __init__(self, round_: int, own_id: str, sent: list[torch.Tensor], payload: Payload, codec: str,
                 degree_cap: int, own_scale: float | None = None, round_gap: int = 0, tokens: int = 0):
        self.round, self.own_id, self.sent, self.payload, self.codec = round_, own_id, sent, payload, codec
        self.slots = RoundSlots(round_, own_id, degree_cap, round_gap)
        self.weight = uniform_weight(degree_cap)
        self.own_scale = own_scale if own_scale is not None else norm(sent)  # τ's yardstick: ‖s_i‖
        self.own_work = OwnWork(self.own_scale, tokens)  # partners' s are judged for their work against ours
        self.mixed = [s.clone() for s in sent]

    @property
    def done(self) -> list[str]:  # partners whose mix is applied, in the order it was
        return self.slots.done

    def payload_for(self, partner: str) -> Payload:
        """What we send `partner`: the same s to every partner."""
        return self.payload

    def value_for(self, partner: str, codec: str | None) -> tuple[str, Payload]:
        return self.codec, self.payload  # s, as we encoded it, whatever the partner offered in

    def agree_weight(self, claimed: object) -> float | None:
        return self.weight if claimed == self.weight else None  # both ends of a Mix2 use 1/(group size)

    def accept_(self, sender: str, round_: int, gives_up_at: float) -> str | None:
        return self.slots.accept_(sender, round_, gives_up_at)

    def apply_(self, partner: str, theirs: Sequence[torch.Tensor], outgoing: bool, weight: float) -> None:
        """A completed exchange: m ← m + w(s_partner − s). Raises RoundClosed after `close_` (nothing changes)."""
        if not self.slots.may_apply(partner):
            raise RoundClosed(f"round {self.round}'s Mix2 closed (or mixed with {partner}) before this commit")
        pull_toward_(self.mixed, theirs, self.sent, weight)
        self.slots.applied_(partner, outgoing, payload_bytes(self.payload_for(partner)))
        self.release_(partner, outgoing)

    def release_(self, partner: str, outgoing: bool) -> None:
        self.slots.release_(partner, outgoing)

    def close_(self) -> list[torch.Tensor] | None:
        """Close for good: m, or None when no exchange completed (the caller then applies its own Δ)."""
        self.slots.close_()
        return self.mixed if self.done else None


async def _give_up_when_set(rnd: Mix2Round, stop: threading.Event) -> None:
    """Once `stop` is set, end the round's offers and its wait for partners (`slots.give_up_at`)."""
    while not stop.is_set():
        await asyncio.sleep(POLL_S)
    rnd.slots.give_up_at = 0.0


class GradGossip:
    """Mix2 over gossip for one peer: `mix` runs a round's Mix2 (async, on the event loop); its `driver` answers
    offers (`serve_exchanges(p2p, gossip.driver)`) and makes ours. It is the driver's policy for Mix2's values."""

    def __init__(self, p2p: P2P, run_id: str, fingerprint: str, like: Sequence[torch.Tensor], config: SyncConfig,
                 seed: int, links: LinkSpeeds | None = None, reputation: Reputation | None = None,
                 kind: str = KIND, error_feedback_decay: float | None = None, routes: Routes | None = None,
                 conduct: Conduct = HONEST, contributions: Contributions | None = None):
        self.p2p, self.config, self.kind = p2p, config, kind
        self.own_id, self.conduct = p2p.peer_id.to_base58(), conduct  # the conduct forms the s we send
        self.degree_cap = config.mix2_group_size - 1
        decay = config.error_feedback_decay if error_feedback_decay is None else error_feedback_decay
        self.feedback = ErrorFeedback(outer_gradient_codec(config), like, decay)
        self.rng = random.Random(seed)
        self.reputation = reputation if reputation is not None else Reputation()  # the peer's one record of offences
        self.driver = ExchangeDriver(p2p, run_id, fingerprint, kind, config, self, GRAD_CODECS,
                                     sum(t.numel() * 4 for t in like) + 2**20, links, self.reputation, routes,
                                     contributions=contributions)
        self.clip = AdaptiveClip(config.clip_multiplier) if config.robust else None
        self._prepared: tuple[int, tuple[Payload, list[torch.Tensor], float]] | None = None  # `own_share`'s

    def own_share(self, delta: Sequence[torch.Tensor], round_: int) -> list[torch.Tensor]:
        """s for `delta`, prepared now for round `round_`'s `mix` (which sends it): the part of Δ partners will
        mix, which an overlapped peer applies at once (factored.py). Raises ValueError for a non-finite Δ."""
        prepared = prepare_payload(self.feedback, delta, self.outgoing)
        self._prepared = (round_, prepared)
        return prepared[1]

    @property
    def current(self) -> Mix2Round | None:  # the latest round's Mix2 (closed once `mix` returned)
        return self.driver.current  # type: ignore[no-any-return]

    # ---- one round ------------------------------------------------------------------------------------------------
    async def mix(self, delta: Sequence[torch.Tensor], live_peers: Sequence[str], round_: int,
                  patience_s: float, stop: threading.Event | None = None,
                  tokens: int = 0) -> tuple[list[torch.Tensor], RoundSync]:
        """Mix2 of round `round_`: m (or Δ itself when no exchange completed) and what it cost. `tokens`: what our
        inner phase trained, claimed to partners.

        Peers not yet in our round are asked again (`retry_delay_s`) for up to `patience_s` seconds. With `stop`
        (an overlapped Mix2) the round also keeps answering partners' offers until then, or until `stop` is set
        (its result is being collected), or its slots are taken."""
        prepared, self._prepared = self._prepared, None
        try:  # the codec's top-k over the whole model runs off the event loop, which keeps answering others
            payload, sent, scale = prepared[1] if prepared is not None and prepared[0] == round_ else \
                await asyncio.get_running_loop().run_in_executor(None, prepare_payload, self.feedback, delta,
                                                                 self.outgoing)
        except ValueError as e:  # non-finite Δ: nothing can be sent
            logger.warning(f"round {round_}: not mixing this outer gradient ({e})")
            return list(delta), RoundSync(codec=self.feedback.codec.name)
        rnd = self.driver.current = Mix2Round(round_, self.own_id, sent, payload, self.feedback.codec.name,
                                              self.degree_cap, scale, self.config.mix2_round_gap, tokens)
        stats = RoundSync(codec=rnd.codec)
        watcher = asyncio.create_task(_give_up_when_set(rnd, stop)) if stop is not None else None
        try:
            await self.driver.open_in_turn(rnd, list(live_peers), patience_s, stats, self.rng)
            while stop is not None and rnd.slots.free_slots() > 0 and time.monotonic() < rnd.slots.give_up_at:
                await asyncio.sleep(POLL_S)  # partners of nearby rounds may still offer theirs
        finally:
            if watcher is not None:
                watcher.cancel()
        mixed = await self.driver.close_round(rnd, stats)
        stats.group_size = 1 + len(rnd.done)
        if mixed is None:
            return list(delta), stats
        self.feedback.commit_(sent)
        return mixed, stats

    def decode_partner(self, rnd: Mix2Round, header: dict[str, Any], payload: Payload) -> list[torch.Tensor]:
        """The partner's s, or ValueError if it is of a round we do not take, does not decode, does not fit our
        shapes, or is implausibly far."""
        same_round(rnd, header)
        theirs = [t.float() for t in decode_all(str(header.get("codec")), payload, like=rnd.sent)]
        distance = consensus_distance(rnd.sent, theirs)
        if not distance <= self.config.max_partner_distance:
            raise ValueError(f"partner's outer gradient is {distance:.3g}× ours away "
                             f"(bound {self.config.max_partner_distance})")
        return theirs

    # ---- what else a header carries: the tokens we claim for our s --------------------------------------------------
    def header_extra(self) -> dict[str, Any]:
        """Fields added to every header we send, offers and answers."""
        rnd = self.current
        return {"tokens": rnd.own_work.tokens} if rnd is not None else {}

    def note_partner(self, rnd: Mix2Round, partner: str, header: dict[str, Any]) -> None:
        """A partner's header, once its payload passed the checks (unverified claims)."""

    # ---- robust mixing ---------------------------------------------------------------------------------------------
    def outgoing(self, sent: list[torch.Tensor]) -> list[torch.Tensor]:
        """What we send for our s, as the peer's conduct forms it: the s every partner receives (once a round)."""
        return self.conduct.sent_outer_gradient(sent)

    def clip_partner(self, rnd: Mix2Round, partner: str, theirs: list[torch.Tensor],
                     header: dict[str, Any]) -> list[torch.Tensor]:
        """What we mix in place of the partner's s: s_i + clip(s_j − s_i, τ); a partner clipped hard is penalised,
        and its value not mixed at all (s_i stands in for it)."""
        if self.clip is None:
            return theirs
        clipped, gap, hard = self.clip.clip(partner, theirs, rnd.sent, rnd.own_scale)
        if hard and rnd.own_scale > 0:
            self.reputation.penalise(partner, "clipped", f"outer gradient {gap:.3g} from ours, ‖ours‖ "
                                                         f"{rnd.own_scale:.3g}")
            return self.stand_in(rnd, partner, theirs)
        return clipped

    def stand_in(self, rnd: Mix2Round, partner: str, theirs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Our own s in place of a partner's we do not mix (it showed no work, or was clipped hard): a free rider's
        ~zero Δ would shrink ours."""
        return [s.clone() for s in rnd.sent]

    # ---- outer state ----------------------------------------------------------------------------------------------
    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"error_feedback:{i}", e) for i, e in enumerate(self.feedback.residual)]

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        self._prepared = None  # of our old Δ
        self.feedback.load_state_dict({"decay": self.feedback.decay, "residual": list(tensors)})
