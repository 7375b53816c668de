"""The testnet report: every peer's metrics and lives merged into one JSON, PNG plots, and pass/fail checks.

A peer has one *life* per process: a kill ends one, a restart begins the next. Checks that judge training look
at *survivors*, the peers whose last life was not ended by a kill. Times are unix seconds; plots show seconds
since the peers were started.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from p2ptrain.testnet.plots import PlotData, write_plots
from p2ptrain.testnet.scenario import ChecksSpec

SURVIVING_ENDS = ("finished", "stopped_at_end")  # life end reasons of a peer that was running at the end
SCENARIO_ENDS = ("killed", "left", "restarted")  # ends the scenario caused; any other but SURVIVING_ENDS fails
WARNINGS_SHOWN, LOG_LEVELS_SHOWN = 8, (" WARN ", " WARNING ", " ERROR ", " CRITICAL ")  # a failed run's digest


@dataclasses.dataclass
class Life:
    """One process of one peer, from start to exit."""

    peer: str
    pid: int
    started: float
    ended: float | None = None
    exit_code: int | None = None
    end_reason: str = ""  # finished | killed | left | restarted | stopped_at_end | killed_at_teardown | crashed
    resumed_from_round: int | None = None  # the checkpoint round it resumed from (None: a fresh start)


@dataclasses.dataclass
class EventRecord:
    """A scenario event as it happened."""

    time: float
    action: str
    description: str
    trigger: str
    source: str  # script | churn
    ok: bool  # False: skipped or failed (see detail)
    detail: str = ""
    peers: list[str] = dataclasses.field(default_factory=list)  # a partition's cut-off group


@dataclasses.dataclass
class RunRecord:
    """Everything a testnet run produced, as the launcher saw it."""

    started: float  # when the peers were started
    ended: float
    rows: dict[str, list[dict[str, Any]]]  # peer -> its metrics lines, in order
    lives: list[Life]
    events: list[EventRecord]
    unfired: list[str]  # scripted events whose trigger never held
    checkpoint_dirs: dict[str, str]
    rates_mbit: dict[str, float | None]
    outcome: str  # done | duration | timeout | interrupted | error
    plan: dict[str, Any] = dataclasses.field(default_factory=dict)
    reachability: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # peer → its reachability lines
    warnings: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # peer → its last warnings and errors

    def lives_of(self, peer: str) -> list[Life]:
        return [life for life in self.lives if life.peer == peer]

    def rows_of(self, life: Life) -> list[dict[str, Any]]:
        end = life.ended if life.ended is not None else float("inf")
        return [row for row in self.rows.get(life.peer, []) if life.started <= row["time"] <= end]

    def survivors(self) -> list[str]:
        """Honest peers running at the end (adversaries are judged by what they did to these)."""
        return [peer for peer in self.rows if self.lives_of(peer) and self.lives_of(peer)[-1].end_reason in
                SURVIVING_ENDS and peer not in self.adversaries]

    @property
    def adversaries(self) -> dict[str, str]:
        return dict(self.plan.get("adversaries") or {})


@dataclasses.dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str


# ---- checks ---------------------------------------------------------------------------------------------------------

def run_checks(record: RunRecord, checks: ChecksSpec) -> list[CheckResult]:
    """The checks every run gets (clean exits, events fired, in time) plus those the scenario turns on."""
    results = [check_finished(record), check_clean_exits(record), check_events_fired(record)]
    if checks.loss_fell:
        results.append(check_loss_fell(record))
    if checks.resumed_from_checkpoint and any(life.resumed_from_round is not None for life in record.lives):
        results.append(check_resumed(record))
    if checks.max_stall_s is not None:
        results.append(check_stalls(record, checks.max_stall_s))
    if checks.max_consensus_distance is not None:
        results.append(check_consensus(record, checks.max_consensus_distance))
    if checks.attackers_banned and record.adversaries:
        results.append(check_attackers_banned(record))
    if checks.reachability:
        results.append(check_reachability(record))
    if checks.min_nat_exchanges is not None:
        results.append(check_nat_exchanges(record, checks.min_nat_exchanges))
    if checks.max_alone_fraction is not None or checks.max_rounds_alone is not None:
        results.append(check_averaging(record, checks.max_alone_fraction, checks.max_rounds_alone))
    if checks.max_heal_s is not None:
        results.append(check_heal(record, checks.max_heal_s))
    return results


def check_heal(record: RunRecord, max_heal_s: float) -> CheckResult:
    """After each heal, every peer that was on one side of the cut and ran on opened an exchange with a peer of the
    other side within `max_heal_s` (the gossip modes' rows name the partners a peer opened to; DiLoCo's none).
    Peers started after the cut were on neither side."""
    name_of = {row["peer_id"]: peer for peer, rows in record.rows.items() for row in rows if row.get("peer_id")}
    cut = None
    late, shown = [], []
    for event in record.events:
        if event.action == "partition" and event.ok:
            cut = event
            continue
        if event.action != "heal" or not event.ok or cut is None:
            continue
        group = set(cut.peers)
        sides = {peer: peer in group for peer, rows in record.rows.items()
                 if peer not in record.adversaries and any(row["time"] < cut.time for row in rows)}
        for peer, cut_off in sorted(sides.items()):
            after = [row for row in record.rows[peer] if row["time"] > event.time]
            if not after:
                continue  # it had left
            crossed = next((row["time"] - event.time for row in after
                            if any(sides.get(name_of.get(p, ""), cut_off) != cut_off for p in row.get("partners", []))),
                           math.inf)
            shown.append(f"{peer} {crossed:.1f} s" if crossed < math.inf else f"{peer} never")
            if not crossed <= max_heal_s:
                late.append(peer)
        cut = None
    if not shown:
        return CheckResult("max_heal_s", False, "no heal after a partition, with peers on both sides running on")
    return CheckResult("max_heal_s", not late, f"first exchange across the healed cut (limit {max_heal_s:g} s): "
                       + ", ".join(shown))


def check_reachability(record: RunRecord) -> CheckResult:
    """Every peer logged a reachability line, and each says what its network makes it: a peer on the public switch
    is reachable directly, one behind NAT never is (it is reachable through a relay, or outbound only)."""
    homes = dict(record.plan.get("homes") or {})
    wrong = []
    for peer in record.rows:
        lines = record.reachability.get(peer, [])
        direct = [line for line in lines if "reachable directly" in line]
        if not lines:
            wrong.append(f"{peer} logged none")
        elif (peer in homes) == bool(direct) or (peer not in homes and len(direct) < len(lines)):
            wrong.append(f"{peer} ({'behind NAT' if peer in homes else 'public'}): {lines[0]!r}")
    shown = [f"{peer}: {record.reachability[peer][-1].split('reachability: ')[-1][:60]}" for peer in record.rows
             if record.reachability.get(peer)]
    return CheckResult("reachability", not wrong, "; ".join(wrong) if wrong else "; ".join(shown))


def log_lines(workdir: Path, peers: list[str], keep: Callable[[str], bool]) -> dict[str, list[str]]:
    """Each peer's log lines that `keep` picks, in the order its log holds them (every life)."""
    found: dict[str, list[str]] = {}
    for peer in peers:
        log = workdir / f"{peer}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        found[peer] = [line.strip() for line in text.splitlines() if keep(line)]
    return found


