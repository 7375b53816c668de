"""Peers at home behind NAT on the netns testbed (testnet/homes.py): a router lets connections out and none in;
GASLoC and DiLoCo train with two NATed peers whose relay is killed mid-run (they go on outbound only, or through
another relay); Factored mixes with peers behind a NAT of their own and behind a shared one; joiners behind NAT
and on the public side take their state from donors behind NAT; and a DiLoCo peer that vanishes silently (no
reset) holds the others up one exchange deadline, not tens of seconds. Needs root, iproute2 and iptables
(installed with apt-get when missing); skips with the reason otherwise."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from p2ptrain.metrics import read_metrics
from p2ptrain.testnet import netns
from p2ptrain.testnet.netns import HostSpec
from p2ptrain.testnet.netns_run import NetnsTestnetOptions, run_netns_testnet
from p2ptrain.timing import SETUP_FLOOR_S

pytestmark = [pytest.mark.netns, pytest.mark.slow]

MATCHMAKING_S = 2.0
PEER_CONFIG = {
    "model": {"name": "tiny", "max_seq_len": 64},
    "data": {"seq_len": 64, "batch_size": 4, "max_corpus_bytes": 2_000_000, "num_shards": 8, "val_batches": 2},
    "inner": {"steps": 30},
    "sync": {"matchmaking_s": MATCHMAKING_S, "allreduce_timeout_s": 30.0},
    "network": {"heartbeat_s": 0.5, "record_ttl_s": 5.0},
}


@pytest.fixture
def nat_ok(netns_ok: None) -> None:
    """iptables for the home routers: installed with apt-get where missing (root, as in CI), else a skip."""
    if shutil.which("iptables") is None and shutil.which("apt-get") is not None:
        # the lock timeout: .ci/docker-env may be installing at the same moment (the Docker tests' xdist worker)
        subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-q", "iptables"],
                       capture_output=True, timeout=900,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    if shutil.which("iptables") is None:
        pytest.skip("NAT tests need iptables and could not install it (apt-get install iptables)")


def run(tmp_path: Path, name: str, steps: int = 30, **scenario: Any) -> tuple[dict[str, Any], Path]:
    """Run a scenario (tiny peers, `steps` inner steps) on the netns testnet; its report and workdir. Every check
    must pass."""
    path, workdir = tmp_path / f"{name}.yaml", tmp_path / name
    mode = scenario.pop("mode")
    config = {**PEER_CONFIG, "sync": {**PEER_CONFIG["sync"], "mode": mode}, "inner": {"steps": steps}}
    path.write_text(yaml.safe_dump({"peer_config": config, **scenario}))
    workdir.mkdir()
    ok = run_netns_testnet(NetnsTestnetOptions(scenario_path=str(path), workdir=str(workdir), timeout_s=240,
                                               name_prefix=f"{name}{os.getpid() % 10000}"))
    report = json.loads((workdir / "report" / "report.json").read_text())
    assert ok and report["passed"], [c for c in report["checks"] if not c["passed"]]
    return report, workdir


def lines(workdir: Path, host: str) -> list[str]:
    text = (workdir / f"{host}.log").read_text(errors="replace")
    return [line.split("reachability: ", 1)[1] for line in text.splitlines() if "reachability: " in line]


def peer_id(workdir: Path, host: str) -> str:
    if host == "bootstrap":
        return (workdir / "bootstrap.addr").read_text().split()[0].rsplit("/p2p/", 1)[1]
    return str(read_metrics(workdir / f"{host}.jsonl")[0]["peer_id"])


PROBE = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 5000), timeout=2) as conn:
        print(conn.recv(64).decode())
except OSError as e:
    print(type(e).__name__)
"""
SERVER = """
import socket
server = socket.create_server(("0.0.0.0", 5000))
print("ready", flush=True)
while True:
    conn, peer = server.accept()
    conn.sendall(peer[0].encode())
    conn.close()
"""


