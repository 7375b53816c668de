"""`p2ptrain testnet`: a bootstrap node and N training peers as separate processes on loopback.

It streams each peer's rounds as they finish, prints a summary, and tells whether training happened: every peer
ran all its rounds and ended with a lower validation loss than after its first round.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import click

from p2ptrain.console import LOG_LEVELS
from p2ptrain.errors import UserError
from p2ptrain.metrics import read_metrics
from p2ptrain.testnet.forkserver import ForkedProcess, ForkServer, kept_server
from p2ptrain.testnet.hosttools import handling_signals, interrupt, process_env
from p2ptrain.timing import SLOW_POLL_S


@dataclasses.dataclass(frozen=True)
class TestnetOptions:
    num_peers: int = 4
    rounds: int | None = None  # default: 8
    model: str | None = None  # default: the config's model (small)
    sync: str | None = None  # default: the config's sync mode (diloco)
    config_path: str | None = None
    workdir: str | None = None
    timeout_s: int = 900
    extra_peer_args: tuple[str, ...] = ()
    status_page: bool = False  # the bootstrap serves the run's status page on 127.0.0.1 (the CLI's default: on)

    @property
    def resolved_rounds(self) -> int:
        return self.rounds or 8


@dataclasses.dataclass
class PeerSummary:
    name: str
    exit_code: int | None
    rounds: list[dict[str, Any]]

    @property
    def trained(self) -> bool:
        return (self.exit_code == 0 and len(self.rounds) >= 2
                and self.rounds[-1]["val_loss"] < self.rounds[0]["val_loss"])


TestnetProcess = ForkedProcess | subprocess.Popen[bytes]


class ProcessGroup:
    """Child processes in their own sessions, so that a stop kills each one with everything it spawned; forked from
    one ``ForkServer`` (forkserver.py), which imports the peer's libraries once for all of them, or with `fresh`, each
    a new interpreter, as a volunteer's shell starts it (benchmarks/peer_memory.py compares the two)."""

    def __init__(self, fresh: bool = False) -> None:
        self.fresh = fresh
        self.children: dict[str, TestnetProcess] = {}
        self.server: ForkServer | None = None

    def start(self, name: str, module_and_args: tuple[str, list[str]], log_path: Path) -> TestnetProcess:
        module, args = module_and_args
        process: TestnetProcess
        if self.fresh:
            with open(log_path, "wb") as log:
                process = subprocess.Popen([sys.executable, "-m", module, *args], env=process_env(),
                                           stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        else:
            if self.server is None:
                self.server = kept_server(process_env())
            process = self.server.start({"module": module}, args, Path.cwd(), log_path, session=True)
        self.children[name] = process
        return process

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM each main process (not its group: the peer must shut its own DHT down and checkpoint), then
        SIGKILL whatever is left of each group; the fork server stays for the process's next testnet."""
        for process in self.children.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.children.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(process, signal.SIGKILL)  # also reaps p2pd daemons left in the group
            process.wait()


def _signal_group(process: TestnetProcess, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


RED_TEAM = "red-team"  # the command of a hostile peer: `python -m p2ptrain.testnet.red_team`, not the p2ptrain CLI


def cli_module(command: str, *args: str) -> tuple[str, list[str]]:
    """What a testnet process runs at our own log level, as a module and its arguments: `p2ptrain COMMAND ARGS`
    (bootstrap, peer), or the red team's peer for RED_TEAM."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    log_level = ["--log-level", level if level in LOG_LEVELS else "info"]
    if command == RED_TEAM:
        return "p2ptrain.testnet.red_team", [*log_level, *args]
    return "p2ptrain.cli", [*log_level, command, *args]


def wait_for_file(path: Path, process: TestnetProcess, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        if process.poll() is not None:
            raise UserError(f"the bootstrap node exited with code {process.returncode}; see {path.parent}")
        time.sleep(SLOW_POLL_S)  # each look reads the children's files
    raise UserError(f"the bootstrap node did not start within {timeout_s:.0f} s; see {path.parent}")


def peer_command(options: TestnetOptions, index: int, bootstrap_maddr: str, run_id: str,
                 workdir: Path) -> tuple[str, list[str]]:
    args = ["--loopback", "--initial-peers", bootstrap_maddr, "--run-id", run_id,
            "--rounds", str(options.resolved_rounds), "--shard-index", str(index), "--torch-threads", "1",
            "--metrics", str(workdir / f"peer{index}.jsonl"), "--no-progress", "--device", "cpu",
            "--min-peers", str(options.num_peers)]  # launched together: they begin round 0 together
    if options.config_path:
        args += ["--config", options.config_path]
    if options.model:
        args += ["--model", options.model]
    if options.sync:
        args += ["--sync", options.sync]
    return cli_module("peer", *args, *options.extra_peer_args)


def start_swarm(group: ProcessGroup, options: TestnetOptions, run_id: str,
                workdir: Path) -> tuple[TestnetProcess, dict[str, TestnetProcess]]:
    """The bootstrap, once it has written its address, then the peers `peer0`... that join through it."""
    page = ["--status-port", "0"] if options.status_page else []
    bootstrap = group.start("bootstrap", cli_module("bootstrap", "--loopback", "--run-id", run_id, "--address-file",
                                                    str(workdir / "bootstrap.addr"), *page), workdir / "bootstrap.log")
    maddr = wait_for_file(workdir / "bootstrap.addr", bootstrap, 60).split()[0]
    peers = {f"peer{i}": group.start(f"peer{i}", peer_command(options, i, maddr, run_id, workdir),
                                     workdir / f"peer{i}.log") for i in range(options.num_peers)}
    return bootstrap, peers


def run_testnet(options: TestnetOptions) -> bool:
    """Run the testnet to completion; True when every peer trained."""
    workdir = Path(options.workdir or tempfile.mkdtemp(prefix="p2ptrain-testnet-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in [workdir / "bootstrap.addr", *workdir.glob("peer*.jsonl")]:  # from an earlier run in this dir
        stale.unlink(missing_ok=True)
    run_id = f"testnet-{uuid.uuid4().hex[:8]}"
    group = ProcessGroup()
    click.echo(f"testnet: bootstrap + {options.num_peers} peers on loopback, {options.resolved_rounds} rounds each, "
               f"sync {options.sync or 'from config'}, logs in {workdir}")
    with handling_signals(interrupt):  # a SIGTERM too stops the peers: they lead sessions of their own
        try:
            _bootstrap, peers = start_swarm(group, options, run_id, workdir)
            _follow_until_done(peers, workdir, options.timeout_s, options.status_page)
        finally:
            with handling_signals(signal.SIG_IGN):  # a second Ctrl-C must not cut the stop short
                group.stop_all()
    summaries = [PeerSummary(name, process.returncode, _read_rounds(workdir / f"{name}.jsonl"))
                 for name, process in peers.items()]
    click.echo(format_summary(summaries))
    ok = all(s.trained for s in summaries)
    click.echo("testnet: every peer trained (validation loss fell)" if ok else
               f"testnet: FAILED — a peer did not finish or its loss did not fall; logs in {workdir}")
    return ok


def _read_rounds(path: Path) -> list[dict[str, Any]]:
    return read_metrics(path) if path.exists() else []


def status_page_url(bootstrap_log: Path) -> str | None:
    """The status page's address once the bootstrap has printed it (`Status page: URL ...`)."""
    try:
        lines = bootstrap_log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((line.split()[2] for line in lines if line.startswith("Status page: http")), None)


def _follow_until_done(peers: dict[str, TestnetProcess], workdir: Path, timeout_s: float,
                       status_page: bool = False) -> None:
    """Print each round as peers report it (and the status page's address once served), until all peers exit or
    the timeout passes."""
    seen = dict.fromkeys(peers, 0)
    deadline = time.monotonic() + timeout_s
    page_told = not status_page
    while time.monotonic() < deadline:
        if not page_told and (url := status_page_url(workdir / "bootstrap.log")):
            click.echo(f"testnet: watch the run at {url} or with `p2ptrain status --page {url} [--json | --watch 5]`")
            page_told = True
        for name in peers:
            rows = _read_rounds(workdir / f"{name}.jsonl")
            for row in rows[seen[name]:]:
                click.echo(f"  {name} round {row['round']:>3}  steps {row['inner_steps']:>3}  loss "
                           f"{row['train_loss']:.3f}  val {row['val_loss']:.3f}  peers {row['peers_averaged']}  "
                           f"{row['tokens_per_s']:.0f} tok/s" + ("  (joined)" if row.get("joined") else ""))
            seen[name] = len(rows)
        if all(p.poll() is not None for p in peers.values()):
            return
        time.sleep(SLOW_POLL_S)  # each look reads the children's files
    click.echo(f"testnet: timed out after {timeout_s} s", err=True)


def format_summary(summaries: list[PeerSummary]) -> str:
    header = (f"{'peer':<7} {'exit':>4} {'rounds':>6} {'loss first':>10} {'loss last':>9} {'val first':>9} "
              f"{'val last':>8} {'sent MB':>8} {'recv MB':>8} {'peers':>5}")
    lines = ["", header, "-" * len(header)]
    for s in summaries:
        if not s.rounds:
            lines.append(f"{s.name:<7} {s.exit_code!s:>4} {0:>6}   (no rounds completed)")
            continue
        first, last = s.rounds[0], s.rounds[-1]
        sent = sum(r["bytes_sent"] for r in s.rounds) / 1e6
        received = sum(r["bytes_received"] for r in s.rounds) / 1e6
        lines.append(f"{s.name:<7} {s.exit_code!s:>4} {len(s.rounds):>6} {first['train_loss']:>10.3f} "
                     f"{last['train_loss']:>9.3f} {first['val_loss']:>9.3f} {last['val_loss']:>8.3f} {sent:>8.2f} "
                     f"{received:>8.2f} {last['peers_averaged']:>5}")
    return "\n".join(lines)
