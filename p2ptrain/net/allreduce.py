"""Exact averaging of outer gradients with hivemind's DecentralizedAverager (DiLoCo, and Factored's Mix2), with
`sync.allreduce_transport: hivemind`; the default is our own exchange all-reduce (sync/exchange_allreduce.py), built
because of what this docstring's second half says.

Peers of the same round meet under one group key: the round number is written into the averager's group bits
before each step, so a peer a round behind or ahead can never be averaged with this round's gradients.

Hostile members (docs/threat-model.md). hivemind 1.1.12's public API gives no hold on how a group reduces, so this
module returns the plain weighted mean and the sync layer judges it (maths/robust_mean.py: finite, near our own Δ,
else our own Δ):
- weights: each part a member sends carries its own `weight` field (AveragingData.weight), read as sent and used as
  is by the reducer (partition.py, TensorPartReducer.accumulate_part: Σ w·x / Σ w); only the sender's `step()`
  asserts w ≥ 0. A member may claim any weight, even a negative, infinite or NaN one, and a different one per part.
  `gather=` metadata is not that claim: it travels once, in matchmaking, and nothing ties it to the parts' weights,
  so it can neither bound nor expose them.
- a robust reduction per part (CenteredClip, trimmed mean) would have to live in the reducer, which
  `_aggregate_with_group` builds privately, with no hook; subclassing it is what STYLE.md rules out.
- `compression=` cannot stand in: it only encodes what *we* send. A receiver decodes every part with hivemind's
  built-in codec named in the message (serialization.py, deserialize_torch_tensor), never with our object, so its
  `extract` never sees another member's data (and it runs in the averager's forked process, out of our reach).
- a member also reduces a span of the vector for the whole group and returns whatever it likes there, possibly a
  different value to each member: a robust reduction at the honest reducers would still leave that span to it.
What does help the check is `gather=`: with `robust`, each member announces ‖Δ‖ there and the result lists the
claims (unverified; a malformed one is dropped). Their lower median tells a peer whose own Δ is short (a joiner, a
paced peer: few inner steps) how long honest outer gradients are this round; a liar among honest members cannot lift
it past their claims.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

import hivemind
import torch
from hivemind.compression import CompressionBase, Float16Compression, NoCompression
from hivemind.utils import MPFuture

from p2ptrain.net.dht_keys import round_group_bits
from p2ptrain.net.lifetime import DiesWithStarter
from p2ptrain.tensor_layout import norm
from p2ptrain.timing import TICK_S, allreduce_bound_s, matchmaking_bound_s

logger = logging.getLogger(__name__)

MAX_GROUP_SIZE = 2**16  # no target: the group holds every live peer of the round
CODECS: dict[str, type[CompressionBase]] = {"none": NoCompression, "fp16": Float16Compression}
BYTES_PER_VALUE = {"none": 4, "fp16": 2}


class SwarmAverager(DiesWithStarter, hivemind.DecentralizedAverager):
    """hivemind's averager, whose process ends with the peer's, however the peer ends (net/lifetime.py), and whose
    target group size can change from one step to the next."""

    def prepare_step(self, group_bits: str, size: int | None, timeout_s: float) -> None:
        """Set the next step's group key bits and target group size, waiting at most `timeout_s` for each (hivemind's
        setter waits forever by default: an averager process that stopped answering would hold the peer for good).
        Raises TimeoutError."""
        self.set_group_bits(group_bits, wait=False).result(timeout=timeout_s)
        self.set_target_group_size(size, timeout_s)

    def set_target_group_size(self, size: int | None, timeout_s: float) -> None:
        """The group the next step waits for: its leader assembles it as soon as `size` members have joined, and
        waits out `min_matchmaking_time` only when some do not come. hivemind fixes the target at construction;
        the change travels to the averager's process over its command pipe, as `set_group_bits` does."""
        future = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size, future=future)))
        future.result(timeout=timeout_s)

    async def _set_target_group_size(self, size: int | None, future: MPFuture) -> None:
        try:
            self._matchmaking.target_group_size = size
            future.set_result(None)
        except Exception as e:  # reported to the caller, as hivemind's own setters do
            if not future.done():
                future.set_exception(e)


