"""The scenario engine behind every multi-host testnet backend: one run of a scenario, start to report.

A backend (``HostControl``: ``netns_run.NetnsHosts`` or ``docker_run.DockerHosts``) only controls hosts: it starts
``p2ptrain bootstrap|peer`` on a host, signals, pauses and reaps it, shapes a host's link and cuts or heals a
partition. Everything else is here, the same for every backend: the peers' flags and rounds, the lives of each peer,
the scenario's events on their timeline (kills, stops, restarts from checkpoint, rate changes, partitions, new
peers, random churn), the metrics files, and at the end the report and its checks. Teardown always runs (in
``finally``, on SIGINT/SIGTERM/SIGHUP too, and by the backend's guard if the launcher itself is killed). The workdir
is shared with every host at the same path, so metrics, checkpoints and logs are read from it.
"""

from __future__ import annotations

import dataclasses
import json
import random
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click
import yaml

from p2ptrain.checkpoint import latest_checkpoint
from p2ptrain.config import build_config, read_config_file
from p2ptrain.errors import CheckpointError, ConfigError, UserError, one_line
from p2ptrain.metrics import read_metrics
from p2ptrain.testnet.hosttools import HostControl, handling_signals, interrupt, wait_exit
from p2ptrain.testnet.loopback import RED_TEAM, PeerSummary, format_summary
from p2ptrain.testnet.plan import RunPlan, Timeline, plan_run
from p2ptrain.testnet.report import (
    EventRecord,
    Life,
    RunRecord,
    format_checks,
    peer_logs,
    run_checks,
    verdict_line,
    write_report,
)
from p2ptrain.testnet.scenario import BOOTSTRAP, Event, Scenario, load_scenario, peer_index
from p2ptrain.timing import LAUNCH_S, PATIENCE_S, TRANSFER_PATIENCE_S

PORT = 31337  # every host has its own network stack, so one fixed port serves all
STATUS_PORT = 8080  # the bootstrap's status page, on its host's loopback
# running peers a peer started mid-run joins through besides the bootstrap (`Fleet.entry_points`)
JOIN_THROUGH_PEERS = 2
# SIGTERM -> SIGKILL: a peer finishes the exchange it is in (its deadline is at most sync.allreduce_timeout_s, 60 s by
# default), writes a checkpoint and leaves the DHT. At 20 s a peer of the 32-peer swarm on a 4 Mbit/s link, whose
# exchange had 20 s left, was killed on its way out
STOP_GRACE_S = TRANSFER_PATIENCE_S + PATIENCE_S
PEER_FLAGS = ("--torch-threads", "1", "--no-progress", "--device", "cpu", "--no-nat-port-map", "--no-auto-nat",
              "--no-relay")  # every peer of every backend, besides --config


@dataclasses.dataclass(frozen=True)
class ScenarioOptions:
    """What `p2ptrain testnet --backend netns|docker` was asked for; None defers to the scenario, then to defaults."""

    num_peers: int | None = None
    bandwidth: str | None = None  # "50mbit,50mbit,5mbit": one rate per peer, or one for all
    scenario_path: str | None = None
    rounds: int | None = None  # the run ends when every peer has logged round rounds-1 ...
    duration_s: float | None = None  # ... or after this many seconds
    model: str | None = None
    config_path: str | None = None  # peer config file; the scenario's peer_config is merged over it
    workdir: str | None = None  # logs, metrics, checkpoints (default: a temp dir)
    report_dir: str | None = None  # report.json and plots (default: <workdir>/report)
    timeout_s: float = 900.0
    name_prefix: str | None = None  # names of the backend's namespaces or containers (default: from the pid)
    status_page: bool = False  # the bootstrap serves the run's status page on its host (the CLI's default: on)

    def __post_init__(self) -> None:
        if self.rounds is not None and self.duration_s is not None:
            raise ConfigError("give --rounds or --duration, not both")
        if self.timeout_s < 10:
            raise ConfigError(f"--timeout must be >= 10 s, got {self.timeout_s}")


