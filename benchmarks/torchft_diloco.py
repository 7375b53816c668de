"""torchft's DiLoCo on loopback, beside ours in benchmarks/loopback_sync.py: the same model, batches and inner phase.

torchft (PyPI `torchft`, 0.2.0 measured) runs DiLoCo over a fault-tolerant process group: a Lighthouse server
decides each round's quorum (its replicas ask it over gRPC at the end of the inner phase), and the replicas average
their outer gradients with Gloo's all-reduce (a ring on TCP), then take Nesterov's outer step. Here n replicas are
threads of one child process (as torchft's own integration tests run them: threads of one process), each with its
own TCPStore, Manager and Gloo group; each trains with our `InnerTrainer` (the peers' inner phase: the same AdamW,
schedule, batches and seed as a peer of loopback_sync.py), wrapped by torchft's `DiLoCo`, which hooks the inner
optimizer's step and syncs at its H-th. The outer step is ours: SGD with `outer.lr` and `outer.momentum` (Nesterov
when γ > 0).

What a round's figures mean here: round_s is the wall time of one inner phase plus its sync; the sync is the
time spent in DiLoCo's step hook on the H-th step (quorum, all-reduce, outer step), compute the rest. Bytes: the
kernel's TCP counters of the child's sockets (benchmarks/wire_bytes.py) over the run, shared out per replica and
round: Gloo's ring, the Lighthouse and Manager gRPC calls; with every end in the child, that is what all the
replicas sent. The child is spawned, not forked, and holds nothing else: torchft leaves its Rust runtime's threads
running in the process, and a later swarm of ours, whose DHT processes are forked from the benchmark's, hung with
them in it. torchft trusts every replica (no clipping, no checks of what a member sends) and has no DHT: it is a
datacenter design, the reference for speed only.

Alone, it runs one torchft swarm on the default peer's settings (the tiny model) and prints each replica's figures:

    python benchmarks/torchft_diloco.py --peers 4 --rounds 10 --inner-steps 20
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's root

from benchmarks.wire_bytes import tcp_bytes  # noqa: E402
from p2ptrain.config import PeerConfig, build_config  # noqa: E402
from p2ptrain.data import TextShards, build_tokenizer  # noqa: E402
from p2ptrain.maths.inner import InnerTrainer  # noqa: E402
from p2ptrain.models import build_model  # noqa: E402

TIMEOUT = timedelta(seconds=60)  # torchft's quorum, connect and operation deadlines
CHILD_MARGIN_S = 60.0  # the child's start (imports, the corpus) and shutdown, beyond the swarm's own deadline


def missing() -> str | None:
    """Why torchft cannot run here (not installed, or an import fails), or None."""
    os.environ.setdefault("RUST_LOG", "warn")  # its Lighthouse and Managers log every quorum at INFO otherwise
    try:
        import torchft  # noqa: F401
        from torchft._torchft import LighthouseServer  # noqa: F401
        from torchft.local_sgd import DiLoCo  # noqa: F401
    except Exception as error:  # ImportError, or a binary extension that does not load
        return f"torchft is not importable ({error!r}); pip install torchft==0.2.0"
    return None


class _Replica:
    """One torchft replica in a thread: its inner trainer, Manager and DiLoCo wrapper; its rounds, or its error."""

    def __init__(self, config: PeerConfig, index: int, peers: int, lighthouse: str, rounds: int):
        self.config, self.index, self.peers, self.lighthouse, self.rounds = config, index, peers, lighthouse, rounds
        self.history: list[dict[str, Any]] = []
        self.val_loss, self.error, self.sync_s = math.nan, "", 0.0
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"torchft-replica-{index}")

    def _run(self) -> None:
        try:
            self._train()
        except Exception as error:  # reported in the row
            self.error = repr(error)

    def _train(self) -> None:
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        config = self.config
        tokenizer = build_tokenizer(config.data)
        shards = TextShards(config.data, tokenizer, config.run.shard_index)
        trainer = InnerTrainer(build_model(config.model, tokenizer.vocab_size, config.run.seed), config.inner,
                               torch.device("cpu"))
        batches = shards.train_batches(seed=hash((config.run.seed, shards.shard_index)) % 2**31)  # as a peer does
        store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=TIMEOUT), min_replica_size=self.peers, use_async_quorum=False,
            load_state_dict=lambda state: trainer.model.load_state_dict(state["model"]),
            state_dict=lambda: {"model": trainer.model.state_dict()},
            replica_id=f"replica{self.index}", store_addr="localhost", store_port=store.port, rank=0, world_size=1,
            lighthouse_addr=self.lighthouse, hostname="localhost", port=0, timeout=TIMEOUT,
            quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT)
        momentum = config.outer.momentum
        outer = torch.optim.SGD(trainer.model.parameters(), lr=config.outer.lr, momentum=momentum,
                                nesterov=config.outer.nesterov and momentum > 0)
        try:
            diloco = DiLoCo(manager, [trainer.model], trainer.optimizer, outer, sync_every=config.inner.steps,
                            backup_device=torch.device("cpu"), pin_memory=False)
            hook = diloco._step_post_hook  # timed: on the H-th step it runs the quorum, all-reduce and outer step

            def timed_hook(*args: Any) -> None:
                started = time.perf_counter()
                hook(*args)
                self.sync_s += time.perf_counter() - started

            diloco._step_post_hook = timed_hook  # type: ignore[method-assign]  # registered by __enter__
            with diloco:
                for round_ in range(self.rounds):
                    started, synced_before = time.perf_counter(), self.sync_s
                    trainer.run_phase(batches, config.inner.steps)
                    round_s, sync_s = time.perf_counter() - started, self.sync_s - synced_before
                    self.history.append({
                        "round": round_, "round_s": round_s, "compute_s": round_s - sync_s,
                        "comm_blocked_s": sync_s, "eval_s": 0.0, "peers_averaged": manager.num_participants(),
                        "exchanges": [], "codec": "none", "failed_exchanges": 0, "bytes_sent": 0,
                        "val_loss": None})  # measured once, after the last round
            self.val_loss = trainer.evaluate(shards.validation_batches())
            if self.history:
                self.history[-1]["val_loss"] = self.val_loss
        finally:
            manager.shutdown(wait=False)


def run_torchft_swarm(configs: Sequence[PeerConfig], rounds: int, timeout_s: float) -> dict[str, Any]:
    """One torchft replica per config (its model, data and inner settings) for `rounds` rounds, in a spawned child
    process; the same keys as loopback_sync's run_swarm (each round's `bytes_sent`: the child's TCP bytes over the
    run, per replica and round). A child that does not answer within `timeout_s` + a margin is killed: an error."""
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[dict[str, Any]] = context.Queue()
    child = context.Process(target=_swarm_in_child, args=(list(configs), rounds, timeout_s, results), daemon=True)
    child.start()
    try:
        result = results.get(timeout=timeout_s + CHILD_MARGIN_S)
    except queue.Empty:
        result = _failed(len(configs), f"the torchft child gave nothing within {timeout_s + CHILD_MARGIN_S:.0f} s",
                         timed_out=True)
    finally:
        child.join(CHILD_MARGIN_S)
        if child.is_alive():
            child.kill()
    return {**result, "wall_s": time.perf_counter() - started, "peak_bytes_per_peer": 0.0, "cpu_s": 0.0,
            "daemons_cpu_s": 0.0}


def _swarm_in_child(configs: list[PeerConfig], rounds: int, timeout_s: float,
                    results: multiprocessing.Queue[dict[str, Any]]) -> None:
    torch.set_num_threads(1)  # one intra-op thread per replica, as the peers of loopback_sync have
    try:
        results.put(_swarm(configs, rounds, timeout_s))
    except Exception as error:  # reported in the row
        results.put(_failed(len(configs), repr(error), timed_out=False))


def _failed(peers: int, error: str, timed_out: bool) -> dict[str, Any]:
    """A swarm that gave no rounds: `error` says why."""
    return {"setup": "torchft-diloco", "peers": peers, "parameters": 0, "histories": [], "errors": [error],
            "timed_out": timed_out, "training_wall_s": math.nan, "wire_bytes_sent": None}


def _swarm(configs: list[PeerConfig], rounds: int, timeout_s: float) -> dict[str, Any]:
    """The replicas as threads of this process, the Lighthouse beside them."""
    missing()  # quiets the Rust logs before the import
    from torchft._torchft import LighthouseServer

    peers = len(configs)
    # built once before the threads: transformers' lazy imports, first run in several threads at once, raised
    # "cannot import name 'AutoConfig'" in one of them
    tokenizer = build_tokenizer(configs[0].data)
    parameters = sum(p.numel() for p in build_model(configs[0].model, tokenizer.vocab_size, 0).parameters())
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=peers)
    replicas = [_Replica(config, i, peers, lighthouse.address(), rounds) for i, config in enumerate(configs)]
    wire_before, training = tcp_bytes({os.getpid()}), time.perf_counter()
    try:
        for replica in replicas:
            replica.thread.start()
        deadline = training + timeout_s
        for replica in replicas:
            replica.thread.join(max(0.0, deadline - time.perf_counter()))
        timed_out = any(replica.thread.is_alive() for replica in replicas)
        training_s, wire_after = time.perf_counter() - training, tcp_bytes({os.getpid()})
    finally:
        lighthouse.shutdown()
    wire = (wire_after - wire_before).sent if wire_before and wire_after else None
    measured = sum(len(r.history) for r in replicas)
    for replica in replicas:
        for m in replica.history:
            m["bytes_sent"] = wire / measured if wire is not None and measured else 0
    return {"setup": "torchft-diloco", "peers": peers, "parameters": parameters,
            "histories": [r.history for r in replicas], "errors": [r.error for r in replicas if r.error],
            "timed_out": timed_out, "training_wall_s": training_s, "wire_bytes_sent": wire}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="torchft's DiLoCo on loopback, its replicas on our inner phase "
                                                 "(benchmarks/loopback_sync.py runs it beside our setups)")
    parser.add_argument("--peers", type=int, default=4, help="replicas (default 4)")
    parser.add_argument("--rounds", type=int, default=10, help="outer rounds (default 10)")
    parser.add_argument("--inner-steps", type=int, default=20, help="H (default 20)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="the swarm's deadline (default 600)")
    args = parser.parse_args(argv)
    if args.peers < 2 or args.rounds < 1 or args.inner_steps < 1 or not args.timeout_s > 0:
        parser.error("--peers must be >= 2, --rounds and --inner-steps >= 1, --timeout-s > 0")
    why = missing()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    configs = [build_config({"model": {"name": "tiny"}, "inner": {"steps": args.inner_steps},
                             "run": {"device": "cpu", "shard_index": i}}) for i in range(args.peers)]
    result = run_torchft_swarm(configs, args.rounds, args.timeout_s)
    for i, history in enumerate(result["histories"]):
        loop_s, sync_s = sum(m["round_s"] for m in history), sum(m["comm_blocked_s"] for m in history)
        print(f"replica {i}: {len(history)} rounds in {loop_s:.2f} s, {sync_s:.2f} s of them syncing; "
              f"validation loss {history[-1]['val_loss'] if history else math.nan:.4f}")
    for error in result["errors"]:
        print(f"error: {error}", file=sys.stderr)
    return 1 if result["errors"] or result["timed_out"] else 0


if __name__ == "__main__":
    sys.exit(main())
