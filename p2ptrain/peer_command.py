"""The `p2ptrain peer` command line, which the testnet's red team (testnet/red_team.py) runs too: the options in
titled sections (what a volunteer types first), the config they build, and the run of the peer or of one process of
its node. The network options serve `p2ptrain bootstrap` and `status` as well."""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

from p2ptrain.choices import ADMISSION_MODES, SYNC_MODES
from p2ptrain.errors import UserError

if TYPE_CHECKING:  # the config pulls in the models: imported when a command runs, not for --help
    from p2ptrain.config import PeerConfig
    from p2ptrain.sync.interface import Conduct


def network_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Flags shared by every command that joins the network."""
    options = [
        click.option("--host-maddrs", multiple=True, help="Multiaddr(s) to listen on (default from config: all "
                                                          "interfaces, a free TCP port)."),
        click.option("--announce-maddrs", multiple=True, help="Public multiaddr(s) to announce."),
        click.option("--identity", "identity_path", type=click.Path(dir_okay=False), default=None,
                     help="libp2p key file for a stable peer id (created if missing)."),
        click.option("--no-nat-port-map", is_flag=True, help="Do not ask the router for a port mapping (UPnP)."),
        click.option("--no-auto-nat", is_flag=True, help="Do not probe reachability through other peers."),
        click.option("--no-relay", is_flag=True, help="Do not use p2pd's libp2p circuit relays (network.use_relay; "
                                                      "p2ptrain's own relays for peers behind NAT are "
                                                      "network.use_relays)."),
        click.option("--loopback", is_flag=True, help="Listen on 127.0.0.1 only and probe nothing (local tests)."),
        click.option("--admission", type=click.Choice(ADMISSION_MODES), default=None,
                     help="Who may take part: anyone (open, the default) or peers with an organiser's ticket."),
        click.option("--organiser-key", type=click.Path(dir_okay=False), default=None,
                     help="Signed runs: the organiser's public key file (.pub from `p2ptrain keygen`)."),
        click.option("--admission-ticket", type=click.Path(dir_okay=False), default=None,
                     help="Signed runs: this peer's ticket file (from `p2ptrain admit`)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def network_overrides(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Dotted config overrides from the network flags (popped from kwargs)."""
    overrides: dict[str, Any] = {}
    if kwargs.pop("loopback"):
        overrides.update({"network.host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "network.nat_port_map": False,
                          "network.auto_nat": False, "network.use_relay": False})
    for flag, key in (("host_maddrs", "network.host_maddrs"), ("announce_maddrs", "network.announce_maddrs")):
        values = kwargs.pop(flag)
        if values:
            overrides[key] = list(values)
    for flag, key in (("identity_path", "identity_path"), ("admission", "admission"),
                      ("organiser_key", "organiser_key"), ("admission_ticket", "admission_ticket")):
        value = kwargs.pop(flag)
        if value:
            overrides[f"network.{key}"] = value
    for flag, key in (("no_nat_port_map", "nat_port_map"), ("no_auto_nat", "auto_nat"), ("no_relay", "use_relay")):
        if kwargs.pop(flag):
            overrides[f"network.{key}"] = False
    return overrides


def split_peers(values: tuple[str, ...]) -> list[str]:
    return [p.strip() for value in values for p in value.replace(",", " ").split() if p.strip()]


def install_stop_handlers(stop: Callable[[], None]) -> None:
    """First SIGINT/SIGTERM: stop cleanly (checkpoint, leave the swarm). Second: exit at once."""
    def handler(signum: int, _frame: object) -> None:
        if getattr(handler, "fired", False):
            raise SystemExit(130)
        handler.fired = True  # type: ignore[attr-defined]
        click.echo(f"\n{signal.Signals(signum).name}: stopping (again to exit at once)", err=True)
        stop()
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where is a stuck peer?
    faulthandler.enable(all_threads=True)  # a crash in native code (torch, a driver) still says where it was


