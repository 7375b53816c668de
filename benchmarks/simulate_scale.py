"""Event-driven simulation of a volunteer swarm: compute utilisation of DiLoCo, gossip and Factored at scale.

No training and no sockets: each peer alternates inner phases (compute) with exchanges over its home link, and a
heap of timed events decides who waits for whom. Pure Python + numpy; 100-1,000 peers, 150M-70B parameters.
Timing of each algorithm (ALGORITHMS.md §1-3); S = payload bytes each way:
  diloco     blocking butterfly all-reduce: a round ends for all when the slowest inner phase is done plus
             allreduce_latency_s + 2·S·(n−1)/n / b_min, b_min = the slowest upload or download in the swarm.
  gossip-1   asynchronous pairs: a peer whose inner phase is done draws a random peer whose link is free; each sends
             S, taking exchange_latency_s + S / (slower direction). The initiator waits; the partner keeps computing,
             unless it was itself waiting to mix, in which case the exchange is its mix too.
  gossip-2   the same with two partners at once, the initiator's upload and download split between the two flows.
  factored   Mix1: a pair exchange started with the round, behind the inner phase; the peer waits only for what is
             left of it when the inner phase ends. Mix2: a blocking 2-partner exchange after every K-th inner phase.
A link serves one exchange at a time; initiators draw among free peers only (the DHT is assumed to record who is
free, so refusals cost nothing); a peer that finds too few free partners waits until a link frees.

Assumptions (ours, not fitted to a real swarm; each is a flag or a constant below):
  Links: upload log-normal with 10th percentile 5 and 90th percentile 100 Mbit/s (median sqrt(5·100) ≈ 22.4,
    σ = ln 20 / (2·1.2816) ≈ 1.17), clipped to [1, 1000] Mbit/s (slower volunteers assumed not to join);
    download = min(5 × upload, 1000). Shaped after public fixed-broadband speed-test summaries (upload medians of
    tens of Mbit/s, a long fibre tail, asymmetric cable/DSL), not a fitted data set. Speed tests report goodput,
    so rates are used as they are; `calibrate` checks the transfer model against measured tbf-shaped transfers.
  Compute: an inner step is 6·N·tokens_per_step FLOPs on gpus_per_peer GPUs at MFU 0.4 (assumed); default GPU
    RTX 4090, 165.2 TFLOP/s dense BF16 with FP32 accumulate (NVIDIA Ada whitepaper), 24 GB. gpus_per_peer = the
    fewest GPUs whose memory (80 % usable) holds 16 bytes/parameter (bf16 weights and grads, fp32 master and
    AdamW moments), so a 70B peer is a multi-GPU node. --step-time-s replaces this model; --compute-spread σ gives
    each peer a log-normal throughput factor (heterogeneous GPUs). Inner phase = inner_steps × step time.
  Payload: S = N × 2 bytes (fp16) / compression, for every exchange and both directions.
Outputs per (swarm, model, compression, algorithm): utilisation = compute time / wall time per peer (median, 10th
percentile), round time (median over peers of each peer's mean), rounds completed within the budget (median, 10th
percentile). A run goes on past the budget until every peer has min_rounds rounds, so that utilisation and round
time rest on several rounds even where few fit the budget.

calibrate: prints the model's transfer time next to measured ones. Record file (a bare list of rows also works):
    {"format": "p2ptrain-exchange-records/1",
     "rows": [{"payload_bytes": 5000000,     # bytes one side sends (in an exchange each side sends this many)
               "link_rate_mbit": 20.0,       # rate the slower end is shaped to, both directions (tc tbf)
               "measured_seconds": 2.085,    # until the last byte arrived (at both ends, for an exchange)
               "kind": "exchange",           # optional: "exchange" (push-pull call incl. latency; the default)
                                             #   or "transfer" (one-way TCP stream timed from its first byte)
               "note": "..."}]}              # optional free text

    python benchmarks/simulate_scale.py                 # default grid -> benchmarks/results/simulate_scale.{md,json}
    python benchmarks/simulate_scale.py --peers 100 --params 7B --compression 1 --stragglers 5
    python benchmarks/simulate_scale.py calibrate [--records FILE] [--exchange-latency-s 0.5]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from p2ptrain.errors import ConfigError, UserError, one_line  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results"
Z_90 = 1.2815515655446004  # 90th percentile of the standard normal
UPLOAD_P10_MBIT, UPLOAD_P90_MBIT = 5.0, 100.0
UPLOAD_MEDIAN_MBIT = math.sqrt(UPLOAD_P10_MBIT * UPLOAD_P90_MBIT)
UPLOAD_SIGMA = math.log(UPLOAD_P90_MBIT / UPLOAD_P10_MBIT) / (2 * Z_90)
DOWNLOAD_PER_UPLOAD = 5.0
LINK_FLOOR_MBIT, LINK_CAP_MBIT = 1.0, 1000.0
TRAIN_BYTES_PER_PARAM = 16
USABLE_GPU_MEMORY = 0.8
PAYLOAD_BYTES_PER_PARAM = 2  # fp16
HORIZON_LIMIT_S = 3.2e9  # a century: rounds slower than this mean the inputs make no sense
KINDS = ("allreduce", "gossip", "factored")
RECORD_FORMAT = "p2ptrain-exchange-records/1"
# Measured 2026-11-22 on the 2-core development machine (kernel 6.18) with p2ptrain.netns.Testbed: host "shaped"
# under tc tbf at link_rate_mbit sends payload_bytes over one TCP connection to an unshaped host; the receiver
# times from the first byte to EOF (the sender/receiver pair of tests/test_netns.py). Goodput: 4.82, 19.19,
# 19.14 and 95.8 Mbit/s (tbf counts whole frames: 1448 payload bytes per 1514-byte frame = 95.6 %). Recipe, as root:
# Testbed("simcal", [HostSpec("shaped", 20), HostSpec("b")]).create(); for each row set_rate("shaped", rate),
# run test_netns.py's RECEIVER in "b" and its SENDER in "shaped" with payload_bytes; teardown() at the end.
SAMPLE_RECORDS: list[dict[str, Any]] = [
    {"payload_bytes": 2_000_000, "link_rate_mbit": 5.0, "measured_seconds": 3.320, "kind": "transfer"},
    {"payload_bytes": 5_000_000, "link_rate_mbit": 20.0, "measured_seconds": 2.085, "kind": "transfer"},
    {"payload_bytes": 20_000_000, "link_rate_mbit": 20.0, "measured_seconds": 8.358, "kind": "transfer"},
    {"payload_bytes": 20_000_000, "link_rate_mbit": 100.0, "measured_seconds": 1.670, "kind": "transfer"},
]


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_flops: float  # dense BF16 tensor FLOP/s with FP32 accumulate, from the vendor's spec sheet
    memory_bytes: float


GPUS = {g.name: g for g in (Gpu("rtx4090", 165.2e12, 24e9), Gpu("a100", 312e12, 80e9), Gpu("h100", 989e12, 80e9))}


@dataclass(frozen=True)
class Algorithm:
    """How a round synchronises: kind 'allreduce' (DiLoCo), 'gossip' or 'factored'."""

    kind: str
    partners: int = 1  # gossip: partners per exchange; factored: Mix2's partners (Mix1 always has one)
    mix2_every: int = 1  # factored: Mix2 after every mix2_every-th inner phase

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"algorithm kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if self.partners < 1 or self.mix2_every < 1:
            raise ConfigError("partners and mix2_every must be >= 1")

    @property
    def name(self) -> str:
        if self.kind == "allreduce":
            return "diloco"
        return f"gossip-{self.partners}" if self.kind == "gossip" else f"factored-K{self.mix2_every}"


@dataclass(frozen=True, eq=False)
class Swarm:
    """Per-peer links (Mbit/s) and inner-phase times (s), and the payload every exchange sends each way."""

    upload_mbit: np.ndarray
    download_mbit: np.ndarray
    inner_phase_s: np.ndarray
    payload_bytes: float
    exchange_latency_s: float = 0.5  # DHT lookup + connection + handshake of one gossip exchange
    allreduce_latency_s: float = 5.0  # matchmaking of one all-reduce (hivemind's min_matchmaking_time)

    def __post_init__(self) -> None:
        n = len(self.upload_mbit)
        if n < 2 or len(self.download_mbit) != n or len(self.inner_phase_s) != n:
            raise ConfigError("a swarm needs >= 2 peers and one upload, download and inner-phase time per peer")
        arrays = (self.upload_mbit, self.download_mbit, self.inner_phase_s)
        if min(float(np.min(a)) for a in arrays) <= 0 or self.payload_bytes <= 0:
            raise ConfigError("link rates, inner-phase times and payload_bytes must be > 0")
        if self.exchange_latency_s < 0 or self.allreduce_latency_s < 0:
            raise ConfigError("latencies must be >= 0 s")

    @property
    def n(self) -> int:
        return len(self.upload_mbit)


def allreduce_s(swarm: Swarm) -> float:
    """Butterfly all-reduce: 2·S·(n−1)/n through the slowest link of the swarm, plus matchmaking."""
    slowest_mbit = min(float(np.min(swarm.upload_mbit)), float(np.min(swarm.download_mbit)))
    bits = 2 * swarm.payload_bytes * 8 * (swarm.n - 1) / swarm.n
    return swarm.allreduce_latency_s + bits / (slowest_mbit * 1e6)


def exchange_s(swarm: Swarm, initiator: int, partners: Sequence[int]) -> float:
    """Push-pull of S with each partner at once; the initiator's link is split evenly between the partners."""
    k, up, down = len(partners), swarm.upload_mbit, swarm.download_mbit
    slowest_mbit = min(min(up[initiator] / k, down[p], up[p], down[initiator] / k) for p in partners)
    return swarm.exchange_latency_s + swarm.payload_bytes * 8 / (float(slowest_mbit) * 1e6)