def reachability_lines(workdir: Path, peers: list[str]) -> dict[str, list[str]]:
    """Each peer's reachability verdicts (`Reachability.line`: "reachability: reachable directly at ..."). Other
    lines of the module that asks ("...net.reachability: reachability not asked: ...": its probe found the
    bootstrap busy, and the peer's own presence gives the verdict later) are no verdict."""
    return log_lines(workdir, peers, lambda line: " reachability: " in line)


def warning_lines(workdir: Path, peers: list[str], last: int = WARNINGS_SHOWN) -> dict[str, list[str]]:
    """Each peer's last `last` warnings and errors: what a failed run's report shows of why (a CI run keeps only
    the test's output, not the logs)."""
    found = log_lines(workdir, peers, lambda line: any(level in line for level in LOG_LEVELS_SHOWN))
    return {peer: lines[-last:] for peer, lines in found.items() if lines}


def peer_logs(workdir: Path, peers: list[str]) -> dict[str, dict[str, list[str]]]:
    """What a run record keeps of the peers' logs (RunRecord fields): reachability lines and last warnings."""
    return {"reachability": reachability_lines(workdir, peers), "warnings": warning_lines(workdir, peers)}


def verdict_line(ok: bool, record: RunRecord) -> str:
    """The run's last line; a failed run's also shows each peer's last warnings."""
    if ok:
        return "testnet: every check passed"
    shown = "".join(f"\n  {peer}: {line[:300]}" for peer, lines in record.warnings.items() for line in lines)
    return "testnet: FAILED — see the checks above" + (f"; the peers' last warnings:{shown}" if shown else "")