class SectionedCommand(click.Command):
    """A command whose --help lists its options in titled sections, in order (click has no option groups)."""

    def __init__(self, *args: Any, sections: Sequence[tuple[str, Sequence[str]]] = (), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sections = sections  # (title, parameter names); options named in no section come last, as "Other"

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {param.name: param.get_help_record(ctx) for param in self.get_params(ctx)}
        listed = {name for _, names in self.sections for name in names}
        titled = [*self.sections, ("Other options", [name for name in records if name not in listed])]
        for title, names in titled:
            rows = [record for name in names if (record := records.get(name)) is not None]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


PEER_SECTIONS = (
    ("Joining a run (what a volunteer types)", ("initial_peers", "run_id", "config_path", "device")),
    ("Training", ("model", "dataset", "sync", "rounds", "min_peers", "eval_every", "shard_index", "torch_threads",
                  "workers")),
    ("Checkpoints and output", ("checkpoint_dir", "resume", "metrics_path", "tensorboard_dir", "wandb_project",
                                "no_progress", "show_plan")),
    ("Network", ("host_maddrs", "announce_maddrs", "identity_path", "serve_relay", "no_nat_port_map", "no_auto_nat",
                 "no_relay", "loopback")),
    ("Signed runs", ("admission", "organiser_key", "admission_ticket")),
)
PEER_CONFIG_FLAGS = (("run_id", "run.run_id"), ("device", "run.device"), ("model", "model.name"),
                     ("dataset", "data.dataset"), ("sync", "sync.mode"), ("rounds", "run.rounds"),
                     ("checkpoint_dir", "run.checkpoint_dir"), ("metrics_path", "run.metrics_path"),
                     ("tensorboard_dir", "run.tensorboard_dir"), ("wandb_project", "run.wandb_project"),
                     ("shard_index", "run.shard_index"),
                     ("torch_threads", "run.torch_threads"), ("eval_every", "run.eval_every"),
                     ("min_peers", "run.min_peers"))  # flag -> the config key it overrides


def peer_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The options of `p2ptrain peer` (and of the testnet's red team, which runs the same peer)."""
    options = [
        click.option("--initial-peers", multiple=True, help="Multiaddr(s) of live peers or a bootstrap node; none "
                                                            "starts a new swarm."),
        click.option("--run-id", help="Run id: peers with the same id train together."),
        click.option("--config", "config_path", type=click.Path(dir_okay=False),
                     help="YAML or TOML file with the knobs."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "mps"]),
                     help="Where to train (default auto)."),
        click.option("--model", help="Model preset (tiny, small, base), local path or hub id."),
        click.option("--dataset", help="Dataset: stdlib, a local file or directory, or hf:<name>[:<config>]."),
        click.option("--sync", type=click.Choice(SYNC_MODES), help="Outer sync: diloco (all-reduce), gasloc or "
                                                                  "factored (gossip)."),
        click.option("--rounds", type=click.IntRange(min=0), help="Outer rounds to run (0: until stopped)."),
        click.option("--min-peers", type=click.IntRange(min=1, max=10_000), help="A fresh peer waits for this many "
                     "peers (itself included) before its first round, so that peers launched together begin together "
                     "(default 1)."),
        click.option("--eval-every", type=click.IntRange(min=1), help="Rounds between validations (default 1)."),
        click.option("--checkpoint-dir", type=click.Path(file_okay=False), help="Write checkpoints here."),
        click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in --checkpoint-dir."),
        click.option("--metrics", "metrics_path", type=click.Path(dir_okay=False),
                     help="Append per-round JSON lines here."),
        click.option("--tensorboard", "tensorboard_dir", type=click.Path(file_okay=False),
                     help="Write per-round scalars here for TensorBoard (pip install 'p2ptrain[tensorboard]')."),
        click.option("--wandb", "wandb_project", metavar="PROJECT", help="Log per-round scalars to this W&B project "
                     "(pip install 'p2ptrain[wandb]'; offline under ./wandb without an API key)."),
        click.option("--shard-index", type=click.IntRange(min=0),
                     help="Read the data pieces of this shard (default: pieces the swarm has not read yet)."),
        click.option("--torch-threads", type=click.IntRange(min=0),
                     help="CPU threads for this peer (0: torch default)."),
        click.option("--no-progress", is_flag=True, help="No progress bar (logs only)."),
        click.option("--plan", "show_plan", is_flag=True,
                     help="Print this peer's memory plan and exit (p2ptrain plan)."),
        click.option("--workers", type=click.IntRange(min=1), help="Processes of this node, one per GPU, training "
                     "as one peer (starts itself under torchrun; default 1)."),
        click.option("--relay", "serve_relay", is_flag=True,
                     help="Serve as a relay for peers behind NAT (a public peer)."),
    ]
    for option in reversed(options):
        func = option(func)
    return network_options(func)


@dataclasses.dataclass(frozen=True)
class PeerRequest:
    """What `p2ptrain peer` was asked to run: the resolved config and how to start."""

    config: PeerConfig
    explicit: dict[str, Any]  # the dotted settings the config file and flags set (a run's manifest fills the rest)
    initial_peers: list[str]
    resume: bool
    workers: int | None
    show_plan: bool


def peer_request(kwargs: dict[str, Any]) -> PeerRequest:
    """The peer's config from its options (`peer_options`); a malformed multiaddr fails here, before start-up."""
    from p2ptrain.config import explicit_settings, load_config
    from p2ptrain.net.dht import parse_maddr

    peers = split_peers(kwargs.pop("initial_peers"))
    for maddr in peers:
        parse_maddr(maddr)  # before the slow start-up: a typo is reported at once
    overrides = network_overrides(kwargs)
    for flag, key in PEER_CONFIG_FLAGS:
        if kwargs.get(flag) is not None:
            overrides[key] = kwargs[flag]
    if kwargs["no_progress"]:
        overrides["run.progress"] = False
    if kwargs["serve_relay"]:
        overrides["network.relay"] = True
    config = load_config(kwargs["config_path"], overrides)
    explicit = explicit_settings(kwargs["config_path"], overrides)
    return PeerRequest(config, explicit, peers, kwargs["resume"], kwargs["workers"], kwargs["show_plan"])


