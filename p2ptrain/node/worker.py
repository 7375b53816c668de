"""The workers of a multi-process node (ranks 1..N−1 under torchrun): they train beside rank 0, the peer, and do
nothing else (no network, no outer state).

A node draws world_size × `data.batch_size` samples per step from one stream, the same on every rank (rank 0 tells
the others its shard and seed when they start), and each rank trains on its own rows (maths/data_parallel.py).
Each round rank 0 says whether to go on, shares the round's parameters, and decides every step; a worker's model
and AdamW state stay equal to rank 0's because DDP gives every rank the same averaged gradient.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from p2ptrain.config import PeerConfig
from p2ptrain.data import PieceOrder, TextShards, Tokenizer, build_tokenizer
from p2ptrain.maths.data_parallel import STOP, TRAIN, NodeGroup
from p2ptrain.maths.inner import InnerTrainer
from p2ptrain.models import build_model

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NodeStart:
    """What rank 0 tells the other workers once its peer has started."""

    shard: int  # the node's training shard
    inner_state: dict[str, Any] | None  # the resumed inner optimizer state (None: a fresh start)


def node_data(config: PeerConfig, tokenizer: Tokenizer, shard: int, world_size: int,
              order_of: Callable[[int], PieceOrder] | None = None) -> TextShards:
    """The node's data: batches of world_size × `data.batch_size` samples, which its ranks split between them;
    `order_of` as in TextShards (a node of several ranks reads its shard's pieces: every rank makes the same
    batches on its own)."""
    data_config = dataclasses.replace(config.data, batch_size=config.data.batch_size * world_size)
    return TextShards(data_config, tokenizer, shard, order_of if world_size == 1 else None)


def node_batches(config: PeerConfig, data: TextShards, shard: int) -> Iterator[torch.Tensor]:
    """The node's batch stream: the same on every rank (a seed from the run's seed and the shard)."""
    return data.train_batches(seed=hash((config.run.seed, shard)) % 2**31)


class NodeWorker:
    """Rank r > 0 of a node: follows rank 0's rounds and steps until it says stop."""

    def __init__(self, config: PeerConfig, node: NodeGroup):
        self.node = node
        tokenizer = build_tokenizer(config.data)
        self.model = build_model(config.model, tokenizer.vocab_size, config.run.seed)
        self.model.to(node.device)  # type: ignore[arg-type]  # transformers' decorator hides nn.Module.to
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.inner = InnerTrainer(self.model, config.inner, node.device, node)
        start: NodeStart = node.broadcast_object(None)
        if start.inner_state is not None:
            self.inner.load_state_dict(start.inner_state)
        self.batches = node_batches(config, node_data(config, tokenizer, start.shard, node.world_size), start.shard)

    def run(self) -> int:
        """Train the rounds rank 0 starts; returns how many. Ctrl-C and torchrun's SIGTERM are rank 0's to act on
        (it finishes the step and tells us to stop); a failed rank 0 fails our next collective (NodeError)."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        rounds = 0
        while self.node.command(STOP) == TRAIN:
            self.node.broadcast_(self.params)
            self.inner.run_phase(self.batches, sys.maxsize)
            rounds += 1
        logger.info(f"worker {self.node.rank}: rank 0 stopped the node after {rounds} rounds")
        return rounds