def check_nat_exchanges(record: RunRecord, minimum: int) -> CheckResult:
    """Every peer behind NAT combined its work with others at least `minimum` times: Σ (group size − 1) over its
    rounds (gossip: the exchanges it started and answered; all-reduce: the other members of its groups)."""
    homes = dict(record.plan.get("homes") or {})
    counts = {peer: sum(max(0, int(row.get("peers_averaged", 1)) - 1) for row in record.rows.get(peer, []))
              for peer in homes if peer in record.rows}
    short = [peer for peer in homes if counts.get(peer, 0) < minimum]
    shown = ", ".join(f"{peer} {count}" for peer, count in counts.items())
    return CheckResult("nat_exchanges", not short and bool(counts),
                       (f"fewer than {minimum} for {', '.join(short)}: " if short else "") + (shown or "no NAT peer"))


def check_attackers_banned(record: RunRecord) -> CheckResult:
    """Every honest survivor listed every adversary among the peers it banned, in some round's metrics."""
    attacker_ids = {peer: {row["peer_id"] for row in record.rows.get(peer, [])} for peer in record.adversaries}
    missed = []
    for peer in record.survivors():
        banned = {p for row in record.rows[peer] for p in row.get("banned_peers", [])}
        missed += [f"{peer} never banned {name}" for name, ids in attacker_ids.items() if not ids & banned]
    silent = [name for name, ids in attacker_ids.items() if not ids]
    detail = "; ".join(missed + [f"{name} logged no round (its peer id is unknown)" for name in silent])
    return CheckResult("attackers_banned", not missed and not silent,
                       detail or f"{len(record.survivors())} honest peers banned {', '.join(record.adversaries)}")


def check_finished(record: RunRecord) -> CheckResult:
    ok = record.outcome in ("done", "duration")
    return CheckResult("finished", ok, {"done": "every peer finished its rounds", "duration": "ran its duration",
                                        "timeout": "timed out", "interrupted": "interrupted"}.get(
                                            record.outcome, record.outcome))


def check_clean_exits(record: RunRecord) -> CheckResult:
    bad = [f"{life.peer} ({life.end_reason}, exit {life.exit_code})" for life in record.lives
           if life.end_reason not in SURVIVING_ENDS + SCENARIO_ENDS]
    return CheckResult("clean_exits", not bad, "every process ended as planned" if not bad else
                       "ended unplanned: " + ", ".join(bad))


def check_events_fired(record: RunRecord) -> CheckResult:
    failed = [f"{e.description}: {e.detail}" for e in record.events if e.source == "script" and not e.ok]
    problems = failed + [f"{text}: never triggered" for text in record.unfired]
    return CheckResult("events_fired", not problems, f"{len(record.events)} event(s) fired" if not problems else
                       "; ".join(problems))


