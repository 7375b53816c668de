"""`p2ptrain testnet --backend netns`: the scenario engine (``engine.py``) on hosts in network namespaces.

Each host gets a namespace, an address and a tbf-shaped link (``p2ptrain.testnet.netns.Testbed``); this module only
starts ``p2ptrain`` processes inside them and signals them. Every process started here lives inside a testbed
namespace, so deleting the namespaces (teardown, or the testbed's guard if the launcher is killed) also kills them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path

from p2ptrain.testnet.engine import PORT, HostControl, ScenarioOptions, merged_peer_config, prepare_run, run_scenario
from p2ptrain.testnet.forkserver import ForkedProcess, ForkServer, kept_server
from p2ptrain.testnet.homes import require_nat_support
from p2ptrain.testnet.hosttools import process_env
from p2ptrain.testnet.loopback import cli_module
from p2ptrain.testnet.netns import HostSpec, Testbed, require_netns_support
from p2ptrain.testnet.plan import RunPlan
from p2ptrain.testnet.scenario import BOOTSTRAP
from p2ptrain.timing import POLL_S

__all__ = ["PORT", "NetnsHosts", "NetnsTestnetOptions", "merged_peer_config", "run_netns_testnet"]

NetnsTestnetOptions = ScenarioOptions  # the name callers of the netns backend know
# The bootstrap's nice value. A real one is the organiser's own machine; here it shares 2 cores with every peer, and
# with 32 peers starting at once it answered no join within 120 s in 1 of 4 runs of swarm32.yaml
BOOTSTRAP_NICE = -5


class NetnsHosts:
    """Hosts as network namespaces of one ``Testbed``, each running one ``p2ptrain`` process (and its children),
    forked from one ``ForkServer`` that imported the peer's libraries once (forkserver.py)."""

    kind = "netns"
    poll_s = POLL_S

    def __init__(self, name_prefix: str, workdir: Path, rates_mbit: Mapping[str, float | None],
                 homes: Mapping[str, str] | None = None):
        self.workdir = workdir
        specs = [HostSpec(host, rate, (homes or {}).get(host)) for host, rate in rates_mbit.items()]
        self.testbed = Testbed(name_prefix, specs)
        self.procs: dict[str, ForkedProcess] = {}  # the current process of each host
        self.server: ForkServer | None = None

    def create(self) -> None:
        # started first (unless this process keeps one already): its imports overlap the building of the namespaces
        self.server = kept_server(process_env())
        self.testbed.create()

    def teardown(self) -> None:
        self.testbed.teardown()  # stops every process forked for the run; the server stays for the next
        self.server = None

    def address(self, host: str) -> str:
        return self.testbed.address(host)

    def shell_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.testbed.namespace(host)]

    def start(self, host: str, command: str, args: list[str], log: Path) -> int:
        assert self.server is not None, "create() first"
        module, module_args = cli_module(command, *args, "--host-maddrs", f"/ip4/{self.address(host)}/tcp/{PORT}")
        proc = self.testbed.fork(host, self.server, module, module_args, log)
        if host == BOOTSTRAP:  # its DHT process and p2pd, started later, inherit it
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, proc.pid, BOOTSTRAP_NICE)
        self.procs[host] = proc
        (self.workdir / "processes.json").write_text(json.dumps({h: p.pid for h, p in self.procs.items()}))
        return proc.pid

    def refresh(self) -> None:
        """Nothing to do: ``exit_code`` asks the kernel directly."""

    def exit_code(self, host: str) -> int | None:
        return self.procs[host].poll()

    def signal(self, host: str, sig: signal.Signals) -> None:
        """SIGKILL the whole process group; otherwise wake the group and signal the main process only.

        A SIGTERM to the group would also kill hivemind's DHT and averager child processes, and the peer would
        then hang on its next DHT call instead of stopping cleanly.
        """
        proc = self.procs[host]
        if sig == signal.SIGKILL:
            _signal_group(proc, sig)
            return
        _signal_group(proc, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)

    def pause(self, host: str, pause: bool) -> None:
        _signal_group(self.procs[host], signal.SIGSTOP if pause else signal.SIGCONT)

    def set_rate(self, host: str, rate_mbit: float | None) -> None:
        self.testbed.set_rate(host, rate_mbit)

    def cut_partition(self, group: list[str]) -> None:
        self.testbed.cut_partition(group)

    def heal_partition(self) -> None:
        self.testbed.heal_partition()


def _signal_group(proc: ForkedProcess, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def require_support(plan: RunPlan) -> None:
    """Root, iproute2, and iptables when the scenario puts peers behind NAT (one-line UserErrors)."""
    require_netns_support()
    if plan.homes:
        require_nat_support()


def run_netns_testnet(options: ScenarioOptions) -> bool:
    """Run a scenario on a namespace testbed; True when every check passed. Needs root (one-line UserError)."""
    plan, workdir, rates = prepare_run(options, require_support)
    hosts: HostControl = NetnsHosts(options.name_prefix or f"tn{os.getpid()}", workdir, rates, plan.homes)
    return run_scenario(options, hosts, plan, workdir, rates, "in network namespaces")
