"""Peers behind NAT on the netns testbed, side by side in one run (root only):

1. one push-pull exchange (S bytes each way), direct (public to public, home to public: the NATed end opens) and
   through a relay (home to home), on links shaped to --rate-mbit: seconds and goodput per payload size;
2. a relay under load: two pairs of home peers exchanging 4 MB payloads through one relay (its link 2.5 × theirs)
   non-stop, with its rate limit off and on (network.relay_mbit): what the relay passes per second, and meanwhile
   a direct 1 MB exchange between an unshaped public host and the relay's host (its own traffic: is the relay's
   link saturated?);
3. the round time of a DiLoCo swarm (3 peers, the small model) with 0, 1/3 and 2/3 of its peers behind NAT.

    sudo python benchmarks/nat.py [--rate-mbit 20] [--quick]

Prints a table and writes JSON and Markdown to benchmarks/results/nat.*. Exchanges in parts 1 and 2 are our
production push-pull (net/exchange.py) and relay (net/relay.py), between p2pd daemons in the testbed's namespaces;
part 3 is the testnet engine (every peer a `p2ptrain peer` process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

RESULTS = Path(__file__).resolve().parent / "results"
PORT = 4101
SIZES = (256 * 1024, 2 * 2**20, 8 * 2**20)
LOAD_BYTES, PROBE_BYTES = 4 * 2**20, 2**20


# ---- workers: one per testbed host, `python benchmarks/nat.py --worker ROLE ...` inside its namespace -----------

class Echo:
    """An exchange handler that answers any offer with a payload of the same size (and mixes nothing)."""

    namespace, max_payload_bytes, chunk_timeout_s = "bench.echo", 2**28, 60.0

    def __init__(self) -> None:
        from p2ptrain.net.reputation import Reputation

        self.reputation = Reputation()

    def open(self, header: dict[str, Any]) -> Any:
        nbytes = int(header.get("nbytes", 0))

        class Answer:
            header: dict[str, Any] = {}
            payload = payload_of(nbytes)

            def validate(self, _header: dict[str, Any], _payload: Any) -> Any:
                return lambda: None

            def close(self) -> None:
                pass

        return Answer()


def payload_of(nbytes: int) -> list[Any]:
    import torch
    from hivemind.compression import serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    return [serialize_torch_tensor(torch.zeros(max(1, nbytes // 4)), runtime_pb2.CompressionType.NONE)]


async def worker(role: str, workdir: Path, name: str, address: str, args: list[str]) -> None:
    """relay [BYTES_PER_S] | {peer|probe|load} {nat|pub} ARGS...: serve echoes (and relay; a NATed peer takes a
    slot), then measure (probe, load), until the launcher says stop."""
    from hivemind.p2p import P2P

    from p2ptrain.net import relay
    from p2ptrain.net.exchange import serve_exchanges

    boot = [] if role == "relay" else [(workdir / "relay.maddr").read_text().strip()]
    p2p = await P2P.create(initial_peers=boot, host_maddrs=[f"/ip4/{address}/tcp/{PORT}"], nat_port_map=False,
                           auto_nat=False, use_relay=False)
    entry = relay.RelayEntry()
    await entry.add_p2p_handlers(p2p, namespace=relay.NAMESPACE)
    await serve_exchanges(p2p, Echo(), entry)
    server = None
    if role == "relay":
        rate = float(args[0]) if args else 1e12
        server = relay.RelayServer(p2p, relay.NAMESPACE, relay.RelayLimits(bytes_per_s=rate, lease_s=30))
        await server.add_p2p_handlers(p2p, namespace=relay.NAMESPACE)
        (workdir / "relay.maddr").write_text(str((await p2p.get_visible_maddrs())[0]))
    elif args.pop(0) == "nat":
        relay_id = boot[0].rsplit("/p2p/", 1)[1]
        lease_s = await relay.take_slot(p2p, relay_id, relay.NAMESPACE, 30)
        entry.relays = {relay_id}
        renewing = asyncio.create_task(renew_slot(p2p, relay_id, lease_s))  # noqa: F841 (runs until shutdown)
    (workdir / f"{name}.id").write_text(p2p.peer_id.to_base58())
    if role in ("probe", "load"):
        results = await measure(p2p, workdir, role, args)
        (workdir / f"{name}.json").write_text(json.dumps(results))
    while not (workdir / "stop").exists():
        if server is not None:
            (workdir / "relay.json").write_text(json.dumps({"bytes": server.relayed_bytes, "t": time.monotonic()}))
        await asyncio.sleep(0.25)
    await p2p.shutdown()


async def renew_slot(p2p: Any, relay_id: str, lease_s: float) -> None:
    """Renew our relay slot every third of its lease, as a peer's presence loop does (a slot taken once lapses
    after its lease: a full run's first section outlasts it)."""
    from p2ptrain.net import relay

    while True:
        await asyncio.sleep(lease_s / 3)
        lease_s = await relay.take_slot(p2p, relay_id, relay.NAMESPACE, 30)


