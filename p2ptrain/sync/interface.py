"""How peers combine their work after an inner phase: the swappable outer-sync stage's interface.

An `OuterSync` takes the round's anchor θ_r and the parameters after the inner phase θ_r', talks to other peers,
and leaves the parameters at θ_{r+1} (which becomes the next anchor). Three strategies: `diloco` (exact all-reduce
of outer gradients), `gasloc` (gossip of proposals with 1 or 2 random peers) and `factored` (background parameter
gossip + periodic blocking gradient mixing). A peer with no partners runs the same code: mixing with nobody is the
identity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from p2ptrain.net.allreduce import AveragingResult
from p2ptrain.net.discovery import PeerRecord


@dataclasses.dataclass
class RoundContext:
    """What the outer sync may know about the swarm at the end of a round."""

    round: int
    inner_steps: int
    live_peers: list[str]  # peer ids of other live peers (any round)
    same_round_peers: int  # how many of them are in this round
    inner_phase_s: float = float("inf")  # expected length of this round's inner phase (inf until measured)
    link_bytes_per_s: dict[str, float] = dataclasses.field(default_factory=dict)  # peers' announced link speeds
    # ids of the others (not joining) in this round, or in the one before by their record: a record is read a moment
    # late, and a peer one round behind is most likely finishing it (an all-reduce waits for it a while)
    round_peers: list[str] = dataclasses.field(default_factory=list)
    full_steps: int = 0  # the inner steps this round's phase was to run (more than `inner_steps` when cut short)
    tokens: int = 0  # the tokens this round's inner phase trained: what our outer gradient's exchanges claim

    def steps_cut_stretch(self) -> float:
        """How much longer a full phase's Δ would be than ours (≥ 1): a phase cut short to end with the round's
        other peers moved less than theirs."""
        return max(1.0, self.full_steps / max(1, self.inner_steps))


def round_peers(others: Sequence[PeerRecord], round_: int, overlapped: bool) -> list[str]:
    """Whom the all-reduce of our round expects: the peers at it, those a round behind (on their way), and with
    overlap those a round ahead, whose all-reduce of our round runs behind their next inner phase. (Left out, a
    faster peer's offer would be refused and both would average alone, often with short rounds.)"""
    ahead = 1 if overlapped else 0
    return [r.peer_id for r in others if round_ - 1 <= r.round <= round_ + ahead]


@dataclasses.dataclass
class RoundSync:
    """What the outer sync of one round did and cost."""

    group_size: int = 1  # peers whose contributions were combined, ourselves included
    partners: list[str] = dataclasses.field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    exchange_s: float = 0.0  # seconds spent in exchanges (blocking or not)
    codec: str = "none"
    consensus_distance: list[float] = dataclasses.field(default_factory=list)  # ‖θ_i − θ_j‖/‖θ_i‖ per partner
    failed: int = 0  # exchanges that timed out or carried invalid data
    refused: int = 0  # partners that were busy or declined
    exchanges: list[ExchangeRecord] = dataclasses.field(default_factory=list)  # the exchanges we started
    answered: list[str] = dataclasses.field(default_factory=list)  # partners whose exchanges with us we applied
    link_bytes_per_s: float = 0.0  # our own link's measured speed (both directions of an exchange), 0: unknown
    expected_blocking_s: float = float("nan")  # what the next round's sync should block training (nan: unknown)
    swarm_blocking_s: float = 0.0  # the same for a peer on the fastest link announced in the swarm (pacing's base)
    mix2_group_size: int = 0  # Factored: peers Mix2 averaged this round, ourselves included (0: no Mix2 landed)
    in_step: bool | None = None  # DiLoCo: whether our state was our group's, by its samples (None: unknown)
    # overlap's first round: no mean was due, and the state moved by nothing but our own unsettled share (none with
    # plain delay), which the next mean takes back; the round leaves us as in step as we were
    nothing_due: bool = False

    def add_exchange_(self, record: ExchangeRecord) -> None:
        """Count one completed exchange that we started."""
        self.partners.append(record.partner)
        self.group_size += 1
        self.bytes_sent += record.bytes_sent
        self.bytes_received += record.bytes_received
        self.exchange_s += record.seconds
        self.codec = record.codec
        self.exchanges.append(record)

    def add_incoming_(self, incoming: RoundSync) -> RoundSync:
        """Count the exchanges others started with us (and their bytes) beside the ones we started; returns self.
        A peer counts once: unaligned rounds (GASLoC) let a partner we opened to open to us in the same round."""
        self.group_size += len(set(incoming.answered) - set(self.partners))
        self.consensus_distance += incoming.consensus_distance
        self.bytes_sent += incoming.bytes_sent
        self.bytes_received += incoming.bytes_received
        return self

    def add_mix2_(self, mix2: RoundSync) -> None:
        """Add Factored's Mix2 (its traffic and exchanges) to the round's record of Mix1."""
        if mix2.partners:
            self.codec = f"{self.codec}+{mix2.codec}" if self.partners else mix2.codec
        self.bytes_sent += mix2.bytes_sent
        self.bytes_received += mix2.bytes_received
        self.group_size = max(self.group_size, mix2.group_size)
        self.mix2_group_size = mix2.group_size
        self.partners += mix2.partners
        self.exchanges += mix2.exchanges
        self.failed += mix2.failed
        self.refused += mix2.refused


def why_alone(context: RoundContext, result: RoundSync, aligned_rounds: bool = True) -> str:
    """Why a round combined nothing but our own contribution, from what the round saw. `aligned_rounds`: whether
    the sync mixes only with the peers of our round (DiLoCo's all-reduce); gossip mixes with live peers of any."""
    if result.nothing_due:
        return "nothing to average yet (an overlapped run's first round applies no mean)"
    if not context.live_peers:
        return "no other peer of the run is live"
    if not aligned_rounds:
        if result.failed or result.refused:
            return (f"of the exchanges it opened with {len(context.live_peers)} live peer(s), {result.failed} "
                    f"failed (timed out or invalid) and {result.refused} were refused (busy or declined)")
        return (f"it opened no exchange with the {len(context.live_peers)} live peer(s) (those too slow to wait "
                f"for, or sitting out after failed exchanges, open theirs to it) and none opened one with it")
    if not context.round_peers:
        return (f"none of the {len(context.live_peers)} other live peer(s) is in round {context.round} or the one "
                f"before")
    if result.failed or result.refused:
        return (f"{len(context.round_peers)} peer(s) were in its round; of its exchanges, {result.failed} failed "
                f"(timed out or invalid) and {result.refused} were refused (busy or declined)")
    return f"the {len(context.round_peers)} peer(s) of its round averaged without it (it came too late or too early)"


@dataclasses.dataclass
class ExchangeRecord:
    """One completed push-pull exchange this peer started: what a transfer model is calibrated against."""

    partner: str
    codec: str
    bytes_sent: int
    bytes_received: int
    seconds: float


class Averager(Protocol):
    """An all-reduce of outer gradients among the peers of a round (net/allreduce.py's hivemind averager, or
    sync/exchange_allreduce.py's exchange): `launch` starts it, the handle's `result()` finishes it."""

    def average(self, delta: Sequence[torch.Tensor], round_: int, weight: float,
                round_peers: Sequence[str], tokens: int = 0) -> AveragingResult: ...

    def launch(self, delta: Sequence[torch.Tensor], round_: int, weight: float,
               round_peers: Sequence[str], tokens: int = 0) -> PendingResult:
        """Start the all-reduce of Δ; `tokens`: what its inner phase trained, claimed to the members that judge
        their partners' work (sync/contribution.py)."""
        ...

    def forget_(self) -> None:
        """Our parameters are no longer what the last all-reduce left (its mean refused, or a state adopted)."""
        ...

    def shutdown(self) -> None: ...


class PendingResult(Protocol):
    def result(self) -> AveragingResult: ...


class Mix2(Protocol):
    """Factored's blocking mix of outer gradients: an all-reduce or gossip (factored.py)."""

    def mix(self, delta: list[torch.Tensor], context: RoundContext) -> tuple[list[torch.Tensor], RoundSync]:
        """The outer gradient to apply (Δ itself when nobody mixed with us) and what mixing cost."""
        ...

    def own_share(self, delta: list[torch.Tensor], context: RoundContext) -> list[torch.Tensor]:
        """What of `delta` the round's `mix` will give partners (Δ, or its compressed s), called just before that
        mix is launched: an overlapped peer applies it at once and the partners' pulls a round later."""
        ...

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Outer state of the transport (error-feedback buffers); empty for the all-reduce."""
        ...

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None: ...

    def stop_(self) -> None:
        """An overlapped mix's result is being collected: stop waiting for partners (thread-safe)."""
        ...


class OuterSync(Protocol):
    """An outer-sync strategy, and the traits of its mode that the round loop and the joiner ask of it."""

    @property
    def aligned_rounds(self) -> bool:
        """Whether peers must be in the same round to sync (an all-reduce) rather than gossip at any time."""
        ...

    @property
    def needs_current_swarm(self) -> bool:
        """Whether a round reads the swarm from the DHT (and publishes its phase) before it syncs: an all-reduce
        expects exactly the peers of its round, where gossip does with a view a heartbeat old (a partner gone since
        refuses or times out, and the next one is drawn)."""
        ...

    @property
    def rounds_count_own_steps(self) -> bool:
        """Whether a peer's round is its own count of outer steps rather than a clock shared with its partners
        (kept when it adopts a state of a lower round, as gossip partners of any round count differently)."""
        ...

    def start_round(self, context: RoundContext) -> None:
        """Called right after the anchor θ_r is fixed, before the inner phase (background work may start)."""
        ...

    def finish_round(self, context: RoundContext) -> RoundSync:
        """Combine with other peers and leave the parameters (and the anchor) at θ_{r+1}."""
        ...

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The outer state a joiner needs and a checkpoint keeps (momentum, previous iterate, ...)."""
        ...

    def outer_state_problem(self, params: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> str | None:
        """What is wrong with a downloaded outer state (`tensors`, in the order of `state_tensors`) beside the
        parameters downloaded with it, that the state alone shows; None when nothing (a momentum shows nothing)."""
        ...

    def load_state_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Load tensors in the order of `state_tensors()` (validated by the caller)."""
        ...

    def shutdown(self) -> None: ...


Tensors = list[torch.Tensor]
NamedTensors = list[tuple[str, torch.Tensor]]


class Conduct(Protocol):
    """How a peer forms what it tells the swarm, called at each point where a value leaves it; each hook returns
    what is sent in the value's place. The honest conduct sends every value as it is; the testnet's red team
    (testnet/adversary.py) lies."""

    def follow(self, round_of: Callable[[], int]) -> None:
        """Called once by the peer that holds this conduct: `round_of()` is that peer's round at any moment."""

    def sent_params(self, value: Tensors, theta0: Tensors) -> Tensors:
        """Parameters sent to a gossip partner (GASLoC, Mix1); `theta0`: the run's initial parameters."""

    def sent_outer_gradient(self, value: Tensors) -> Tensors:
        """An outer gradient sent to partners (Mix2 gossip, the exchange all-reduces)."""

    def own_outer_gradient(self, value: Tensors) -> Tensors:
        """The outer gradient handed to hivemind's all-reduce, which sends it from inside its own process."""

    def announced_round(self, round_: int) -> int:
        """The round announced with a round-start snapshot."""

    def served_state(self, named: NamedTensors) -> NamedTensors:
        """The named round-start state a joiner downloads and a checkpoint keeps."""


class HonestConduct:
    """Every value as it is."""

    def follow(self, round_of: Callable[[], int]) -> None:
        pass

    def sent_params(self, value: Tensors, theta0: Tensors) -> Tensors:
        return value

    def sent_outer_gradient(self, value: Tensors) -> Tensors:
        return value

    def own_outer_gradient(self, value: Tensors) -> Tensors:
        return value

    def announced_round(self, round_: int) -> int:
        return round_

    def served_state(self, named: NamedTensors) -> NamedTensors:
        return named


HONEST = HonestConduct()
