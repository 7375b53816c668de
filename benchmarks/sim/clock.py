"""The algorithm benchmark's wall clock: when each peer's rounds start and end with a straggler on the links.

Inner steps take the measured mean step time; fast peers have bandwidth B, the last peer B·straggler_fraction
(bytes/s, each way). Transfer times come from the scale simulation's model (`flow_s`, `allreduce_transfer_s` in
benchmarks/scale/model.py), with ideal links: no latency, efficiency 1. DiLoCo and codec rows all-reduce (everyone
waits for the slowest member, then sends its payloads through B_min); gossip exchanges wait only for the partners
involved (gradient gossip and CHOCO as GASLoC, with their codec's payload); the one-step-delay rows, Factored's Mix1
and the compressed gossip rows with overlap run their transfers during the next inner phase.

A gossip round here is synchronous: each peer sends its payload to each partner in turn over the slower end of the
link while receiving theirs (full duplex), so a pair's exchange takes S / b_min. The scale model's push-pull
exchange (`exchange_transfer_s`) is what p2ptrain's protocol does: the two directions one after the other
(2·S / b_min for a pair on symmetric links) and k partners at once sharing the initiator's link. The clock keeps
the benchmark's own composition; its published tables were made with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from benchmarks.scale.model import allreduce_transfer_s, flow_s
from benchmarks.sim.exchanges import allreduce_factor, send_parameters
from benchmarks.sim.graphs import Graphs, Neighbours
from benchmarks.sim.peers import Bench, row_codec
from benchmarks.sim.rows import ROWS, Algorithm
from benchmarks.sim.simulation import make_graphs
from p2ptrain.maths.codecs import compress_all
from p2ptrain.maths.pacing import inner_steps_for_link
from p2ptrain.net.wire import payload_bytes

LATENCY_S = 0.0  # ideal links: an exchange or all-reduce costs only its bytes
EFFICIENCY = 1.0


@dataclasses.dataclass(frozen=True)
class Units:
    delta_bytes: int  # one peer's Δ payload with the row's codec (fp32 for Factored's Mix2; CHOCO's corrections)
    param_bytes: int  # one peer's parameter payload (GASLoC's y, Factored's Mix1 θ)


def exchange_units(row: Algorithm, bench: Bench) -> Units:
    """Payload sizes from the codecs themselves (our formats have a size fixed by the shapes)."""
    delta_bytes = payload_bytes(compress_all(row_codec(row), bench.theta0))
    return Units(delta_bytes, send_parameters(row.param_codec, bench.theta0, bench.theta0)[1])


@dataclasses.dataclass
class Clock:
    starts: list[list[float]] = dataclasses.field(default_factory=list)  # [round][peer], seconds
    compute_ends: list[list[float]] = dataclasses.field(default_factory=list)
    ends: list[list[float]] = dataclasses.field(default_factory=list)


def _wait_then_send(ready: Sequence[float], graph: Neighbours, nbytes: float, bandwidth: Sequence[float]) -> list:
    """Each peer waits for its own partners only, then sends to each in turn over the slower end of the link."""
    return [max(ready[j] for j in [i, *graph[i]]) + sum(flow_s(nbytes, bandwidth[i], bandwidth[j]) for j in graph[i])
            for i in range(len(ready))]


def _allreduce_s(row: Algorithm, units: Units, bandwidth: Sequence[float]) -> float:
    """The row's all-reduce of Δ: its payloads per peer through the slowest peer's link."""
    sent = allreduce_factor(row, len(bandwidth)) * units.delta_bytes
    return allreduce_transfer_s(sent, min(bandwidth), LATENCY_S, EFFICIENCY)


def round_end_times(row: Algorithm, units: Units, r: int, start: list[float], compute_end: list[float],
                    bandwidth: Sequence[float], graphs: Graphs, carry: dict[str, float]) -> list[float]:
    n = len(start)
    if row.kind == "diloco":  # blocking: everyone waits for the slowest member
        return [max(compute_end) + _allreduce_s(row, units, bandwidth)] * n
    if row.kind == "delayed":  # Δ_r travels during round r+1; its mean is applied at the end of round r+1
        ends = [max(c, carry.get("arrival_s", 0.0)) for c in compute_end]
        carry["arrival_s"] = max(max(compute_end), carry.get("arrival_s", 0.0)) + _allreduce_s(row, units, bandwidth)
        return ends
    if row.kind == "gasloc":
        return _wait_then_send(compute_end, graphs[0][r], units.param_bytes, bandwidth)
    if row.kind in ("gradgossip", "choco") and not row.overlap:  # as GASLoC, with the codec's payload
        return _wait_then_send(compute_end, graphs[0][r], units.delta_bytes, bandwidth)
    if row.kind in ("gradgossip", "choco"):  # round r's payloads travel during round r + 1, whose end uses them
        ends = [max(c, carry.get(f"sent_{i}", 0.0)) for i, c in enumerate(compute_end)]
        sent = _wait_then_send(compute_end, graphs[0][r], units.delta_bytes, bandwidth)
        carry.update({f"sent_{i}": done for i, done in enumerate(sent)})
        return ends
    mix1_done = _wait_then_send(start, graphs[0][r], units.param_bytes, bandwidth)  # overlaps the inner phase
    ready = [max(c, m) for c, m in zip(compute_end, mix1_done, strict=True)]
    mix2_done = ready if (r + 1) % row.mix2_every else _wait_then_send(ready, graphs[1][r], units.delta_bytes,
                                                                       bandwidth)
    if row.mix2_overlap == "none":
        return mix2_done
    # Mix2 of round r runs during round r + 1, whose end applies it: a round ends when both are done
    ends = [max(e, carry.get(f"mix2_{i}", 0.0)) for i, e in enumerate(ready)]
    carry.update({f"mix2_{i}": done for i, done in enumerate(mix2_done)})
    return ends


def simulate_clock(row: Algorithm, units: Units, steps: list[int], step_s: float, bandwidth: Sequence[float],
                   graphs: Graphs, budget_s: float, max_rounds: int) -> Clock:
    clock, start, carry = Clock(), [0.0] * len(steps), dict[str, float]()
    for r in range(max_rounds):
        if min(start) >= budget_s:
            break
        compute_end = [s + h * step_s for s, h in zip(start, steps, strict=True)]
        end = round_end_times(row, units, r, start, compute_end, bandwidth, graphs, carry)
        clock.starts.append(start)
        clock.compute_ends.append(compute_end)
        clock.ends.append(end)
        start = end
    return clock


def paced_steps(row: Algorithm, units: Units, step_s: float, bandwidth: Sequence[float], steps: int) -> list[int]:
    """GASLoC's pacing (docs/algorithms.md §2): a slow peer takes fewer steps so its round ends with the fast peers'.

    The expected transfer time is the peer's payloads to its partners through its own link.
    """
    if row.kind != "gasloc":
        return [steps] * len(bandwidth)
    degree, fast = {"matching": 1, "cycle": 2}.get(row.graph, len(bandwidth) - 1), max(bandwidth)
    round_s = steps * step_s + flow_s(degree * units.param_bytes, fast, fast)
    return [steps if b == fast else inner_steps_for_link(round_s, step_s, flow_s(degree * units.param_bytes, b, b), 1,
                                                         steps) for b in bandwidth]


def clock_stats(clock: Clock, budget_s: float) -> tuple[list[int], float]:
    """Completed rounds per peer within the budget, and mean compute utilisation within it."""
    n, limit = len(clock.starts[0]), budget_s * (1 + 1e-9)
    rounds = [sum(1 for end in clock.ends if end[i] <= limit) for i in range(n)]
    busy = [sum(max(0.0, min(c[i], budget_s) - min(s[i], budget_s))
                for s, c in zip(clock.starts, clock.compute_ends, strict=True)) for i in range(n)]
    return rounds, sum(busy) / n / budget_s


@dataclasses.dataclass(frozen=True)
class WallClock:
    step_s: float
    bandwidth_bytes_per_s: list[float]
    budget_s: float
    budget_rounds: int
    max_rounds: int


def links(bench: Bench, step_s: float) -> list[float]:
    """Bytes/s of each peer's link: fast peers carry one fp32 model per inner phase (or --bandwidth), the last
    peer straggler_fraction of that."""
    s = bench.settings
    fast = s.bandwidth_bytes_per_s or bench.model_bytes / (s.inner_steps * step_s)
    return [fast] * (s.peers - 1) + [fast * s.straggler_fraction]


def equal_tokens_utilisation(row: Algorithm, bench: Bench, step_s: float) -> float:
    """Mean compute utilisation of the peers until the last of them has completed the run's R rounds of H steps
    on ``links`` (the straggler included). With the default links it does not depend on ``step_s``."""
    s = bench.settings
    graphs = make_graphs(row, s.peers, s.rounds, s.seed)
    clock = simulate_clock(row, exchange_units(row, bench), [s.inner_steps] * s.peers, step_s, links(bench, step_s),
                           graphs, math.inf, s.rounds)
    return clock_stats(clock, max(max(ends) for ends in clock.ends))[1]


def make_wallclock(bench: Bench, step_s: float) -> WallClock:
    """Links and budget of table 2: the budget is DiLoCo's time for ``budget_rounds`` rounds with the straggler."""
    s = bench.settings
    bandwidth = links(bench, step_s)
    budget_rounds = s.budget_rounds or s.rounds
    diloco = ROWS[0]
    graphs = make_graphs(diloco, s.peers, budget_rounds, s.seed)
    clock = simulate_clock(diloco, exchange_units(diloco, bench), [s.inner_steps] * s.peers, step_s, bandwidth,
                           graphs, math.inf, budget_rounds)
    return WallClock(step_s, bandwidth, clock.ends[-1][0], budget_rounds,
                     math.ceil(s.max_rounds_factor * budget_rounds))