@dataclasses.dataclass
class AveragingResult:
    """The gradient to apply and what it cost."""

    delta: list[torch.Tensor]
    group_size: int  # peers whose gradients were averaged, ourselves included
    bytes_sent: int = 0  # payload bytes where the transport counts them (the exchange's); the round's metrics
    bytes_received: int = 0  # report what its streams carried (net/stream_bytes.py), for every transport
    seconds: float = 0.0
    claimed_norms: list[float] = dataclasses.field(default_factory=list)  # ‖Δ‖ the members announced (robust only)
    # ‖our input‖ and ‖mean − our input‖ where the all-reduce measured them (the exchange's CenteredClip does, for
    # every input); None: the check of the mean measures them itself (sync/diloco.checked)
    own_norm: float | None = None
    own_deviation: float | None = None
    discarded: bool = False  # the members could not agree on the inputs: nobody applies anything this round
    in_step: bool | None = None  # whether our state was the group's, by the samples members showed (None: unknown)


def claimed_norms(gathered: Mapping[object, object]) -> list[float]:
    """The members' ‖Δ‖ claims that parse as finite non-negative numbers (untrusted records: others are dropped)."""
    claims = [meta.get("norm") for meta in gathered.values() if isinstance(meta, dict)]
    return [float(c) for c in claims if isinstance(c, (int, float)) and not isinstance(c, bool)
            and math.isfinite(c) and c >= 0]


def allreduce_traffic_bytes(vector_bytes: int, group_size: int) -> int:
    """Bytes one peer sends (and receives) in an ideal (butterfly) all-reduce, 2·S·(n−1)/n: what benchmarks
    compare measured bytes with, never a measurement."""
    return int(2 * vector_bytes * (group_size - 1) / max(1, group_size))


class PendingAverage:
    """An all-reduce running in the background (one-step-delay overlap); `result()` waits for it."""

    def __init__(self, averager: AllReduceAverager, own: list[torch.Tensor], control: object, started: float):
        self.averager, self.own, self.control, self.started = averager, own, control, started

    def result(self) -> AveragingResult:
        try:  # bounded: hivemind's own wait has none, and an averager process that stopped answering never ends it
            gathered = (self.control.result(timeout=self.averager.step_bound_s)  # type: ignore[attr-defined]
                        if self.control is not None else None)
        except Exception as e:  # a failed all-reduce must not stop training: our own Δ stands in
            logger.warning(f"all-reduce failed ({e!r}); applying this peer's outer gradient")
            if self.control is not None and not self.control.done():  # type: ignore[attr-defined]
                with contextlib.suppress(Exception):  # (its process may be past listening)
                    self.control.cancel()  # type: ignore[attr-defined]
            gathered = None
        return self.averager.collect(self.own, gathered, self.started)