@dataclass(eq=False)
class SimResult:
    """Per-peer outcome of one run; every peer's compute_s + wait_s equals end_s."""

    algorithm: Algorithm
    budget_s: float
    end_s: float
    compute_s: np.ndarray
    wait_s: np.ndarray
    rounds_in_budget: np.ndarray
    round_s: list[list[float]]  # per peer, the duration of each completed round
    partners: list[set[int]]  # per peer, everyone it exchanged with (all-reduce: not recorded)

    @property
    def utilisation(self) -> np.ndarray:
        return self.compute_s / self.end_s

    def summary(self) -> dict[str, float]:
        """Medians over peers; round time is each peer's mean over its completed rounds (fast peers, who complete
        more rounds, would otherwise outweigh slow ones)."""
        mean_round_s = [sum(per_peer) / len(per_peer) for per_peer in self.round_s if per_peer]
        return {
            "utilisation_median": float(np.median(self.utilisation)),
            "utilisation_p10": float(np.percentile(self.utilisation, 10)),
            "round_s_median": float(np.median(mean_round_s)) if mean_round_s else math.nan,
            "rounds_in_budget_median": float(np.median(self.rounds_in_budget)),
            "rounds_in_budget_p10": float(np.percentile(self.rounds_in_budget, 10)),
            "simulated_s": self.end_s,
        }