class Fleet:
    """The bootstrap and the peers of one run: start, signal, restart, and follow their lives and metrics."""

    def __init__(self, hosts: HostControl, workdir: Path, plan: RunPlan, peer_args: list[str], num_shards: int,
                 status_page: bool = False):
        self.hosts, self.workdir, self.plan, self.status_page = hosts, workdir, plan, status_page
        self.peer_args, self.num_shards = peer_args, num_shards  # the flags every peer gets; the corpus's shards
        self.run_id = f"{hosts.kind}-{uuid.uuid4().hex[:8]}"
        self.bootstrap_maddr = ""
        self.lives: list[Life] = []
        self.current: dict[str, Life] = {}
        self.stopped: set[str] = set()  # peers now frozen
        self.asked_to_stop: dict[str, float] = {}  # peers sent SIGTERM for reaching the last round -> deadline
        self.leaving: dict[str, float] = {}  # peers a `leave` event sent SIGTERM -> when they are SIGKILLed
        self.round_budget: dict[str, int] = {}  # the --rounds each peer's current process was given
        self.rows: dict[str, list[dict[str, Any]]] = {}

    def checkpoint_dir(self, peer: str) -> Path:
        return self.workdir / "checkpoints" / peer

    def _start(self, host: str, command: str, args: list[str]) -> int:
        log = self.workdir / f"{host}.log"
        with open(log, "ab") as out:
            out.write(f"---- {time.strftime('%H:%M:%S')} p2ptrain {command} {' '.join(args)}\n".encode())
        return self.hosts.start(host, command, args, log)

    def start_bootstrap(self) -> None:
        address_file = self.workdir / "bootstrap.addr"
        address_file.unlink(missing_ok=True)
        self._start("bootstrap", "bootstrap", [
            "--identity", str(self.workdir / "bootstrap.key"), "--address-file", str(address_file),
            "--run-id", self.run_id, "--no-nat-port-map", "--no-auto-nat", "--no-relay",
            *(["--status-port", str(STATUS_PORT)] if self.status_page else [])])
        deadline = time.monotonic() + LAUNCH_S
        while not (address_file.exists() and address_file.read_text().strip()):
            self.hosts.refresh()
            if self.hosts.exit_code("bootstrap") is not None:
                raise UserError(f"the bootstrap node exited with code {self.hosts.exit_code('bootstrap')}; see "
                                f"{self.workdir / 'bootstrap.log'}")
            if time.monotonic() > deadline:
                raise UserError(f"the bootstrap node did not start within {LAUNCH_S:.0f} s; see "
                                f"{self.workdir / 'bootstrap.log'}")
            time.sleep(self.hosts.poll_s)
        own = f"/ip4/{self.hosts.address('bootstrap')}/"
        maddrs = address_file.read_text().split()
        self.bootstrap_maddr = next((m for m in maddrs if m.startswith(own)), maddrs[0])
        if self.status_page:  # the page is on the bootstrap host's loopback: read it from there
            watch = " ".join([*self.hosts.shell_prefix("bootstrap"), "p2ptrain", "status", "--page",
                              f"http://127.0.0.1:{STATUS_PORT}/"])
            click.echo(f"testnet: watch the run with `{watch} [--json | --watch 5]` (it answers within a second)")

    def start_peer(self, peer: str, resume: bool) -> str:
        """Start a peer, from its latest checkpoint when ``resume`` and one exists; returns how it started."""
        self._reap_exited()
        checkpoint_round, note = None, "fresh start"
        if resume:
            try:
                latest = latest_checkpoint(self.checkpoint_dir(peer))
                checkpoint_round = None if latest is None else int(json.loads((latest / "meta.json").read_text())[
                    "round"])
            except (CheckpointError, OSError, ValueError, KeyError) as e:  # `--resume` would fail: start fresh
                note = f"fresh start (unreadable checkpoint: {one_line(e)})"
            if checkpoint_round is not None:
                note = f"resumed from the checkpoint of round {checkpoint_round}"
            elif note == "fresh start":
                note = "fresh start (no checkpoint yet)"
        rounds = 0 if self.plan.rounds is None else max(1, self.plan.rounds - (checkpoint_round or 0))
        self.round_budget[peer] = rounds or 2**62
        entry = [arg for maddr in self.entry_points(peer) for arg in ("--initial-peers", maddr)]  # flag per address
        args = [*entry, "--run-id", self.run_id, "--rounds", str(rounds),
                "--shard-index", str(peer_index(peer, "peer") % self.num_shards), "--metrics",
                str(self.workdir / f"{peer}.jsonl"), "--checkpoint-dir", str(self.checkpoint_dir(peer)),
                *self.peer_args]
        command = "peer"
        if peer in self.plan.adversaries:
            command, args = RED_TEAM, args + ["--attack", self.plan.adversaries[peer]]
        if peer in self.plan.relays:
            args.append("--relay")
        pid = self._start(peer, command, args + (["--resume"] if checkpoint_round is not None else []))
        life = Life(peer, pid, time.time(), resumed_from_round=checkpoint_round)
        self.lives.append(life)
        self.current[peer] = life
        self.rows.setdefault(peer, [])
        self.asked_to_stop.pop(peer, None)
        self.leaving.pop(peer, None)
        return note

    def entry_points(self, peer: str) -> list[str]:
        """The initial peers `peer` joins through: the bootstrap, and once the swarm trains, up to JOIN_THROUGH_PEERS
        running peers that others can dial (not behind NAT, not adversaries), as a volunteer may copy any running
        peer's printed command. Through the bootstrap alone, a joiner of the 32-peer swarm got no answer for 120 s
        in 2 of 3 runs: the box's one bootstrap answers every peer's DHT."""
        running = [p for p in sorted(self.current) if p != peer and p not in self.plan.homes and p not in self.leaving
                   and p not in self.plan.adversaries and self.running(p) and self.rows.get(p)
                   and self.rows[p][-1]["time"] >= self.current[p].started]  # its identity of this life
        chosen = random.Random(f"{self.run_id}/{peer}/{len(self.lives)}").sample(
            running, min(JOIN_THROUGH_PEERS, len(running)))
        return [self.bootstrap_maddr, *(f"/ip4/{self.hosts.address(p)}/tcp/{PORT}/p2p/{self.rows[p][-1]['peer_id']}"
                                        for p in chosen)]

    def running(self, peer: str) -> bool:
        return peer in self.current and self.hosts.exit_code(peer) is None

    def end_life(self, peer: str, reason: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal a peer (waking it first unless SIGKILL), wait up to STOP_GRACE_S, then SIGKILL it."""
        self.hosts.signal(peer, sig)
        self.reap(peer, reason, STOP_GRACE_S)

    def leave(self, peer: str) -> None:
        """SIGTERM a peer as a volunteer's Ctrl-C does, and go on: `poll` closes its life when it exits, and SIGKILLs
        it past STOP_GRACE_S. (Waited for here, three leaves at once held the scenario's next events 34 s.)"""
        self.hosts.signal(peer, signal.SIGTERM)
        self.leaving[peer] = time.monotonic() + STOP_GRACE_S

    def reap(self, peer: str, reason: str, grace_s: float) -> None:
        """Wait for a signalled peer to exit and close its life; past ``grace_s`` it is SIGKILLed."""
        code = wait_exit(self.hosts, peer, grace_s)
        if code is None:
            self.hosts.signal(peer, signal.SIGKILL)
            code = wait_exit(self.hosts, peer, STOP_GRACE_S)
            reason = "killed_at_teardown"
        signalled_out = reason in ("stopped_at_end", "left")  # asked to exit: an unclean exit is a crash
        self._close_life(peer, "crashed" if signalled_out and not exited_cleanly(code) else reason, code)

    def _close_life(self, peer: str, reason: str, code: int | None) -> None:
        life = self.current.pop(peer)
        life.ended, life.exit_code, life.end_reason = time.time(), code, reason
        self.stopped.discard(peer)
        self.leaving.pop(peer, None)

    def pause(self, peer: str, pause: bool) -> None:
        self.hosts.pause(peer, pause)
        (self.stopped.add if pause else self.stopped.discard)(peer)

    def poll(self) -> None:
        """Close the lives of exited peers, reload metrics, SIGKILL leaving peers past their grace, and stop peers
        that are past the last round."""
        self._reap_exited()
        for peer in self.rows:
            path = self.workdir / f"{peer}.jsonl"
            self.rows[peer] = read_metrics(path) if path.exists() else []
        for peer, deadline in list(self.leaving.items()):
            if peer in self.current and time.monotonic() > deadline:
                self.reap(peer, "left", grace_s=0.0)
        if self.plan.rounds is None:
            return
        for peer, life in self.current.items():
            rows = [row for row in self.rows[peer] if row["time"] >= life.started]
            done_by_itself = rows and rows[-1]["round"] + 1 >= rows[0]["round"] + self.round_budget[peer]  # --rounds
            if rows and rows[-1]["round"] >= self.plan.rounds - 1 and not done_by_itself \
                    and peer not in self.asked_to_stop:
                self.hosts.signal(peer, signal.SIGTERM)  # it jumped ahead by joining the swarm: its count is not done
                self.asked_to_stop[peer] = time.monotonic() + STOP_GRACE_S
        for peer, deadline in list(self.asked_to_stop.items()):
            if peer in self.current and time.monotonic() > deadline:
                self.reap(peer, "finished", grace_s=0.0)  # hung on the way out: SIGKILL, killed_at_teardown

    def _reap_exited(self) -> None:
        self.hosts.refresh()
        for peer in list(self.current):
            code = self.hosts.exit_code(peer)
            if code is not None:
                left = peer in self.leaving and exited_cleanly(code)
                self._close_life(peer, "left" if left else "finished" if code == 0 else "crashed", code)

    def last_rounds(self) -> dict[str, int]:
        return {peer: rows[-1]["round"] for peer, rows in self.rows.items() if rows}

    def any_active(self) -> bool:
        return any(self.running(peer) and peer not in self.stopped for peer in self.current)

    def stop_all(self) -> None:
        """Wake and SIGTERM every peer once, give them STOP_GRACE_S together to checkpoint, SIGKILL the rest."""
        peers = list(self.current)
        signalled = {**self.asked_to_stop, **self.leaving}
        for peer in peers:
            self.hosts.signal(peer, signal.SIGCONT if peer in signalled else signal.SIGTERM)  # 2nd TERM aborts
        deadline = time.monotonic() + STOP_GRACE_S
        for peer in peers:
            reason = "left" if peer in self.leaving else "stopped_at_end"
            self.reap(peer, reason, max(0.1, deadline - time.monotonic()))


def exited_cleanly(code: int | None) -> bool:
    """Exit 0, or SIGTERM's own (-15: stopped before its handler was installed)."""
    return code in (0, -signal.SIGTERM)


def apply_event(fleet: Fleet, event: Event) -> tuple[bool, str]:
    """Carry out one event; (False, why) when it cannot apply now (e.g. the peer is not running)."""
    peer, hosts = event.peer or "", fleet.hosts
    if peer == BOOTSTRAP:  # only `kill`: peers lose their bootstrap (and relay), and go on without it
        hosts.signal(peer, signal.SIGKILL)
        return True, ""
    needs_running = event.action in ("kill", "leave", "stop", "continue")
    if needs_running and not fleet.running(peer):
        return False, f"{peer} is not running"
    if event.action == "kill":
        fleet.end_life(peer, "killed")
    elif event.action == "leave":
        fleet.leave(peer)
    elif event.action in ("stop", "continue"):
        fleet.pause(peer, event.action == "stop")
    elif event.action == "restart":
        if fleet.running(peer):
            fleet.end_life(peer, "restarted", signal.SIGTERM)
        return True, fleet.start_peer(peer, resume=True)
    elif event.action == "add_peer":
        return True, fleet.start_peer(peer, resume=False)
    elif event.action == "set_rate":
        hosts.set_rate(peer, event.rate_mbit)
    elif event.action == "partition":
        hosts.cut_partition(list(event.group))
    elif event.action == "heal":
        hosts.heal_partition()
    return True, ""


def unfired_events(script: Timeline) -> list[str]:
    return [f"{e.describe()} ({e.trigger})" for e in script.pending]


def drive(fleet: Fleet, plan: RunPlan, timeout_s: float, events: list[EventRecord], script: Timeline) -> str:
    """Fire events until the run's bound and return the outcome; ``script`` (the scenario's own events) is left
    holding those never fired, also when an interrupt ends the run early."""
    timelines = {"script": script, "churn": Timeline(plan.churn_events)}
    churn_down: set[str] = set()  # peers a churn kill took down: only those get the churn restart
    started = time.monotonic()
    while True:
        fleet.poll()
        elapsed = time.monotonic() - started
        for source, timeline in timelines.items():
            for event in timeline.due(elapsed, fleet.last_rounds()):
                if source == "churn" and event.action == "restart" and event.peer not in churn_down:
                    ok, detail = False, f"{event.peer} was not taken down by churn"
                else:
                    ok, detail = _apply_safely(fleet, event)
                if source == "churn" and ok:
                    (churn_down.add if event.action == "kill" else churn_down.discard)(str(event.peer))
                events.append(EventRecord(time.time(), event.action, event.describe(), event.trigger, source, ok,
                                          detail, list(event.group)))
                click.echo(f"testnet: t={elapsed:5.1f}s {event.describe()} ({event.trigger})"
                           + ("" if ok and not detail else f": {detail}"))
        if plan.duration_s is not None and elapsed >= plan.duration_s:
            return "duration"
        if plan.duration_s is None and not fleet.any_active():
            return "done"
        if elapsed > timeout_s:
            click.echo(f"testnet: timed out after {timeout_s:g} s", err=True)
            return "timeout"
        time.sleep(fleet.hosts.poll_s)


def _apply_safely(fleet: Fleet, event: Event) -> tuple[bool, str]:
    try:
        return apply_event(fleet, event)
    except UserError as e:  # an `ip`/`tc`/`docker` command failed: record it, the run goes on
        return False, one_line(e)


def merged_peer_config(options: ScenarioOptions, plan: RunPlan, workdir: Path) -> tuple[Path, int]:
    """Write --config with the scenario's peer_config merged over it; validated here, before any host exists."""
    values = read_config_file(options.config_path) if options.config_path else {}
    for section, settings in plan.peer_config.items():
        if isinstance(settings, dict) and isinstance(values.get(section), dict):
            values[section] = {**values[section], **settings}
        else:
            values[section] = settings
    if options.model:
        values.setdefault("model", {})["name"] = options.model
    if isinstance(values.setdefault("run", {}), dict):  # the initial peers begin together (swarm_start.py)
        values["run"].setdefault("min_peers", len(plan.initial_peers))
    config = build_config(values)
    path = workdir / "peer_config.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=True))
    return path, config.data.num_shards


def prepare_run(options: ScenarioOptions, check_backend: Callable[[RunPlan], None]) -> tuple[RunPlan, Path,
                                                                                     dict[str, float | None]]:
    """The plan, the workdir and every host's rate (bootstrap unshaped); the scenario is checked first, then the
    backend (``check_backend`` raises a one-line UserError), before anything is written."""
    scenario = load_scenario(options.scenario_path) if options.scenario_path else Scenario()
    plan = plan_run(scenario, options.num_peers, options.bandwidth, options.rounds, options.duration_s)
    check_backend(plan)
    workdir = Path(options.workdir or tempfile.mkdtemp(prefix="p2ptrain-testnet-")).resolve()  # hosts share the path
    workdir.mkdir(parents=True, exist_ok=True)
    rates: dict[str, float | None] = {"bootstrap": None, **dict(zip(plan.initial_peers, plan.peer_rates_mbit,
                                                                    strict=True))}
    rates.update({str(e.peer): e.rate_mbit for e in plan.events if e.action == "add_peer"})
    return plan, workdir, rates


def run_scenario(options: ScenarioOptions, hosts: HostControl, plan: RunPlan, workdir: Path,
                 rates: Mapping[str, float | None], where: str) -> bool:
    """Run a planned scenario on a backend's hosts; True when every check passed."""
    config_path, num_shards = merged_peer_config(options, plan, workdir)
    fleet = Fleet(hosts, workdir, plan, ["--config", str(config_path), *PEER_FLAGS], num_shards, options.status_page)
    bound = f"{plan.rounds} rounds" if plan.rounds is not None else f"{plan.duration_s:g} s"
    click.echo(f"testnet: bootstrap + {len(plan.initial_peers)} peers {where}, {bound}, {len(plan.events)} "
               f"scripted + {len(plan.churn_events)} churn events, logs in {workdir}")
    events: list[EventRecord] = []
    outcome, error, started, script = "error", None, time.time(), Timeline(plan.events)
    with handling_signals(interrupt):
        try:
            hosts.create()
            fleet.start_bootstrap()
            started = time.time()
            for peer in plan.initial_peers:
                fleet.start_peer(peer, resume=False)
            outcome = drive(fleet, plan, options.timeout_s, events, script)
        except BaseException as e:  # KeyboardInterrupt (Ctrl-C, SIGTERM, SIGHUP) included: report, then re-raise
            outcome, error = ("interrupted" if isinstance(e, KeyboardInterrupt) else "error"), e
        finally:
            with handling_signals(signal.SIG_IGN):  # a second Ctrl-C must not cut the teardown short
                click.echo("testnet: stopping peers and tearing down the testbed")
                try:
                    fleet.stop_all()
                finally:
                    hosts.teardown()
    checkpoint_dirs = {peer: str(fleet.checkpoint_dir(peer)) for peer in fleet.rows}
    peer_rates = {host: rate for host, rate in rates.items() if host != "bootstrap"}
    record = RunRecord(started, time.time(), fleet.rows, fleet.lives, events, unfired_events(script), checkpoint_dirs,
                       peer_rates, outcome, dataclasses.asdict(plan), **peer_logs(workdir, list(fleet.rows)))
    return _report(record, plan, Path(options.report_dir or workdir / "report"), error)


def _report(record: RunRecord, plan: RunPlan, report_dir: Path, error: BaseException | None) -> bool:
    results = run_checks(record, plan.checks)
    paths = write_report(record, results, report_dir)
    summaries = [PeerSummary(peer, record.lives_of(peer)[-1].exit_code if record.lives_of(peer) else None, rows)
                 for peer, rows in record.rows.items()]
    click.echo(format_summary(summaries))
    click.echo("checks:\n" + format_checks(results))
    click.echo(f"testnet: report in {paths[0]} (plots: {', '.join(p.name for p in paths[1:])})")
    if error is not None:
        raise error
    ok = all(r.passed for r in results)
    click.echo(verdict_line(ok, record))
    return ok
