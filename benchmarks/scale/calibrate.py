"""The transfer model against the push-pull exchanges of a real netns testnet run (running one needs root).

A run: `p2ptrain testnet --backend netns` with sync: gasloc, the tiny model and peers on links of different tbf
rates. Every peer's metrics file holds one record per exchange the peer started (partner peer id, codec, bytes
sent and received, seconds from opening the stream to the partner's ack); metrics rows carry the peer's own id, so
a partner's id leads to its host and the host to the rate the testnet shaped it to. Each exchange is predicted by
model.exchange_transfer_s, the function the simulation uses. Per link pair: bytes, measured median, predicted
with the simulation's constants (before) and with constants fitted from this run (after).

tbf shapes on-wire bytes, the model's rates are goodput: a TCP stream through tbf carries 1448 payload bytes per
1514-byte frame. Measured 2026-11-22 on the 2-core development machine with p2ptrain.testnet.netns.Testbed (one TCP
stream from a shaped host to an unshaped one, timed from the first byte to EOF, as in tests/test_netns.py): 4.82, 19.19,
19.14 and 95.8 Mbit/s of goodput at 5, 20, 20 and 100 Mbit/s, i.e. 0.957-0.964 of the rate. That was the
previous calibration (one-way transfers, no protocol); it is kept only as this constant.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks.scale.model import exchange_transfer_s
from p2ptrain.errors import ConfigError, UserError
from p2ptrain.metrics import read_metrics

TBF_GOODPUT_PER_RATE = 1448 / 1514  # TCP payload per tbf-counted frame (MTU 1500, timestamps on)
RESULTS_NAME = "simulate_scale_calibration"
BANDWIDTH = "20mbit,20mbit,5mbit,2mbit"
DURATION_S = 60.0
PEER_CONFIG: dict[str, Any] = {
    "model": {"name": "tiny", "max_seq_len": 64},
    "data": {"seq_len": 64, "batch_size": 8, "max_corpus_bytes": 2_000_000, "num_shards": 8, "val_batches": 2},
    "inner": {"steps": 20},
    "sync": {"mode": "gasloc", "param_codec": "fp16", "matchmaking_s": 2.0},  # fp16: one payload size per run
    "network": {"heartbeat_s": 0.5, "record_ttl_s": 5.0},
}


@dataclass(frozen=True)
class ExchangeConstants:
    """The transfer model's two constants for a gossip exchange."""

    fixed_s: float  # per exchange
    efficiency: float  # exchange goodput / link goodput


@dataclass(frozen=True)
class MeasuredExchange:
    """One exchange record of a run, with both ends' hosts and the tbf rates they were shaped to."""

    initiator: str
    partner: str
    initiator_mbit: float
    partner_mbit: float
    codec: str
    bytes_sent: int
    bytes_received: int
    seconds: float
    round: int

    @property
    def pair(self) -> tuple[float, float]:
        return max(self.initiator_mbit, self.partner_mbit), min(self.initiator_mbit, self.partner_mbit)


def predict_s(exchange: MeasuredExchange, constants: ExchangeConstants) -> float:
    """The simulation's exchange time for this record: both hosts shaped both ways, tbf rate → TCP goodput."""
    goodput_mbit = np.array([exchange.initiator_mbit, exchange.partner_mbit]) * TBF_GOODPUT_PER_RATE
    return exchange_transfer_s(goodput_mbit, goodput_mbit, 0, [1], exchange.bytes_sent, exchange.bytes_received,
                               constants.fixed_s, constants.efficiency)


def match_exchanges(
    rows_by_host: dict[str, list[dict[str, Any]]], rate_by_host: dict[str, float | None]
) -> tuple[list[MeasuredExchange], list[dict[str, Any]]]:
    """Each host's exchange records with the partner's peer id resolved to its host and both ends' rates; the
    records whose partner is unknown (no metrics row carries its id) or unshaped come back apart."""
    host_of = {row["peer_id"]: host for host, rows in rows_by_host.items() for row in rows}
    matched, unmatched = [], []
    for host, rows in sorted(rows_by_host.items()):
        for row in rows:
            for record in row.get("exchanges", []):
                partner = host_of.get(record["partner"])
                rates = rate_by_host.get(host), rate_by_host.get(partner) if partner else None
                if partner is None or rates[0] is None or rates[1] is None:
                    unmatched.append(dict(record, initiator=host, partner_host=partner))
                    continue
                matched.append(MeasuredExchange(
                    host, partner, float(rates[0]), float(rates[1]), record["codec"], int(record["bytes_sent"]),
                    int(record["bytes_received"]), float(record["seconds"]), int(row["round"])))
    return matched, unmatched


@dataclass(frozen=True)
class Run:
    """What a testnet run left for calibration."""

    exchanges: list[MeasuredExchange]
    unmatched: list[dict[str, Any]]  # exchange records whose partner or rate is unknown
    description: str  # when, on which rates, for how long


