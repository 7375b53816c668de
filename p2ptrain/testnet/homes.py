"""Home networks for the namespace testbed: hosts behind a NAT router that accepts no inbound connection.

A home is a router namespace ``p2pt-<prefix>-r<k>``: its ``wan0`` sits on the testbed's public switch (bridge
``brA``, switch port ``w<k>``) with a public address, its bridge ``lan`` holds the home's hosts (router port
``l<i>`` for host ``i``) on their own subnet ``10.213.<k+1>.0/24`` (router ``.1``, hosts ``.2``, ``.3``, ...), and
the hosts route everything through it. The router forwards connections that start at home, rewriting their source
to its own public address (``iptables -t nat ... MASQUERADE``), lets back only the packets of connections so
established, and drops the rest: a public host connecting to the router's address gets a reset (nothing listens
there), one connecting to a home address finds no route, as on the internet. Hosts of one home reach each other on
their LAN. A home host's upload is shaped on its ``eth0``, its download on its router port ``l<i>``.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence

from p2ptrain.errors import UserError
from p2ptrain.testnet.hosttools import run_tool

LAN_PREFIX = "10.213."  # home k's LAN is 10.213.<k+1>.0/24; the public switch is 10.213.0.0/24 (netns.py)
MAX_HOMES = 250


@dataclasses.dataclass(frozen=True)
class Home:
    """One NAT router and the hosts behind it (by their index in the testbed)."""

    name: str
    index: int  # k: router namespace r<k>, switch port w<k>, LAN 10.213.<k+1>.0/24
    namespace: str
    wan_address: str  # the router's public address: what every connection from this home appears to come from
    members: tuple[int, ...]

    @property
    def lan_gateway(self) -> str:
        return f"{LAN_PREFIX}{self.index + 1}.1"

    def lan_address(self, host_index: int) -> str:
        return f"{LAN_PREFIX}{self.index + 1}.{self.members.index(host_index) + 2}"

    @property
    def switch_port(self) -> str:
        return f"w{self.index}"


def plan_homes(namespace_prefix: str, hosts: Sequence[tuple[int, str | None]],
               public_address: dict[int, str]) -> dict[str, Home]:
    """Homes by name, in order of first appearance; each router takes the public address of its first member.
    `hosts`: (index, home name or None) of every host; `public_address`: index → its address on the switch."""
    members: dict[str, list[int]] = {}
    for index, home in hosts:
        if home is not None:
            members.setdefault(home, []).append(index)
    if len(members) > MAX_HOMES:
        raise UserError(f"{len(members)} home networks: at most {MAX_HOMES}")
    return {name: Home(name, k, f"{namespace_prefix}-r{k}", public_address[indices[0]], tuple(indices))
            for k, (name, indices) in enumerate(members.items())}


def require_nat_support() -> None:
    """A one-line UserError unless `iptables` is installed (Debian's, on the nft backend, works in namespaces)."""
    if shutil.which("iptables") is None:
        raise UserError("home networks (NAT) need iptables: install it (apt-get install iptables)")


def build_router(home: Home, switch_namespace: str) -> None:
    """Wire the router's WAN port to the public switch, make its LAN bridge, and turn on NAT and the firewall."""
    sw, rt = ["ip", "-n", switch_namespace, "link"], ["ip", "-n", home.namespace]
    run_tool(sw + ["add", home.switch_port, "type", "veth", "peer", "name", "wan0", "netns", home.namespace])
    run_tool(sw + ["set", home.switch_port, "master", "brA", "up"])
    run_tool(rt + ["addr", "add", f"{home.wan_address}/24", "dev", "wan0"])
    run_tool(rt + ["link", "set", "wan0", "up"])
    run_tool(rt + ["link", "add", "lan", "type", "bridge", "forward_delay", "0", "stp_state", "0"])
    run_tool(rt + ["addr", "add", f"{home.lan_gateway}/24", "dev", "lan"])
    run_tool(rt + ["link", "set", "lan", "up"])
    in_router = ["ip", "netns", "exec", home.namespace]
    run_tool(in_router + ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
    for rule in (["-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE"],
                 ["-P", "FORWARD", "DROP"],
                 ["-A", "FORWARD", "-i", "lan", "-o", "wan0", "-j", "ACCEPT"],
                 ["-A", "FORWARD", "-i", "lan", "-o", "lan", "-j", "ACCEPT"],  # bridged LAN traffic (br_netfilter)
                 ["-A", "FORWARD", "-i", "wan0", "-o", "lan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                  "-j", "ACCEPT"]):
        run_tool(in_router + ["iptables", *rule])


def attach_host(home: Home, host_index: int, host_namespace: str) -> None:
    """Plug a host into its home's LAN (router port l<i>, host eth0) with a default route through the router."""
    port = f"l{host_index}"
    rt = ["ip", "-n", home.namespace, "link"]
    run_tool(rt + ["add", port, "type", "veth", "peer", "name", "eth0", "netns", host_namespace])
    run_tool(rt + ["set", port, "master", "lan", "up"])
    in_host = ["ip", "-n", host_namespace]
    run_tool(in_host + ["addr", "add", f"{home.lan_address(host_index)}/24", "dev", "eth0"])
    run_tool(in_host + ["link", "set", "eth0", "up"])
    run_tool(in_host + ["route", "add", "default", "via", home.lan_gateway])
