"""`p2ptrain testnet --backend netns`: a bootstrap and N peers, each in its own network namespace, run a scenario.

Each host gets a namespace, an address and a tbf-shaped link (``p2ptrain.testnet.netns.Testbed``). The launcher
starts the bootstrap and the peers inside them, fires the scenario's events on a timeline (kills, stops, restarts from
checkpoint, rate changes, partitions, new peers, random churn), follows the peers' metrics files, and at the end
writes the report and judges the scenario's checks. Teardown always runs: in ``finally`` on success, failure and
SIGINT/SIGTERM/SIGHUP, and through the testbed's guard process if the launcher itself is killed; every process
started here lives inside a testbed namespace, so deleting the namespaces also kills them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import yaml

from p2ptrain.checkpoint import latest_checkpoint
from p2ptrain.config import build_config, read_config_file
from p2ptrain.errors import CheckpointError, ConfigError, UserError, one_line
from p2ptrain.metrics import read_metrics
from p2ptrain.testnet.loopback import PeerSummary, cli_argv, format_summary
from p2ptrain.testnet.netns import HostSpec, Testbed, require_netns_support
from p2ptrain.testnet.report import EventRecord, Life, RunRecord, format_checks, run_checks, write_report
from p2ptrain.testnet.scenario import Event, RunPlan, Scenario, Timeline, load_scenario, peer_index, plan_run

POLL_S = 0.25  # how often the launcher looks at its children and their metrics files
PORT = 31337  # every host has its own network stack, so one fixed port serves all
BOOTSTRAP_TIMEOUT_S = 60.0
STOP_GRACE_S = 20.0  # SIGTERM -> SIGKILL: a peer finishes the averaging it is in, then writes a checkpoint
PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


@dataclasses.dataclass(frozen=True)
class NetnsTestnetOptions:
    """What `p2ptrain testnet --backend netns` was asked for; None defers to the scenario, then to defaults."""

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
    name_prefix: str | None = None  # namespace prefix (default: from the pid)

    def __post_init__(self) -> None:
        if self.rounds is not None and self.duration_s is not None:
            raise ConfigError("give --rounds or --duration, not both")
        if self.timeout_s < 10:
            raise ConfigError(f"--timeout must be >= 10 s, got {self.timeout_s}")


class Fleet:
    """The bootstrap and the peers of one run: start, signal, restart, and follow their lives and metrics."""

    def __init__(self, testbed: Testbed, workdir: Path, plan: RunPlan, peer_argv: list[str], num_shards: int):
        self.testbed, self.workdir, self.plan = testbed, workdir, plan
        self.peer_argv = peer_argv  # the flags every peer gets
        self.num_shards = num_shards
        self.run_id = f"netns-{uuid.uuid4().hex[:8]}"
        self.bootstrap_maddr = ""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # the current process of each host
        self.lives: list[Life] = []
        self.current: dict[str, Life] = {}
        self.stopped: set[str] = set()  # peers now SIGSTOPped
        self.asked_to_stop: dict[str, float] = {}  # peers sent SIGTERM for reaching the last round -> deadline
        self.round_budget: dict[str, int] = {}  # the --rounds each peer's current process was given
        self.rows: dict[str, list[dict[str, Any]]] = {}

    def checkpoint_dir(self, peer: str) -> Path:
        return self.workdir / "checkpoints" / peer

    def _popen(self, host: str, argv: list[str]) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
        with open(self.workdir / f"{host}.log", "ab") as log:
            log.write(f"---- {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
            log.flush()
            proc = self.testbed.popen(host, argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT)
        self.procs[host] = proc
        (self.workdir / "processes.json").write_text(json.dumps({h: p.pid for h, p in self.procs.items()}))
        return proc

    def start_bootstrap(self) -> None:
        address_file = self.workdir / "bootstrap.addr"
        address_file.unlink(missing_ok=True)
        proc = self._popen("bootstrap", cli_argv(
            "bootstrap", "--host-maddrs", f"/ip4/{self.testbed.address('bootstrap')}/tcp/{PORT}", "--identity",
            str(self.workdir / "bootstrap.key"), "--address-file", str(address_file), "--no-nat-port-map",
            "--no-auto-nat", "--no-relay"))
        deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S
        while not (address_file.exists() and address_file.read_text().strip()):
            if proc.poll() is not None:
                raise UserError(f"the bootstrap node exited with code {proc.returncode}; see "
                                f"{self.workdir / 'bootstrap.log'}")
            if time.monotonic() > deadline:
                raise UserError(f"the bootstrap node did not start within {BOOTSTRAP_TIMEOUT_S:.0f} s; see "
                                f"{self.workdir / 'bootstrap.log'}")
            time.sleep(POLL_S)
        self.bootstrap_maddr = address_file.read_text().split()[0]

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
        argv = cli_argv("peer", "--initial-peers", self.bootstrap_maddr, "--run-id", self.run_id,
                        "--rounds", str(rounds), "--shard-index", str(peer_index(peer, "peer") % self.num_shards),
                        "--metrics", str(self.workdir / f"{peer}.jsonl"), "--checkpoint-dir",
                        str(self.checkpoint_dir(peer)), "--host-maddrs",
                        f"/ip4/{self.testbed.address(peer)}/tcp/{PORT}", *self.peer_argv)
        if peer in self.plan.adversaries:
            argv += ["--red-team", self.plan.adversaries[peer]]
        proc = self._popen(peer, argv + (["--resume"] if checkpoint_round is not None else []))
        life = Life(peer, proc.pid, time.time(), resumed_from_round=checkpoint_round)
        self.lives.append(life)
        self.current[peer] = life
        self.rows.setdefault(peer, [])
        self.asked_to_stop.pop(peer, None)
        return note

    def running(self, peer: str) -> bool:
        return peer in self.current and self.procs[peer].poll() is None

    def end_life(self, peer: str, reason: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal a peer (waking it first unless SIGKILL), wait up to STOP_GRACE_S, then SIGKILL it."""
        self.send(peer, sig)
        self.reap(peer, reason, STOP_GRACE_S)

    def send(self, peer: str, sig: signal.Signals) -> None:
        """SIGKILL the whole process group; otherwise wake the group and signal the peer's main process only.

        A SIGTERM to the group would also kill hivemind's DHT and averager child processes, and the peer would
        then hang on its next DHT call instead of stopping cleanly.
        """
        if sig == signal.SIGKILL:
            _signal_group(self.procs[peer], sig)
            return
        _signal_group(self.procs[peer], signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            self.procs[peer].send_signal(sig)

    def reap(self, peer: str, reason: str, grace_s: float) -> None:
        """Wait for a signalled peer to exit and close its life; past ``grace_s`` it is SIGKILLed."""
        proc = self.procs[peer]
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            reason = "killed_at_teardown"
        clean = proc.returncode in (0, -signal.SIGTERM)  # -SIGTERM: stopped before its handler was installed
        self._close_life(peer, "crashed" if reason == "stopped_at_end" and not clean else reason)

    def _close_life(self, peer: str, reason: str) -> None:
        life = self.current.pop(peer)
        life.ended, life.exit_code, life.end_reason = time.time(), self.procs[peer].returncode, reason
        self.stopped.discard(peer)

    def pause(self, peer: str, pause: bool) -> None:
        _signal_group(self.procs[peer], signal.SIGSTOP if pause else signal.SIGCONT)
        (self.stopped.add if pause else self.stopped.discard)(peer)

    def poll(self) -> None:
        """Close the lives of exited peers, reload metrics, and stop peers that are past the last round."""
        self._reap_exited()
        for peer in self.rows:
            path = self.workdir / f"{peer}.jsonl"
            self.rows[peer] = read_metrics(path) if path.exists() else []
        if self.plan.rounds is None:
            return
        for peer, life in self.current.items():
            rows = [row for row in self.rows[peer] if row["time"] >= life.started]
            done_by_itself = len(rows) >= self.round_budget[peer]  # it exits on its own after its --rounds
            if rows and rows[-1]["round"] >= self.plan.rounds - 1 and not done_by_itself \
                    and peer not in self.asked_to_stop:
                self.send(peer, signal.SIGTERM)  # it jumped ahead by joining the swarm: its own count is not done
                self.asked_to_stop[peer] = time.monotonic() + STOP_GRACE_S
        for peer, deadline in list(self.asked_to_stop.items()):
            if peer in self.current and time.monotonic() > deadline:
                self.reap(peer, "finished", grace_s=0.0)  # hung on the way out: SIGKILL, killed_at_teardown

    def _reap_exited(self) -> None:
        for peer in list(self.current):
            code = self.procs[peer].poll()
            if code is not None:
                self._close_life(peer, "finished" if code == 0 else "crashed")

    def last_rounds(self) -> dict[str, int]:
        return {peer: rows[-1]["round"] for peer, rows in self.rows.items() if rows}

    def any_active(self) -> bool:
        return any(self.running(peer) and peer not in self.stopped for peer in self.current)

    def stop_all(self) -> None:
        """Wake and SIGTERM every peer once, give them STOP_GRACE_S together to checkpoint, SIGKILL the rest."""
        peers = list(self.current)
        for peer in peers:
            self.send(peer, signal.SIGCONT if peer in self.asked_to_stop else signal.SIGTERM)  # a 2nd TERM aborts
        deadline = time.monotonic() + STOP_GRACE_S
        for peer in peers:
            self.reap(peer, "stopped_at_end", max(0.1, deadline - time.monotonic()))


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def apply_event(fleet: Fleet, event: Event) -> tuple[bool, str]:
    """Carry out one event; (False, why) when it cannot apply now (e.g. the peer is not running)."""
    peer, testbed = event.peer or "", fleet.testbed
    needs_running = event.action in ("kill", "stop", "continue")
    if needs_running and not fleet.running(peer):
        return False, f"{peer} is not running"
    if event.action == "kill":
        fleet.end_life(peer, "killed")
    elif event.action in ("stop", "continue"):
        fleet.pause(peer, event.action == "stop")
    elif event.action == "restart":
        if fleet.running(peer):
            fleet.end_life(peer, "restarted", signal.SIGTERM)
        return True, fleet.start_peer(peer, resume=True)
    elif event.action == "add_peer":
        return True, fleet.start_peer(peer, resume=False)
    elif event.action == "set_rate":
        testbed.set_rate(peer, event.rate_mbit)
    elif event.action == "partition":
        testbed.cut_partition(list(event.group))
    elif event.action == "heal":
        testbed.heal_partition()
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
                                          detail))
                click.echo(f"testnet: t={elapsed:5.1f}s {event.describe()} ({event.trigger})"
                           + ("" if ok and not detail else f": {detail}"))
        if plan.duration_s is not None and elapsed >= plan.duration_s:
            return "duration"
        if plan.duration_s is None and not fleet.any_active():
            return "done"
        if elapsed > timeout_s:
            click.echo(f"testnet: timed out after {timeout_s:g} s", err=True)
            return "timeout"
        time.sleep(POLL_S)