async def exchange(p2p: Any, workdir: Path, target: str, nbytes: int) -> float:
    """Seconds of one echo exchange of `nbytes` each way with host `target` ("name" or "name@relay")."""
    from hivemind.p2p import PeerID

    from p2ptrain.net import relay
    from p2ptrain.net.exchange import push_pull
    from p2ptrain.net.routes import Route

    name, _, via = target.partition("@")
    route = Route((workdir / "relay.id").read_text(), relay.NAMESPACE) if via else None
    started = time.monotonic()
    await push_pull(p2p, PeerID.from_base58((workdir / f"{name}.id").read_text()), Echo.namespace, {},
                    payload_of(nbytes), lambda h, p: lambda: None, 2**28, 120.0, route)
    return time.monotonic() - started


async def measure(p2p: Any, workdir: Path, role: str, args: list[str]) -> dict[str, Any]:
    """probe: each target × size × reps; load: TARGET SECONDS (4 MB exchanges back to back)."""
    while not (workdir / "go").exists():
        await asyncio.sleep(0.1)
    if role == "load":
        target, until, done = args[0], time.monotonic() + float(args[1]), 0
        while time.monotonic() < until:
            await exchange(p2p, workdir, target, LOAD_BYTES)
            done += 1
        return {"exchanges": done}
    reps, sizes, targets = int(args[0]), [int(s) for s in args[1].split(",")], args[2:]
    await exchange(p2p, workdir, targets[0], 1024)  # connections up before timing
    return {t: {str(s): [await exchange(p2p, workdir, t, s) for _ in range(reps)] for s in sizes} for t in targets}


# ---- the launcher -------------------------------------------------------------------------------------------------

def start(bed: Any, workdir: Path, host: str, role: str, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), GOLOG_LOG_LEVEL="error")
    argv = [sys.executable, __file__, "--worker", role, str(workdir), host, bed.address(host), *args]
    with open(workdir / f"{host}.log", "ab") as log:
        return bed.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} within {timeout_s:g} s (see the logs in {path.parent})")
        time.sleep(0.1)