class _FreeSet:
    """Peers whose link is free: O(1) add, remove and uniform draw."""

    def __init__(self, n: int) -> None:
        self.items, self.position = list(range(n)), list(range(n))

    def remove(self, peer: int) -> None:
        index, last = self.position[peer], self.items.pop()
        if last != peer:
            self.items[index], self.position[last] = last, index
        self.position[peer] = -1

    def add(self, peer: int) -> None:
        self.position[peer] = len(self.items)
        self.items.append(peer)

    def draw(self, rng: random.Random, k: int, exclude: int) -> list[int] | None:
        """k distinct free peers other than ``exclude``, or None if there are fewer."""
        if len(self.items) - (self.position[exclude] >= 0) < k:
            return None
        chosen: list[int] = []
        while len(chosen) < k:
            peer = self.items[rng.randrange(len(self.items))]
            if peer != exclude and peer not in chosen:
                chosen.append(peer)
        return chosen


class _Simulation:
    """One run. Heap entries are (time_s, priority, seq, event, peer or exchange id); "try" events have priority 1
    so they run after every state change at the same instant, and peers ready together can pair with each other."""

    def __init__(self, algorithm: Algorithm, swarm: Swarm, budget_s: float, min_rounds: int, seed: int) -> None:
        n = swarm.n
        self.alg, self.swarm, self.budget_s, self.min_rounds = algorithm, swarm, budget_s, min_rounds
        self.rng, self.seq = random.Random(seed), itertools.count()
        self.heap: list[tuple[float, int, int, str, int]] = []
        self.compute_s, self.wait_s, self.since_s, self.computing = [0.0] * n, [0.0] * n, [0.0] * n, [True] * n
        self.round_start_s, self.rounds_in_budget = [0.0] * n, [0] * n
        self.round_s: list[list[float]] = [[] for _ in range(n)]
        self.partners: list[set[int]] = [set() for _ in range(n)]
        self.need: list[str | None] = [None] * n  # pending exchange: "gossip", "mix1" or "mix2"
        self.inner_done = [False] * n
        self.free = _FreeSet(n)
        self.waiting: set[int] = set()  # peers with a need and a free link that found too few free partners
        self.exchanges: dict[int, tuple[str, list[int], list[int]]] = {}
        self.exchange_ids = itertools.count()
        self.arrived, self.peers_at_min_rounds, self.done_at_s = 0, 0, math.inf

    def run(self) -> SimResult:
        for peer in range(self.swarm.n):
            self._start_round(peer, 0.0)
        while self.heap and self.heap[0][0] <= max(self.budget_s, self.done_at_s):
            time_s, _, _, event, who = heapq.heappop(self.heap)
            if time_s > HORIZON_LIMIT_S:
                raise ConfigError("rounds take over a century: raise bandwidth or compression, or lower --min-rounds")
            getattr(self, f"_on_{event}")(who, time_s)
        end_s = max(self.budget_s, self.done_at_s)
        for peer in range(self.swarm.n):
            self._switch(peer, end_s, self.computing[peer])
        return SimResult(
            self.alg, self.budget_s, end_s, np.array(self.compute_s), np.array(self.wait_s),
            np.array(self.rounds_in_budget), self.round_s, self.partners,
        )

    def _push(self, time_s: float, priority: int, event: str, who: int) -> None:
        heapq.heappush(self.heap, (time_s, priority, next(self.seq), event, who))

    def _switch(self, peer: int, now_s: float, computing: bool) -> None:
        """Book the time since the peer's last switch as compute or wait, then enter the new state."""
        elapsed_s = now_s - self.since_s[peer]
        if self.computing[peer]:
            self.compute_s[peer] += elapsed_s
        else:
            self.wait_s[peer] += elapsed_s
        self.since_s[peer], self.computing[peer] = now_s, computing

    def _start_round(self, peer: int, now_s: float) -> None:
        self._switch(peer, now_s, computing=True)
        self.inner_done[peer] = False
        self._push(now_s + float(self.swarm.inner_phase_s[peer]), 0, "inner_done", peer)
        if self.alg.kind == "factored":
            self.need[peer] = "mix1"
            self._push(now_s, 1, "try", peer)

    def _end_round(self, peer: int, now_s: float) -> None:
        self.round_s[peer].append(now_s - self.round_start_s[peer])
        self.rounds_in_budget[peer] += now_s <= self.budget_s
        if len(self.round_s[peer]) == self.min_rounds:
            self.peers_at_min_rounds += 1
            if self.peers_at_min_rounds == self.swarm.n:
                self.done_at_s = now_s
        self.round_start_s[peer] = now_s
        self._start_round(peer, now_s)

    def _on_inner_done(self, peer: int, now_s: float) -> None:
        self._switch(peer, now_s, computing=False)
        self.inner_done[peer] = True
        if self.alg.kind == "allreduce":
            self.arrived += 1
            if self.arrived == self.swarm.n:
                self.arrived = 0
                self._push(now_s + allreduce_s(self.swarm), 0, "allreduce_done", -1)
        elif self.alg.kind == "gossip":
            self.need[peer] = "gossip"
            self._push(now_s, 1, "try", peer)
        elif self.need[peer] != "mix1":  # factored, Mix1 already done: otherwise wait for it
            self._after_mix1(peer, now_s)

    def _after_mix1(self, peer: int, now_s: float) -> None:
        if (len(self.round_s[peer]) + 1) % self.alg.mix2_every == 0:
            self.need[peer] = "mix2"
            self._push(now_s, 1, "try", peer)
        else:
            self._end_round(peer, now_s)

    def _on_allreduce_done(self, _: int, now_s: float) -> None:
        for peer in range(self.swarm.n):
            self._end_round(peer, now_s)

    def _on_try(self, peer: int, now_s: float) -> None:
        kind = self.need[peer]
        if kind is None or self.free.position[peer] < 0:
            return  # nothing to do, or its link is busy: the exchange that frees it tries again
        chosen = self.free.draw(self.rng, 1 if kind == "mix1" else self.alg.partners, exclude=peer)
        if chosen is None:
            self.waiting.add(peer)
            return
        group = [peer, *chosen]
        satisfied = [peer] + [p for p in chosen if self.need[p] == kind]  # a partner waiting to mix is mixed too
        for p in group:
            self.free.remove(p)
            self.waiting.discard(p)
        self.partners[peer].update(chosen)
        for p in chosen:
            self.partners[p].add(peer)
        exchange_id = next(self.exchange_ids)
        self.exchanges[exchange_id] = (kind, group, satisfied)
        self._push(now_s + exchange_s(self.swarm, peer, chosen), 0, "exchange_done", exchange_id)

    def _on_exchange_done(self, exchange_id: int, now_s: float) -> None:
        kind, group, satisfied = self.exchanges.pop(exchange_id)
        for peer in group:
            self.free.add(peer)
        for peer in satisfied:
            self.need[peer] = None
            if kind != "mix1":
                self._end_round(peer, now_s)
            elif self.inner_done[peer]:
                self._after_mix1(peer, now_s)
        for peer in [p for p in group if p not in satisfied and self.need[p] is not None] + list(self.waiting):
            self._push(now_s, 1, "try", peer)


