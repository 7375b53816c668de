"""A node of several worker processes (say, the GPUs of one workstation) that acts as one peer: the inner phase
runs data-parallel over `torch.distributed`, and only rank 0 talks to the swarm.

Every rank takes its slice of the node's batch; DDP averages the gradients in the backward, so all ranks hold the
same parameters and AdamW state after every step, and rank 0's inner phase is the node's. Rank 0 decides each
round (how many steps, when to stop) and hands the others the round's parameters; the others follow
(`p2ptrain/node/worker.py`). A one-process node runs the same code: every collective is then the identity.

A worker that dies or stops answering fails the collective the others are in (gloo reports the closed connection
at once; a silent worker after `timeout_s`): that surfaces as `NodeError`, and the node stops cleanly.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from p2ptrain.errors import UserError, one_line

# what rank 0 tells the others before each round (`NodeGroup.command`)
TRAIN, STOP = 1, 0


class NodeError(UserError):
    """A worker process of this node failed or stopped answering."""


def node_size_from_environment() -> int:
    """The number of worker processes torchrun started for this node (1 when not started by torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        raise UserError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number of processes") from None


class NodeGroup:
    """The processes of one node. `rank` 0 is the peer; `world_size` 1 is a node of one process (no collectives)."""

    def __init__(self, rank: int = 0, world_size: int = 1, device: torch.device | None = None):
        self.rank, self.world_size = rank, world_size
        self.device = device or torch.device("cpu")

    @classmethod
    def from_environment(cls, device: torch.device, timeout_s: float) -> NodeGroup:
        """This process's place in a torchrun node (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), joining the
        node's process group: NCCL with one GPU per rank (`cuda:<local rank>`) on CUDA, gloo on CPU. A process
        started alone is a node of one on `device`."""
        world_size = node_size_from_environment()
        if world_size == 1:
            return cls(device=device)
        rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise UserError(f"worker {rank} of this node wants GPU {local_rank}, but this machine has "
                                f"{torch.cuda.device_count()}: start at most one worker per GPU")
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        elif device.type != "cpu":
            raise UserError(f"a node of several processes trains on cuda or cpu, not {device.type}")
        try:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:  # the rendezvous failed: torchrun's env or a worker is missing
            raise NodeError(f"worker {rank} of this node could not join the others: {one_line(e)}") from None
        return cls(rank, world_size, device)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the inner phase runs forward and backward through: DDP over the node, or the model itself."""
        if self.world_size == 1:
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        with self.guard("wrap the model"):
            return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def local_part(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the node's batch (the node draws world_size × data.batch_size rows)."""
        if self.world_size == 1:
            return batch
        rows = batch.shape[0] // self.world_size
        return batch[self.rank * rows:(self.rank + 1) * rows]

    def no_sync(self, module: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Skip DDP's gradient all-reduce in this backward unless `sync` (the last micro-batch of a step)."""
        if sync or not isinstance(module, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return module.no_sync()

    def command(self, value: int) -> int:
        """Rank 0's `value` on every rank (what the others are to do next)."""
        if self.world_size == 1:
            return value
        flag = torch.tensor([value], dtype=torch.int64, device=self.device)
        with self.guard("agree on the next step"):
            dist.broadcast(flag, src=0)
        return int(flag.item())

    @torch.no_grad()
    def broadcast_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite `tensors` on every rank with rank 0's (the round's parameters)."""
        if self.world_size == 1:
            return
        with self.guard("share the round's parameters"):
            for tensor in tensors:
                dist.broadcast(tensor.data, src=0)

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's picklable `value` on every rank (a resumed inner optimizer state)."""
        if self.world_size == 1:
            return value
        box = [value]
        with self.guard("share the inner optimizer state"):
            dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turn a failed collective into NodeError: a worker died, or did not answer within the timeout."""
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            if self.world_size == 1:
                raise
            raise NodeError(f"worker {self.rank} of this {self.world_size}-process node could not {what}: another "
                            f"worker failed or stopped answering ({one_line(e)})") from None

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
