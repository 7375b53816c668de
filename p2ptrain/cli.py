"""The `p2ptrain` command: a thin layer that parses flags and calls the library. User mistakes are one line, exit 2."""

from __future__ import annotations

import sys
import threading
from typing import Any

import click

from p2ptrain import __version__
from p2ptrain.choices import PRECISIONS, STATE_DEVICES, SYNC_MODES
from p2ptrain.console import LOG_LEVELS, configure_logging, run_command
from p2ptrain.peer_command import (
    PEER_SECTIONS,
    SectionedCommand,
    install_stop_handlers,
    network_options,
    network_overrides,
    peer_options,
    peer_request,
    run_peer,
    split_peers,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="p2ptrain", message="%(prog)s %(version)s")
@click.option("--log-level", default="info", type=click.Choice(LOG_LEVELS))
def cli(log_level: str) -> None:
    """p2ptrain: train a language model together over the internet (DiLoCo and gossip over hivemind)."""
    configure_logging(log_level)


@cli.command()
@network_options
@click.option("--address-file", type=click.Path(dir_okay=False), help="Also write the multiaddrs to this file.")
@click.option("--run-id", default=None, help="The run it serves: it stores that run's DHT records only (default from "
              "config).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="The run's config (YAML or TOML): the bootstrap hands its manifest (model, data, sync) to "
                   "volunteers, who then join with --initial-peers alone.")
@click.option("--sign-with", type=click.Path(dir_okay=False), default=None,
              help="Signed runs: the organiser's private key file; the manifest goes out signed with it.")
@click.option("--no-relay-service", is_flag=True, help="Do not serve as a relay for peers behind NAT.")
@click.option("--status-port", type=click.IntRange(0, 65535), default=None,
              help="Also serve the run's status page on this port (0: any free one), as `status --serve` does.")
@click.option("--status-host", default="127.0.0.1", show_default=True,
              help="With --status-port: the address to listen on (0.0.0.0 shows the page to other machines).")
def bootstrap(address_file: str | None, run_id: str | None, config_path: str | None, sign_with: str | None,
              no_relay_service: bool, status_port: int | None, status_host: str, **kwargs: Any) -> None:
    """Run a DHT-only bootstrap node (and relay) and print the address peers must pass as --initial-peers."""
    from p2ptrain.config import load_config
    from p2ptrain.manifest import founding_manifest, join_command
    from p2ptrain.net.bootstrap import BootstrapNode

    overrides = network_overrides(kwargs)
    overrides["network.relay"] = not no_relay_service
    if run_id:
        overrides["run.run_id"] = run_id
    if sign_with and not config_path:
        raise click.UsageError("--sign-with signs the run's manifest: it needs --config")
    config = load_config(config_path, overrides)
    manifest = founding_manifest(config) if config_path else None
    if manifest is not None and sign_with:
        manifest = manifest.signed_with(sign_with)
    node = BootstrapNode(config.network, config.run.run_id, address_file,
                         manifest.to_document() if manifest is not None else None)
    stop, page = threading.Event(), None
    install_stop_handlers(stop.set)
    try:
        if manifest is not None:
            click.echo(f"Serving {manifest.summary()}")
        click.echo("Bootstrap node running. Peers join with:")
        for maddr in node.maddrs:
            join = join_command(config, maddr) if manifest is not None else \
                f"p2ptrain peer --run-id {config.run.run_id} --initial-peers {maddr}"
            click.echo(f"  {join}")
        if status_port is not None:
            from p2ptrain.status_page import StatusPage

            page = StatusPage.beside(config, node.maddrs, status_host, status_port)
            click.echo(f"Status page: {page.url} (also `p2ptrain status --page {page.url}`)")
        sys.stdout.flush()
        node.serve_until(stop)
    finally:
        if page is not None:
            page.stop()
        node.shutdown()


@cli.command(cls=SectionedCommand, sections=PEER_SECTIONS)
@peer_options
def peer(**kwargs: Any) -> None:
    """Run a training peer. A volunteer usually passes --initial-peers, --run-id, --config and --device; the other
    knobs live in the config file."""
    run_peer(peer_request(kwargs))


@cli.command()
@click.option("--initial-peers", multiple=True, help="Multiaddr of any live peer or bootstrap.")
@click.option("--page", "page_url", default=None,
              help="Read a status page instead (its http:// address, from `status --serve` or a bootstrap's "
                   "--status-port): no DHT node, an answer in well under a second.")