def read_run(run_dir: Path) -> Run:
    """A testnet workdir: rates from report/report.json, exchanges from each peer's <host>.jsonl."""
    report_path = run_dir / "report" / "report.json"
    if not report_path.exists():
        raise ConfigError(f"{run_dir}: no report/report.json (give the workdir of a netns testnet run)")
    report = json.loads(report_path.read_text())
    rates = {host: info.get("rate_mbit") for host, info in report["peers"].items()}
    rows = {host: read_metrics(run_dir / f"{host}.jsonl") for host in rates if (run_dir / f"{host}.jsonl").exists()}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(report["started"]))
    shown = ", ".join("unshaped" if rate is None else f"{rate:g}" for rate in rates.values())
    description = (f"the netns testnet run of {started} ({len(rates)} peers at {shown} Mbit/s, "
                   f"{report['ended'] - report['started']:.0f} s)")
    return Run(*match_exchanges(rows, rates), description)


def _groups(exchanges: Iterable[MeasuredExchange]) -> dict[tuple[float, float], list[MeasuredExchange]]:
    groups: dict[tuple[float, float], list[MeasuredExchange]] = {}
    for exchange in exchanges:
        groups.setdefault(exchange.pair, []).append(exchange)
    return dict(sorted(groups.items(), reverse=True))


def fit(exchanges: list[MeasuredExchange]) -> ExchangeConstants:
    """measured s = fixed_s + transfer s / efficiency, the transfer s being the model's at full efficiency, fitted
    as a Theil–Sen line: the slope is the median of the slopes between every two exchanges on links of different
    speed, the intercept the median residual. Medians resist a shared CPU's outliers (the first round's warm-up, a
    partner busy training). A negative fixed cost is clipped to 0, an efficiency above 1 to 1."""
    x = np.array([predict_s(e, ExchangeConstants(0.0, 1.0)) for e in exchanges])
    y = np.array([e.seconds for e in exchanges])
    dx, dy = x[None, :] - x[:, None], y[None, :] - y[:, None]
    apart = np.triu(np.abs(dx) > 1e-6 * x.max(), k=1)
    if not apart.any():
        raise ConfigError("fitting needs exchanges on at least two link pairs of different speed")
    slope = float(np.median(dy[apart] / dx[apart]))
    fixed_s = float(np.median(y - slope * x))
    if fixed_s < 0:
        fixed_s, slope = 0.0, float(np.median(y / x))
    if slope < 1:
        fixed_s, slope = max(0.0, float(np.median(y - x))), 1.0
    return ExchangeConstants(fixed_s, 1 / slope)


def pair_rows(
    exchanges: list[MeasuredExchange], before: ExchangeConstants, after: ExchangeConstants
) -> list[dict[str, Any]]:
    rows = []
    for (fast, slow), group in _groups(exchanges).items():
        measured = statistics.median(e.seconds for e in group)
        row: dict[str, Any] = {
            "pair_mbit": [fast, slow], "exchanges": len(group),
            "bytes_sent": statistics.median(e.bytes_sent for e in group),
            "bytes_received": statistics.median(e.bytes_received for e in group),
            "measured_median_s": measured,
            "measured_p10_s": float(np.percentile([e.seconds for e in group], 10)),
            "measured_p90_s": float(np.percentile([e.seconds for e in group], 90)),
        }
        for label, constants in (("before", before), ("after", after)):
            predicted = statistics.median(predict_s(e, constants) for e in group)
            row.update({f"predicted_{label}_s": predicted, f"ratio_{label}": measured / predicted})
        rows.append(row)
    return rows


TABLE_HEADER = ("| link pair Mbit/s | exchanges | bytes each way | measured median s (p10–p90) | predicted s before "
                "| measured / predicted before | predicted s after | measured / predicted after |")


def format_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [TABLE_HEADER, "|" + "---|" * 8]
    for r in rows:
        size = f"{r['bytes_sent']:.0f}" if r["bytes_sent"] == r["bytes_received"] else \
            f"{r['bytes_sent']:.0f} / {r['bytes_received']:.0f}"
        lines.append(f"| {r['pair_mbit'][0]:g} – {r['pair_mbit'][1]:g} | {r['exchanges']} | {size} "
                     f"| {r['measured_median_s']:.3f} ({r['measured_p10_s']:.3f}–{r['measured_p90_s']:.3f}) "
                     f"| {r['predicted_before_s']:.3f} | {r['ratio_before']:.3f} | {r['predicted_after_s']:.3f} "
                     f"| {r['ratio_after']:.3f} |")
    return lines


