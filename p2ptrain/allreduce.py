"""DiLoCo's averaging stage: an exact all-reduce of outer gradients with hivemind's DecentralizedAverager.

Peers of the same round meet under one group key: the round number is written into the averager's group bits
before each step, so a peer a round behind or ahead can never be averaged with this round's gradients.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import hivemind
import torch

from p2ptrain.sync import AveragingResult, SyncConfig

logger = logging.getLogger(__name__)

ROUND_BITS = 16  # rounds are told apart modulo 2**16 in the group key


def round_group_bits(round_: int) -> str:
    return format(round_ % 2**ROUND_BITS, f"0{ROUND_BITS}b")


def allreduce_traffic_bytes(vector_bytes: int, group_size: int) -> int:
    """Bytes one peer sends (and receives) in hivemind's butterfly all-reduce: 2·S·(n−1)/n."""
    return int(2 * vector_bytes * (group_size - 1) / max(1, group_size))


class AllReduceAverager:
    """Averages Δ with every peer of the round that shows up within `matchmaking_s`; alone, returns Δ."""

    def __init__(self, dht: hivemind.DHT, run_id: str, template: Sequence[torch.Tensor], config: SyncConfig):
        self.config = config
        self.vector_bytes = sum(t.numel() * 4 for t in template)
        self._averager = hivemind.DecentralizedAverager(
            averaged_tensors=[torch.zeros(t.shape, dtype=torch.float32) for t in template],
            dht=dht,
            start=True,
            prefix=f"{run_id}_diloco",
            initial_group_bits=round_group_bits(0),
            min_group_size=2,
            min_matchmaking_time=config.matchmaking_s,
            request_timeout=max(1.0, config.matchmaking_s / 2),
            allreduce_timeout=config.allreduce_timeout_s,
            next_chunk_timeout=config.allreduce_timeout_s / 2,
            allow_state_sharing=False,
        )

    def average(self, delta: Sequence[torch.Tensor], round_: int, weight: float, partners: int) -> AveragingResult:
        started = time.monotonic()
        own = [d.detach().float().cpu().clone() for d in delta]
        if partners <= 0:
            return AveragingResult(own, group_size=1, seconds=time.monotonic() - started)
        self._averager.set_group_bits(round_group_bits(round_))
        with self._averager.get_tensors() as tensors:
            for buffer, d in zip(tensors, own, strict=True):
                buffer.copy_(d)
        try:
            gathered = self._averager.step(
                gather={"round": round_}, weight=max(weight, 1e-6),
                timeout=self.config.matchmaking_s * 2 + 1.0, allow_retries=True,
            )
        except Exception as e:  # a failed all-reduce must not stop training: apply our own Δ this round
            logger.warning(f"all-reduce of round {round_} failed ({e!r}); applying this peer's outer gradient")
            gathered = None
        if not gathered:
            return AveragingResult(own, group_size=1, seconds=time.monotonic() - started)
        with self._averager.get_tensors() as tensors:
            mean = [t.clone() for t in tensors]
        traffic = allreduce_traffic_bytes(self.vector_bytes, len(gathered))
        return AveragingResult(mean, len(gathered), traffic, traffic, time.monotonic() - started)

    def shutdown(self) -> None:
        self._averager.shutdown()
