"""Loopback sync benchmark: the share of a round's wall time real peers spend computing, and the bytes they send,
per outer-sync setup, with every peer in this process on 127.0.0.1.

Setups (each a swarm of real TrainingPeers: hivemind DHT, P2P daemons, the production round loop):
  diloco-exchange  sync.mode diloco, sync.allreduce_transport exchange (the default: sync/exchange_allreduce.py, every
                   member swaps Δ with every other and takes their CenteredClip mean)
  diloco-hivemind  sync.mode diloco, sync.allreduce_transport hivemind (net/allreduce.py: hivemind's butterfly
                   averager; its group forms once the round's live peers have joined, waiting out
                   sync.matchmaking_s, 3 s by default, only for peers that do not come; it trusts each member with
                   a span of the mean: not robust to a hostile member)
  diloco-scatter   sync.allreduce_transport scatter (sync/scatter_allreduce.py: each member reduces one chunk for
                   all with CenteredClip, and every member checks the means it gets back)
  diloco-overlap   diloco-exchange with `sync.overlap: delayed` (DiLoCoX's one-step delay): a round's all-reduce runs
                   behind the next inner phase, and its mean is applied one round late
  diloco-scatter-overlap  diloco-scatter with `sync.overlap: delayed`
  diloco-hivemind-overlap  diloco-hivemind with `sync.overlap: delayed`
  diloco-sparse    diloco-exchange with `sync.grad_codec: sparse` (2-bit values, 2 % of each chunk, error feedback
                   β 0.95) and the outer recipe benchmarks/algorithms.py measured for it (γ 0, outer lr 1.0)
  gasloc           sync.mode gasloc, push-pull parameter gossip with 1 random peer per round
  gasloc-overlap   gasloc with `sync.overlap: delayed`: the exchanges a peer starts run during its next inner phase,
                   and their pull joins the next round's proposal
  torchft-diloco   not ours: torchft's DiLoCo (PyPI torchft; benchmarks/torchft_diloco.py) on the same inner phase
                   and outer step, Gloo's ring all-reduce and a Lighthouse quorum; skipped where torchft is not
                   installed (pip install torchft==0.2.0)
and a reference with no network: the same model, batches and inner steps run by `InnerTrainer.run_phase` (the
peer's own inner phase), one trainer alone and n trainers at once in threads (the CPU share n peers get).

Per setup and peer count, over the peers' rounds after the first (warm-up):
  utilisation   median of compute_s / round_s (inner phase seconds / the round's wall seconds)
  bytes ÷ ideal mean bytes_sent per peer per round ÷ 2·S·(n−1)/n, the bytes of an ideal (butterfly) all-reduce, S =
                parameters × bytes per value of the codec the round used (4: fp32, `grad_codec none`; sparse: its
                payload's share of fp32 bytes, memory/buffers.py's payload_share, × 4); gasloc has no
                all-reduce to compare with: its figure is bytes ÷ S (one parameter payload = 1)
  val loss      mean over peers of the validation loss after the last round (peers validate every `--eval-every`
                rounds, 0 by default: only their first, left out, and last, as the reference validates once)
Where the bytes come from: every transport's bytes_sent is measured on the peer's own streams
(net/stream_bytes.py): each frame hivemind writes for it, headers, refused and held offers, commits and digests
included, and for the hivemind transport its averager's streams, counted in the averager's own process; gasloc's
row also shows how many offers a peer answered per round (each sent about S back, counted). Not in bytes_sent:
libp2p's framing under the streams and the DHT's requests; the wire column (benchmarks/wire_bytes.py, the
kernel's TCP counters of the peers' daemons) counts those too.

Peers are threads of this process, one torch thread each, on a 2-core machine: they share the cores and the GIL
(the tiny model's steps are short, much of them Python), so their compute_s stretches; the "n at once" reference
shows by how much with no network at all. Times are wall-clock: other work on a shared machine skews them (the load
average before and after is recorded). Each setup runs once per peer count (`--repeats` for more, interleaved:
A B C A B C), peer counts in turn. The default run (2 and 4 peers, tiny model, 10 rounds x 20 inner steps,
batch 8 x 128 tokens, 9 setups) took 3.4 min of wall time and 4.7 min of CPU time in this process on 2 cores, besides
the DHT processes, P2P daemons and hivemind's averager processes (their CPU is in the table).

    python benchmarks/loopback_sync.py            # default run
    python benchmarks/loopback_sync.py --quick    # CI size: 2 peers, 4 rounds, about a minute
    python benchmarks/loopback_sync.py --peers 2,4,6 --rounds 20 --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.sim.entry import publish  # noqa: E402
from benchmarks.sim.rows import CODEC_RECIPE  # noqa: E402
from benchmarks.torchft_diloco import missing as torchft_missing  # noqa: E402
from benchmarks.torchft_diloco import run_torchft_swarm  # noqa: E402
from benchmarks.wire_bytes import DAEMON_NAME, daemon_pids, tcp_bytes  # noqa: E402
from p2ptrain.config import PeerConfig, build_config  # noqa: E402
from p2ptrain.data import TextShards, build_tokenizer  # noqa: E402
from p2ptrain.maths.inner import InnerTrainer  # noqa: E402
from p2ptrain.memory.buffers import payload_share  # noqa: E402
from p2ptrain.metrics import RoundMetrics  # noqa: E402
from p2ptrain.models import build_model  # noqa: E402
from p2ptrain.net.allreduce import BYTES_PER_VALUE, allreduce_traffic_bytes  # noqa: E402
from p2ptrain.peer import TrainingPeer  # noqa: E402

RESULTS_PATH = REPO / "benchmarks" / "results" / "loopback_sync.json"
# the outer step the simulation measured for the compressing codecs (sim/rows.py), as a sync.outer section
CODEC_OUTER = {"lr": CODEC_RECIPE["outer_lr"], "momentum": CODEC_RECIPE["momentum"]}
TORCHFT = "torchft-diloco"
SETUPS: dict[str, dict[str, Any]] = {
    "diloco-exchange": {"mode": "diloco", "allreduce_transport": "exchange"},
    "diloco-hivemind": {"mode": "diloco", "allreduce_transport": "hivemind"},
    "diloco-scatter": {"mode": "diloco", "allreduce_transport": "scatter"},
    "diloco-overlap": {"mode": "diloco", "allreduce_transport": "exchange", "overlap": "delayed"},
    "diloco-scatter-overlap": {"mode": "diloco", "allreduce_transport": "scatter", "overlap": "delayed"},
    "diloco-hivemind-overlap": {"mode": "diloco", "allreduce_transport": "hivemind", "overlap": "delayed"},
    "diloco-sparse": {"mode": "diloco", "grad_codec": "sparse", "topk_density": 0.02, "sparse_bits": 2,
                      "error_feedback_decay": CODEC_RECIPE["ef_decay"], "outer": CODEC_OUTER},
    "gasloc": {"mode": "gasloc", "gossip_peers": 1},
    "gasloc-overlap": {"mode": "gasloc", "gossip_peers": 1, "overlap": "delayed"},
    # not a peer of ours: torchft's DiLoCo (benchmarks/torchft_diloco.py) on our default DiLoCo's inner and outer
    # settings, where torchft is installed
    TORCHFT: {"mode": "diloco"},
}
# loopback only, no NAT probing or relays; records refreshed often, so peers see each other's rounds quickly
NETWORK = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "nat_port_map": False, "auto_nat": False, "use_relay": False,
           "heartbeat_s": 0.5, "record_ttl_s": 5.0}
CORPUS = {"max_corpus_bytes": 2_000_000, "num_shards": 8, "val_batches": 2}
RUN_TIMEOUT_S = 120.0  # per swarm, plus ROUND_TIMEOUT_S a round: a swarm still running then is stopped
ROUND_TIMEOUT_S = 30.0
WALL_BUDGET = "about 4 min of wall time, 5 min of CPU time in this process on 2 cores"
QUICK = {"peers": (2,), "rounds": 4, "inner_steps": 10, "batch_size": 4, "seq_len": 64}  # CI size


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one invocation runs."""

    peers: tuple[int, ...] = (2, 4)  # swarm sizes, in turn
    rounds: int = 10  # outer rounds per swarm (the first is warm-up, left out of the figures)
    inner_steps: int = 20  # H
    model: str = "tiny"
    batch_size: int = 8  # samples per inner step
    seq_len: int = 128  # tokens per sample
    repeats: int = 1  # runs of each setup per peer count, interleaved
    eval_every: int = 0  # the peers' run.eval_every; 0: the first (not measured) and last rounds only
    setups: tuple[str, ...] = tuple(SETUPS)

    def __post_init__(self) -> None:
        if min(self.peers, default=0) < 2 or self.rounds < 2 or min(self.inner_steps, self.repeats) < 1 \
                or self.eval_every < 0:
            raise ValueError("--peers must list counts >= 2, --rounds be >= 2, --inner-steps and --repeats >= 1, "
                             "--eval-every >= 0")
        unknown = set(self.setups) - set(SETUPS)
        if unknown or not self.setups:
            raise ValueError(f"--setups must name some of {', '.join(SETUPS)}; unknown: {', '.join(sorted(unknown))}")


