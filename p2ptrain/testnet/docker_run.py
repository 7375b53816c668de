"""`p2ptrain testnet --backend docker`: the scenario engine (``engine.py``) on hosts that are Docker containers.

Every host is a network namespace held by a small container (``tini -- sleep infinity`` in the peer image) on a
bridge network of the run's own, ``10.214.N.0/24``, at a fixed address; each life of the host's process is a
container of the real images (``docker/Dockerfile.peer``, ``docker/Dockerfile.bootstrap``, through their
entrypoints) in that namespace (``--network container:``). So, as on the netns testbed, a killed peer's address
stays and answers with a reset, and its shaping and routes outlive it. The run's workdir is mounted at the same path
in every container, so metrics and checkpoints land where the engine reads them. Links are shaped with tbf both ways:
upload on the host's eth0 (by the peer image's entrypoint from ``P2PTRAIN_RATE_MBIT``, and ``tc`` in the namespace
for a rate change), download on the namespace's veth on the Docker host. A partition is a blackhole route to every
host of the other side in each namespace (addresses stay, as on the netns switch); a stop is ``docker pause`` (the
cgroup freezer: every process of the peer, like SIGSTOP to its group). Containers and the network carry the label
``p2ptrain.testnet=<prefix>``; teardown removes them, a guard process does if the launcher is killed, and
``python -m p2ptrain.testnet.docker_run --cleanup`` removes leftovers by hand.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from p2ptrain.errors import ConfigError, UserError
from p2ptrain.testnet.engine import PORT, HostControl, ScenarioOptions, prepare_run, run_scenario
from p2ptrain.testnet.hosttools import check_rate, child_env, process_start_ticks, run_tool, tbf_args, wait_for_exit
from p2ptrain.testnet.loopback import RED_TEAM
from p2ptrain.testnet.plan import RunPlan
from p2ptrain.timing import SLOW_POLL_S

LABEL = "p2ptrain.testnet"
PEER_IMAGE = "p2ptrain-peer:latest"  # the tags docker/docker-compose.yml builds
BOOTSTRAP_IMAGE = "p2ptrain-bootstrap:latest"
SUBNET_SPACE = "10.214"  # networks 10.214.N.0/24; host i of a run is .i+2 (.1 is the bridge)
EXITED = ("exited", "dead")


def docker(*args: str, check: bool = True) -> str:
    """``docker ARGS``'s stdout; a failure is a one-line UserError naming the command."""
    return run_tool(["docker", *args], check=check).stdout.strip()


def require_docker() -> None:
    """A one-line UserError unless the docker CLI is installed and its engine answers."""
    if shutil.which("docker") is None:
        raise UserError("`docker` not found: install Docker (e.g. apt-get install docker.io) and start dockerd")
    done = run_tool(["docker", "version", "--format", "{{.Server.Version}}"], check=False)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no answer"])[-1]
        raise UserError(f"the Docker engine does not answer ({reason}): start dockerd, or run as a user in the "
                        f"docker group")


def signal_from_exit(code: int) -> int:
    """A container's exit code as Popen reports a process's: 128 + N (tini: its child died of signal N) is -N."""
    return -(code - 128) if 128 < code < 128 + signal.NSIG else code