def simulate(algorithm: Algorithm, swarm: Swarm, budget_s: float, min_rounds: int = 10, seed: int = 0) -> SimResult:
    """Run until budget_s and until every peer has completed min_rounds rounds, whichever is later."""
    if budget_s <= 0 or min_rounds < 1:
        raise ConfigError("budget_s must be > 0 and min_rounds >= 1")
    return _Simulation(algorithm, swarm, budget_s, min_rounds, seed).run()


@dataclass(frozen=True)
class Scenario:
    """One grid point: swarm size and model size, plus the assumptions that turn them into a Swarm."""

    peers: int
    params: float  # model parameters N
    gpu: str = "rtx4090"
    mfu: float = 0.4  # model FLOPs utilisation of the inner steps (assumed)
    tokens_per_step: int = 131_072  # tokens per inner step per peer
    inner_steps: int = 500  # H
    step_time_s: float | None = None  # replaces the FLOP model when given
    compute_spread: float = 0.0  # σ of the per-peer log-normal throughput factor; 0 = identical GPUs
    compression: float = 1.0  # payload = fp16 bytes / compression
    exchange_latency_s: float = 0.5
    allreduce_latency_s: float = 5.0
    stragglers: int = 0  # peers whose links are multiplied by straggler_factor
    straggler_factor: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise ConfigError(f"gpu {self.gpu!r}: use one of {', '.join(GPUS)}")
        if self.peers < 2 or self.params <= 0 or not 0 < self.mfu <= 1 or self.compression < 1:
            raise ConfigError("need peers >= 2, params > 0, 0 < mfu <= 1 and compression >= 1")
        if self.tokens_per_step < 1 or self.inner_steps < 1 or (self.step_time_s is not None and self.step_time_s <= 0):
            raise ConfigError("tokens_per_step and inner_steps must be >= 1 and step_time_s > 0")
        if self.compute_spread < 0 or not 0 <= self.stragglers <= self.peers or not 0 < self.straggler_factor <= 1:
            raise ConfigError("need compute_spread >= 0, 0 <= stragglers <= peers and 0 < straggler_factor <= 1")