def peer_config(s: Settings, sync: dict[str, Any], run_id: str, shard: int, seed: int = 0,
                swarm_size: int = 1) -> PeerConfig:
    """A peer of the benchmark: loopback, the settings' model and batch, `sync` on the sync section's defaults
    (its "outer" entry, if any, on the outer section's), `seed` the run's (θ_0 and batches). Its first round waits
    for the swarm's `swarm_size` peers (run.min_peers): a gossip peer that has not seen its partner yet mixes with
    no one (once under CI's load, in all the measured rounds of a 4-round swarm)."""
    sync = dict(sync)
    outer = sync.pop("outer", {})
    return build_config({
        "run": {"run_id": run_id, "rounds": s.rounds, "device": "cpu", "progress": False,
                "shard_index": shard % CORPUS["num_shards"], "seed": seed, "eval_every": s.eval_every or s.rounds,
                "min_peers": swarm_size},
        "model": {"name": s.model, "max_seq_len": s.seq_len},
        "data": {"seq_len": s.seq_len, "batch_size": s.batch_size, **CORPUS},
        "inner": {"steps": s.inner_steps},
        "sync": sync,
        "outer": outer,
        "network": NETWORK,
    })


# ---- one swarm ---------------------------------------------------------------------------------------------------


class PeerRun:
    """A TrainingPeer's `run()` in a thread; keeps its history, or the error it raised."""

    def __init__(self, peer: TrainingPeer):
        self.peer, self.error = peer, ""
        self.history: list[RoundMetrics] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.history = self.peer.run()
        except Exception as e:  # reported in the row
            self.error = repr(e)