class DockerHosts:
    """Hosts as containers on one bridge network; each host runs one container at a time (one life)."""

    kind = "docker"
    poll_s = SLOW_POLL_S  # every look costs a `docker ps`

    def __init__(self, name_prefix: str, workdir: Path, rates_mbit: Mapping[str, float | None],
                 peer_image: str = PEER_IMAGE, bootstrap_image: str = BOOTSTRAP_IMAGE):
        if not name_prefix.replace("-", "").isalnum() or len(name_prefix) > 24:
            raise ConfigError(f"docker testnet prefix {name_prefix!r}: use 1-24 letters, digits or '-'")
        for rate in rates_mbit.values():
            check_rate(rate)
        self.prefix, self.workdir = name_prefix, workdir
        self.rates = dict(rates_mbit)
        self.index = {host: i for i, host in enumerate(rates_mbit)}
        self.images = {"peer": peer_image, "bootstrap": bootstrap_image}
        self.subnet = ""
        self.containers: dict[str, str] = {}  # host -> its current container's name
        self.exit_codes: dict[str, int] = {}  # container -> exit code, once it has exited
        self.lives: dict[str, int] = {}  # host -> containers started so far
        self.partition: set[str] | None = None  # the cut-off side while a partition holds (routes in the namespaces)
        self.guard: subprocess.Popen[bytes] | None = None

    def create(self) -> None:
        require_docker()
        for image in self.images.values():
            if run_tool(["docker", "image", "inspect", image], check=False).returncode != 0:
                raise UserError(f"image {image} not found: build it (docker compose -f docker/docker-compose.yml "
                                f"build), or name yours with --peer-image/--bootstrap-image")
        self._start_guard()
        self._create_network()
        for host in self.index:
            docker("run", "--detach", "--name", self._holder(host), "--hostname", host, "--label",
                   f"{LABEL}={self.prefix}", "--network", self.prefix, "--ip", self.address(host), "--cap-add",
                   "NET_ADMIN", "--entrypoint", "tini", self.images["peer"], "--", "sleep", "infinity")
            self._shape(host)

    def _create_network(self) -> None:
        first = os.getpid() % 200
        for n in [(first + k) % 250 for k in range(20)]:
            done = run_tool(["docker", "network", "create", "--driver", "bridge", "--label", f"{LABEL}={self.prefix}",
                             "--subnet", f"{SUBNET_SPACE}.{n}.0/24", self.prefix], check=False)
            if done.returncode == 0:
                self.subnet = f"{SUBNET_SPACE}.{n}."
                return
            if "overlap" not in done.stderr:
                raise UserError(f"`docker network create {self.prefix}` failed: {done.stderr.strip()}")
        raise UserError(f"no free subnet in {SUBNET_SPACE}.0.0/16 for the testnet network")

    def _start_guard(self) -> None:
        argv = [sys.executable, "-m", "p2ptrain.testnet.docker_run", "--guard", self.prefix, str(os.getpid()),
                str(process_start_ticks(os.getpid()))]
        quiet = subprocess.DEVNULL
        self.guard = subprocess.Popen(argv, env=child_env(), start_new_session=True, stdin=quiet, stdout=quiet,
                                      stderr=quiet)

    def _holder(self, host: str) -> str:
        """The container that holds the host's network namespace for the whole run."""
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{self.subnet}{self.index[host] + 2}"

    def shell_prefix(self, host: str) -> list[str]:
        return ["docker", "exec", self._holder(host)]  # the peer image, in the host's network for the whole run

    def start(self, host: str, command: str, args: list[str], log: Path) -> int:
        self.lives[host] = self.lives.get(host, 0) + 1
        name = f"{self._holder(host)}-{self.lives[host]}"
        env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "P2PTRAIN_HOST_MADDRS": f"/ip4/{self.address(host)}/tcp/"
               f"{PORT}"}
        if command in ("peer", RED_TEAM) and self.rates[host] is not None:
            env["P2PTRAIN_RATE_MBIT"] = f"{self.rates[host]:g}"  # the entrypoint shapes the upload (again)
        if command == RED_TEAM:
            env["P2PTRAIN_RED_TEAM"] = "1"  # the peer image's entrypoint runs the red team's peer
        image = self.images["peer" if command == RED_TEAM else command]
        docker("run", "--detach", "--name", name, "--label", f"{LABEL}={self.prefix}", "--network",
               f"container:{self._holder(host)}", "--cap-add", "NET_ADMIN", "--volume",
               f"{self.workdir}:{self.workdir}", *[f"--env={k}={v}" for k, v in env.items()], image, *args)
        self.containers[host] = name
        return int(docker("inspect", "--format", "{{.State.Pid}}", name) or 0)

    def refresh(self) -> None:
        listed = docker("ps", "--all", "--filter", f"label={LABEL}={self.prefix}", "--format",
                        "{{.Names}} {{.State}}")
        states = dict(line.split(" ", 1) for line in listed.splitlines() if " " in line)
        for host, name in self.containers.items():
            if name not in self.exit_codes and states.get(name, "exited") in EXITED:
                code = docker("inspect", "--format", "{{.State.ExitCode}}", name, check=False)
                self.exit_codes[name] = signal_from_exit(int(code)) if code.lstrip("-").isdigit() else -9
                self._keep_logs(host, name)

    def _keep_logs(self, host: str, name: str) -> None:
        """Append a finished container's output to the host's log file, then remove the container."""
        with open(self.workdir / f"{host}.log", "ab") as out:
            subprocess.run(["docker", "logs", name], stdout=out, stderr=subprocess.STDOUT, check=False)
        docker("rm", "--force", name, check=False)

    def exit_code(self, host: str) -> int | None:
        return self.exit_codes.get(self.containers[host])

    def signal(self, host: str, sig: signal.Signals) -> None:
        name = self.containers[host]
        if sig != signal.SIGKILL:
            docker("unpause", name, check=False)  # fails harmlessly when it is not paused
        if sig != signal.SIGCONT:
            docker("kill", "--signal", sig.name, name, check=False)  # tini passes it on to p2ptrain

    def pause(self, host: str, pause: bool) -> None:
        docker("pause" if pause else "unpause", self.containers[host])

    def set_rate(self, host: str, rate_mbit: float | None) -> None:
        check_rate(rate_mbit)
        self.rates[host] = rate_mbit
        self._shape(host)

    def _shape(self, host: str) -> None:
        """tbf on the namespace's eth0 (upload) and on its veth's end on the Docker host (download)."""
        rate, holder = self.rates[host], self._holder(host)
        iflink = docker("exec", holder, "cat", "/sys/class/net/eth0/iflink")
        veth = next((p.name for p in Path("/sys/class/net").iterdir()
                     if (p / "ifindex").read_text().strip() == iflink), None)
        if veth is None:
            raise UserError(f"cannot find the host end of {host}'s veth (ifindex {iflink})")
        if rate is None:
            docker("exec", holder, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
            run_tool(["tc", "qdisc", "del", "dev", veth, "root"], check=False)  # fails harmlessly when unshaped
        else:
            docker("exec", holder, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", *tbf_args(rate))
            run_tool(["tc", "qdisc", "replace", "dev", veth, "root", "tbf", *tbf_args(rate)])

    def cut_partition(self, group: list[str]) -> None:
        self.partition = set(group)
        for host in self.index:
            self._route(host, cut=True)

    def heal_partition(self) -> None:
        for host in self.index:
            self._route(host, cut=False)
        self.partition = None

    def _route(self, host: str, cut: bool) -> None:
        """Add (or remove) a blackhole route to every host on the other side of the partition."""
        side = host in (self.partition or set())
        others = [self.address(h) for h in self.index if (h in (self.partition or set())) != side]
        if not others:
            return
        script = "; ".join(f"ip route {'replace' if cut else 'del'} blackhole {address}/32" for address in others)
        docker("exec", self._holder(host), "sh", "-c", script + ("" if cut else "; true"))

    def teardown(self) -> None:
        for host, name in self.containers.items():
            if name not in self.exit_codes:
                docker("kill", name, check=False)
                self._keep_logs(host, name)
        cleanup(self.prefix)
        if self.guard is not None:
            self.guard.kill()
            self.guard.wait()
            self.guard = None


def cleanup(prefix: str | None = None) -> list[str]:
    """Remove the containers and networks of one testnet (or of all); return their names."""
    label = f"label={LABEL}" + (f"={prefix}" if prefix else "")
    containers = docker("ps", "--all", "--quiet", "--filter", label, check=False).split()
    networks = docker("network", "ls", "--quiet", "--filter", label, check=False).split()
    if containers:
        docker("rm", "--force", "--volumes", *containers, check=False)
    if networks:
        docker("network", "rm", *networks, check=False)
    return containers + networks


def require_docker_for(plan: RunPlan) -> None:
    """The Docker engine, for a scenario it can run: NAT homes (routers) exist on the netns backend only."""
    if plan.homes:
        raise UserError(f"the docker backend has no NAT routers: run this scenario (nat: {', '.join(plan.homes)}) "
                        f"with --backend netns")
    require_docker()


def run_docker_testnet(options: ScenarioOptions, peer_image: str = PEER_IMAGE,
                       bootstrap_image: str = BOOTSTRAP_IMAGE) -> bool:
    """Run a scenario on containers of the real images; True when every check passed."""
    plan, workdir, rates = prepare_run(options, require_docker_for)
    hosts: HostControl = DockerHosts(options.name_prefix or f"tn{os.getpid()}", workdir, rates,
                                     peer_image, bootstrap_image)
    return run_scenario(options, hosts, plan, workdir, rates, f"in Docker containers ({peer_image})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.testnet.docker_run", description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--cleanup", action="store_true", help="remove every testnet container and network left over")
    group.add_argument("--guard", nargs=3, metavar=("PREFIX", "OWNER_PID", "OWNER_TICKS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.guard:
            wait_for_exit(int(args.guard[1]), int(args.guard[2]))
            cleanup(args.guard[0])
            return 0
        require_docker()
        removed = cleanup()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"removed {len(removed)} container(s) and network(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
