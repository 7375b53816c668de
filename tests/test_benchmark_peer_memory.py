"""benchmarks/peer_memory.py: a peer's memory is the PSS of each of its processes, counted once, by kind; the
32-peer projection is that figure times 32 plus the bootstrap and the fork server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks.peer_memory import MIB, format_table, peer_memory, projected_mib, smaps_rollup  # noqa: E402

PARENT_OF_A_SLEEP = ("import subprocess, time\nchild = subprocess.Popen(['sleep', '60'])\nprint('up', flush=True)\n"
                     "time.sleep(60)\n")


@pytest.mark.slow
def test_a_peers_memory_counts_each_of_its_processes_once_by_kind() -> None:
    root = subprocess.Popen([sys.executable, "-c", PARENT_OF_A_SLEEP], stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout is not None and root.stdout.readline() == "up\n"
        by_kind = peer_memory(root.pid)
        assert sorted(by_kind) == ["other", "peer"]
        assert by_kind["peer"]["processes"] == by_kind["other"]["processes"] == 1
        for entry in by_kind.values():
            assert 0 < entry["pss"] <= entry["rss"] and 0 < entry["private"] <= entry["rss"]
        assert by_kind["peer"]["pss"] == pytest.approx(smaps_rollup(root.pid)["Pss"], rel=0.2)
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(root.pid)], check=False)
        root.kill()
        root.wait()
    assert peer_memory(root.pid) == {} and smaps_rollup(root.pid) == {}


def test_the_projection_and_the_table_use_the_per_peer_figure() -> None:
    row = {"mode": "forked", "peers": 4, "seconds_to_rounds": 9.0, "per_peer_pss_mib": {"mean": 100.0, "max": 120.0},
           "per_peer_private_mib": 80.0, "per_peer_rss_mib": 400.0, "processes_per_peer": 3.0,
           "by_kind_pss_mib": {"peer": 60.0, "p2pd": 15.0, "other": 25.0},
           "bootstrap_pss_mib": 50.0, "server_pss_mib": 200.0}
    assert projected_mib(row) == 32 * 100.0 + 50.0 + 200.0
    table = format_table([row])
    assert "forked      4       100    120       80    400" in table and "60   3.0     3.4 G" in table, table
    assert MIB == 2**20
