"""Per-peer costs of each sync mode at 8, 16 and 32 real peers on the netns testnet, side by side (root only).

Every (swarm size, mode) gets the same scenario: N peers whose upload links are the N quantiles (i + ½)/N of the
scale model's home distribution (benchmarks/scale/model.py: log-normal, p10 5 / median 22 / p90 100 Mbit/s), a
quarter of them behind NAT each at a home of its own (the fastest peer relays), the tiny model, one wall-clock
budget. Per row, from the peers' metrics and from sampling their processes while they run:

- compute utilisation (compute seconds ÷ wall seconds of a peer's rounds; median over peers) and the mean
  validation loss at the end of the budget (equal wall clock);
- payload bytes a peer sent per round (its exchanges, from its metrics);
- wire bytes a peer's host sent per round (its namespace's interfaces, `/proc/PID/net/dev`), and what is beyond
  the payloads: the DHT, libp2p's framing, TCP/IP headers (bytes per round are medians over peers: the relay's host
  also forwards the NATed peers' streams). From the start to the end of a peer's last round (start, join and the
  wait for the swarm included, so a run whose peers wait longer or train fewer rounds reads higher) and, "in
  rounds", from the end of a peer's first round to the end of its last, over the rounds in between: what each
  round costs;
- peak memory per peer: the PSS of the peer's process tree (the peer, its DHT process, p2pd), sampled every few
  seconds; PSS counts a page shared by k processes 1/k to each, so it is what a peer takes from the machine;
- rounds averaged alone (no partner, or a group of one).

Then, per mode, each figure at the largest size ÷ at the smallest (flat costs read about 1), and the simulation
(benchmarks/simulate_scale.py's event loop) replaying each run with its own links, inner phases and payloads,
a per-round cost of the client fitted per mode at the smallest size (benchmarks/scale/measured.py).

    sudo python benchmarks/swarm_scale.py [--sizes 8 16 32] [--budget-s 120] [--modes swarm,diloco,...] [--keep DIR]
    python benchmarks/swarm_scale.py --from-runs DIR [--sizes ...] [--modes ...]   # read kept runs again

All peers share this machine's 2 cores (one torch thread each), so a step takes longer the more peers compute at
once: utilisation at 32 peers is partly the CPU's, and inner steps run per peer fall with N in every mode alike.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.peer_memory import peer_memory, total  # noqa: E402
from benchmarks.scale.measured import SIMULATED, fit_round_cost, simulated_utilisation  # noqa: E402
from benchmarks.scale.model import LINK_CAP_MBIT, LINK_FLOOR_MBIT, UPLOAD_MEDIAN_MBIT, UPLOAD_SIGMA  # noqa: E402
from benchmarks.testnet_utilization import DATA, MODEL, VARIANTS, peer_figures  # noqa: E402
from p2ptrain.errors import UserError  # noqa: E402
from p2ptrain.testnet.netns_run import NetnsTestnetOptions, run_netns_testnet  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (8, 16, 32)
# the mission's compressed outer-gradient gossip, DiLoCo on both exact transports, GASLoC, Factored-local
MODES: dict[str, dict[str, Any]] = {
    "swarm": VARIANTS["swarm"],
    "diloco": {"mode": "diloco"},
    "diloco-scatter": {"mode": "diloco", "allreduce_transport": "scatter"},
    "gasloc": {"mode": "gasloc"},
    "gasloc-overlap": VARIANTS["gasloc-overlap"],  # its exchanges during the next inner phase
    "factored-local": VARIANTS["factored-local"],
}
SAMPLE_S = 3.0  # between two samples of every peer's processes' memory
WIRE_SAMPLE_S = 0.5  # between two readings of every host's interface counters (a file read each)


def home_links_mbit(peers: int) -> list[float]:
    """The `peers` quantiles (i + ½)/N of the home upload distribution, clipped as the scale model clips it, slowest
    first (three significant figures)."""
    normal = statistics.NormalDist(math.log(UPLOAD_MEDIAN_MBIT), UPLOAD_SIGMA)
    rates = [min(max(math.exp(normal.inv_cdf((i + 0.5) / peers)), LINK_FLOOR_MBIT), LINK_CAP_MBIT)
             for i in range(peers)]
    return [float(f"{rate:.3g}") for rate in rates]


def nat_peers(peers: int, fraction: float) -> list[str]:
    """A `fraction` of the peers behind NAT, spread evenly over the links (peers are numbered slowest first); never
    the last, fastest peer, which relays for them."""
    count = min(round(fraction * peers), peers - 1)
    return [f"peer{int((i + 0.5) * (peers - 1) / count)}" for i in range(count)]


def scenario(mode: str, peers: int, budget_s: float, inner_steps: int, nat_fraction: float,
             start_wait_s: float | None = None) -> dict[str, Any]:
    nat = nat_peers(peers, nat_fraction)
    return {
        "description": f"swarm scale: {mode}, {peers} home peers",
        "peers": peers,
        "bandwidth": [f"{rate:g}mbit" for rate in home_links_mbit(peers)],
        "duration_s": budget_s,
        **({"nat": nat, "relays": [f"peer{peers - 1}"]} if nat else {}),
        "peer_config": {
            "model": MODEL,
            "data": DATA | {"num_shards": max(DATA["num_shards"], peers)},
            "inner": {"steps": inner_steps, "min_steps": max(1, inner_steps // 20)},
            "sync": MODES[mode] | {"matchmaking_s": 2.0},  # the network section's defaults: 1 s heartbeats
            # the DHT and p2pd answer while peers train; peers wait for the whole swarm before round 0
            "run": {"training_priority": "idle"} | ({"min_peers_wait_s": start_wait_s} if start_wait_s else {}),
        },
        "checks": {"loss_fell": True},
    }


class ProcessSampler(threading.Thread):
    """Each host's current process (the run's processes.json): every SAMPLE_S its tree's PSS, every WIRE_SAMPLE_S
    its namespace's bytes sent on every interface but loopback. Keeps each host's peak PSS and its counter readings
    (a namespace's counters outlive a restarted peer: a host's reading is the largest so far)."""

    def __init__(self, workdir: Path):
        super().__init__(daemon=True)
        self.workdir, self.stop_event = workdir, threading.Event()
        self.peak_pss: dict[str, int] = {}
        self.sent_at: dict[str, list[tuple[float, int]]] = {}  # host -> (unix time, tx bytes) of every reading

    def run(self) -> None:
        readings_per_sample = round(SAMPLE_S / WIRE_SAMPLE_S)
        for reading in itertools.count(1):
            if self.stop_event.wait(WIRE_SAMPLE_S):
                return
            self.sample(memory=reading % readings_per_sample == 0)

    def sample(self, memory: bool = True) -> None:
        try:
            processes = json.loads((self.workdir / "processes.json").read_text())
        except (OSError, ValueError):
            return
        for host, pid in processes.items():
            if memory:
                self.peak_pss[host] = max(self.peak_pss.get(host, 0), total(peer_memory(pid), "pss"))
            sent = interface_sent_bytes(pid)
            if sent is not None:
                readings = self.sent_at.setdefault(host, [])
                readings.append((time.time(), max(sent, readings[-1][1] if readings else 0)))

    def sent_by(self, host: str, end: float) -> int | None:
        """Bytes `host` sent from its start to its first reading at or after `end`; None without one (its process
        ended first): a reading before `end` would leave out what the host sent last, payloads included."""
        after = [sent for t, sent in self.sent_at.get(host, []) if t >= end]
        return after[0] if after else None

    def sent_between(self, host: str, start: float, end: float) -> int | None:
        """Bytes `host` sent from its last reading at or before `start` to its first at or after `end` (so at most a
        reading interval more at each end); None without such readings."""
        samples = self.sent_at.get(host, [])
        before, after = [s for t, s in samples if t <= start], [s for t, s in samples if t >= end]
        return after[0] - before[-1] if before and after else None

    def stop(self) -> None:
        self.stop_event.set()
        self.join()
        self.sample()


def interface_sent_bytes(pid: int) -> int | None:
    """Bytes sent on every interface but loopback of `pid`'s network namespace; None once the process is gone."""
    try:
        return sent_beyond_loopback(Path(f"/proc/{pid}/net/dev").read_text())
    except OSError:
        return None