class AllReduceAverager:
    """Averages Δ with the peers of the round (up to `target_group_size`, if set): the group forms as soon as the
    round's live peers, whom the DHT records name, have all joined, and otherwise at the end of `matchmaking_s`
    with those that came (late ones average in the next round); alone, returns Δ.
    `robust`: announce our ‖Δ‖ and return the members' claims with the mean (for the sync layer's check)."""

    def __init__(self, dht: hivemind.DHT, prefix: str, template: Sequence[torch.Tensor], matchmaking_s: float,
                 allreduce_timeout_s: float, codec: str = "none", target_group_size: int | None = None,
                 robust: bool = True, refuses: Callable[[str], bool] = lambda _peer: False):
        self.matchmaking_s, self.robust, self.target_group_size = matchmaking_s, robust, target_group_size
        self.matchmaking_timeout_s = matchmaking_bound_s(matchmaking_s)  # a step's, and each question to hivemind
        self.step_bound_s = allreduce_bound_s(matchmaking_s, allreduce_timeout_s)  # the longest a step may take
        self.refuses = refuses  # the peer's reputation and admission: a group holding such a peer is not used
        self._averager = SwarmAverager(
            averaged_tensors=[torch.zeros(t.shape, dtype=torch.float32) for t in template],
            dht=dht,
            start=True,
            prefix=prefix,
            initial_group_bits=round_group_bits(0),
            target_group_size=target_group_size,
            min_group_size=2,
            min_matchmaking_time=matchmaking_s,
            request_timeout=max(TICK_S, matchmaking_s / 2),
            allreduce_timeout=allreduce_timeout_s,
            next_chunk_timeout=allreduce_timeout_s / 2,
            compression=CODECS[codec](),
            allow_state_sharing=False,
        )

    def average(self, delta: Sequence[torch.Tensor], round_: int, weight: float,
                round_peers: Sequence[str], tokens: int = 0) -> AveragingResult:
        """Blocking: the weighted mean of Δ over the group (Δ itself when alone or when the all-reduce fails)."""
        return self.launch(delta, round_, weight, round_peers).result()

    def launch(self, delta: Sequence[torch.Tensor], round_: int, weight: float,
               round_peers: Sequence[str], tokens: int = 0) -> PendingAverage:
        """Start averaging Δ in the background (with the peers of the round, if `round_peers` names any);
        `result()` of the returned handle finishes it. `tokens` is not sent: no member sees another's Δ here."""
        started = time.monotonic()
        own = [d.detach().float().cpu().clone() for d in delta]
        if not round_peers:
            return PendingAverage(self, own, None, started)
        try:
            self._averager.prepare_step(round_group_bits(round_),
                                        min(len(round_peers) + 1, self.target_group_size or MAX_GROUP_SIZE),
                                        timeout_s=self.matchmaking_timeout_s)
        except Exception as e:  # its process did not answer in time (or at all): this round averages alone
            logger.warning(f"all-reduce of round {round_} did not start: hivemind's averager did not answer ({e!r})")
            return PendingAverage(self, own, None, started)
        with self._averager.get_tensors() as tensors:
            for buffer, d in zip(tensors, own, strict=True):
                buffer.copy_(d)
        gather: dict[str, float] = {"round": round_, "norm": norm(own)} if self.robust else {"round": round_}
        try:
            control = self._averager.step(gather=gather, weight=max(weight, 1e-6), wait=False,
                                          timeout=self.matchmaking_timeout_s, allow_retries=True)
        except Exception as e:  # could not even start: our own Δ stands in
            logger.warning(f"all-reduce of round {round_} did not start ({e!r})")
            control = None
        return PendingAverage(self, own, control, started)

    def collect(self, own: list[torch.Tensor], gathered: object, started: float) -> AveragingResult:
        if not gathered:
            return AveragingResult(own, group_size=1, seconds=time.monotonic() - started)
        with self._averager.get_tensors() as tensors:
            mean = [t.clone() for t in tensors]
        assert isinstance(gathered, Mapping)
        refused = sorted(str(peer) for peer in gathered if self.refuses(str(peer)))
        if refused:  # hivemind's matchmaking admits anyone who knows the group key: what they sent is not used
            logger.warning(f"the all-reduce group held {len(refused)} peer(s) this peer refuses (banned or not "
                           f"admitted: {', '.join(refused)}); applying this peer's own outer gradient")
            return AveragingResult(own, 1, seconds=time.monotonic() - started)
        claims = claimed_norms(gathered) if self.robust else []
        return AveragingResult(mean, len(gathered), seconds=time.monotonic() - started, claimed_norms=claims)

    def forget_(self) -> None:
        pass  # nothing of a past round is kept

    def shutdown(self) -> None:
        self._averager.shutdown()
