"""The exchange all-reduce (sync/exchange_allreduce.py, or its verified reduce-scatter, sync/scatter_allreduce.py)
behind the averager interface DiLoCo and Factored's Mix2 use: blocking (`average`) or on the peer's event loop,
its result waited for later (`launch`: DiLoCoX's one-step-delay overlap)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

import torch

from p2ptrain.net.allreduce import AveragingResult
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.sync.allreduce_agreement import Reduction
from p2ptrain.sync.exchange_driver import ExchangeDriver

logger = logging.getLogger(__name__)


class AllReduceTransport(Protocol):
    """An all-reduce over the exchange protocol: `ExchangeAllReduce`, or `ScatterAllReduce`."""

    previous: Reduction | None  # what its latest round reduced, reported to the next round's members

    @property
    def driver(self) -> ExchangeDriver: ...

    def gather(self, delta: Sequence[torch.Tensor], round_peers: Sequence[str], round_: int, patience_s: float,
               state: list[float] | None = None, tokens: int = 0) -> Coroutine[Any, Any, AveragingResult]: ...

    def undo_commit_(self) -> None: ...


class PendingGather:
    """An all-reduce running on the peer's event loop (one-step-delay overlap); `result()` waits for it."""

    def __init__(self, future: object, own: list[torch.Tensor]):
        self.future, self.own = future, own

    def result(self) -> AveragingResult:
        try:
            return self.future.result()  # type: ignore[attr-defined]
        except Exception as e:  # a failed all-reduce must not stop training: our own Δ stands in
            logger.warning(f"all-reduce failed ({e!r}); applying this peer's outer gradient")
            return AveragingResult(self.own, group_size=1)


class ExchangeAverager:
    """An exchange all-reduce behind the averager interface DiLoCo and Mix2 use (`average`, `launch`)."""

    def __init__(self, exchange: AllReduceTransport, loop: BackgroundLoop, patience_s: float,
                 state: Callable[[int], list[float]] | None = None):
        self.exchange, self.loop, self.patience_s = exchange, loop, patience_s
        self.state = state  # round → our anchor's sample (DiLoCo: sync/state_evidence.py); None: none shown

    def average(self, delta: Sequence[torch.Tensor], round_: int, weight: float,
                round_peers: Sequence[str], tokens: int = 0) -> AveragingResult:
        return self.launch(delta, round_, weight, round_peers, tokens).result()

    def launch(self, delta: Sequence[torch.Tensor], round_: int, weight: float,
               round_peers: Sequence[str], tokens: int = 0) -> PendingGather:
        """Start the all-reduce on the event loop; `weight` (the inner steps) is not sent: the receiver fixes 1/n.
        `tokens` is claimed to the members, which judge our work by our Δ (sync/contribution.py)."""
        own = [d.detach().float().cpu().clone() for d in delta]
        state = self.state(round_) if self.state is not None else None  # taken now: the anchor moves on
        return PendingGather(self.loop.submit(self.exchange.gather(own, round_peers, round_, self.patience_s, state,
                                                                   tokens)), own)

    def forget_(self) -> None:
        """Report no previous reduction next round: we do not hold what it left; and give the error feedback back
        what the latest round's commit took (its mean was refused, so our own Δ was applied whole; or a state was
        adopted, and the remainder of our own trajectory is dropped with it either way)."""
        self.exchange.previous = None
        self.exchange.undo_commit_()

    def shutdown(self) -> None:  # offers held for a round we will not reach are refused now (round_gate.py)
        self.loop.run(self.exchange.driver.gate.close(), timeout=5.0)
