"""The simulation given a real run's own inputs: a swarm_scale.py row (netns testnet) replayed through sim.py.

A row's swarm becomes a model.Swarm: its peers' tbf upload rates as goodput (calibrate.TBF_GOODPUT_PER_RATE; the
testnet shapes uploads only, so downloads are uncapped), each peer's inner phase as it measured it (compute plus
validation, per round: the CPU sharing of the machine is in it), and the payloads its mode sends: the median
exchange's bytes for gossip, the model's fp32 Δ for DiLoCo's all-reduce (the exchange transport is an all-gather,
(n − 1)·S a member; the verified reduce-scatter a butterfly, 2·S·(n − 1)/n).

What a round costs the client beyond compute, validation and transfers (records read and published, matchmaking,
DiLoCo's digest stage, applying the mix) is not modelled from first principles: one constant per mode,
`fit_round_cost`, fitted to one measured row, and the other sizes test it: the swarm's `round_cost_s`, time not
computing before each inner phase. The simulated utilisation is scaled, peer by peer, by compute ÷ (compute +
validation), as the measured one counts only compute. Only modes the simulation has an algorithm for are replayed
(SIMULATED).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.scale.calibrate import TBF_GOODPUT_PER_RATE
from benchmarks.scale.model import EXCHANGE_FIXED_S, FP32_BYTES_PER_PARAM, LINK_CAP_MBIT, LINK_EFFICIENCY, Swarm
from benchmarks.scale.sim import Algorithm, simulate

# swarm_scale's mode -> (the simulation's algorithm, whether DiLoCo's all-reduce is an all-gather)
SIMULATED: dict[str, tuple[Algorithm, bool]] = {
    "swarm": (Algorithm("gradgossip", 1, overlap=True), False),  # Mix1 every 4th round is left out
    "gasloc": (Algorithm("gossip", 1), False),
    # a pair exchange behind the next inner phase, as gradgossip's; the measured payload is GASLoC's θ
    "gasloc-overlap": (Algorithm("gradgossip", 1, overlap=True), False),
    "diloco": (Algorithm("allreduce"), True),
    "diloco-scatter": (Algorithm("allreduce"), False),
}
MIN_ROUNDS = 10  # simulated rounds a peer completes at least
COST_RANGE_S = (0.0, 60.0)


def peer_inputs(rows: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """(inner phase s, compute share of it): a peer's mean compute plus validation per round, and compute's part."""
    compute = statistics.fmean(r["compute_s"] for r in rows)
    phase = compute + statistics.fmean(r.get("eval_s", 0.0) for r in rows)
    return phase, compute / phase


def exchange_bytes(peers: Mapping[str, Mapping[str, Any]]) -> float | None:
    """The median bytes a peer sent in one exchange it opened, over every peer's rounds (None: no exchange logged)."""
    sent = [e["bytes_sent"] for info in peers.values() for r in info["rounds"] for e in r.get("exchanges", [])]
    return float(statistics.median(sent)) if sent else None


def measured_swarm(mode: str, report: Mapping[str, Any], parameters: int, round_cost_s: float
                   ) -> tuple[Swarm, np.ndarray]:
    """The row's swarm as the simulation sees it, and each peer's compute share of its inner phase."""
    peers = {p: info for p, info in report["peers"].items() if info["rounds"]}
    inputs = [peer_inputs(info["rounds"]) for info in peers.values()]
    upload = np.array([info["rate_mbit"] for info in peers.values()], dtype=float) * TBF_GOODPUT_PER_RATE
    dense = float(parameters * FP32_BYTES_PER_PARAM)
    sent = exchange_bytes(peers) if mode in ("swarm", "gasloc") else None
    payload = sent if sent is not None else dense
    swarm = Swarm(upload, np.full(len(peers), LINK_CAP_MBIT), np.array([phase for phase, _ in inputs]), payload,
                  EXCHANGE_FIXED_S, 0.0, LINK_EFFICIENCY, payload, SIMULATED[mode][1], round_cost_s=round_cost_s)
    return swarm, np.array([share for _, share in inputs])


def simulated_utilisation(mode: str, report: Mapping[str, Any], parameters: int, budget_s: float,
                          round_cost_s: float = 0.0, seed: int = 0) -> float:
    """The median over peers of the utilisation the simulation predicts for the row's swarm."""
    swarm, share = measured_swarm(mode, report, parameters, round_cost_s)
    result = simulate(SIMULATED[mode][0], swarm, budget_s, MIN_ROUNDS, seed)
    # over whole rounds, as the measured figure is (a simulated round holds one inner phase): the budget's end
    # falling in a round's compute or in its wait would otherwise move the figure in steps
    whole = [phase * len(rounds) / sum(rounds) for phase, rounds in zip(swarm.inner_phase_s, result.round_s,
                                                                        strict=True)]
    return float(np.median(np.array(whole) * share))


def fit_round_cost(mode: str, report: Mapping[str, Any], parameters: int, budget_s: float, measured: float) -> float:
    """The round's cost (s) at which the simulated utilisation is the measured one (bisection: the utilisation
    falls as the cost grows); a bound of COST_RANGE_S when the measured one lies beyond it."""
    low, high = COST_RANGE_S
    for _ in range(40):
        middle = (low + high) / 2
        if simulated_utilisation(mode, report, parameters, budget_s, middle) > measured:
            low = middle
        else:
            high = middle
    return (low + high) / 2