def summary_lines(rows: list[dict[str, Any]], before: ExchangeConstants, after: ExchangeConstants,
                  before_origin: str, run: str) -> list[str]:
    worst = {label: max(abs(float(np.log(r[f"ratio_{label}"]))) for r in rows) for label in ("before", "after")}
    return [
        f"before: fixed {before.fixed_s:.3f} s per exchange, link efficiency {before.efficiency:.3f} "
        f"({before_origin}); worst pair off by a factor {np.exp(worst['before']):.2f}",
        f"after:  fixed {after.fixed_s:.3f} s per exchange, link efficiency {after.efficiency:.3f}, fitted from "
        f"{run}; worst pair off by a factor {np.exp(worst['after']):.2f}",
    ]


def run_testnet(bandwidth: str, duration_s: float, name_prefix: str, workdir: Path) -> bool:
    """One netns testnet run (root) into ``workdir``; True when its checks passed. Its namespaces are gone after."""
    # imported here: p2ptrain.testnet.netns_run pulls in torch and transformers (4 s), which the simulation never needs
    from p2ptrain.testnet.netns import NAMESPACE_MARKER, delete_namespaces, list_namespaces
    from p2ptrain.testnet.netns_run import NetnsTestnetOptions, run_netns_testnet

    scenario = {"description": "transfer-model calibration of benchmarks/simulate_scale.py",
                "peers": len(bandwidth.split(",")), "bandwidth": bandwidth.split(","), "duration_s": duration_s,
                "peer_config": PEER_CONFIG, "checks": {"loss_fell": True}}
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "scenario.yaml").write_text(yaml.safe_dump(scenario))
    try:
        return run_netns_testnet(NetnsTestnetOptions(
            scenario_path=str(workdir / "scenario.yaml"), workdir=str(workdir), name_prefix=name_prefix,
            timeout_s=3 * duration_s + 120))
    finally:
        mine = f"{NAMESPACE_MARKER}{name_prefix}-"
        delete_namespaces([ns for ns in list_namespaces() if ns.startswith(mine)])  # the testnet's teardown missed
        left = [ns for ns in list_namespaces() if ns.startswith(mine)]
        print(f"namespaces {mine}* left after teardown: {', '.join(left) or 'none'}")


def calibrate(
    from_run: Path | None, workdir: Path | None, bandwidth: str, duration_s: float, name_prefix: str,
    before: ExchangeConstants, before_origin: str, command: str, output_dir: Path,
) -> dict[str, Any]:
    """Run the testnet into ``workdir`` (default: a temporary directory) or read the finished run ``from_run``,
    print the table, write JSON and Markdown; returns the document."""
    settings: dict[str, Any] = {"from_run": str(from_run)} if from_run else {
        "bandwidth": bandwidth, "duration_s": duration_s, "name_prefix": name_prefix, "peer_config": PEER_CONFIG}
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="p2ptrain-calibrate-") as tmp:
        if from_run is None:
            from_run = workdir or Path(tmp)
            settings["checks_passed"] = run_testnet(bandwidth, duration_s, name_prefix, from_run)
        run = read_run(from_run)
    exchanges, unmatched = run.exchanges, run.unmatched
    if not exchanges:
        raise UserError(f"no exchange records with known partners in the run ({len(unmatched)} unmatched)")
    after = fit(exchanges)
    rows = pair_rows(exchanges, before, after)
    intro = (f"{len(exchanges)} exchanges matched to both ends' rates, {len(unmatched)} not "
             f"(tbf rate × {TBF_GOODPUT_PER_RATE:.4f} = TCP goodput)")
    table, summary = format_table(rows), summary_lines(rows, before, after, before_origin, run.description)
    print("\n".join([intro, *table, *summary]))
    document = {"format": "p2ptrain-scale-calibration/2", "command": command, "started": started,
                "load_average": os.getloadavg(), "settings": settings, "tbf_goodput_per_rate": TBF_GOODPUT_PER_RATE,
                "before": dict(asdict(before), origin=before_origin),
                "fitted": dict(asdict(after), origin=run.description),
                "pairs": rows, "exchanges": [asdict(e) for e in exchanges], "unmatched": unmatched}
    write_results(document, [intro, "", *table, "", *(f"- {line}" for line in summary)], output_dir)
    return document


def write_results(document: dict[str, Any], body: list[str], output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"{RESULTS_NAME}.json").write_text(json.dumps(document, indent=1) + "\n")
    settings = document["settings"]
    markdown = [
        "# The scale simulation's exchange model against netns testnet exchanges", "",
        f"Command: `{document['command']}` ({document['started']}, load average "
        f"{', '.join(f'{x:.2f}' for x in document['load_average'])} on the shared machine)", "",
        f"Testnet: {json.dumps(settings)}", "",
        *body, "",
        "Predicted: fixed + (bytes sent / b(i→p) + bytes received / b(p→i)) / efficiency, b = the slower end's "
        "tbf rate × 1448/1514 (TCP goodput); benchmarks/scale/model.py `exchange_transfer_s`. Measured: "
        "`seconds` of each exchange record in the peers' metrics files (from opening the stream to the ack).", "",
    ]
    (output_dir / f"{RESULTS_NAME}.md").write_text("\n".join(markdown))