def sent_beyond_loopback(net_dev: str) -> int:
    """The transmitted bytes of a /proc/<pid>/net/dev table (two header lines), loopback left out: a peer's
    loopback carries its talk with its own DHT process and p2pd, not the link's."""
    sent = 0
    for line in net_dev.splitlines()[2:]:
        name, fields = line.split(":", 1)
        if name.strip() != "lo":
            sent += int(fields.split()[8])
    return sent


def summarise(mode: str, peers: int, report: dict[str, Any], sampler: ProcessSampler) -> dict[str, Any]:
    figures = {peer: peer_figures(info["rounds"]) | {"wire_sent": sampler.sent_by(peer, info["rounds"][-1]["time"]),
                                                     "peak_pss": sampler.peak_pss.get(peer)} | in_rounds(
                                                         peer, info["rounds"], sampler)
               for peer, info in report["peers"].items() if info["rounds"]}
    return aggregate(mode, peers, figures) | {"passed_checks": report["passed"],
                                              "bootstrap_peak_pss": sampler.peak_pss.get("bootstrap")}


def in_rounds(peer: str, rows: list[dict[str, Any]], sampler: ProcessSampler) -> dict[str, Any]:
    """What the peer's host sent from the end of its first round to the end of its last, and its payloads of the
    rounds in between (None: fewer than two rounds, or no samples around them)."""
    sent = sampler.sent_between(peer, rows[0]["time"], rows[-1]["time"]) if len(rows) >= 2 else None
    return {"wire_sent_in_rounds": sent, "payload_in_rounds": float(sum(r["bytes_sent"] for r in rows[1:]))}