def test_a_home_router_lets_connections_out_and_none_in(nat_ok: None) -> None:
    hosts = [HostSpec("pub"), HostSpec("a", home="h1"), HostSpec("b", home="h2"), HostSpec("c", home="h2")]
    bed = netns.Testbed(f"natr{os.getpid() % 10000}", hosts)

    def probe(src: str, address: str) -> str:
        out = bed.popen(src, [sys.executable, "-c", PROBE, address], stdout=subprocess.PIPE, text=True)
        return out.communicate(timeout=30)[0].strip()

    with bed:
        for host in ("pub", "a", "b"):
            server = bed.popen(host, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        assert probe("a", bed.address("pub")) == bed.public_address("a") != bed.address("a")  # MASQUERADE
        assert probe("pub", bed.public_address("a")) == "ConnectionRefusedError"  # nothing forwarded in
        assert probe("pub", bed.address("a")) == "OSError"  # a home address is not routed: network unreachable
        assert probe("a", bed.public_address("b")) == "ConnectionRefusedError"  # home to home: no way in either
        assert probe("c", bed.address("b")) == bed.address("c")  # one home, one LAN
        assert bed.public_address("b") == bed.public_address("c")


def test_gasloc_behind_nat_trains_through_a_relay_then_outbound_only_when_the_relay_dies(
        nat_ok: None, tmp_path: Path) -> None:
    report, workdir = run(tmp_path, "natg", steps=60, mode="gasloc", peers=4, rounds=12, nat=["peer2", "peer3"],
                          events=[{"after_round": 3, "kill": "bootstrap"}],
                          checks={"loss_fell": True, "reachability": True, "min_nat_exchanges": 3})
    relay = peer_id(workdir, "bootstrap")
    for peer in ("peer0", "peer1"):
        assert lines(workdir, peer) == [f"reachable directly at /ip4/10.213.0.{int(peer[-1]) + 2}/tcp/31337"]
    killed_at = next(e["time"] for e in report["events"] if e["action"] == "kill")
    public_until = max(read_metrics(workdir / f"{peer}.jsonl")[-1]["time"] for peer in ("peer0", "peer1"))
    for peer in ("peer2", "peer3"):
        said = lines(workdir, peer)
        assert said[0].startswith(f"behind NAT, reachable through relay {relay}")
        assert said[-1].startswith("outbound only: no peer can connect to this one") and len(said) == 2
        # it still initiates (nobody can open an exchange to it): it tries every round while a peer it can reach
        # trains, and mixes in most. Its rounds after the public peers ended are not counted: on a loaded machine
        # the NATed peers lag, and CI once saw only 2 of 6 rounds after the kill mixed when they were.
        after = [(len(row["partners"]), row["refused_exchanges"], row["failed_exchanges"])
                 for row in read_metrics(workdir / f"{peer}.jsonl") if killed_at + 2 < row["time"] < public_until]
        assert after and all(sum(tries) > 0 for tries in after), after
        assert sum(mixed for mixed, _, _ in after) >= len(after) / 2, after


def test_diloco_behind_nat_moves_to_another_relay_when_its_relay_dies(nat_ok: None, tmp_path: Path) -> None:
    report, workdir = run(tmp_path, "natd", mode="diloco", peers=4, rounds=14, nat=["peer2", "peer3"],
                           relays=["peer0"], events=[{"after_round": 3, "kill": "bootstrap"}],
                           checks={"loss_fell": True, "reachability": True, "min_nat_exchanges": 12})
    first, second = peer_id(workdir, "bootstrap"), peer_id(workdir, "peer0")
    killed_at = next(e["time"] for e in report["events"] if e["action"] == "kill")
    for peer in ("peer2", "peer3"):
        said = lines(workdir, peer)
        # on the bootstrap's relay until the swarm's records announce peer0's (or on peer0's at once, when they
        # came first); on peer0's once the bootstrap is dead (a later line may say outbound only: peer0 can end its
        # run first)
        assert said[0].startswith((f"behind NAT, reachable through relay {first}",
                                   f"behind NAT, reachable through relay {second}")), said
        assert any(line.startswith(f"behind NAT, reachable through relay {second}") for line in said), said
        rows = read_metrics(workdir / f"{peer}.jsonl")
        # The move costs a round or none (8 local runs: no short round in 6, 1 and 2 in the others): the peers behind
        # NAT notice the relay's connection close within a fraction of a second and take a slot on the other relay,
        # partners read their new records the next round, and an exchange through the dead relay is asked again
        # until the stage's patience (both ends leave the round together). Before, a relay's death was noticed at
        # the next renewal and a member that could not reach it left the round early: rounds split for 0 to 6 rounds
        # in 6 local runs, 7 in a CI run. After the move, rounds average all four again; the last three but one may
        # hold one hiccup of their own (an exchange's ack lost at the end of a round: one member out of step for a
        # round, 1 of 6 runs). Under CI's load the move once took 6 rounds (4-9 of 12; the DHT reads that carry the
        # new records are slower there): what is asked is that the four average together again and stay together
        # (3 of the last 4 rounds but one), with 4 rounds to spare.
        after = [row for row in rows if row["time"] > killed_at]
        short = [row["round"] for row in after if row["peers_averaged"] < 4]
        assert len(short) <= len(after) - 4 and sum(row["peers_averaged"] == 4 for row in after[-5:-1]) >= 3, short


def test_factored_mixes_with_peers_behind_one_nat_and_behind_a_shared_one(nat_ok: None, tmp_path: Path) -> None:
    """peer2 has a home of its own, peer3 and peer4 share one (one LAN: they reach each other directly, the rest
    through the relay). Mix1 is gossip, Mix2 an all-reduce of groups of 3 every round."""
    _report, workdir = run(tmp_path, "natf", mode="factored", peers=5, rounds=8, nat=["peer2", ["peer3", "peer4"]],
                           checks={"loss_fell": True, "reachability": True, "min_nat_exchanges": 8})
    relay = peer_id(workdir, "bootstrap")
    for peer in ("peer2", "peer3", "peer4"):
        assert lines(workdir, peer)[0].startswith(f"behind NAT, reachable through relay {relay}")
        rows = read_metrics(workdir / f"{peer}.jsonl")[1:]
        assert 2 * sum(row["mix2_averaged"] >= 2 for row in rows) >= len(rows), [r["mix2_averaged"] for r in rows]
        assert sum(len(row["partners"]) for row in rows) >= len(rows) // 2  # Mix1: exchanges it started


def test_joiners_take_their_state_from_a_donor_behind_nat(nat_ok: None, tmp_path: Path) -> None:
    _report, workdir = run(tmp_path, "natj", steps=60, mode="diloco", peers=1, rounds=16, nat=["peer0", "peer1"],
                           events=[{"after_round": 2, "of": "peer0", "add_peer": None},  # peer1, behind NAT
                                   {"after_round": 8, "of": "peer0", "add_peer": None}],  # peer2, public
                           checks={"loss_fell": False, "reachability": True})
    donors = {peer_id(workdir, p) for p in ("peer0", "peer1")}
    for joiner in ("peer1", "peer2"):
        log = (workdir / f"{joiner}.log").read_text(errors="replace")
        joined = [line for line in log.splitlines() if "joined round" in line and "with the state of" in line]
        assert joined and joined[0].split("with the state of ")[1].split()[0] in donors, log[-2000:]
        # in its first round, or its second: under load (a CI run) peer1's first download, through the relay, ended
        # after 12 of 20 tensors with nothing in the donor's or the relay's log, and it joined a round later
        rows = read_metrics(workdir / f"{joiner}.jsonl")
        assert any(row["joined"] for row in rows[:2]), [(row["round"], row["joined"]) for row in rows]


def test_a_diloco_peer_that_vanishes_silently_holds_the_others_up_one_exchange_deadline(
        netns_ok: None, tmp_path: Path) -> None:
    """Its address stops answering (a partition, then SIGKILL: no reset reaches anyone). Before, the all-reduce's
    confirmations (a few bytes in a round trip) read as a slow link and stretched the next data exchange's deadline
    to sync.allreduce_timeout_s: the survivors waited 30-60 s for the vanished member (netns testnet, 4 of 7 runs)."""
    report, workdir = run(tmp_path, "natv", steps=60, mode="diloco", peers=3, rounds=10,
                          events=[{"after_round": 3, "of": "peer0", "partition": ["peer2"]},
                                  {"after_round": 3, "of": "peer0", "kill": "peer2"}],
                          checks={"loss_fell": True})
    vanished_at = max(e["time"] for e in report["events"])
    for peer in ("peer0", "peer1"):
        every = read_metrics(workdir / f"{peer}.jsonl")
        rows = every[:-2]  # (at the end, one survivor waits for the other's exit)
        before = [row["round_s"] for row in rows if row["time"] < vanished_at]
        after = [row for row in rows if row["time"] > vanished_at]
        bound = SETUP_FLOOR_S + MATCHMAKING_S + 4 * statistics.median(before)
        assert max(row["round_s"] for row in after) <= bound, [round(row["round_s"], 1) for row in after]
        # The survivors go on together. Not every round: the opener of a pair with the vanished member waits out the
        # exchange's deadline while the other survivor's confirmations end after the patience, so the vanish round
        # may be discarded and the next averaged alone while one catches up (a CI run: 2 rows after the vanish, both
        # alone). A cut at the patience fixed that but broke relayed exchanges, whose answers come later (see
        # test_diloco_behind_nat_moves_to_another_relay_when_its_relay_dies)
        assert any(row["peers_averaged"] == 2 for row in every if row["time"] > vanished_at), every[-4:]