LOSS_WINDOW_ROUNDS = 3  # loss_fell compares medians of this many rounds at each end (fewer in short runs)


def check_loss_fell(record: RunRecord) -> CheckResult:
    """Every survivor's validation loss fell: the median of its last rounds below that of its first ones.

    One round's validation loss is a few batches (testnet peers: 2) and varies by ±10 % from round to round, so
    comparing the last round with the first alone failed runs that trained; k ≤ 3 rounds at each end (at most
    half the rounds each, so the two ends never share a round) keep the check about the trend. A joiner that took a
    peer's state before its first round starts at the swarm's loss, where its own model, fresh, was at the run's
    start: its last rounds are judged against the run's starting loss, that is, against having learnt nothing
    (`starting_loss`). Its own trend is no test: late in a run the swarm's loss is flat, and a joiner of swarm32
    with 6 rounds (1.842 -> 1.848 by their medians) failed on noise."""
    survivors = record.survivors()
    if not survivors:
        return CheckResult("loss_fell", False, "no peer survived to the end")
    start = starting_loss(record)
    bad, shown = [], []
    for peer in survivors:
        losses = [row["val_loss"] for row in record.rows[peer] if row.get("evaluated", True)]  # run.eval_every
        k = min(LOSS_WINDOW_ROUNDS, len(losses) // 2)
        joiner = bool(record.rows[peer]) and bool(record.rows[peer][0].get("joined"))
        if joiner and losses:
            first, last = start, statistics.median(losses[-LOSS_WINDOW_ROUNDS:])
        elif k:
            first, last = statistics.median(losses[:k]), statistics.median(losses[-k:])
        else:
            first = last = math.nan
        if not last < first:
            bad.append(peer)
        if losses:
            shown.append(f"{peer} {'joined, run start ' if joiner else ''}{first:.3f}->{last:.3f}")
    return CheckResult("loss_fell", not bad, ("" if not bad else f"did not fall for {', '.join(bad)}: ") +
                       ", ".join(shown))


def starting_loss(record: RunRecord) -> float:
    """The median first validation loss of the peers that began at round 0 without taking a state (NaN: none)."""
    firsts = [rows[0]["val_loss"] for peer, rows in record.rows.items() if peer not in record.adversaries and rows
              and rows[0].get("round") == 0 and not rows[0].get("joined") and math.isfinite(rows[0]["val_loss"])]
    return statistics.median(firsts) if firsts else math.nan


def averaged_alone(row: dict[str, Any]) -> bool:
    """Whether a round averaged with nobody: neither its averaging (all-reduce group, gossip partners) nor a Mix2
    applied a group of more than the peer itself."""
    return max(int(row.get("peers_averaged", 1)), int(row.get("mix2_averaged", 0))) <= 1


def alone_rounds(record: RunRecord, peer: str) -> list[bool]:
    """Per round of `peer` after the first of each of its lives, whether it averaged alone."""
    return [averaged_alone(row) for life in record.lives_of(peer) for row in record.rows_of(life)[1:]]


def alone_fraction(rounds: Sequence[bool]) -> float:
    return sum(rounds) / len(rounds) if rounds else math.nan


def longest_alone(rounds: Sequence[bool]) -> int:
    """The most rounds in a row that averaged alone."""
    longest = current = 0
    for alone in rounds:
        current = current + 1 if alone else 0
        longest = max(longest, current)
    return longest


def check_averaging(record: RunRecord, max_fraction: float | None, max_in_a_row: int | None) -> CheckResult:
    """Survivors averaged with someone: in all but `max_fraction` of their rounds (the swarm's, all survivors'
    rounds together) and never alone more than `max_in_a_row` rounds running."""
    rounds = {peer: alone_rounds(record, peer) for peer in record.survivors()}
    every = [alone for peer_rounds in rounds.values() for alone in peer_rounds]
    if not every:
        return CheckResult("averaging", False, "no survivor logged a round after its first")
    fraction = alone_fraction(every)
    streaks = {peer: longest_alone(peer_rounds) for peer, peer_rounds in rounds.items()}
    bad = [] if max_fraction is None or fraction <= max_fraction else \
        [f"{fraction:.0%} of rounds alone (limit {max_fraction:.0%})"]
    if max_in_a_row is not None:
        bad += [f"{peer} alone {n} rounds in a row (limit {max_in_a_row})" for peer, n in sorted(streaks.items())
                if n > max_in_a_row]
    return CheckResult("averaging", not bad, "; ".join(bad) or f"{fraction:.0%} of {len(every)} rounds alone, at "
                       f"most {max(streaks.values())} in a row")


def check_resumed(record: RunRecord) -> CheckResult:
    """A restarted peer's first round after the restart is at or past the round of the checkpoint it loaded."""
    bad, shown = [], []
    for life in record.lives:
        if life.resumed_from_round is None:
            continue
        rows = record.rows_of(life)
        first = rows[0]["round"] if rows else None
        shown.append(f"{life.peer} checkpoint {life.resumed_from_round} -> round {first}")
        if first is None or first < life.resumed_from_round:
            bad.append(life.peer)
    return CheckResult("resumed_from_checkpoint", not bad, ", ".join(shown))


def stopped_intervals(record: RunRecord, peer: str) -> list[tuple[float, float]]:
    """When a peer was SIGSTOPped by the scenario (until its SIGCONT, or the end of the run)."""
    intervals, since = [], None
    for event in record.events:
        if event.ok and event.description == f"stop {peer}":
            since = event.time
        elif event.ok and event.description in (f"continue {peer}", f"restart {peer}") and since is not None:
            intervals.append((since, event.time))
            since = None
    return intervals + ([(since, record.ended)] if since is not None else [])


def longest_stall_s(times: Sequence[float], end: float, stopped: Sequence[tuple[float, float]]) -> float:
    """Longest wait between consecutive rounds (and from the last to ``end``), not counting time spent stopped."""
    points = sorted(times) + [end] if times else []
    longest = 0.0
    for a, b in zip(points, points[1:], strict=False):
        paused = sum(max(0.0, min(b, stop_b) - max(a, stop_a)) for stop_a, stop_b in stopped)
        longest = max(longest, b - a - paused)
    return longest


def check_stalls(record: RunRecord, max_stall_s: float) -> CheckResult:
    """No peer went longer than ``max_stall_s`` seconds without a round (from its first round to its last, or to
    its end if it was killed, stopped or still running then), time spent stopped not counted.

    Seconds, not rounds: what a fault costs is fixed seconds (an exchange deadline, the patience, a state
    download), while a limit in median rounds moves with the round time: quicker rounds would fail runs whose
    stalls had not grown, and a peer training alone at twice the pace would halve the unit for every other peer."""
    if not any(record.rows.values()):
        return CheckResult("max_stall_s", False, "no peer logged a round")
    worst: dict[str, float] = {}
    for life in record.lives:
        times = [row["time"] for row in record.rows_of(life)]
        end = life.ended if life.ended is not None else record.ended
        if life.end_reason == "finished" and times:
            end = times[-1]  # it exited after its last round: its shutdown is no stall
        stall = longest_stall_s(times, end, stopped_intervals(record, life.peer))
        worst[life.peer] = max(worst.get(life.peer, 0.0), stall)
    bad = sorted(peer for peer, seconds in worst.items() if seconds > max_stall_s)
    shown = ", ".join(f"{peer} {seconds:.1f} s" for peer, seconds in sorted(worst.items()))
    return CheckResult("max_stall_s", not bad, f"longest stall (limit {max_stall_s:g} s): {shown}")


def checkpoint_consensus(checkpoint_dirs: dict[str, str]) -> tuple[str, float] | None:
    """(where, max_i ‖θ_i − θ̄‖/‖θ̄‖) over the given peers' checkpoints: at the newest round they all hold, or, where
    they hold none in common (gossip modes: each peer's rounds are its own), at each one's newest, which a run that
    stops its peers at its end writes at one moment. None with fewer than 2 peers or a peer without a checkpoint."""
    from safetensors.torch import load_file

    from p2ptrain.maths.mixing import consensus_distance, exact_average

    def model_files(directory: str) -> dict[int, Path]:
        found = {}
        for path in Path(directory).glob("round-*/model.safetensors"):
            found[int(path.parent.name.split("-")[1])] = path
        return found

    files = {peer: model_files(d) for peer, d in checkpoint_dirs.items()}
    if len(files) < 2 or not all(files.values()):
        return None
    common = set.intersection(*(set(f) for f in files.values()))
    if common:
        where, chosen = f"round {max(common)}", [f[max(common)] for f in files.values()]
    else:
        newest = [max(f) for f in files.values()]
        where, chosen = f"each one's newest (rounds {min(newest)}-{max(newest)})", \
            [f[r] for f, r in zip(files.values(), newest, strict=True)]
    models = [load_file(str(path)) for path in chosen]
    names = sorted(models[0])
    states = [[model[name] for name in names] for model in models]
    mean = exact_average(states)
    return where, max(consensus_distance(mean, state) for state in states)


def check_consensus(record: RunRecord, bound: float) -> CheckResult:
    survivors = {peer: record.checkpoint_dirs[peer] for peer in record.survivors() if peer in record.checkpoint_dirs}
    try:
        found = checkpoint_consensus(survivors)
    except (OSError, ValueError, KeyError) as e:
        return CheckResult("max_consensus_distance", False, f"cannot read the checkpoints: {e}")
    if found is None:
        return CheckResult("max_consensus_distance", False, f"no checkpoints of >= 2 survivors to compare "
                           f"({', '.join(survivors) or 'none'})")
    where, distance = found
    return CheckResult("max_consensus_distance", distance <= bound, f"{distance:.2e} at {where} over "
                       f"{len(survivors)} survivors (limit {bound:g})")


# ---- output ---------------------------------------------------------------------------------------------------------

def report_dict(record: RunRecord, results: list[CheckResult]) -> dict[str, Any]:
    """The merged report: per-peer lives and rounds, events, checks."""
    peers = {peer: {"rate_mbit": record.rates_mbit.get(peer), "checkpoint_dir": record.checkpoint_dirs.get(peer),
                    "lives": [dataclasses.asdict(life) for life in record.lives_of(peer)], "rounds": rows,
                    "last_warnings": record.warnings.get(peer, [])}
             for peer, rows in record.rows.items()}
    return {"passed": all(r.passed for r in results), "outcome": record.outcome, "started": record.started,
            "ended": record.ended, "checks": [dataclasses.asdict(r) for r in results], "plan": record.plan,
            "peers": peers, "events": [dataclasses.asdict(e) for e in record.events],
            "unfired_events": record.unfired}


def write_report(record: RunRecord, results: list[CheckResult], out_dir: str | Path) -> list[Path]:
    """Write report.json and the PNG plots into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "report.json"
    json_path.write_text(json.dumps(report_dict(record, results), indent=1, sort_keys=True))
    return [json_path, *write_plots(plot_data(record), out)]


def plot_data(record: RunRecord) -> PlotData:
    """What the plots draw: every peer's rows, split by life, and the events that happened."""
    lives = {peer: [record.rows_of(life) for life in record.lives_of(peer)] for peer in record.rows}
    marks = [(event.time, event.description) for event in record.events if event.ok]
    return PlotData(record.started, record.rows, lives, marks)


def format_checks(results: list[CheckResult]) -> str:
    return "\n".join(f"  {'PASS' if r.passed else 'FAIL'} {r.name}: {r.detail}" for r in results)
