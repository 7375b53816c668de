"""What the simulation assumes: home links, compute per inner step, and how long an exchange or all-reduce takes.

Transfer model (S = payload bytes each way; rates are goodput, as speed tests report it):
  exchange   p2ptrain's push-pull (p2ptrain/net/exchange.py): the initiator streams its payload, the responder reads and
             validates all of it before it streams its own back, then a commit/ack round trip. So the two
             directions run one after the other: fixed_s + (S / b(i→p) + S / b(p→i)) / efficiency, with b(i→p) =
             min(upload of i, download of p), the bottleneck of the pair in that direction. With k partners at
             once the initiator's upload and download are split evenly between the k flows; the exchange ends
             with the slowest flow. `--duplex` is a what-if, not p2ptrain's protocol: both directions stream at
             once, so an exchange takes the slower of the two, fixed_s + max(S / b(i→p), S / b(p→i)) / efficiency.
  all-reduce a butterfly: allreduce_latency_s + 2·S·(n−1)/n / (b_min · efficiency), b_min the slowest upload or
             download of the swarm. A sparse codec's payloads cannot be summed on the way: its all-reduce is an
             all-gather, every peer sends its payload to the n − 1 others: allreduce_latency_s + (n−1)·S / (b_min ·
             efficiency).
  fixed_s (EXCHANGE_FIXED_S) and efficiency (LINK_EFFICIENCY) are fitted by `simulate_scale.py calibrate` from
  the exchanges of a netns testnet run (FITTED_FROM). The all-reduce was not measured: it rides the same libp2p
  streams, so it is given the same efficiency (assumed).
  Both are built from two functions, `flow_s` (one direction through its bottleneck) and `allreduce_transfer_s`,
  which are also the transfer times of the algorithm benchmark's clock (benchmarks/sim/clock.py): one formula for
  both simulators. That clock composes them differently (each peer sends to its partners in turn while receiving
  theirs, no latency, efficiency 1); its docstring says how.

Links: upload log-normal with 10th percentile 5 and 90th percentile 100 Mbit/s (median sqrt(5·100) ≈ 22.4,
  σ = ln 20 / (2·1.2816) ≈ 1.17), clipped to [1, 1000] Mbit/s (slower volunteers assumed not to join);
  download = min(5 × upload, 1000). Shaped after public fixed-broadband speed-test summaries (upload medians of
  tens of Mbit/s, a long fibre tail, asymmetric cable/DSL), not a fitted data set.
Compute: an inner step is 6·N·tokens_per_step FLOPs on gpus_per_peer GPUs at MFU 0.4 (assumed); default GPU
  RTX 4090, 165.2 TFLOP/s dense BF16 with FP32 accumulate (NVIDIA Ada whitepaper), 24 GB. gpus_per_peer = the
  fewest GPUs whose memory (80 % usable) holds 16 bytes/parameter (bf16 weights and grads, fp32 master and
  AdamW moments), so a 70B peer is a multi-GPU node. step_time_s replaces this model; compute_spread σ gives
  each peer a log-normal throughput factor (heterogeneous GPUs). Inner phase = inner_steps × step time.
Payloads: outer gradients (DiLoCo's all-reduce, Factored's Mix2, gradient gossip) S_Δ = 4·N·delta_ratio bytes, the
  codec's measured bytes ÷ fp32 (fp16: 1/2; the sparse codec: from benchmarks/results/algorithms.json); parameters
  (GASLoC's y, Mix1's θ) S_θ = 4·N·param_ratio, fp16 differences from θ_0 (1/2), what production sends: the sparse
  codec does not apply to them (CHOCO-Gossip with it lost 9 % in the algorithm benchmark). Both directions alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from p2ptrain.errors import ConfigError

Z_90 = 1.2815515655446004  # 90th percentile of the standard normal
UPLOAD_P10_MBIT, UPLOAD_P90_MBIT = 5.0, 100.0
UPLOAD_MEDIAN_MBIT = math.sqrt(UPLOAD_P10_MBIT * UPLOAD_P90_MBIT)
UPLOAD_SIGMA = math.log(UPLOAD_P90_MBIT / UPLOAD_P10_MBIT) / (2 * Z_90)
DOWNLOAD_PER_UPLOAD = 5.0
LINK_FLOOR_MBIT, LINK_CAP_MBIT = 1.0, 1000.0
TRAIN_BYTES_PER_PARAM = 16
USABLE_GPU_MEMORY = 0.8
FP32_BYTES_PER_PARAM = 4
FP16_RATIO = 0.5  # fp16 payload ÷ fp32 bytes
MEGABITS_PER_BYTE = 8 / 1e6

# Fitted by `python benchmarks/simulate_scale.py calibrate --workdir /tmp/cal/real` to the exchanges of one netns
# testnet run (62 exchanges on link pairs 20-20, 20-5, 20-2 and 5-2 Mbit/s; the table, measured against predicted
# before and after, is benchmarks/results/simulate_scale_calibration.md). The Theil–Sen intercept was -8 ms, so
# the fixed cost is 0 and the efficiency the median of measured / transfer seconds. The testnet adds no
# propagation delay: on the Internet an exchange also pays a few round trips (stream open, answer, commit/ack);
# --exchange-latency-s adds them.
EXCHANGE_FIXED_S = 0.0  # per exchange: stream set-up, headers, validation, commit/ack round trip
LINK_EFFICIENCY = 0.889  # exchange goodput / link goodput: libp2p framing and encryption, protobuf chunks, TCP
FITTED_FROM = ("fitted by `simulate_scale.py calibrate` to the netns testnet run of 2026-11-22 10:45 UTC (4 peers "
               "at 20, 20, 5, 2 Mbit/s, 66 s; benchmarks/results/simulate_scale_calibration.md)")
ALLREDUCE_LATENCY_S = 5.0  # matchmaking of one all-reduce (hivemind's min_matchmaking_time; not measured)
# What a round costs the client beyond compute and transfers (records read and published, partners drawn, the mix
# applied): fitted by `benchmarks/swarm_scale.py` to its 8-peer rows, the simulation given each run's own links and
# inner phases (benchmarks/scale/measured.py): 0.18-0.26 s for GASLoC and Factored's gossip, over two runs
# (benchmarks/results/swarm_scale.md, swarm_scale_default.md); the larger is taken. DiLoCo's fitted 0-5 s is its
# all-reduce's latency, which ALLREDUCE_LATENCY_S already counts. Spent before each inner phase, as no compute.
ROUND_COST_S = 0.26


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_flops: float  # dense BF16 tensor FLOP/s with FP32 accumulate, from the vendor's spec sheet
    memory_bytes: float


GPUS = {g.name: g for g in (Gpu("rtx4090", 165.2e12, 24e9), Gpu("a100", 312e12, 80e9), Gpu("h100", 989e12, 80e9))}


def flow_s(amount: float, sender_upload: float, receiver_download: float) -> float:
    """Seconds to move ``amount`` one way: through the slower of the sender's upload and the receiver's download.

    Any consistent units: megabits over Mbit/s here, bytes over bytes/s in the algorithm benchmark's clock
    (benchmarks/sim/clock.py), which builds its transfers from this function and `allreduce_transfer_s`.
    """
    return amount / min(sender_upload, receiver_download)


def butterfly_payloads(n: int) -> float:
    """Payloads each peer sends in a butterfly all-reduce over n peers: (n−1)/n in the reduce-scatter, as much
    again in the all-gather."""
    return 2 * (n - 1) / n


def allreduce_transfer_s(sent: float, slowest_link: float, latency_s: float, efficiency: float) -> float:
    """An all-reduce in which every peer sends ``sent``: all wait for the slowest link of the group (any
    consistent units, as in `flow_s`), plus matchmaking."""
    return latency_s + sent / (slowest_link * efficiency)


def exchange_transfer_s(
    upload_mbit: Sequence[float], download_mbit: Sequence[float], initiator: int, partners: Sequence[int],
    sent_bytes: float, received_bytes: float, fixed_s: float, efficiency: float, duplex: bool = False,
) -> float:
    """One push-pull exchange: the initiator's bytes out, then each partner's back, through the bottleneck of
    each direction; with k partners at once the initiator's link is split k ways. See the module docstring.
    ``duplex`` (a what-if, not p2ptrain's protocol): both directions at once, the slower of the two."""
    k = len(partners)
    sent_megabits, received_megabits = sent_bytes * MEGABITS_PER_BYTE, received_bytes * MEGABITS_PER_BYTE
    combine = max if duplex else (lambda out_s, back_s: out_s + back_s)

    def both_ways_s(partner: int) -> float:
        return combine(flow_s(sent_megabits, upload_mbit[initiator] / k, download_mbit[partner]),
                       flow_s(received_megabits, upload_mbit[partner], download_mbit[initiator] / k))

    return fixed_s + max(both_ways_s(partner) for partner in partners) / efficiency


@dataclass(frozen=True, eq=False)
class Swarm:
    """Per-peer links (Mbit/s, goodput) and inner-phase times (s), and the payloads exchanges send each way."""

    upload_mbit: np.ndarray
    download_mbit: np.ndarray
    inner_phase_s: np.ndarray
    payload_bytes: float  # a parameter payload (GASLoC's y, Mix1's θ)
    exchange_latency_s: float = EXCHANGE_FIXED_S  # fixed cost of one gossip exchange
    allreduce_latency_s: float = ALLREDUCE_LATENCY_S
    link_efficiency: float = LINK_EFFICIENCY  # what fraction of a link's goodput a transfer gets
    delta_payload_bytes: float = 0.0  # an outer-gradient payload; 0 = payload_bytes
    sparse_deltas: bool = False  # outer gradients travel sparse: an all-reduce of them is an all-gather
    duplex: bool = False  # what-if: a gossip exchange streams both directions at once
    round_cost_s: float = 0.0  # each round's client work before its inner phase, no compute (ROUND_COST_S)

    @property
    def delta_bytes(self) -> float:
        return self.delta_payload_bytes or self.payload_bytes

    def __post_init__(self) -> None:
        n = len(self.upload_mbit)
        if n < 2 or len(self.download_mbit) != n or len(self.inner_phase_s) != n:
            raise ConfigError("a swarm needs >= 2 peers and one upload, download and inner-phase time per peer")
        arrays = (self.upload_mbit, self.download_mbit, self.inner_phase_s)
        if min(float(np.min(a)) for a in arrays) <= 0 or self.payload_bytes <= 0 or self.delta_payload_bytes < 0:
            raise ConfigError("link rates, inner-phase times and payload_bytes must be > 0")
        if self.exchange_latency_s < 0 or self.allreduce_latency_s < 0 or not self.round_cost_s >= 0:
            raise ConfigError("latencies and the round's cost must be >= 0 s")
        if not 0 < self.link_efficiency <= 1:
            raise ConfigError(f"link_efficiency {self.link_efficiency}: give a fraction in (0, 1]")

    @property
    def n(self) -> int:
        return len(self.upload_mbit)


def allreduce_s(swarm: Swarm) -> float:
    """The outer gradients' all-reduce: a butterfly, 2·S_Δ·(n−1)/n, or for sparse payloads an all-gather,
    (n−1)·S_Δ, through the slowest link of the swarm, plus matchmaking."""
    slowest_mbit = min(float(np.min(swarm.upload_mbit)), float(np.min(swarm.download_mbit)))
    payloads = swarm.n - 1 if swarm.sparse_deltas else butterfly_payloads(swarm.n)
    megabits = payloads * swarm.delta_bytes * MEGABITS_PER_BYTE
    return allreduce_transfer_s(megabits, slowest_mbit, swarm.allreduce_latency_s, swarm.link_efficiency)


def exchange_s(swarm: Swarm, initiator: int, partners: Sequence[int], deltas: bool = False) -> float:
    """A gossip exchange (both ways) between ``initiator`` and ``partners`` of parameters, or of outer gradients."""
    nbytes = swarm.delta_bytes if deltas else swarm.payload_bytes
    return exchange_transfer_s(swarm.upload_mbit, swarm.download_mbit, initiator, partners, nbytes, nbytes,
                               swarm.exchange_latency_s, swarm.link_efficiency, swarm.duplex)


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
    codec: str = "fp16"  # the outer gradients' codec, a label
    delta_ratio: float = FP16_RATIO  # an outer-gradient payload ÷ its fp32 bytes
    sparse_deltas: bool = False  # the codec is sparse: DiLoCo's all-reduce becomes an all-gather
    param_ratio: float = FP16_RATIO  # a parameter payload ÷ its fp32 bytes (fp16 differences from θ_0)
    duplex: bool = False  # what-if: gossip exchanges stream both directions at once (p2ptrain's push-pull does not)
    exchange_latency_s: float = EXCHANGE_FIXED_S
    allreduce_latency_s: float = ALLREDUCE_LATENCY_S
    link_efficiency: float = LINK_EFFICIENCY
    round_cost_s: float = ROUND_COST_S
    stragglers: int = 0  # peers whose links are multiplied by straggler_factor
    straggler_factor: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise ConfigError(f"gpu {self.gpu!r}: use one of {', '.join(GPUS)}")
        if self.peers < 2 or self.params <= 0 or not 0 < self.mfu <= 1:
            raise ConfigError("need peers >= 2, params > 0 and 0 < mfu <= 1")
        if not (0 < self.delta_ratio <= 1 and 0 < self.param_ratio <= 1):
            raise ConfigError("payload ratios (bytes ÷ fp32 bytes) must be in (0, 1]")
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
        upload, download, s.inner_steps * step_s / speed, s.params * FP32_BYTES_PER_PARAM * s.param_ratio,
        s.exchange_latency_s, s.allreduce_latency_s, s.link_efficiency,
        s.params * FP32_BYTES_PER_PARAM * s.delta_ratio, s.sparse_deltas, s.duplex, s.round_cost_s,
    )
