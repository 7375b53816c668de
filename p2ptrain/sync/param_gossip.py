"""A peer's side of gossip: what it offers, how it validates a partner's payload, and how it mixes.

Every peer has a *public value* = base + c: `base` is set by the round loop (the anchor θ_r during the inner
phase, the proposal y while it mixes at the round's end) and `c` accumulates the corrections of exchanges other
peers started with it. An exchange with weight w between values a and b moves a by w(b − a) and b by w(a − b), so
the sum over the swarm is preserved whoever started it. Values travel as codec(value − θ_0), a reference every
peer holds (the run's seeded initial parameters), as 16-bit differences by default.
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
from hivemind.p2p import P2P, PeerID

from p2ptrain.maths.codecs import choose_codec_for_link, relative_decode, relative_encode
from p2ptrain.maths.mixing import consensus_distance, pull_toward_, uniform_weight
from p2ptrain.maths.pacing import LinkSpeeds
from p2ptrain.maths.topology import draw_partners
from p2ptrain.net.exchange import ExchangeRefused, OpenExchange, Payload, push_pull
from p2ptrain.net.wire import WireError, payload_bytes
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.interface import ExchangeRecord, RoundSync

logger = logging.getLogger(__name__)

PARAM_CODECS_ADAPTIVE = ("fp16", "int8")  # parameters: dense codecs only (top-k of θ − θ_0 loses too much)
# an exchange that blocks training for less than this fraction of the inner phase is worth waiting for, however it
# compares with our own link: peers on equally fast links measure speeds 30 % apart from CPU load alone (netns
# testnet, 50 Mbit/s each: 2.8 and 3.6 MB/s), and ranking them by that noise left fast peers without partners
NEGLIGIBLE_BLOCKING_FRACTION = 0.1
ROUND_RETRY_S = 0.25  # Mix1: wait before asking again a partner that has not reached our round yet
WRONG_ROUND = "not in this round"


class _Exchange:
    """One accepted incoming exchange (the responder's side)."""

    def __init__(self, mixer: ParamGossip, weight: float, public: list[torch.Tensor], header: dict[str, Any]):
        self.mixer, self.weight, self.public = mixer, weight, public
        self.codec = str(header.get("codec", "fp16"))
        self.payload = relative_encode(public, mixer.reference, self.codec)
        self.header = {"codec": self.codec, "round": mixer.round}

    def validate(self, partner_header: dict[str, Any], partner_payload: Payload) -> Any:
        partner = self.mixer.decode_partner(partner_header, partner_payload, own=self.public)

        def apply() -> None:
            self.mixer.add_correction_(self.weight, partner, self.public)

        return apply

    def close(self) -> None:
        self.mixer.release_responder()


class ParamGossip:
    """Offers and answers pairwise exchanges of one kind of value ("gasloc" proposals or "mix1" parameters).

    `links` is the peer's one table of measured links (shared with its gradient gossip, if any)."""

    def __init__(self, p2p: P2P, run_id: str, fingerprint: str, kind: str, reference: Sequence[torch.Tensor],
                 config: SyncConfig, seed: int, same_round_only: bool = False, overlapped: bool = False,
                 links: LinkSpeeds | None = None):
        self.p2p, self.run_id, self.fingerprint, self.kind, self.config = p2p, run_id, fingerprint, kind, config
        self.namespace = f"{run_id}.{kind}"
        self.chunk_timeout_s = config.state_download_timeout_s
        self.same_round_only = same_round_only  # Mix1: mix round-t values only (no staleness)
        self.overlapped = overlapped  # Mix1: our exchanges run during the inner phase (GASLoC's block training)
        self.reference = [t.detach().float().cpu().clone() for t in reference]
        self.raw_bytes = sum(t.numel() * 4 for t in self.reference)
        self.max_payload_bytes = self.raw_bytes + 2**20
        self.rng = random.Random(seed)
        self.round = 0
        self._lock = threading.Lock()
        self._base = [t.clone() for t in self.reference]
        self._correction = [torch.zeros_like(t) for t in self.reference]
        self._responding = False
        self._waiting_for_round = False
        self.give_up_at = 0.0  # `mix` stops waiting for partners to reach its round at this time.monotonic()
        self.links = links if links is not None else LinkSpeeds()
        self.incoming = RoundSync(group_size=0)  # what exchanges others started with us did this round
        self.budget_s = float("inf")  # time an exchange may take without delaying training (adaptive codec)
        self.last_payload_bytes = self.raw_bytes // 2  # one direction of our latest exchange (fp16 until then)
        self.announced: dict[str, float] = {}  # peers' announced link speeds, as of our latest mix

    # ---- the public value ----------------------------------------------------------------------------------------
    def set_base_(self, base: Sequence[torch.Tensor]) -> None:
        with self._lock:
            self._base = [t.detach().float().cpu().clone() for t in base]

    def take_correction_(self) -> list[torch.Tensor]:
        """Return and reset c (what others' exchanges moved our value by since the last call)."""
        with self._lock:
            correction, self._correction = self._correction, [torch.zeros_like(t) for t in self.reference]
            return correction

    def take_incoming_stats(self) -> RoundSync:
        with self._lock:
            stats, self.incoming = self.incoming, RoundSync(group_size=0)
            return stats

    def add_correction_(self, weight: float, partner: list[torch.Tensor], ours: list[torch.Tensor]) -> None:
        with self._lock:
            pull_toward_(self._correction, partner, ours, weight)
            self.incoming.group_size += 1
            self.incoming.consensus_distance.append(consensus_distance(ours, partner))

    # ---- responder -----------------------------------------------------------------------------------------------
    def open(self, header: dict[str, Any]) -> OpenExchange | str:
        """Accept an offer from a peer of this run and model, one at a time; refuse anything else at once."""
        if header.get("run_id") != self.run_id or header.get("fingerprint") != self.fingerprint:
            return "another run or model"
        if header.get("kind") != self.kind or header.get("codec") not in ("none", "fp16", "int8"):
            return "unsupported exchange"
        weight = header.get("weight")
        if not isinstance(weight, float) or not 0 < weight <= 0.5:
            return "bad mixing weight"
        with self._lock:
            if self.same_round_only and header.get("round") != self.round:
                return WRONG_ROUND
            if self._responding:
                return "busy"
            self._responding = True
            public = [b + c for b, c in zip(self._base, self._correction, strict=True)]
        return _Exchange(self, weight, public, header)

    def release_responder(self) -> None:
        with self._lock:
            self._responding = False

    def decode_partner(self, header: dict[str, Any], payload: Payload, own: list[torch.Tensor]) -> list[torch.Tensor]:
        """The partner's value, or ValueError if it does not decode, does not fit, or is implausibly far."""
        partner = relative_decode(payload, self.reference, str(header.get("codec", "fp16")))
        distance = consensus_distance(own, partner)
        if not distance <= self.config.max_partner_distance:
            raise ValueError(f"partner is {distance:.3g}× our norm away (bound {self.config.max_partner_distance})")
        return partner

    # ---- initiator -----------------------------------------------------------------------------------------------
    def choose_codec(self, partner: str) -> str:
        if self.config.param_codec != "adaptive":
            return self.config.param_codec
        budget_s = self.budget_s if self.budget_s < float("inf") else 60.0
        # the EMA is both directions' bytes over the exchange's time (they travel one after the other): on a
        # symmetric link one direction's payload fits the budget when twice its bytes fit at the EMA's rate
        one_way_bytes_per_s = self.links.estimate_bytes_per_s(partner) / 2
        return choose_codec_for_link(self.raw_bytes, one_way_bytes_per_s, budget_s, PARAM_CODECS_ADAPTIVE).name

    # ---- links ----------------------------------------------------------------------------------------------------
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
        never wait for a slow one and a slow one waits only for its own link."""
        phase_s = self.budget_s if self.budget_s < float("inf") else 0.0
        hidden_s = phase_s if self.overlapped else NEGLIGIBLE_BLOCKING_FRACTION * phase_s
        limit = max(hidden_s, 1.25 * self.expected_exchange_s())
        return [p for p in live_peers if self.expected_exchange_s(links.get(p, 0.0)) <= limit]

    async def mix(self, value: list[torch.Tensor], live_peers: list[str], round_: int,
                  patience_s: float = 0.0, links: dict[str, float] | None = None,
                  ) -> tuple[list[torch.Tensor], RoundSync]:
        """Exchange `value` with up to `gossip_peers` random live peers; return value + Σ w (partner − value).

        Peers that are busy or refuse are skipped; those not yet in our round (Mix1) are asked again every
        ROUND_RETRY_S for up to `patience_s` seconds. With `links` (peers' announced link speeds), peers too slow
        to wait for are left to start exchanges with us (`partners_worth_waiting_for`).
        """
        if links is not None:
            self.announced = links
            eligible = self.partners_worth_waiting_for(live_peers, links)
            logger.debug(f"round {round_}: {len(eligible)} of {len(live_peers)} live peers are fast enough to wait for"
                         f" (own link {self.own_link_bytes_per_s():.3g} B/s, links {links})")
            live_peers = eligible
        k = self.config.gossip_peers
        weight = uniform_weight(k)
        mixed = [v.clone() for v in value]
        stats = RoundSync(group_size=1)
        tried: set[str] = set()
        self.give_up_at = time.monotonic() + patience_s
        while len(stats.partners) < k:
            candidates = draw_partners(live_peers, 1, self.rng, exclude=tried | set(stats.partners))
            if not candidates:
                if time.monotonic() >= self.give_up_at or not self._waiting_for_round:
                    break
                tried, self._waiting_for_round = set(), False
                await asyncio.sleep(ROUND_RETRY_S)
                continue
            tried.add(candidates[0])
            result = await self._exchange_with(candidates[0], value, weight, round_, stats)
            if result is not None:
                pull_toward_(mixed, result, value, weight)
        stats.link_bytes_per_s = self.links.fastest_measured_bytes_per_s()
        stats.expected_blocking_s = k * self.expected_exchange_s()
        fastest = max([self.own_link_bytes_per_s(), *(links or {}).values()])
        stats.swarm_blocking_s = k * 2 * self.last_payload_bytes / fastest
        return mixed, stats

    async def _exchange_with(self, partner: str, value: list[torch.Tensor], weight: float, round_: int,
                             stats: RoundSync) -> list[torch.Tensor] | None:
        codec = self.choose_codec(partner)
        payload = relative_encode(value, self.reference, codec)
        nbytes = self.last_payload_bytes = payload_bytes(payload)
        link = self.links.to(partner)
        deadline_s = self.links.deadline_s(partner, 2 * nbytes, self.config.exchange_safety_factor)
        header = {"run_id": self.run_id, "fingerprint": self.fingerprint, "kind": self.kind, "round": round_,
                  "codec": codec, "weight": weight}
        received: list[list[torch.Tensor]] = []

        def validate(answer: dict[str, Any], partner_payload: Payload) -> Any:
            theirs = self.decode_partner(answer, partner_payload, own=value)
            return lambda: received.append(theirs)

        started = time.monotonic()
        try:
            outcome = await push_pull(self.p2p, PeerID.from_base58(partner), self.namespace, header, payload,
                                      validate, self.max_payload_bytes, deadline_s)
        except ExchangeRefused as e:
            logger.debug(f"{partner} refused: {e}")
            if str(e) == WRONG_ROUND:
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
        stats.consensus_distance.append(consensus_distance(value, received[0]))
        return received[0]
