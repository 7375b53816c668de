"""Helpers for tests that run real peers (real hivemind DHT and averager) on loopback, in this process."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.p2p import P2P

from p2ptrain.config import PeerConfig, build_config
from p2ptrain.metrics import RoundMetrics
from p2ptrain.peer import TrainingPeer
from p2ptrain.sync.interface import RoundSync


def tiny_config(run_id: str, **sections: dict[str, Any]) -> PeerConfig:
    """A config that trains in seconds on one CPU thread, loopback only, no NAT probing."""
    values: dict[str, dict[str, Any]] = {
        "run": {"run_id": run_id, "device": "cpu", "progress": False},
        "model": {"name": "tiny", "max_seq_len": 64},
        "data": {"seq_len": 64, "batch_size": 4, "max_corpus_bytes": 1_000_000, "num_shards": 8, "val_batches": 2},
        "inner": {"steps": 5, "warmup_steps": 2, "lr": 3e-3},
        # DiLoCo, the exact reference, whose peers agree to the bit; a test of a gossip mode names its own
        "sync": {"mode": "diloco", "matchmaking_s": 3.0, "allreduce_timeout_s": 30.0, "state_download_timeout_s": 20.0},
        "network": {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "nat_port_map": False, "auto_nat": False,
                    "use_relay": False, "heartbeat_s": 0.5, "record_ttl_s": 5.0},
    }
    for section, changes in sections.items():
        values.setdefault(section, {}).update(changes)
    return build_config(values)


def replace_section(config: PeerConfig, section: str, **changes: Any) -> PeerConfig:
    """A copy of `config` with fields of one section changed (re-validated)."""
    new_section = dataclasses.replace(getattr(config, section), **changes)
    return dataclasses.replace(config, **{section: new_section})


class PeerThread:
    """A TrainingPeer running `run()` in a thread; keeps a copy of its parameters after every round."""

    def __init__(self, peer: TrainingPeer):
        self.peer = peer
        self.params_after_round: dict[int, list[torch.Tensor]] = {}
        self.round_ended_at: dict[int, float] = {}  # time.monotonic() at the end of each round
        self.history: list[RoundMetrics] = []
        self.error: BaseException | None = None
        self.round_done = threading.Condition()
        peer.round_callbacks.append(self._on_round)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _on_round(self, peer: TrainingPeer, metrics: RoundMetrics) -> None:
        with self.round_done:
            self.params_after_round[metrics.round] = [p.detach().clone() for p in peer.params]
            self.round_ended_at[metrics.round] = time.monotonic()
            self.round_done.notify_all()

    def _run(self) -> None:
        try:
            self.history = self.peer.run()
        except BaseException as e:  # surfaced by join()
            self.error = e

    def start(self) -> PeerThread:
        self.thread.start()
        return self

    def wait_for_round(self, round_: int, timeout_s: float) -> None:
        """Block until the peer has finished `round_` (condition wait, no sleeps)."""
        with self.round_done:
            ok = self.round_done.wait_for(
                lambda: round_ in self.params_after_round or not self.thread.is_alive(), timeout=timeout_s)
        assert ok and round_ in self.params_after_round, f"peer did not finish round {round_} in {timeout_s} s"

    def params_at(self, moment: float) -> list[torch.Tensor]:
        """Its parameters as they stood at `moment` (time.monotonic()): those after its last round ended by then."""
        return self.params_after_round[max(r for r, t in self.round_ended_at.items() if t <= moment)]

    def join(self, timeout_s: float) -> list[RoundMetrics]:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"peer still running after {timeout_s} s"
        if self.error is not None:
            raise self.error
        return self.history


def stop_and_shut_down(running: list[PeerThread], others: Sequence[TrainingPeer | None] = ()) -> None:
    """Stop the peers running in `running`, wait for their threads, then shut them and `others` down (None: a peer
    that was never started)."""
    for thread in running:
        thread.peer.stop()
    for thread in running:
        thread.thread.join(timeout=60)
    for peer in [thread.peer for thread in running] + list(others):
        if peer is not None:
            peer.shutdown()


def start_peer(config: PeerConfig, initial_peers: list[str] | None = None) -> TrainingPeer:
    return TrainingPeer(config, initial_peers or [])


def max_param_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll a condition that has no event to wait on (state in another process), with a deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.1)


def run_swarm(
    config: PeerConfig, peers: int, timeout_s: float = 300
) -> tuple[list[PeerThread], list[list[RoundMetrics]]]:
    """Start `peers` peers (the first founds the swarm), run them to `config.run.rounds`, shut them down. They begin
    round 0 together (`run.min_peers`): a peer that ran its first rounds alone on a loaded machine is another test."""
    if config.run.min_peers == 1:
        config = replace_section(config, "run", min_peers=peers)
    first = start_peer(config)
    return run_peers([first] + [start_peer(config, first.maddrs) for _ in range(peers - 1)], timeout_s)


def run_peers(members: list[TrainingPeer], timeout_s: float = 300, attackers: int = 0
              ) -> tuple[list[PeerThread], list[list[RoundMetrics]]]:
    """Run started peers to their `run.rounds` in threads, then shut them all down (also on failure). The last
    `attackers` members are stopped once the others are done, with the rounds they made by then: a banned attacker
    that keeps trying to join would otherwise hold the test up for its join deadlines (40 s of a 74 s test)."""
    threads = [PeerThread(p) for p in members]
    honest = threads[:len(threads) - attackers]
    try:
        for thread in threads:
            thread.start()
        histories = [thread.join(timeout_s=timeout_s) for thread in honest]
        for thread in threads[len(honest):]:
            thread.peer.stop()
        histories += [thread.join(timeout_s=timeout_s) for thread in threads[len(honest):]]
    finally:
        for member in members:
            member.shutdown()
    return threads, histories


async def start_p2ps(n: int) -> list[P2P]:
    """`n` bare hivemind P2P nodes on loopback (the first bootstraps the others), no NAT probing, no relays."""
    options = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False)
    first = await P2P.create(**options)
    return [first] + [await P2P.create(initial_peers=await first.get_visible_maddrs(), **options)
                      for _ in range(n - 1)]


async def shutdown(p2ps: list[P2P]) -> None:
    for p2p in p2ps:
        await p2p.shutdown()


class LoneMixer:
    """Factored's Mix1 with no partner: the mixed value is the frozen one and the correction zero, so that θ moves
    by the outer step alone."""

    round, budget_s, give_up_at = 0, 0.0, 0.0

    def set_base_(self, base: Sequence[torch.Tensor]) -> None:
        self.base = [b.clone() for b in base]

    async def mix(self, value: list[torch.Tensor], *_args: object, **_kwargs: object) -> tuple[list, RoundSync]:
        return value, RoundSync()

    def take_correction_(self) -> list[torch.Tensor]:
        return [torch.zeros_like(b) for b in self.base]

    def take_incoming_stats(self) -> RoundSync:
        return RoundSync()