def _apply_safely(fleet: Fleet, event: Event) -> tuple[bool, str]:
    try:
        return apply_event(fleet, event)
    except UserError as e:  # an `ip`/`tc` command failed: record it, the run goes on
        return False, one_line(e)


def merged_peer_config(options: NetnsTestnetOptions, plan: RunPlan, workdir: Path) -> tuple[Path, int]:
    """Write --config with the scenario's peer_config merged over it; validated here, before any namespace."""
    values = read_config_file(options.config_path) if options.config_path else {}
    for section, settings in plan.peer_config.items():
        if isinstance(settings, dict) and isinstance(values.get(section), dict):
            values[section] = {**values[section], **settings}
        else:
            values[section] = settings
    if options.model:
        values.setdefault("model", {})["name"] = options.model
    config = build_config(values)
    path = workdir / "peer_config.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=True))
    return path, config.data.num_shards


@contextlib.contextmanager
def _signals(handler: Any) -> Iterator[None]:
    """Install ``handler`` for SIGINT/SIGTERM/SIGHUP for the block (main thread only), then restore the old ones."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_netns_testnet(options: NetnsTestnetOptions) -> bool:
    """Run a scenario on a namespace testbed; True when every check passed. Needs root (one-line UserError)."""
    scenario = load_scenario(options.scenario_path) if options.scenario_path else Scenario()
    plan = plan_run(scenario, options.num_peers, options.bandwidth, options.rounds, options.duration_s)
    require_netns_support()
    workdir = Path(options.workdir or tempfile.mkdtemp(prefix="p2ptrain-netns-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config_path, num_shards = merged_peer_config(options, plan, workdir)
    rates: dict[str, float | None] = dict(zip(plan.initial_peers, plan.peer_rates_mbit, strict=True))
    rates.update({str(e.peer): e.rate_mbit for e in plan.events if e.action == "add_peer"})
    hosts = [HostSpec("bootstrap")] + [HostSpec(peer, rate) for peer, rate in rates.items()]
    testbed = Testbed(options.name_prefix or f"tn{os.getpid()}", hosts)
    peer_flags = ["--torch-threads", "1", "--no-progress", "--device", "cpu", "--config", str(config_path),
                  "--no-nat-port-map", "--no-auto-nat", "--no-relay"]
    fleet = Fleet(testbed, workdir, plan, peer_flags, num_shards)
    bound = f"{plan.rounds} rounds" if plan.rounds is not None else f"{plan.duration_s:g} s"
    click.echo(f"testnet: bootstrap + {len(plan.initial_peers)} peers in network namespaces, {bound}, "
               f"{len(plan.events)} scripted + {len(plan.churn_events)} churn events, logs in {workdir}")
    events: list[EventRecord] = []
    outcome, error, started, script = "error", None, time.time(), Timeline(plan.events)
    with _signals(_interrupt):
        try:
            testbed.create()
            fleet.start_bootstrap()
            started = time.time()
            for peer in plan.initial_peers:
                fleet.start_peer(peer, resume=False)
            outcome = drive(fleet, plan, options.timeout_s, events, script)
        except BaseException as e:  # KeyboardInterrupt (Ctrl-C, SIGTERM, SIGHUP) included: report, then re-raise
            outcome, error = ("interrupted" if isinstance(e, KeyboardInterrupt) else "error"), e
        finally:
            with _signals(signal.SIG_IGN):  # a second Ctrl-C must not cut the teardown short
                click.echo("testnet: stopping peers and tearing down the testbed")
                try:
                    fleet.stop_all()
                finally:
                    testbed.teardown()
    checkpoint_dirs = {peer: str(fleet.checkpoint_dir(peer)) for peer in fleet.rows}
    record = RunRecord(started, time.time(), fleet.rows, fleet.lives, events, unfired_events(script), checkpoint_dirs,
                       rates, outcome, dataclasses.asdict(plan))
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
    click.echo("testnet: every check passed" if ok else "testnet: FAILED — see the checks above")
    return ok