@click.option("--run-id", default=None, help="Run id to list (default: the run the address serves, from its "
                                             "manifest).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document (a line) per refresh instead of a table.")
@click.option("--watch", "every_s", type=click.FloatRange(min=0.5), default=None,
              help="Refresh every this many seconds over one connection, until Ctrl-C.")
@click.option("--count", type=click.IntRange(min=1), default=None, help="With --watch: stop after this many.")
@click.option("--serve", "serve_port", type=click.IntRange(0, 65535), default=None,
              help="Serve a live web page of the run on this port (0: any free one) until Ctrl-C.")
@click.option("--serve-host", default="127.0.0.1", show_default=True,
              help="With --serve: the address to listen on (0.0.0.0 shows the page to other machines).")
@network_options
def status(initial_peers: tuple[str, ...], page_url: str | None, run_id: str | None, as_json: bool,
           every_s: float | None, count: int | None, serve_port: int | None, serve_host: str, **kwargs: Any) -> None:
    """Print the run's live peers: round, phase, losses, tokens/s, reach, bans (or serve them as a web page)."""
    if count is not None and every_s is None:
        raise click.UsageError("--count needs --watch")
    if serve_port is not None and (as_json or count is not None):
        raise click.UsageError("--serve shows the page: it takes neither --json nor --count")
    if bool(initial_peers) == bool(page_url):
        raise click.UsageError("give either --initial-peers (a live peer or bootstrap) or --page (a status page)")
    if page_url and (serve_port is not None or run_id):
        raise click.UsageError("--page reads the run its page shows: it takes neither --serve nor --run-id")
    stop = threading.Event()
    if every_s is not None:  # Ctrl-C ends the watch after the refresh in progress
        install_stop_handlers(stop.set)
    if page_url:  # imports neither hivemind nor torch: that is the point of this path
        from p2ptrain.status_view import read_page, show_status

        show_status(lambda: read_page(page_url), as_json, every_s, count, stop)
        return
    from p2ptrain.config import load_config
    from p2ptrain.status import print_status

    overrides = network_overrides(kwargs)
    overrides["network.client_mode"] = True
    if run_id:
        overrides["run.run_id"] = run_id
    config = load_config(None, overrides)
    if not run_id:  # the run the address serves, as its join line names no run id
        from p2ptrain.manifest import served_run_id
        from p2ptrain.net.admission import Admission

        Admission.from_config(config.network, config.run.run_id)  # a bad key file fails before any network I/O
        served = served_run_id(config, split_peers(initial_peers))
        config = load_config(None, {**overrides, "run.run_id": served}) if served else config
    if serve_port is not None:
        from p2ptrain.status_page import StatusPage

        page = StatusPage(config, split_peers(initial_peers), serve_host, serve_port, every_s or 5.0)
        install_stop_handlers(stop.set)
        click.echo(f"Status page of run {config.run.run_id!r}: {page.url} (Ctrl-C stops it)")
        sys.stdout.flush()
        try:
            stop.wait()
        finally:
            page.stop()
        return
    print_status(config, split_peers(initial_peers), as_json, every_s, count, stop)