def gpus_per_peer(params: float, gpu: Gpu) -> int:
    return math.ceil(params * TRAIN_BYTES_PER_PARAM / (gpu.memory_bytes * USABLE_GPU_MEMORY))


def flops_step_time_s(params: float, gpu: Gpu, mfu: float, tokens_per_step: int) -> float:
    """6·N·tokens FLOPs over the peer's GPUs at the given MFU."""
    return 6 * params * tokens_per_step / (gpu.peak_flops * mfu * gpus_per_peer(params, gpu))


def sample_upload_mbit(n: int, rng: np.random.Generator) -> np.ndarray:
    rates = rng.lognormal(math.log(UPLOAD_MEDIAN_MBIT), UPLOAD_SIGMA, n)
    return np.clip(rates, LINK_FLOOR_MBIT, LINK_CAP_MBIT)


def build_swarm(scenario: Scenario) -> Swarm:
    s, rng = scenario, np.random.default_rng(scenario.seed)
    upload = sample_upload_mbit(s.peers, rng)
    download = np.minimum(upload * DOWNLOAD_PER_UPLOAD, LINK_CAP_MBIT)
    upload[: s.stragglers] *= s.straggler_factor  # links are drawn iid, so the first peers are as good as any
    download[: s.stragglers] *= s.straggler_factor
    step_s = s.step_time_s or flops_step_time_s(s.params, GPUS[s.gpu], s.mfu, s.tokens_per_step)
    speed = np.exp(rng.normal(0.0, s.compute_spread, s.peers)) if s.compute_spread else np.ones(s.peers)
    return Swarm(
        upload, download, s.inner_steps * step_s / speed, s.params * PAYLOAD_BYTES_PER_PARAM / s.compression,
        s.exchange_latency_s, s.allreduce_latency_s,
    )