def daemons_cpu_s() -> tuple[float, float]:
    """CPU seconds of this process's live children (DHT processes, p2pd daemons, hivemind averagers): all of them,
    and the p2pd daemons' alone."""
    total = p2pd = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times, name = child.cpu_times(), child.name()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
        p2pd += times.user + times.system if name == DAEMON_NAME else 0.0
    return total, p2pd


def process_tree_bytes() -> int:
    """Memory of this process and its live children (DHT processes, p2pd daemons, averagers), each page once: the
    proportional set size (a forked DHT process shares its parent's pages, which RSS counts in both)."""
    total = 0
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += process.memory_full_info().pss
    return total


class PeakMemory:
    """The peak of `process_tree_bytes()` from `start()` to `stop()`, sampled every `every_s` in a thread, above what it
    was at the start."""

    # every 5 s: each sample reads smaps_rollup of every process of the swarm (17 at 8 peers; torchft's is one), CPU
    # taken from our peers and not torchft's. At 1 s it was 9 % of this process's samples (py-spy, 8 DiLoCo peers),
    # and the peers' inner phases ran 1.26-1.51× the no-network reference, against 0.97-1.19× at 5 s (2026-12-02)
    def __init__(self, every_s: float = 5.0):
        self.every_s, self.base, self.peak = every_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, process_tree_bytes())

    def start(self) -> PeakMemory:
        self.base = self.peak = process_tree_bytes()
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop sampling; the peak above the start, in bytes."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, process_tree_bytes())
        return self.peak - self.base