def run_peer(request: PeerRequest, conduct: Conduct | None = None, module: str = "p2ptrain") -> None:
    """Print the memory plan, or run the peer (one node of `--workers` processes) until its rounds end or a signal.
    `conduct`: how the peer forms what it sends (the honest default when None; the testnet's red team lies);
    `module`: the program (`python -m MODULE`) whose command line the node's other processes run."""
    import torch

    from p2ptrain.device import resolve_device
    from p2ptrain.manifest import hand_to_node, join_command, join_run
    from p2ptrain.maths.data_parallel import NodeGroup
    from p2ptrain.peer import TrainingPeer

    config, manifest = join_run(request.config, request.explicit, request.initial_peers)
    if request.show_plan:
        from p2ptrain.memory.plan import settings_of
        from p2ptrain.memory.report import PlanRequest, plan_text

        click.echo(plan_text(config, settings_of(config), PlanRequest(device=config.run.device)))
        return
    device = resolve_device(config.run.device)  # before the node starts: a bad device fails once, in one line
    if config.run.check_memory:
        check_memory_plan(config)
    if request.workers is not None and request.workers > 1:
        hand_to_node(manifest)  # the node's other processes take it from us
    start_node_processes(request.workers, module)
    node = NodeGroup.from_environment(device, config.run.node_timeout_s)
    if not node.is_leader:
        from p2ptrain.node.worker import NodeWorker

        try:
            NodeWorker(config, node).run()
        finally:
            node.close()
        return
    log = logging.getLogger("p2ptrain")
    log.info(f"config (what differs from the defaults): {json.dumps(config.changes_from_defaults(), sort_keys=True)}")
    log.debug(f"resolved config: {config.to_json()}")
    if manifest is not None:
        click.echo(f"Joining {manifest.summary()}")
    training_peer = TrainingPeer(config, request.initial_peers, resume=request.resume, node=node, conduct=conduct,
                                 manifest=manifest)
    install_stop_handlers(training_peer.stop)
    try:
        if manifest is not None and manifest.fingerprint != training_peer.fingerprint:
            raise UserError(f"the model built from run {manifest.run_id!r}'s settings has fingerprint "
                            f"{training_peer.fingerprint}, the run's is {manifest.fingerprint}: install p2ptrain "
                            f"{manifest.version} with the transformers release the organiser uses")
        click.echo(f"Peer {training_peer.peer_id} in run {config.run.run_id!r}. Others can join with:")
        for maddr in training_peer.maddrs:
            click.echo(f"  {join_command(config, maddr)}")
        sys.stdout.flush()
        try:
            history = training_peer.run()
        except torch.OutOfMemoryError:
            raise UserError(f"out of {device.type} memory at round {training_peer.state.round}: "
                            f"{memory_advice(config)}") from None
        if history:
            click.echo(f"done: {len(history)} rounds, round {history[-1].round}, val loss "
                       f"{history[0].val_loss:.3f} -> {history[-1].val_loss:.3f}")
    finally:
        training_peer.shutdown()


def check_memory_plan(config: PeerConfig) -> None:
    """Refuse, in one line with the plan's advice, a peer whose memory plan does not fit its device."""
    from p2ptrain.memory.report import local_misfit

    misfit = local_misfit(config)
    if misfit is not None:
        raise UserError(f"this peer does not fit its device: {misfit} (p2ptrain plan shows the whole plan; "
                        f"run.check_memory: false starts it anyway)")


def memory_advice(config: PeerConfig) -> str:
    """What to change after running out of memory: the plan's advice, or the settings that lower the peak."""
    from p2ptrain.memory.report import local_misfit

    misfit = local_misfit(config)
    return misfit or ("the plan expected it to fit; more inner.micro_batches, inner.activation_checkpointing: true "
                      "or inner.precision: bf16 lower the peak (p2ptrain plan shows by how much)")


def start_node_processes(workers: int | None, module: str) -> None:
    """`--workers N`: run this same command as the N processes of a node (it returns only inside them)."""
    from p2ptrain.maths.data_parallel import node_size_from_environment

    if "WORLD_SIZE" in os.environ:  # started by torchrun (by us, or by the user)
        if workers is not None and workers != node_size_from_environment():
            raise click.UsageError(f"--workers {workers} under torchrun with {os.environ['WORLD_SIZE']} processes")
        return
    if workers is not None and workers > 1:
        from p2ptrain.node.launcher import run_node

        sys.exit(run_node(workers, sys.argv[1:], module=module))