@cli.command()
@click.option("--model", help="Model preset (tiny, small, base), local directory, or hub id with config.json cached.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="The peer's YAML or TOML config.")
@click.option("--gpu-gb", multiple=True, type=float, help="A GPU's memory in GB as on the card; repeat for several "
                                                          "(default: this machine's device).")
@click.option("--device", default="auto", type=click.Choice(["auto", "cpu", "cuda", "mps"]),
              help="Without --gpu-gb: which local device to plan for.")
@click.option("--host-gb", type=float, help="Host memory in GB (default: this machine's).")
@click.option("--batch-size", type=int, help="Samples per inner step (data.batch_size).")
@click.option("--seq-len", type=int, help="Tokens per sample (data.seq_len).")
@click.option("--micro-batches", type=int, help="Parts a step's batch is split into (inner.micro_batches).")
@click.option("--checkpointing/--no-checkpointing", "activation_checkpointing", default=None,
              help="Activation checkpointing (inner.activation_checkpointing).")
@click.option("--precision", type=click.Choice(PRECISIONS), help="inner.precision.")
@click.option("--state-device", type=click.Choice(STATE_DEVICES), help="outer.state_device.")
@click.option("--sync", type=click.Choice(SYNC_MODES), help="Outer sync mode (sync.mode).")
@click.option("--peers", default=4, show_default=True, type=int, help="Peers in an all-reduce round.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plan(model: str | None, config_path: str | None, gpu_gb: tuple[float, ...], device: str, host_gb: float | None,
         sync: str | None, peers: int, as_json: bool, **settings: Any) -> None:
    """Print the memory a peer needs per device and host, what fits, and the settings that would make it fit."""
    from p2ptrain.config import load_config
    from p2ptrain.memory.plan import settings_of
    from p2ptrain.memory.report import PlanRequest, override_settings, plan_text

    request = PlanRequest(gpu_gb, device, host_gb, peers)
    overrides = {key: value for key, value in (("model.name", model), ("sync.mode", sync)) if value is not None}
    config = load_config(config_path, overrides)
    click.echo(plan_text(config, override_settings(settings_of(config), settings), request, as_json))


@cli.command()
@click.argument("paths", nargs=-1, metavar="[CHECKPOINT] OUT")
@click.option("--from-swarm", "initial_peers", multiple=True, metavar="ADDR",
              help="Take the swarm's current model from the run at ADDR instead of a checkpoint (as a joiner takes "
                   "a state: corroborated by other peers).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="With --from-swarm: a config for a run whose address serves no manifest, and local settings.")
@click.option("--dataset", default=None, help="With --from-swarm, a run on a local dataset: your copy of it (its "
                                              "validation documents check the state taken).")
@network_options
def export(paths: tuple[str, ...], initial_peers: tuple[str, ...], config_path: str | None, dataset: str | None,
           **kwargs: Any) -> None:
    """Write CHECKPOINT's model (a checkpoint directory, or a --checkpoint-dir for its latest), or with --from-swarm
    the run's current model, to OUT as a Hugging Face model directory: config, weights and tokenizer, loadable with
    AutoModelForCausalLM.from_pretrained."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    if len(paths) != (1 if initial_peers else 2):
        raise click.UsageError("export takes CHECKPOINT OUT, or OUT with --from-swarm ADDR")
    out = paths[-1]
    if initial_peers:
        from p2ptrain.config import explicit_settings, load_config
        from p2ptrain.export import export_from_swarm
        from p2ptrain.manifest import join_run

        peers = split_peers(initial_peers)
        overrides = network_overrides(kwargs)
        if dataset:
            overrides["data.dataset"] = dataset
        config, manifest = join_run(load_config(config_path, overrides), explicit_settings(config_path, overrides),
                                    peers)
        exported, taken = export_from_swarm(config, peers, out, manifest)
        click.echo(f"{taken} of {exported.config.model.name!r} written to {out}: "
                   f"AutoModelForCausalLM.from_pretrained({out!r}) loads it")
        return
    if dataset or config_path or any(value for value in kwargs.values()):
        raise click.UsageError("--dataset, --config and the network options go with --from-swarm")
    from p2ptrain.export import export_checkpoint

    exported = export_checkpoint(paths[0], out)
    click.echo(f"round {exported.round} of {exported.config.model.name!r} written to {out}: "
               f"AutoModelForCausalLM.from_pretrained({out!r}) and AutoTokenizer.from_pretrained({out!r}) load it")


@cli.command()
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.option("--prompt", required=True, help="The text to continue.")
@click.option("--tokens", default=200, show_default=True, type=click.IntRange(1, 4096), help="Tokens to generate.")
@click.option("--temperature", default=0.8, show_default=True, type=click.FloatRange(0, 10),
              help="Sampling temperature; 0 is greedy.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the sampling.")
def sample(checkpoint: str, prompt: str, tokens: int, temperature: float, seed: int) -> None:
    """Print PROMPT continued by the model of CHECKPOINT (a checkpoint directory or a --checkpoint-dir)."""
    from p2ptrain.export import load_exportable, sample_text

    click.echo(sample_text(load_exportable(checkpoint), prompt, tokens, temperature, seed))


@cli.command()
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="Private key file to write (mode 0600); the public key goes to OUT.pub.")
def keygen(out_path: str) -> None:
    """Organiser: make the key pair of a signed run (keep the key, give peers the .pub)."""
    from p2ptrain.net.admission import generate_organiser_key

    private_path, public_path = generate_organiser_key(out_path)
    click.echo(f"organiser key: {private_path} (keep it private)\npublic key: {public_path} (every peer and "
               f"bootstrap of the run: --admission signed --organiser-key {public_path})")


@cli.command()
@click.argument("peer_id")
@click.option("--key", "key_path", required=True, type=click.Path(dir_okay=False),
              help="The organiser's private key file (from `p2ptrain keygen`).")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Ticket file to write.")
@click.option("--run-id", default=None, help="Run the ticket admits to (default from config).")
def admit(peer_id: str, key_path: str, out_path: str, run_id: str | None) -> None:
    """Organiser: write the ticket that admits PEER_ID (as the volunteer's peer printed it) to a signed run."""
    from p2ptrain.config import load_config
    from p2ptrain.net.admission import admit_peer

    run = load_config(None, {"run.run_id": run_id} if run_id else {}).run.run_id
    admit_peer(key_path, run, peer_id, out_path)
    click.echo(f"ticket for {peer_id} in run {run!r}: {out_path} (the peer passes --admission-ticket {out_path})")


@cli.command()
@click.option("--peers", "num_peers", default=None, type=click.IntRange(1, 32),
              help="Training peers to start (default 4, or the scenario's).")
@click.option("--rounds", default=None, type=click.IntRange(min=1), help="Rounds each peer runs.")
@click.option("--model", default=None, help="Model preset for every peer.")
@click.option("--sync", default=None, type=click.Choice(SYNC_MODES), help="Outer sync of every peer (loopback).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Config file for every peer.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Where logs and metrics go (default: a temp dir).")
@click.option("--timeout", "timeout_s", default=900, show_default=True, type=click.IntRange(min=10),
              help="Seconds before the testnet gives up.")
@click.option("--backend", default="loopback", show_default=True, type=click.Choice(["loopback", "netns", "docker"]),
              help="loopback: processes on 127.0.0.1; netns: one network namespace per host (root); docker: one "
                   "container of the real images per host.")
@click.option("--bandwidth", default=None, help="netns/docker: per-peer rates, e.g. 50mbit,50mbit,5mbit (or one for "
                                                "all).")
@click.option("--scenario", "scenario_path", type=click.Path(dir_okay=False), help="netns/docker: scenario YAML file.")
@click.option("--duration", "duration_s", type=click.FloatRange(min=1), help="netns/docker: run this many seconds.")
@click.option("--report", "report_dir", type=click.Path(file_okay=False), help="netns/docker: where the report goes.")
@click.option("--status-page/--no-status-page", default=True, show_default=True,
              help="The bootstrap serves the run's status page, and the testnet prints how to read it.")
@click.option("--peer-image", default="p2ptrain-peer:latest", show_default=True, help="docker: the peer image.")
@click.option("--bootstrap-image", default="p2ptrain-bootstrap:latest", show_default=True,
              help="docker: the bootstrap image.")
def testnet(backend: str, bandwidth: str | None, scenario_path: str | None, duration_s: float | None,
            report_dir: str | None, peer_image: str, bootstrap_image: str, **kwargs: Any) -> None:
    """Start a bootstrap and N peers, train, and print a summary; exit 1 if training did not happen."""
    if backend in ("netns", "docker"):
        from p2ptrain.testnet.engine import ScenarioOptions

        if kwargs.pop("sync"):
            raise click.UsageError("--sync is for the loopback backend; set sync.mode in --config or the scenario")
        options = ScenarioOptions(bandwidth=bandwidth, scenario_path=scenario_path, duration_s=duration_s,
                                  report_dir=report_dir, **kwargs)
        if backend == "netns":
            from p2ptrain.testnet.netns_run import run_netns_testnet

            ok = run_netns_testnet(options)
        else:
            from p2ptrain.testnet.docker_run import run_docker_testnet

            ok = run_docker_testnet(options, peer_image, bootstrap_image)
    else:
        from p2ptrain.testnet.loopback import TestnetOptions, run_testnet

        if bandwidth or scenario_path or duration_s or report_dir:
            raise click.UsageError("--bandwidth, --scenario, --duration and --report need --backend netns or docker")
        kwargs["num_peers"] = kwargs["num_peers"] or 4
        ok = run_testnet(TestnetOptions(**kwargs))
    sys.exit(0 if ok else 1)


def main() -> None:
    """Entry point: one line and exit 2 for user mistakes (bad flags, config, files, unreachable peers)."""
    run_command(cli)


if __name__ == "__main__":
    main()