NUMERIC = ("median_utilisation", "mean_val_loss", "mean_rounds", "mean_inner_steps", "payload_bytes_per_round",
           "wire_bytes_per_round", "beyond_payload_bytes_per_round", "beyond_payload_in_rounds_per_round",
           "median_peak_pss", "max_peak_pss", "alone")


def aggregate(mode: str, peers: int, figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A row from its peers' figures. Bytes per round are medians over peers: the relay's host also forwards the
    NATed peers' streams, which would lift a mean."""
    values = list(figures.values())
    if not values:  # no peer ended a round within the budget (32 peers on 0.5 s heartbeats: docs/design.md)
        return {"mode": mode, "peers": peers, "peers_with_rounds": 0, "peer_rows": {}} | {
            key: math.nan for key in NUMERIC}

    def per_round(key: str) -> float:
        known = [f[key] / f["rounds"] for f in values if f[key] is not None]
        return statistics.median(known) if known else math.nan

    beyond = [(f["wire_sent"] - f["bytes_sent"]) / f["rounds"] for f in values if f["wire_sent"] is not None]
    beyond_in_rounds = [(f["wire_sent_in_rounds"] - f["payload_in_rounds"]) / (f["rounds"] - 1) for f in values
                        if f.get("wire_sent_in_rounds") is not None]  # kept rows from before it: none
    pss = [f["peak_pss"] for f in values if f["peak_pss"]]
    alone = [f["alone"] for f in values if not math.isnan(f["alone"])]
    return {
        "mode": mode, "peers": peers, "peers_with_rounds": len(values),
        "median_utilisation": statistics.median(f["utilisation"] for f in values),
        "mean_val_loss": statistics.fmean(f["val_loss"] for f in values),
        "mean_rounds": statistics.fmean(f["rounds"] for f in values),
        "mean_inner_steps": statistics.fmean(f["inner_steps"] for f in values),
        "payload_bytes_per_round": per_round("bytes_sent"),
        "wire_bytes_per_round": per_round("wire_sent"),
        "beyond_payload_bytes_per_round": statistics.median(beyond) if beyond else math.nan,
        "beyond_payload_in_rounds_per_round": statistics.median(beyond_in_rounds) if beyond_in_rounds else math.nan,
        "median_peak_pss": statistics.median(pss) if pss else math.nan,
        "max_peak_pss": max(pss) if pss else math.nan,
        "alone": statistics.fmean(alone) if alone else math.nan,
        "peer_rows": figures,
    }


def run_one(mode: str, peers: int, args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run one (mode, size): its row, and the testnet's report (what the simulation replays)."""
    name = f"{mode}-{peers}"
    scenario_path = workdir / f"{name}.yaml"
    scenario_path.write_text(yaml.safe_dump(scenario(mode, peers, args.budget_s, args.inner_steps,
                                                     args.nat_fraction, args.start_wait_s)))
    run_dir, report_dir = workdir / name, workdir / f"{name}-report"
    run_dir.mkdir(parents=True, exist_ok=True)
    sampler = ProcessSampler(run_dir)
    sampler.start()
    try:
        run_netns_testnet(NetnsTestnetOptions(scenario_path=str(scenario_path), workdir=str(run_dir),
                                              report_dir=str(report_dir), timeout_s=args.budget_s * 3 + 180))
    finally:
        sampler.stop()
    report = json.loads((report_dir / "report.json").read_text())
    row = summarise(mode, peers, report, sampler) | {"parameters": logged_parameters(run_dir),
                                                     "budget_s": args.budget_s}
    (workdir / f"{name}.row.json").write_text(json.dumps(row))  # what --from-runs reads again
    print(table([row]), flush=True)
    return row, report


def kept_runs(modes: list[str], sizes: list[int], workdir: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The runs of `modes` × `sizes` that --keep kept in `workdir` (runs of different budgets may sit side by
    side): each one's row and report; a one-line UserError when none is there."""
    runs = []
    for peers in sizes:
        for mode in modes:
            name = f"{mode}-{peers}"
            try:
                row = json.loads((workdir / f"{name}.row.json").read_text())
                report = json.loads((workdir / f"{name}-report" / "report.json").read_text())
            except (OSError, ValueError):
                continue
            runs.append((row | aggregate(mode, peers, row["peer_rows"]) | {
                "parameters": row.get("parameters") or logged_parameters(workdir / name)}, report))
    if not runs:
        raise UserError(f"no kept run of {', '.join(modes)} at {', '.join(map(str, sizes))} peers in {workdir}")
    return runs


def logged_parameters(run_dir: Path) -> int | None:
    """The model's parameter count, as a peer logged it ("model tiny: 117,120 parameters on cpu")."""
    for log in sorted(run_dir.glob("peer*.log")):
        found = re.search(r"model \S+: ([\d,]+) parameters", log.read_text(errors="replace"))
        if found:
            return int(found.group(1).replace(",", ""))
    return None


def against_simulation(rows: list[dict[str, Any]], reports: list[dict[str, Any]], budget_s: float
                       ) -> list[dict[str, Any]]:
    """Each row of a mode the simulation has, replayed with its own inputs (benchmarks/scale/measured.py): the
    mode's per-round cost fitted at the smallest size, the larger sizes predicted with it. `budget_s`: of rows
    that do not say their own."""
    found, cost = [], {}
    for row, report in sorted(zip(rows, reports, strict=True), key=lambda pair: pair[0]["peers"]):
        mode, measured, parameters = row["mode"], row["median_utilisation"], row["parameters"]
        if mode not in SIMULATED or parameters is None or not row["peers_with_rounds"]:
            continue
        row_budget_s = row.get("budget_s", budget_s)
        fitted = mode not in cost
        if fitted:
            cost[mode] = fit_round_cost(mode, report, parameters, row_budget_s, measured)
        simulated = simulated_utilisation(mode, report, parameters, row_budget_s, cost[mode])
        found.append({"mode": mode, "peers": row["peers"], "measured": measured, "simulated": simulated,
                      "ratio": simulated / measured if measured else math.nan, "round_cost_s": cost[mode],
                      "fitted_here": fitted,
                      "unfitted": simulated_utilisation(mode, report, parameters, row_budget_s)})
    return found


def markdown(header: list[str], cells: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|---" * len(header) + "|",
                      *("| " + " | ".join(row) + " |" for row in cells)])


def simulation_table(found: list[dict[str, Any]]) -> str:
    return markdown(["mode", "peers", "measured utilisation", "simulated", "simulated ÷ measured", "round cost s",
                     "simulated without it"],
                    [[f["mode"], str(f["peers"]), f"{f['measured']:.3f}",
                      "(fitted here)" if f["fitted_here"] else f"{f['simulated']:.3f}",
                      "" if f["fitted_here"] else f"{f['ratio']:.2f}", f"{f['round_cost_s']:.3f}",
                      f"{f['unfitted']:.3f}"] for f in found])


def table(rows: list[dict[str, Any]]) -> str:
    return markdown(["peers", "mode", "median utilisation", "mean val loss", "rounds", "payload kB / round",
                     "wire kB / round", "beyond payloads kB / round", "beyond payloads in rounds kB / round",
                     "peak PSS MiB (median, max)", "alone"],
                    [[str(r["peers"]), r["mode"], f"{r['median_utilisation']:.3f}", f"{r['mean_val_loss']:.4f}",
                      f"{r['mean_rounds']:.1f}", f"{r['payload_bytes_per_round'] / 1e3:.1f}",
                      f"{r['wire_bytes_per_round'] / 1e3:.1f}", f"{r['beyond_payload_bytes_per_round'] / 1e3:.1f}",
                      f"{r.get('beyond_payload_in_rounds_per_round', math.nan) / 1e3:.1f}",
                      f"{r['median_peak_pss'] / 2**20:.0f}, {r['max_peak_pss'] / 2**20:.0f}", f"{r['alone']:.0%}"]
                     for r in rows])


GROWTH_KEYS = {"payload kB / round": "payload_bytes_per_round", "wire kB / round": "wire_bytes_per_round",
               "beyond payloads kB / round": "beyond_payload_bytes_per_round",
               "beyond payloads in rounds kB / round": "beyond_payload_in_rounds_per_round",
               "peak PSS": "median_peak_pss"}


def growth(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode, each per-peer cost at the largest size ÷ at the smallest."""
    found = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        of_mode = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["peers"])
        if len(of_mode) < 2:
            continue
        small, large = of_mode[0], of_mode[-1]
        found.append({"mode": mode, "from": small["peers"], "to": large["peers"]} | {
            label: large[key] / small[key] if small[key] else math.nan for label, key in GROWTH_KEYS.items()})
    return found


def growth_table(found: list[dict[str, Any]]) -> str:
    return markdown(["mode", "peers", *GROWTH_KEYS],
                    [[g["mode"], f"{g['to']} ÷ {g['from']}", *(f"{g[label]:.2f}×" for label in GROWTH_KEYS)]
                     for g in found])


def budgets(rows: list[dict[str, Any]], default_s: float) -> str:
    """Each size's wall-clock budget (kept runs read together may differ), e.g. "120 s a run (32 peers: 360 s)"."""
    by_size = {r["peers"]: r.get("budget_s", default_s) for r in rows}
    common = max(set(by_size.values()), key=list(by_size.values()).count)
    other = [f"{peers} peers: {budget:g} s" for peers, budget in by_size.items() if budget != common]
    return f"{common:g} s a run" + (f" ({', '.join(other)})" if other else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="swarm sizes, each a run per mode")
    parser.add_argument("--budget-s", type=float, default=120.0, help="wall-clock budget of every run")
    parser.add_argument("--inner-steps", type=int, default=20, help="H of every peer")
    parser.add_argument("--nat-fraction", type=float, default=0.25, help="of the peers, behind NAT")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument("--start-wait-s", type=float, default=None,
                        help="how long peers wait for the whole swarm before round 0 (run.min_peers_wait_s; within "
                             "the budget); 32 peers on 2 cores need more than the default 120 s")
    parser.add_argument("--keep", default=None, help="write the scenarios, logs and reports here, and keep them")
    parser.add_argument("--out", default=str(RESULTS / "swarm_scale"),
                        help="write the table to OUT.md and every figure to OUT.json")
    parser.add_argument("--from-runs", default=None, metavar="DIR",
                        help="run nothing: read again the runs of --sizes × --modes that --keep DIR kept")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}; known: {', '.join(MODES)}")
    if min(args.sizes) < 3 or args.budget_s <= 0 or args.inner_steps < 1 or not 0 <= args.nat_fraction < 1:
        parser.error("--sizes must be >= 3, --budget-s > 0, --inner-steps >= 1, --nat-fraction in [0, 1)")
    started = time.time()
    if args.from_runs is not None:
        try:
            runs = kept_runs(modes, args.sizes, Path(args.from_runs))
        except UserError as e:
            parser.error(str(e))
    else:
        with tempfile.TemporaryDirectory(prefix="p2ptrain-swarm-scale-") as tmp:
            workdir = Path(args.keep or tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            runs = [run_one(mode, peers, args, workdir) for peers in args.sizes for mode in modes]
    rows, reports = [row for row, _ in runs], [report for _, report in runs]
    text, found, simulated = table(rows), growth(rows), against_simulation(rows, reports, args.budget_s)
    print(text + "\n\n" + growth_table(found) + "\n\n" + simulation_table(simulated))
    settings = {"command": " ".join(["python", *sys.argv]), "sizes": args.sizes, "budget_s": args.budget_s,
                "inner_steps": args.inner_steps, "nat_fraction": args.nat_fraction,
                "links_mbit": {n: home_links_mbit(n) for n in args.sizes}, "wall_s": time.time() - started}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"settings": settings, "rows": rows, "growth": found,
                                                    "simulation": simulated}, indent=1))
    out.with_suffix(".md").write_text(
        f"# Per-peer costs at {', '.join(map(str, args.sizes))} peers on the netns testnet\n\n`{settings['command']}`: "
        f"home upload links (log-normal, p10 5 / median 22 / p90 100 Mbit/s), {args.nat_fraction:.0%} behind NAT, "
        f"{budgets(rows, args.budget_s)}, H = {args.inner_steps}, tiny model, 1 torch thread per peer on 2 shared "
        f"cores.\n\n{text}\n\nLargest ÷ smallest swarm, per peer:\n\n{growth_table(found)}\n\n"
        f"The simulation (benchmarks/simulate_scale.py's event loop) given each run's own links, inner phases and "
        f"payloads (benchmarks/scale/measured.py):\n\n{simulation_table(simulated)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
