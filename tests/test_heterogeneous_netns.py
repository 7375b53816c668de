"""GASLoC on links of very different speeds, each peer its own host with `tc` shaping (netns testnet): the peer
on the slow link takes fewer inner steps and sends 8-bit parameters, fast peers keep their steps, 16-bit among
themselves, and do not wait for the slow one. Needs root and iproute2; skips with the reason otherwise."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import yaml

from p2ptrain.metrics import read_metrics
from p2ptrain.testnet.netns_run import NetnsTestnetOptions, run_netns_testnet

pytestmark = [pytest.mark.netns, pytest.mark.slow]

FAST, SLOW = ("peer0", "peer1"), "peer2"
STEPS, MIN_STEPS = 100, 5  # ~1 s of compute per round on one thread: an exchange on a fast link costs ~10 steps
SCENARIO = {
    "peers": 3, "duration_s": 60, "bandwidth": ["50mbit", "50mbit", "1mbit"],
    "peer_config": {
        "model": {"name": "tiny", "max_seq_len": 64},
        "data": {"seq_len": 64, "batch_size": 4, "max_corpus_bytes": 2_000_000, "num_shards": 8, "val_batches": 2},
        "inner": {"steps": STEPS, "min_steps": MIN_STEPS},
        "sync": {"mode": "gasloc", "param_codec": "adaptive", "adapt_inner_steps": True},
        "network": {"heartbeat_s": 0.5, "record_ttl_s": 5.0},
    },
    "checks": {"loss_fell": True},
}


def run_testnet(tmp_path: Path, prefix: str) -> dict[str, list[dict[str, Any]]]:
    """The scenario's metrics; every check of the run must pass, clean exits included."""
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump(SCENARIO))
    ok = run_netns_testnet(NetnsTestnetOptions(scenario_path=str(scenario), workdir=str(tmp_path),
                                               timeout_s=300, name_prefix=prefix))
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert ok and report["passed"], [c for c in report["checks"] if not c["passed"]]
    return {peer: read_metrics(tmp_path / f"{peer}.jsonl") for peer in (*FAST, SLOW)}


def test_a_slow_link_peer_takes_fewer_steps_sends_8_bit_and_fast_peers_do_not_wait_for_it(
        netns_ok: None, tmp_path: Path) -> None:
    rows = run_testnet(tmp_path, "het")
    name_of = {peer_rows[0]["peer_id"]: peer for peer, peer_rows in rows.items()}
    exchanges = [(peer, name_of.get(e["partner"], "?"), e) for peer, peer_rows in rows.items()
                 for r in peer_rows for e in r["exchanges"]]
    fast_pairs = [e for a, b, e in exchanges if {a, b} <= set(FAST)]
    assert len(fast_pairs) >= 5, "the fast peers hardly mixed with each other"
    # Fast pairs exchange fp16: ~0.1 s against a ~1 s inner phase. One exchange that stalls on a loaded CPU reads
    # as a slow link and may send the next one 8-bit (seen once in CI: the codec adapts to what it measured), so
    # one in ten may differ, no more.
    not_fp16 = [e["codec"] for e in fast_pairs if e["codec"] != "fp16"]
    assert len(not_fp16) <= max(1, len(fast_pairs) // 10), [e["codec"] for e in fast_pairs]
    slow_links = [(a, b, e) for a, b, e in exchanges if SLOW in (a, b)]

    # Pacing: round 0 runs the full H (nothing measured yet); once its link is measured and its exchanges are
    # 8-bit, the slow peer gives up the steps its extra link time is worth (~2 s per exchange at 1 Mbit/s against
    # ~0.1 s on a fast link: 80 steps at 25 ms, 40 at 50 ms on a loaded CI machine), while a fast peer, whose
    # rounds set the pace, keeps (nearly) all H.
    # (A peer that starts before the others trains alone, unpaced, until it meets a partner; the others may take
    # 20 s to join, downloading the state over its 1 Mbit link. Its paced rounds are those after its first 8-bit
    # exchange: its link has been measured by then.)
    first_try = next((i for i, r in enumerate(rows[SLOW]) if r["exchanges"] or r["failed_exchanges"]), None)
    assert first_try is not None, "the slow peer never tried an exchange"
    first_int8 = next((i for i, r in enumerate(rows[SLOW]) if any(e["codec"] == "int8" for e in r["exchanges"])),
                      None)
    assert first_int8 is not None, "the slow peer never exchanged 8-bit"
    paced_rows = rows[SLOW][first_int8 + 1:]
    assert len(paced_rows) >= 3, "the slow peer met its partners too late in the run"
    steps = {peer: statistics.median(r["inner_steps"] for r in peer_rows[1:]) for peer, peer_rows in rows.items()}
    steps[SLOW] = statistics.median(r["inner_steps"] for r in paced_rows)
    slow_step_s = statistics.median(r["compute_s"] / r["inner_steps"] for r in rows[SLOW][1:])
    paced = [e["seconds"] for a, _, e in slow_links if a == SLOW and e["codec"] == "int8"]
    assert paced, "the slow peer never sent 8-bit"
    extra_s = statistics.median(paced) - statistics.median(e["seconds"] for e in fast_pairs)
    assert steps[SLOW] <= max(MIN_STEPS, STEPS - 0.5 * extra_s / slow_step_s), (steps, extra_s, slow_step_s)
    assert all(steps[peer] >= 0.85 * STEPS for peer in FAST), steps
    # Adaptive codec: once the slow peer has measured a link, 16-bit no longer fits its (paced) inner phase.
    seen: set[str] = set()
    for a, b, e in slow_links:
        if a == SLOW and b in seen:
            assert e["codec"] == "int8", (a, b, e)
        seen.add(b)
    # Partner choice: a fast peer starts an exchange with the slow one at most until the slow one has announced
    # its link speed (its first round); after that the slow peer starts them and fast peers answer while training.
    # (A slow peer whose own offers never complete announces no speed: a fast peer then judges it by the exchange
    # it measured with it. In CI one fast peer once started 6 with it.)
    for peer in FAST:
        starts = [(i, e["codec"], round(e["seconds"], 1)) for i, r in enumerate(rows[peer]) for e in r["exchanges"]
                  if name_of.get(e["partner"]) == SLOW]
        assert len(starts) <= 2, (peer, "(its round, codec, s)", starts, "the slow peer's first try", first_try)
    assert sum(1 for a, _, _ in slow_links if a == SLOW) >= 3, "the slow peer should reach the fast ones itself"
    for peer_rows in rows.values():
        assert min(r["val_loss"] for r in peer_rows[1:]) < peer_rows[0]["val_loss"]