def exchanges_direct_vs_relayed(rate_mbit: float, reps: int, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    """Part 1: probe from h1 (home) and from pub to the others."""
    from p2ptrain.testnet.netns import HostSpec, Testbed

    workdir = Path(tempfile.mkdtemp(prefix="nat-bench-1-"))
    hosts = [HostSpec("relay"), HostSpec("pub", rate_mbit), HostSpec("pub2", rate_mbit),
             HostSpec("h1", rate_mbit, home="a"), HostSpec("h2", rate_mbit, home="b")]
    with Testbed(f"natb1{os.getpid() % 10000}", hosts) as bed:
        start(bed, workdir, "relay", "relay")
        wait_for(workdir / "relay.maddr")
        (workdir / "relay.id").write_text((workdir / "relay.maddr").read_text().strip().rsplit("/p2p/", 1)[1])
        for host, nat in (("pub2", "pub"), ("h2", "nat")):
            start(bed, workdir, host, "peer", nat)
        size_arg = ",".join(map(str, sizes))
        start(bed, workdir, "pub", "probe", "pub", str(reps), size_arg, "pub2")
        start(bed, workdir, "h1", "probe", "nat", str(reps), size_arg, "pub2", "h2@relay")
        for host in ("pub2", "h2", "pub", "h1"):
            wait_for(workdir / f"{host}.id")
        (workdir / "go").touch()
        for host in ("pub", "h1"):
            wait_for(workdir / f"{host}.json", 600)
        (workdir / "stop").touch()
        found = {h: json.loads((workdir / f"{h}.json").read_text()) for h in ("pub", "h1")}
    paths = [("public -> public (direct)", found["pub"]["pub2"]), ("home -> public (direct, NATed end opens)",
             found["h1"]["pub2"]), ("home -> home (through the relay)", found["h1"]["h2@relay"])]
    return [{"path": path, "bytes": int(size), "seconds": statistics.median(times),
             "goodput_mbit": 2 * int(size) * 8 / statistics.median(times) / 1e6}
            for path, by_size in paths for size, times in by_size.items()]


def relay_under_load(rate_mbit: float, relay_mbit: float | None, load_s: float) -> dict[str, Any]:
    """Part 2: two home pairs through one relay (its link 2.5 × theirs), and a direct probe of the relay's host."""
    from p2ptrain.testnet.netns import HostSpec, Testbed

    workdir = Path(tempfile.mkdtemp(prefix="nat-bench-2-"))
    homes = [HostSpec(f"h{i}", rate_mbit, home=f"home{i}") for i in range(1, 5)]
    hosts = [HostSpec("relay", 2.5 * rate_mbit), HostSpec("pub"), *homes]  # the probe: the relay's link is the limit
    with Testbed(f"natb2{os.getpid() % 10000}", hosts) as bed:
        start(bed, workdir, "relay", "relay", *([str(relay_mbit * 1e6 / 8)] if relay_mbit else []))
        wait_for(workdir / "relay.maddr")
        (workdir / "relay.id").write_text((workdir / "relay.maddr").read_text().strip().rsplit("/p2p/", 1)[1])
        for host in ("h2", "h4"):
            start(bed, workdir, host, "peer", "nat")
        for host, target in (("h1", "h2@relay"), ("h3", "h4@relay")):
            start(bed, workdir, host, "load", "nat", target, str(load_s))
        start(bed, workdir, "pub", "probe", "pub", "3", str(PROBE_BYTES), "relay")
        for host in ("h1", "h2", "h3", "h4", "pub"):
            wait_for(workdir / f"{host}.id")
        before = json.loads((workdir / "relay.json").read_text())
        (workdir / "go").touch()
        for host in ("h1", "h3", "pub"):
            wait_for(workdir / f"{host}.json", 600)
        after = json.loads((workdir / "relay.json").read_text())
        (workdir / "stop").touch()
        probe = json.loads((workdir / "pub.json").read_text())["relay"][str(PROBE_BYTES)]
        done = sum(json.loads((workdir / f"{h}.json").read_text())["exchanges"] for h in ("h1", "h3"))
    seconds = after["t"] - before["t"]
    return {"relay_mbit": relay_mbit, "relayed_mbit_per_s": (after["bytes"] - before["bytes"]) * 8 / seconds / 1e6,
            "relayed_exchanges": done, "probe_s": statistics.median(probe), "window_s": seconds}


def swarm_rounds(rate_mbit: float, rounds: int, nat: list[str]) -> dict[str, Any]:
    """Part 3: a DiLoCo swarm of 3 small-model peers, `nat` of them behind NAT of their own."""
    from p2ptrain.metrics import read_metrics
    from p2ptrain.testnet.netns_run import NetnsTestnetOptions, run_netns_testnet

    workdir = Path(tempfile.mkdtemp(prefix="nat-bench-3-"))
    scenario = {"peers": 3, "rounds": rounds, "bandwidth": f"{rate_mbit:g}mbit", "nat": nat,
                "peer_config": {"model": {"name": "small", "max_seq_len": 64},
                                "data": {"seq_len": 64, "batch_size": 4, "max_corpus_bytes": 2_000_000,
                                         "num_shards": 8, "val_batches": 2},
                                "inner": {"steps": 20}, "sync": {"mode": "diloco", "matchmaking_s": 3.0},
                                "network": {"heartbeat_s": 0.5, "record_ttl_s": 5.0}},
                "checks": {"loss_fell": False}}
    (workdir / "scenario.yaml").write_text(yaml.safe_dump(scenario))
    ok = run_netns_testnet(NetnsTestnetOptions(scenario_path=str(workdir / "scenario.yaml"), workdir=str(workdir),
                                               timeout_s=600, name_prefix=f"natb3{os.getpid() % 10000}"))
    rows = [row for p in ("peer0", "peer1", "peer2") for row in read_metrics(workdir / f"{p}.jsonl")[1:]]
    return {"behind_nat": len(nat), "ok": ok, "round_s": statistics.median(r["round_s"] for r in rows),
            "blocked_s": statistics.median(r["comm_blocked_s"] for r in rows),
            "full_groups": sum(r["peers_averaged"] == 3 for r in rows) / len(rows)}


def markdown(results: dict[str, Any]) -> str:
    out = [f"# Peers behind NAT (benchmarks/nat.py, links {results['rate_mbit']:g} Mbit/s)", "",
           "## One exchange, direct and relayed", "", "| path | payload each way | seconds | goodput Mbit/s |",
           "|---|---|---|---|"]
    out += [f"| {r['path']} | {r['bytes'] / 2**20:.2f} MiB | {r['seconds']:.2f} | {r['goodput_mbit']:.1f} |"
            for r in results["exchanges"]]
    out += ["", "## One relay, two home pairs exchanging through it non-stop", "",
            "| relay limit | relayed Mbit/s | relayed exchanges | direct 1 MiB exchange with the relay host, s |",
            "|---|---|---|---|"]
    for r in results["relay"]:
        limit = "none" if r["relay_mbit"] is None else f"{r['relay_mbit']:g} Mbit/s"
        out.append(f"| {limit} | {r['relayed_mbit_per_s']:.1f} | {r['relayed_exchanges']} | {r['probe_s']:.2f} |")
    out += ["", "## DiLoCo round time (3 peers, small model)", "",
            "| peers behind NAT | median round s | median blocked s | rounds with all 3 |", "|---|---|---|---|"]
    out += [f"| {r['behind_nat']} of 3 | {r['round_s']:.2f} | {r['blocked_s']:.2f} | {r['full_groups']:.0%} |"
            for r in results["swarm"]]
    return "\n".join(out) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        role, workdir, name, address, *rest = sys.argv[2:]
        asyncio.run(worker(role, Path(workdir), name, address, rest))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=20.0, help="every home and peer link, both ways")
    parser.add_argument("--quick", action="store_true", help="fewer sizes, repetitions and rounds")
    args = parser.parse_args()
    sizes = SIZES[:2] if args.quick else SIZES
    results: dict[str, Any] = {"rate_mbit": args.rate_mbit, "started": time.time()}
    results["exchanges"] = exchanges_direct_vs_relayed(args.rate_mbit, 2 if args.quick else 3, sizes)
    results["relay"] = [relay_under_load(args.rate_mbit, limit, 8.0 if args.quick else 15.0)
                        for limit in (None, args.rate_mbit / 2)]
    rounds = 4 if args.quick else 8
    results["swarm"] = [swarm_rounds(args.rate_mbit, rounds, nat) for nat in ([], ["peer2"], ["peer1", "peer2"])]
    text = markdown(results)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "nat.json").write_text(json.dumps(results, indent=1))
    (RESULTS / "nat.md").write_text(text)


if __name__ == "__main__":
    main()