def run_swarm(s: Settings, setup: str, n: int, sync: dict[str, Any] | None = None, seed: int = 0) -> dict[str, Any]:
    """Start n peers (the first founds the swarm), run them to `s.rounds` in threads, shut them down. `sync`: the
    setup's sync section (default SETUPS[setup])."""
    run_id = f"bench-{setup}-{uuid.uuid4().hex[:6]}"
    sync = SETUPS[setup] if sync is None else sync
    if setup == TORCHFT:  # its child process, spawned after the sampler's start, is in the peak (its own imports too)
        sampler = PeakMemory().start()
        try:
            result = run_torchft_swarm([peer_config(s, sync, run_id, shard=i, seed=seed) for i in range(n)],
                                       s.rounds, RUN_TIMEOUT_S + ROUND_TIMEOUT_S * s.rounds)
        finally:
            peak = sampler.stop()
        return {**result, "peak_bytes_per_peer": peak / n}
    started, cpu_started = time.perf_counter(), time.process_time()
    peers: list[TrainingPeer] = []
    memory = PeakMemory().start()
    try:
        peers.append(TrainingPeer(peer_config(s, sync, run_id, shard=0, seed=seed, swarm_size=n)))
        peers += [TrainingPeer(peer_config(s, sync, run_id, shard=i, seed=seed, swarm_size=n), peers[0].maddrs)
                  for i in range(1, n)]
        runs = [PeerRun(p) for p in peers]
        daemons = daemon_pids()
        wire_before, training = tcp_bytes(daemons), time.perf_counter()
        for r in runs:
            r.thread.start()
        deadline = training + RUN_TIMEOUT_S + ROUND_TIMEOUT_S * s.rounds
        for r in runs:
            r.thread.join(max(0.0, deadline - time.perf_counter()))
        timed_out = any(r.thread.is_alive() for r in runs)
        for r in runs:  # a swarm past its deadline ends its rounds now (run() returns what it did)
            r.peer.stop()
        for r in runs:
            r.thread.join(ROUND_TIMEOUT_S)
        training_s, (daemons_s, p2pd_s) = time.perf_counter() - training, daemons_cpu_s()
        wire_after = tcp_bytes(daemons)
    finally:
        peak_bytes = memory.stop()
        for p in peers:
            p.shutdown()
    return {"setup": setup, "peers": n, "parameters": sum(p.numel() for p in peers[0].params),
            "peak_bytes_per_peer": peak_bytes / n,
            "histories": [[dataclasses.asdict(m) for m in r.history] for r in runs],
            "errors": [r.error for r in runs if r.error], "timed_out": timed_out, "training_wall_s": training_s,
            "wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu_started,
            "daemons_cpu_s": daemons_s, "p2pd_cpu_s": p2pd_s,
            "wire_bytes_sent": (wire_after - wire_before).sent if wire_before and wire_after else None}