def run_grid(
    scenarios: list[Scenario], algorithms: list[Algorithm], budget_s: float, min_rounds: int
) -> list[dict[str, Any]]:
    """One row per (scenario, algorithm), printed as it comes; algorithms share the scenario's swarm."""
    rows = []
    for scenario in scenarios:
        swarm = build_swarm(scenario)
        for algorithm in algorithms:
            started = time.perf_counter()
            result = simulate(algorithm, swarm, budget_s, min_rounds, scenario.seed)
            rows.append({
                "peers": scenario.peers, "params": scenario.params, "compression": scenario.compression,
                "algorithm": algorithm.name,
                "inner_phase_s_median": float(np.median(swarm.inner_phase_s)),
                "payload_mb": swarm.payload_bytes / 1e6, **result.summary(),
                "cpu_s": round(time.perf_counter() - started, 3),
            })
            print(format_row(rows[-1]), flush=True)
    return rows


HEADER = ("| peers | params | compression | algorithm | inner phase s | payload MB | util median | util p10 "
          "| round s median | rounds in budget median / p10 |")
RULE = "|" + "---|" * 10


def _params_label(params: float) -> str:
    return f"{params / 1e9:g}B" if params >= 1e9 else f"{params / 1e6:g}M"


def format_row(row: dict[str, Any]) -> str:
    cells = (
        row["peers"], _params_label(row["params"]), f"{row['compression']:g}x", row["algorithm"],
        f"{row['inner_phase_s_median']:.0f}", f"{row['payload_mb']:.4g}", f"{row['utilisation_median']:.3f}",
        f"{row['utilisation_p10']:.3f}", f"{row['round_s_median']:.0f}",
        f"{row['rounds_in_budget_median']:g} / {row['rounds_in_budget_p10']:g}",
    )
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def write_results(rows: list[dict[str, Any]], settings: dict[str, Any], command: str, output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    assumptions = {
        "upload_mbit": {"distribution": "log-normal", "p10": UPLOAD_P10_MBIT, "median": UPLOAD_MEDIAN_MBIT,
                        "p90": UPLOAD_P90_MBIT, "sigma": UPLOAD_SIGMA, "clip": [LINK_FLOOR_MBIT, LINK_CAP_MBIT]},
        "download_per_upload": DOWNLOAD_PER_UPLOAD, "gpus": {k: asdict(v) for k, v in GPUS.items()},
        "train_bytes_per_param": TRAIN_BYTES_PER_PARAM, "payload_bytes_per_param": PAYLOAD_BYTES_PER_PARAM,
    }
    document = {"command": command, "settings": settings, "assumptions": assumptions, "rows": rows}
    (output_dir / "simulate_scale.json").write_text(json.dumps(document, indent=1) + "\n")
    lines = [
        "# Simulated compute utilisation at scale", "", f"Command: `{command}`", "",
        f"Settings: {json.dumps(settings)}", "",
        "Model and assumptions: see the docstring of benchmarks/simulate_scale.py (home links log-normal, "
        "p10 5 / median 22.4 / p90 100 Mbit/s upload, download 5x; compute from 6·N·tokens FLOPs at the stated "
        "MFU). Utilisation = compute time / wall time per peer; rounds in budget counted at the budget.", "",
        HEADER, RULE, *(format_row(row) for row in rows), "", *NOTES,
    ]
    (output_dir / "simulate_scale.md").write_text("\n".join(lines))


NOTES = [
    "Notes:",
    "- One compression ratio applies to every payload. Parameters (gossip's y, Mix1's θ) compress worse than outer "
    "gradients (ALGORITHMS.md §5), so rows with compression > 1 are optimistic for gossip and Mix1.",
    "- DiLoCo's peers all run the same H; hivemind's target-batch-size pacing or GASLoC's adaptive H, which let "
    "slow peers do fewer steps, are not simulated.",
    "- Rounds in budget 0 means the first round did not end within the budget; utilisation and round time then "
    "come from the run past the budget (min_rounds per peer).",
    "",
]


@dataclass(frozen=True)
class ExchangeRecord:
    """One measured exchange or transfer (see the module docstring for the file format)."""

    payload_bytes: int
    link_rate_mbit: float
    measured_seconds: float
    kind: str = "exchange"
    note: str = ""

    def __post_init__(self) -> None:
        if self.payload_bytes <= 0 or self.link_rate_mbit <= 0 or self.measured_seconds <= 0:
            raise ConfigError("payload_bytes, link_rate_mbit and measured_seconds must be > 0")
        if self.kind not in ("exchange", "transfer"):
            raise ConfigError(f"kind {self.kind!r}: use 'exchange' or 'transfer'")


def parse_records(document: Any) -> list[ExchangeRecord]:
    """Rows of a records document (or a bare list of rows); a bad row raises a ConfigError naming it."""
    if isinstance(document, dict):
        if document.get("format", RECORD_FORMAT) != RECORD_FORMAT:
            raise ConfigError(f"records format {document.get('format')!r}: expected {RECORD_FORMAT!r}")
        document = document.get("rows")
    if not isinstance(document, list) or not document:
        raise ConfigError('exchange records: give a non-empty list of rows, or {"format": ..., "rows": [...]}')
    records = []
    for index, row in enumerate(document):
        try:
            records.append(ExchangeRecord(**row))
        except (TypeError, ConfigError) as error:
            raise ConfigError(f"exchange record row {index}: {error}") from None
    return records


def predicted_s(record: ExchangeRecord, exchange_latency_s: float) -> float:
    """The simulation's own exchange model for two peers whose links are both shaped to the record's rate."""
    rates = np.full(2, record.link_rate_mbit)
    latency_s = exchange_latency_s if record.kind == "exchange" else 0.0
    return exchange_s(Swarm(rates, rates, np.ones(2), record.payload_bytes, latency_s), 0, [1])


def calibrate(records: list[ExchangeRecord], exchange_latency_s: float) -> list[dict[str, Any]]:
    rows = []
    for record in records:
        predicted = predicted_s(record, exchange_latency_s)
        rows.append({**asdict(record), "predicted_seconds": predicted, "ratio": record.measured_seconds / predicted})
    return rows


def print_calibration(rows: list[dict[str, Any]]) -> None:
    print("| payload bytes | link Mbit/s | kind | measured s | predicted s | measured / predicted |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['payload_bytes']} | {row['link_rate_mbit']:g} | {row['kind']} | {row['measured_seconds']:.3f} "
              f"| {row['predicted_seconds']:.3f} | {row['ratio']:.3f} |")
    median_ratio = float(np.median([row["ratio"] for row in rows]))
    print(f"median measured / predicted: {median_ratio:.3f} (the model is {abs(median_ratio - 1):.1%} "
          f"{'optimistic' if median_ratio > 1 else 'pessimistic'})")


def parse_params(text: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(text[-1:].upper())
    try:
        return float(text[:-1]) * scale if scale else float(text)
    except ValueError:
        raise ConfigError(f"model size {text!r}: write e.g. 150M, 1.5B or 7e9") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="simulate", choices=("simulate", "calibrate"))
    add = parser.add_argument
    add("--peers", default="100,1000", help="comma-separated swarm sizes")
    add("--params", default="150M,1B,7B,70B", help="comma-separated model sizes (150M, 1B, 7e9)")
    add("--algorithms", default="diloco,gossip-1,gossip-2,factored", help="subset of the default four")
    add("--mix2-every", type=int, default=4, help="factored: Mix2 after every K-th inner phase")
    add("--budget-h", type=float, default=24.0, help="wall-clock budget in which rounds are counted, hours")
    add("--min-rounds", type=int, default=10, help="simulate at least this many rounds per peer")
    add("--gpu", default="rtx4090", choices=sorted(GPUS))
    add("--mfu", type=float, default=0.4)
    add("--tokens-per-step", type=int, default=131_072)
    add("--inner-steps", type=int, default=500, help="H, inner steps per round")
    add("--step-time-s", type=float, default=None, help="seconds per inner step; replaces the FLOP model")
    add("--compute-spread", type=float, default=0.0, help="σ of per-peer log-normal GPU throughput factors")
    add("--compression", default="1,100", help="comma-separated ratios: payload = fp16 bytes / ratio")
    add("--exchange-latency-s", type=float, default=0.5)
    add("--allreduce-latency-s", type=float, default=5.0)
    add("--stragglers", type=int, default=0, help="peers whose links are slowed by --straggler-factor")
    add("--straggler-factor", type=float, default=0.1)
    add("--seed", type=int, default=0)
    add("--output-dir", type=Path, default=RESULTS_DIR)
    add("--records", type=Path, default=None, help="calibrate: exchange-records JSON (default: built-in sample)")
    return parser.parse_args(argv)


def _algorithms(names: str, mix2_every: int) -> list[Algorithm]:
    known = {"diloco": Algorithm("allreduce"), "gossip-1": Algorithm("gossip", 1), "gossip-2": Algorithm("gossip", 2),
             "factored": Algorithm("factored", 2, mix2_every)}
    unknown = [name for name in names.split(",") if name not in known]
    if unknown:
        raise ConfigError(f"unknown algorithm {unknown[0]!r}: use {', '.join(known)}")
    return [known[name] for name in names.split(",")]


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(parse_args(argv), argv)
    except (UserError, OSError, json.JSONDecodeError) as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    if args.mode == "calibrate":
        document = json.loads(args.records.read_text()) if args.records else SAMPLE_RECORDS
        print(f"records: {args.records or 'built-in sample (tc tbf on the development machine)'}")
        print_calibration(calibrate(parse_records(document), args.exchange_latency_s))
        return 0
    algorithms = _algorithms(args.algorithms, args.mix2_every)
    knobs = ("gpu", "mfu", "tokens_per_step", "inner_steps", "step_time_s", "compute_spread", "compression",
             "exchange_latency_s", "allreduce_latency_s", "stragglers", "straggler_factor", "seed")
    settings: dict[str, Any] = {knob: getattr(args, knob) for knob in knobs if knob != "compression"}
    grid = itertools.product(args.peers.split(","), args.params.split(","), args.compression.split(","))
    try:
        scenarios = [Scenario(int(p), parse_params(m), compression=float(c), **settings) for p, m, c in grid]
    except ValueError as error:
        raise ConfigError(f"--peers and --compression take comma-separated numbers: {error}") from None
    print(HEADER + "\n" + RULE)
    started = time.perf_counter()
    rows = run_grid(scenarios, algorithms, args.budget_h * 3600, args.min_rounds)
    print(f"simulated {len(rows)} runs in {time.perf_counter() - started:.1f} s")
    settings.update(compression=args.compression, budget_h=args.budget_h, min_rounds=args.min_rounds)
    settings.update(mix2_every=args.mix2_every)
    command = "python benchmarks/simulate_scale.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_results(rows, settings, command.strip(), args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