def run_reference(s: Settings, trainers: int) -> dict[str, Any]:
    """`trainers` InnerTrainers at once in threads, no network: each runs s.rounds inner phases of H steps."""
    config = peer_config(s, {}, "reference", shard=0)
    tokenizer = build_tokenizer(config.data)
    phases: list[list[float]] = [[] for _ in range(trainers)]
    losses = [math.nan] * trainers

    def train(i: int) -> None:
        shards = TextShards(config.data, tokenizer, i % config.data.num_shards)
        trainer = InnerTrainer(build_model(config.model, tokenizer.vocab_size, config.run.seed), config.inner,
                               torch.device("cpu"))
        batches = shards.train_batches(seed=hash((config.run.seed, shards.shard_index)) % 2**31)  # as a peer does
        for _ in range(s.rounds):
            phases[i].append(trainer.run_phase(batches, s.inner_steps).compute_s)
        losses[i] = trainer.evaluate(shards.validation_batches())

    started = time.perf_counter()
    threads = [threading.Thread(target=train, args=(i,)) for i in range(trainers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"setup": "reference", "peers": trainers, "phases_s": phases, "val_losses": losses,
            "wall_s": time.perf_counter() - started}


# ---- figures -----------------------------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: Sequence[float]) -> float | None:
    """The mean; None when there is none, or it is not finite (strict JSON)."""
    mean = statistics.fmean(values) if values else math.nan
    return mean if math.isfinite(mean) else None


def codec_of(rounds: Sequence[dict[str, Any]]) -> str:
    """The codec the rounds' payloads used: their exchanges' (gossip), else the round's own (all-reduce)."""
    codecs = [e["codec"] for m in rounds for e in m["exchanges"]] or [m["codec"] for m in rounds]
    return statistics.mode(codecs)


def reference_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    phases = [t for run in runs for per_trainer in run["phases_s"] for t in per_trainer[1:]]
    return {"setup": "reference", "peers": runs[0]["peers"], "compute_s": _median(phases), "utilisation": 1.0,
            "val_loss": _mean([x for run in runs for x in run["val_losses"]]),
            "wall_s": sum(r["wall_s"] for r in runs)}


def bytes_per_value(codec: str, sync: dict[str, Any]) -> float:
    """What one parameter costs in a payload of `codec` (the sparse codecs: per the setup's density and bits)."""
    if codec in BYTES_PER_VALUE:
        return BYTES_PER_VALUE[codec]
    sparse = build_config({"sync": {k: v for k, v in sync.items() if k != "outer"}}).sync
    return 4 * payload_share(codec, sparse.topk_density, sparse.sparse_bits, sparse.topk_chunk_size)


def round_figures(rounds: list[dict[str, Any]], n: int, parameters: int, sync: dict[str, Any],
                  reference_s: float | None) -> dict[str, Any]:
    """Utilisation, times, group sizes and bytes over peers' rounds (at least one)."""
    codec, mode = codec_of(rounds), sync["mode"]
    payload = parameters * bytes_per_value(codec, sync)  # S: one codec-encoded copy of the parameters
    ideal = payload if mode == "gasloc" else allreduce_traffic_bytes(payload, n)
    sent = statistics.fmean(m["bytes_sent"] for m in rounds)
    compute = statistics.median(m["compute_s"] for m in rounds)
    return {
        "codec": codec, "payload_bytes": payload, "bytes_basis": "S" if mode == "gasloc" else "2·S·(n−1)/n",
        "utilisation": statistics.median(m["compute_s"] / m["round_s"] for m in rounds),
        # the network's share alone: the round less its validation (which the reference's loop does not run)
        "utilisation_less_eval": statistics.median(m["compute_s"] / (m["round_s"] - m["eval_s"]) for m in rounds),
        "eval_s": statistics.median(m["eval_s"] for m in rounds),
        "compute_s": compute, "blocked_s": statistics.median(m["comm_blocked_s"] for m in rounds),
        "round_s": statistics.median(m["round_s"] for m in rounds),
        "compute_vs_reference": compute / reference_s if reference_s else None,
        "group_size": statistics.median(m["peers_averaged"] for m in rounds),
        "full_groups": None if mode == "gasloc" else sum(m["peers_averaged"] == n for m in rounds) / len(rounds),
        "bytes_sent": sent, "bytes_ratio": sent / ideal, "ideal_bytes": ideal,
        # gossip: exchanges others opened with us (peers_averaged is ourselves, those we opened, those we answered)
        "answered": statistics.fmean(m["peers_averaged"] - 1 - len(m["exchanges"]) for m in rounds)
        if mode == "gasloc" else None,
        "failed_exchanges": sum(m["failed_exchanges"] for m in rounds),
    }


def swarm_row(runs: list[dict[str, Any]], reference_s: float | None) -> dict[str, Any]:
    """A setup's figures over its runs' peers and rounds (the first round of each peer left out)."""
    n, setup = runs[0]["peers"], runs[0]["setup"]
    histories = [h for run in runs for h in run["histories"]]
    rounds = [m for h in histories for m in h[1:]]
    row = {"setup": setup, "peers": n, "rounds_measured": len(rounds),
           "val_loss": _mean([h[-1]["val_loss"] for h in histories if h]),
           "errors": [e for run in runs for e in run["errors"]], "timed_out": any(r["timed_out"] for r in runs),
           "wall_s": sum(r["wall_s"] for r in runs), "daemons_cpu_s": sum(r["daemons_cpu_s"] for r in runs),
           "p2pd_cpu_s": sum(r.get("p2pd_cpu_s", 0.0) for r in runs),
           # a peer's rounds, the first included, end to end (the sum of its round_s): median over peers and runs
           "loop_s": _median([sum(m["round_s"] for m in h) for h in histories if h]),
           "peak_bytes_per_peer": max((r.get("peak_bytes_per_peer", 0.0) for r in runs), default=0.0)}
    if rounds:
        row.update(round_figures(rounds, n, runs[0]["parameters"], SETUPS[setup], reference_s))
    # the daemons' TCP counters over the whole run (first rounds included), per peer and round
    wire = _mean([r["wire_bytes_sent"] / max(1, sum(len(h) for h in r["histories"])) for r in runs
                  if r.get("wire_bytes_sent") is not None])
    row["wire_bytes_per_round"] = wire
    row["wire_ratio"] = wire / row["ideal_bytes"] if wire is not None and row.get("ideal_bytes") else None
    return row


# ---- the run and the report ----------------------------------------------------------------------------------------


def run(s: Settings, output: Path, command: str) -> dict[str, Any]:
    """Every setup at every peer count (interleaved), the reference, the JSON file; returns the report."""
    started, started_cpu, threads_before = time.perf_counter(), time.process_time(), torch.get_num_threads()
    load_before = os.getloadavg()[0]  # the machine may be shared: other work skews every time measured here
    torch.set_num_threads(1)  # every peer and reference trainer: one intra-op thread (they share the process)
    rows, raw = [], []
    why_not_torchft = torchft_missing() if TORCHFT in s.setups else None
    skipped = {TORCHFT: why_not_torchft} if why_not_torchft else {}
    setups = [setup for setup in s.setups if setup not in skipped]
    for setup, why in skipped.items():
        print(f"{setup}: skipped: {why}", flush=True)
    try:
        for n in s.peers:
            alone, together = [run_reference(s, 1)], [run_reference(s, n)]
            swarms: dict[str, list[dict[str, Any]]] = {setup: [] for setup in setups}
            for _ in range(s.repeats):
                for setup in setups:
                    swarms[setup].append(run_swarm(s, setup, n))
                    print(f"{setup:<16} {n} peers: {swarms[setup][-1]['wall_s']:.0f} s", flush=True)
            reference_alone, reference_n = reference_row(alone), reference_row(together)
            rows += [reference_alone, reference_n]
            rows += [{**swarm_row(runs, reference_n["compute_s"]), "reference_compute_s": reference_alone["compute_s"]}
                     for runs in swarms.values()]
            raw += alone + together + [r for runs in swarms.values() for r in runs]
    finally:
        torch.set_num_threads(threads_before)
    report = {"command": command, "settings": dataclasses.asdict(s), "rows": rows, "runs": raw, "notes": NOTES,
              "skipped": skipped,
              "matchmaking_s": peer_config(s, {}, "x", 0).sync.matchmaking_s, "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.machine(), "cpu_count": psutil.cpu_count(),
              "load_before": load_before, "load_after": os.getloadavg()[0],
              "cpu_s": time.process_time() - started_cpu, "wall_s": time.perf_counter() - started}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    return report


NOTES = ("Notes: figures over every peer's rounds after its first. utilisation = compute_s / round_s (the peer's "
         "inner phase over the round's wall time, evaluation and DHT reads included in the latter; peers validate "
         "every run.eval_every rounds, by default here only in their last, as the reference validates once at the "
         "end); less eval: "
         "compute_s / (round_s − eval_s), the round's validation (eval s, measured) left out, as the reference's "
         "loop has none: what the network and the round's bookkeeping cost. wire ÷ ideal: what the swarm's P2P "
         "daemons sent over TCP from the first round to the last (the kernel's counters, benchmarks/wire_bytes.py: "
         "payloads, framing, encryption, DHT, matchmaking, joins), per peer and round, over the same ideal. "
         "ref s = one "
         "InnerTrainer alone, the same H steps, no network; compute ÷ ref = the peers' median compute_s over that "
         "of n trainers at once in threads, no network (what the network stack takes from training beyond the "
         "cores and GIL the peers share). bytes ÷ ideal: mean bytes_sent per peer per round over 2·S·(n−1)/n "
         "(gasloc: over S), S = parameters × bytes per value of the codec used. bytes_sent is measured on each "
         "peer's streams (net/stream_bytes.py: every frame, headers, refused and held offers, digests included; "
         "the hivemind transport's from its averager's process): the exchange all-reduce sends (n−1)·S (every "
         "member's Δ to every other), 1× ideal for 2 peers, n/2× beyond; gasloc, the exchanges a peer opened and "
         "those it answered ('answered': the offers it answered per round, each S sent back). group: median "
         "group size (gasloc: itself and the partners it mixed with, opened or answered); full groups: rounds "
         "averaged by all n peers. peak MiB a peer: the peak memory (proportional set size) of this process and "
         "its children (DHT processes, p2pd daemons, averagers) while the swarm ran, above what it was before its "
         "peers started, over n (the imports and the corpus are in the base; torch's allocator may keep what a "
         "round freed). loop s: a peer's rounds end to end, the first included (the sum of its round s), median "
         "over peers and runs. torchft-diloco: torchft's DiLoCo (benchmarks/torchft_diloco.py), its replicas "
         "threads of one child process on our inner phase and outer step; its blocked s is its sync (quorum, "
         "Gloo all-reduce, outer step), its bytes the child's TCP counters (Gloo, the Lighthouse and Manager "
         "calls) per replica and round, so bytes and wire are one figure; its peak memory holds its child process's "
         "own Python, torch and transformers (in the base for our peers). "
         "daemons CPU: the DHT processes, p2pd daemons and hivemind averagers, measured before shutdown, all "
         "runs of the row together (in brackets: the p2pd daemons' share). On a shared machine (load average "
         "above the cores) compute seconds, the reference's most, swing up to 3× between runs; utilisation, "
         "groups and bytes hardly move.")


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _bytes_cell(r: dict[str, Any]) -> str:
    if r.get("bytes_ratio") is None or r["bytes_basis"] != "S":
        return _fmt(r.get("bytes_ratio"), ".3f")
    return f"{r['bytes_ratio']:.3f} ÷ S ({r['answered']:.2f} answered)"


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [f"# Loopback sync benchmark\n\n`{report['command']}`  \nmodel {s['model']}, batch {s['batch_size']} x "
             f"{s['seq_len']} tokens, {s['rounds']} rounds x {s['inner_steps']} inner steps, {s['repeats']} run(s) "
             f"per setup, sync.matchmaking_s {report['matchmaking_s']:g}, "
             f"validation every {s.get('eval_every') or s['rounds']} rounds (run.eval_every), 1 torch thread per peer, "
             f"{report['cpu_count']} CPU cores, load average {report['load_before']:.1f} before, "
             f"{report['load_after']:.1f} after  \nwall {report['wall_s']:.0f} s, CPU of this process "
             f"{report['cpu_s']:.0f} s (default run: {WALL_BUDGET})\n",
             "| setup | peers | utilisation | less eval | compute s | ref s, 1 alone | compute ÷ ref, n at once "
             "| blocked s | eval s | round s | loop s | group | full groups | bytes ÷ ideal | wire ÷ ideal | codec "
             "| val loss | peak MiB a peer | daemons CPU s | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if r["setup"] == "reference":
            who = "1 alone" if r["peers"] == 1 else f"{r['peers']} at once"
            lines.append(f"| reference, {who} | {r['peers']} | 1 | 1 | {_fmt(r['compute_s'], '.3f')} "
                         f"| | | | | | | | | | | | {_fmt(r['val_loss'], '.4f')} | | | {r['wall_s']:.0f} |")
            continue
        trouble = " (timed out)" if r["timed_out"] else f" ({len(r['errors'])} errors)" if r["errors"] else ""
        full = _fmt(r.get("full_groups"), ".0%")
        lines.append(f"| {r['setup']}{trouble} | {r['peers']} | {_fmt(r.get('utilisation'), '.3f')} "
                     f"| {_fmt(r.get('utilisation_less_eval'), '.3f')} "
                     f"| {_fmt(r.get('compute_s'), '.3f')} | {_fmt(r['reference_compute_s'], '.3f')} "
                     f"| {_fmt(r.get('compute_vs_reference'), '.2f')} | {_fmt(r.get('blocked_s'), '.3f')} "
                     f"| {_fmt(r.get('eval_s'), '.3f')} | {_fmt(r.get('round_s'), '.3f')} "
                     f"| {_fmt(r.get('loop_s'), '.2f')} | {_fmt(r.get('group_size'), 'g')} | {full} "
                     f"| {_bytes_cell(r)} | {_fmt(r.get('wire_ratio'), '.3f')} | {r.get('codec', '–')} "
                     f"| {_fmt(r['val_loss'], '.4f')} | {_fmt(r['peak_bytes_per_peer'] / 2**20 or None, '.0f')} "
                     f"| {r['daemons_cpu_s']:.0f} ({r.get('p2pd_cpu_s', 0.0):.0f}) | {r['wall_s']:.0f} |")
    skipped = [f"{setup}: skipped: {why}" for setup, why in report.get("skipped", {}).items()]
    return "\n".join(lines + ["", report["notes"]] + ([""] + skipped if skipped else [])) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> tuple[Settings, Path]:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default=None, help=f"swarm sizes, comma-separated (default {defaults.peers})")
    for name in ("rounds", "inner_steps", "batch_size", "seq_len", "repeats", "eval_every"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help=f"default {getattr(defaults, name)}")
    parser.add_argument("--model", default=None, help=f"model preset (default {defaults.model})")
    parser.add_argument("--setups", default=None, help=f"comma-separated, of {', '.join(SETUPS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="CI size: 2 peers, 4 rounds of 10 steps of 4 x 64 tokens")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH, help="where to write the JSON results")
    args = parser.parse_args(argv)
    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    for name in ("rounds", "inner_steps", "batch_size", "seq_len", "repeats", "eval_every", "model"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    try:
        if args.peers is not None:
            values["peers"] = tuple(int(x) for x in args.peers.split(","))
        if args.setups is not None:
            values["setups"] = tuple(args.setups.split(","))
        return Settings(**values), args.output
    except ValueError as error:
        parser.error(str(error))
        raise


def main() -> None:
    settings, output = parse_args()
    publish(run(settings, output, "python " + " ".join(sys.argv)), output, markdown)


if __name__ == "__main__":
    main()
