"""Scenario files, the run plan, churn, the event timeline, and the report's checks and plots (no root needed)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from p2ptrain.errors import ConfigError, UserError
from p2ptrain.testnet import netns_run, plots
from p2ptrain.testnet.netns_run import NetnsTestnetOptions, run_netns_testnet
from p2ptrain.testnet.plan import Timeline, churn_events, plan_run
from p2ptrain.testnet.report import (
    EventRecord,
    Life,
    RunRecord,
    longest_stall_s,
    peer_logs,
    reachability_lines,
    run_checks,
    verdict_line,
    write_report,
)
from p2ptrain.testnet.scenario import (
    ChecksSpec,
    ChurnSpec,
    Event,
    Scenario,
    load_scenario,
    parse_bandwidth,
    parse_rate,
    parse_scenario,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO_ROOT / "testnet" / "scenarios").glob("*.yaml"))


def write_scenario(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    return path


# ---- rates and bandwidth lists ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, mbit", [("50mbit", 50.0), ("800kbit", 0.8), ("1gbit", 1000.0), ("2.5", 2.5),
                                        (10, 10.0), ("20000bit", 0.02), ("none", None), ("Unlimited", None)])
def test_parse_rate_units(text: object, mbit: float | None) -> None:
    assert parse_rate(text) == mbit


@pytest.mark.parametrize("text", ["5mbps", "fast", "-3mbit", "0mbit", "200gbit", True])
def test_bad_rates_are_one_line_errors(text: object) -> None:
    with pytest.raises(ConfigError, match="rate") as info:
        parse_rate(text, "--bandwidth[0]")
    assert "\n" not in str(info.value)


def test_bandwidth_list_from_command_line_and_yaml() -> None:
    assert parse_bandwidth("50mbit,50mbit,5mbit") == (50.0, 50.0, 5.0)
    assert parse_bandwidth(["1gbit", "none"]) == (1000.0, None)
    assert parse_bandwidth("20mbit") == (20.0,)


# ---- parsing -------------------------------------------------------------------------------------------------------

FULL = """
description: everything
peers: 4
bandwidth: [50mbit, 50mbit, 50mbit, 5mbit]
rounds: 12
peer_config: {model: {name: tiny}, run: {checkpoint_every: 1}}
events:
  - {after_round: 2, of: peer2, kill: peer2}
  - {at_s: 30, restart: peer2}
  - {at_s: 31, stop: peer1}
  - {at_s: 32, continue: peer1}
  - {at_s: 33, set_rate: {peer: peer3, rate: 1mbit}}
  - {after_round: 5, partition: [peer2, peer3]}
  - {at_s: 60, heal: partition}
  - {at_s: 70, add_peer: {rate: 20mbit}}
  - {at_s: 71, kill: peer4}
  - {at_s: 72, leave: peer0}
checks: {loss_fell: false, max_stall_s: 8, max_consensus_distance: 0.05}
"""


def test_full_scenario_parses_and_plans(tmp_path: Path) -> None:
    plan = plan_run(load_scenario(write_scenario(tmp_path, FULL)))
    assert plan.peer_rates_mbit == (50.0, 50.0, 50.0, 5.0) and plan.rounds == 12 and plan.duration_s is None
    assert plan.added_peers == ("peer4",)
    assert [e.describe() for e in plan.events] == [
        "kill peer2", "restart peer2", "stop peer1", "continue peer1", "set_rate peer3 1 Mbit/s",
        "partition peer2,peer3", "heal partition", "add_peer peer4 20 Mbit/s", "kill peer4", "leave peer0"]
    assert plan.events[0] == Event("kill", "peer2", after_round=2, of="peer2")
    assert plan.events[5].of is None and plan.events[5].trigger == "after round 5 of any peer"
    assert plan.checks == ChecksSpec(loss_fell=False, max_stall_s=8.0, max_consensus_distance=0.05)
    assert plan.peer_config == {"model": {"name": "tiny"}, "run": {"checkpoint_every": 1}}
    json.dumps(dataclasses.asdict(plan))  # the plan goes into report.json


def test_command_line_overrides_the_scenario(tmp_path: Path) -> None:
    scenario = load_scenario(write_scenario(tmp_path, "peers: 2\nbandwidth: 10mbit\nduration_s: 100\n"))
    plan = plan_run(scenario)
    assert plan.peer_rates_mbit == (10.0, 10.0) and plan.duration_s == 100 and plan.rounds is None
    plan = plan_run(scenario, num_peers=3, bandwidth="1mbit,2mbit,none", rounds=5)
    assert plan.peer_rates_mbit == (1.0, 2.0, None) and plan.rounds == 5 and plan.duration_s is None
    assert plan_run(Scenario(), bandwidth="5mbit,5mbit,5mbit").peer_rates_mbit == (5.0, 5.0, 5.0)  # count from list
    default = plan_run(Scenario())
    assert default.peer_rates_mbit == (None,) * 4 and default.rounds == 8


@pytest.mark.parametrize("text, message", [
    ("peers: 3\nbogus: 1\n", "unknown key 'bogus'"),
    ("events:\n  - {at_s: 3, kil: peer1}\n", "events[0]: unknown key 'kil'"),
    ("events:\n  - {kill: peer1}\n", "events[0]: kill: give exactly one trigger"),
    ("events:\n  - {at_s: 1, after_round: 2, kill: peer1}\n", "exactly one trigger"),
    ("events:\n  - {at_s: 1, kill: peer1, stop: peer2}\n", "exactly one action"),
    ("events:\n  - {at_s: 1, kill: bob}\n", "'bob' is not a peer name"),
    ("events:\n  - {at_s: 1, of: peer1, kill: peer1}\n", "`of` goes with after_round"),
    ("events:\n  - {at_s: x, kill: peer1}\n", "at_s: expected a number"),
    ("events:\n  - {at_s: 1, set_rate: {peer: peer1}}\n", "set_rate: {peer: peer1, rate: 5mbit}"),
    ("events:\n  - {at_s: 1, set_rate: {peer: peer1, rate: 5mbps}}\n", "set_rate.rate: '5mbps' is not a rate"),
    ("events:\n  - {at_s: 1, partition: []}\n", "list the peers to cut off"),
    ("events:\n  - {at_s: 1, heal: now}\n", "write heal: partition"),
    ("events: {at_s: 1}\n", "events must be a list"),
    ("rounds: 5\nduration_s: 10\n", "rounds or duration_s, not both"),
    ("rounds: 0\n", "rounds must be >= 1"),
    ("churn: {min_alive: 2}\n", "churn.kills_per_min is required"),
    ("churn: {kills_per_min: 0}\n", "churn.kills_per_min must be in (0, 600]"),
    ("churn: {kills_per_min: 1, seed: 1.5}\n", "churn.seed: expected a whole number"),
    ("churn: {kills_per_min: 1, min_alive: 2.0}\n", "churn.min_alive: expected a whole number"),
    ("churn: {kills_per_min: 1, down_s: x}\n", "churn.down_s: expected a number"),
    ("churn: {kills_per_min: 1, bogus: 2}\n", "unknown key 'churn.bogus'"),
    ("checks: {loss_fell: 1}\n", "checks.loss_fell: expected true or false"),
    ("checks: {max_stall_s: 0}\n", "checks.max_stall_s must be > 0"),
    ("checks: {max_stall_rounds: 4}\n", "unknown key 'checks.max_stall_rounds'"),
    ("peer_config: [1]\n", "peer_config: expected a mapping"),
    ("- just a list\n", "expected a mapping"),
    ("peers: [unclosed\n", "is not valid YAML"),
])
def test_scenario_mistakes_are_one_line_errors_naming_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write_scenario(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_scenario(path)
    assert message in str(info.value)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("text, kwargs, message", [
    ("events:\n  - {at_s: 1, kill: peer5}\n", {"num_peers": 3}, "no peer 'peer5' in this run"),
    ("events:\n  - {after_round: 1, of: peer9, heal: partition}\n", {}, "no peer 'peer9'"),
    ("peers: 4\n", {"bandwidth": "1mbit,2mbit"}, "2 rates for 4 peers"),
    ("churn: {kills_per_min: 1}\nrounds: 5\n", {}, "churn.stop_s"),
])
def test_plan_mistakes(tmp_path: Path, text: str, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        plan_run(load_scenario(write_scenario(tmp_path, text)), **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value) and "\n" not in str(info.value)


def test_missing_file_is_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read scenario file"):
        load_scenario(tmp_path / "nope.yaml")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_scenarios_are_valid(path: Path) -> None:
    plan = plan_run(load_scenario(path))
    assert plan.rounds or plan.duration_s
    assert plan.peer_config["model"]["name"] == "tiny"


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"churn.yaml", "straggler.yaml", "partition.yaml", "kill_restart.yaml"}


# ---- churn -----------------------------------------------------------------------------------------------------------

def test_churn_is_deterministic_respects_min_alive_and_pairs_kills_with_restarts() -> None:
    spec = ChurnSpec(kills_per_min=30, min_alive=2, down_s=10, start_s=5, stop_s=300, seed=7)
    events = churn_events(spec, num_peers=4, duration_s=None)
    assert events == churn_events(spec, num_peers=4, duration_s=None)
    assert events != churn_events(ChurnSpec(30, 2, 10, 5, 300, seed=8), 4, None)
    kills = [e for e in events if e.action == "kill"]
    restarts = [e for e in events if e.action == "restart"]
    assert len(kills) == len(restarts) > 10
    assert [e.at_s for e in events] == sorted(e.at_s for e in events)  # type: ignore[type-var]
    assert all(5 < (e.at_s or 0) < 300 for e in kills)
    for kill in kills:  # every kill has its restart exactly down_s later
        assert Event("restart", kill.peer, at_s=round((kill.at_s or 0) + 10, 3)) in restarts
    alive = {f"peer{i}" for i in range(4)}
    for event in events:  # replay: a kill only ever hits a live peer, and never goes below min_alive
        if event.action == "kill":
            assert event.peer in alive and len(alive) > 2
            alive.discard(str(event.peer))
        else:
            alive.add(str(event.peer))


def test_churn_rate_matches_poisson_mean() -> None:
    # With min_alive far below the peer count nothing is skipped: kills ~ Poisson(rate * window).
    counts = [sum(e.action == "kill" for e in churn_events(ChurnSpec(6, 1, 1, 0, 600, seed=s), 50, None))
              for s in range(20)]
    mean = sum(counts) / len(counts)
    assert 55 < mean < 65, mean  # expected 6/min * 10 min = 60; sd of the mean ~ 1.7


# ---- timeline --------------------------------------------------------------------------------------------------------

def test_timeline_fires_in_order_each_waiting_for_its_trigger_and_the_previous() -> None:
    timeline = Timeline([Event("kill", "peer2", after_round=2, of="peer2"), Event("restart", "peer2", at_s=5),
                         Event("heal", at_s=1), Event("stop", "peer0", after_round=4)])
    assert timeline.due(10.0, {"peer0": 9, "peer2": 1}) == []  # the first waits on peer2; the rest wait on it
    fired = timeline.due(10.0, {"peer0": 9, "peer2": 2})
    assert [e.action for e in fired] == ["kill", "restart", "heal", "stop"]
    timeline = Timeline([Event("heal", at_s=3), Event("stop", "peer0", after_round=4)])
    assert timeline.due(2.9, {}) == [] and [e.action for e in timeline.due(3.0, {"peer1": 3})] == ["heal"]
    assert timeline.due(4.0, {"peer1": 3}) == [] and len(timeline.due(4.0, {"peer1": 4})) == 1  # any peer
    assert timeline.pending == []


# ---- report: checks and plots ----------------------------------------------------------------------------------------

def row(peer_round: int, time_s: float, val_loss: float, round_s: float = 2.0) -> dict[str, float | int | str]:
    return {"peer_id": "x", "round": peer_round, "inner_steps": 5, "train_loss": val_loss, "val_loss": val_loss,
            "tokens_per_s": 100.0, "compute_s": 0.5, "comm_blocked_s": 1.5, "bytes_sent": 1000,
            "bytes_received": 1000, "peers_averaged": 2, "round_s": round_s, "joined": False, "time": time_s}


def kill_restart_record(tmp_path: Path) -> RunRecord:
    """peer0 runs rounds 0-9 every 2 s; peer1 is killed at t=5 after rounds 0-1, resumes from round 2 at t=9."""
    rows = {"peer0": [row(r, 100 + 2 * r, 5.0 - 0.1 * r) for r in range(10)],
            "peer1": [row(0, 100, 5.0), row(1, 102, 4.9), row(6, 112, 4.5), row(7, 114, 4.4), row(8, 116, 4.3),
                      row(9, 118, 4.2)]}
    lives = [Life("peer0", 1, 99.0, 119.0, 0, "finished"), Life("peer1", 2, 99.0, 105.0, -9, "killed"),
             Life("peer1", 3, 109.0, 119.0, 0, "finished", resumed_from_round=2)]
    events = [EventRecord(105.0, "kill", "kill peer1", "at 5 s", "script", True),
              EventRecord(109.0, "restart", "restart peer1", "at 9 s", "script", True, "resumed")]
    return RunRecord(99.0, 119.0, rows, lives, events, [], {}, {"peer0": None, "peer1": 5.0}, "done")


def test_checks_pass_on_a_good_kill_restart_run(tmp_path: Path) -> None:
    record = kill_restart_record(tmp_path)
    results = {r.name: r for r in run_checks(record, ChecksSpec(max_stall_s=4.0))}
    assert set(results) == {"finished", "clean_exits", "events_fired", "loss_fell", "resumed_from_checkpoint",
                            "max_stall_s"}
    assert all(r.passed for r in results.values()), results
    assert "peer1 checkpoint 2 -> round 6" in results["resumed_from_checkpoint"].detail


def test_checks_fail_when_loss_rises_resume_goes_back_or_a_peer_stalls(tmp_path: Path) -> None:
    record = kill_restart_record(tmp_path)
    for late_row in record.rows["peer0"][-2:]:  # two of the last three rounds: the trend rose
        late_row["val_loss"] = 9.0
    record.lives[2].resumed_from_round = 7  # it claims checkpoint 7 but logged round 6 first
    del record.rows["peer0"][3:6]  # peer0: rounds 2 -> 6 took 8 s
    results = {r.name: r for r in run_checks(record, ChecksSpec(max_stall_s=6.0))}
    assert not results["loss_fell"].passed and "peer0" in results["loss_fell"].detail
    assert not results["resumed_from_checkpoint"].passed
    assert not results["max_stall_s"].passed and "peer0 8.0 s" in results["max_stall_s"].detail


def partition_record(crossing: dict[str, float]) -> RunRecord:
    """peer0-peer3 gossip every second from t=100; peer2 and peer3 are cut off at 110 and the cut heals at 120;
    `crossing`: peer → when it first opens to a peer of the other side after the heal (the rest: its own side)."""
    other = {"peer0": "peer2", "peer1": "peer3", "peer2": "peer0", "peer3": "peer1"}
    same = {"peer0": "peer1", "peer1": "peer0", "peer2": "peer3", "peer3": "peer2"}
    rows = {}
    for peer in other:
        rows[peer] = [dict(row(r, 100.0 + r, 5.0 - 0.01 * r), peer_id=f"id-{peer}",
                           partners=[f"id-{other[peer] if 100.0 + r == crossing.get(peer) else same[peer]}"])
                      for r in range(40)]
    rows["peer4"] = [dict(row(r, 125.0 + r, 4.0), peer_id="id-peer4", partners=["id-peer0"]) for r in range(10)]
    lives = [Life(peer, i, 99.0, 140.0, 0, "finished") for i, peer in enumerate(rows)]
    events = [EventRecord(110.5, "partition", "partition peer2,peer3", "at 10 s", "script", True,
                          peers=["peer2", "peer3"]),
              EventRecord(120.5, "heal", "heal partition", "at 20 s", "script", True),
              EventRecord(124.0, "add_peer", "add_peer peer4", "at 24 s", "script", True)]
    return RunRecord(99.0, 140.0, rows, lives, events, [], {}, {}, "duration")


def test_the_heal_check_wants_every_peer_of_both_sides_to_mix_across_the_cut_in_time() -> None:
    """Within `max_heal_s` of the heal, each peer of either side opened to a peer of the other one; a peer that
    joined after the cut (peer4, opening to peer0) is of neither side and is not judged."""
    crossing = {"peer0": 122.0, "peer1": 124.0, "peer2": 121.0, "peer3": 127.0}
    result = run_checks(partition_record(crossing), ChecksSpec(loss_fell=False, max_heal_s=8.0))[-1]
    assert result.name == "max_heal_s" and result.passed, result
    assert "peer3 6.5 s" in result.detail and "peer4" not in result.detail
    result = run_checks(partition_record(crossing), ChecksSpec(loss_fell=False, max_heal_s=5.0))[-1]
    assert not result.passed and "peer3 6.5 s" in result.detail
    del crossing["peer1"]  # it mixed on its own side only: the halves never met through it
    result = run_checks(partition_record(crossing), ChecksSpec(loss_fell=False, max_heal_s=60.0))[-1]
    assert not result.passed and "peer1 never" in result.detail
    no_heal = partition_record(crossing)
    no_heal.events = [e for e in no_heal.events if e.action != "heal"]
    assert not run_checks(no_heal, ChecksSpec(loss_fell=False, max_heal_s=60.0))[-1].passed


def test_loss_fell_judges_the_trend_not_one_noisy_last_round(tmp_path: Path) -> None:
    """A round's validation loss is two batches: one high last value does not fail a run whose loss fell."""
    record = kill_restart_record(tmp_path)
    record.rows["peer0"][-1]["val_loss"] = 9.0
    result = run_checks(record, ChecksSpec())[3]
    assert result.name == "loss_fell" and result.passed, result
    assert "peer0 4.900->4.300" in result.detail  # medians of rounds 0-2 and 7-9
    record.rows["peer1"] = record.rows["peer1"][:1]  # one round: nothing to compare
    assert not run_checks(record, ChecksSpec())[3].passed


def test_a_late_joiner_is_judged_against_the_runs_starting_loss(tmp_path: Path) -> None:
    """A joiner (it took a state before its first round) passes when its loss is below the founders' first
    rounds', and fails when it is not (it learnt nothing from the state it took, or diverged), however many rounds
    it had."""
    record = kill_restart_record(tmp_path)
    record.rows["peer2"] = [dict(row(8, 116, 4.6), joined=True), row(9, 118, 4.7)]  # rising: its own trend fails
    record.lives.append(Life("peer2", 4, 115.0, 119.0, 0, "finished"))
    result = run_checks(record, ChecksSpec())[3]
    assert result.passed and "peer2 joined, run start 5.000->4.650" in result.detail, result
    record.rows["peer2"][-1]["val_loss"] = 5.6  # median of 4.6 and 5.6: 5.1, above the start
    result = run_checks(record, ChecksSpec())[3]
    assert not result.passed and "did not fall for peer2" in result.detail, result
    record.rows["peer2"] = [dict(row(8, 116, 4.6), joined=False)]  # one round, no state taken: nothing to compare
    assert not run_checks(record, ChecksSpec())[3].passed
    # six rounds from a state taken late (swarm32: 1.842 -> 1.848 by their medians, a flat swarm's noise): judged
    # against the run's start all the same
    record.rows["peer2"] = [dict(row(8 + r, 116 + r, loss), joined=r == 0)
                            for r, loss in enumerate([4.5, 4.4, 4.3, 4.4, 4.5, 4.4])]
    result = run_checks(record, ChecksSpec())[3]
    assert result.passed and "peer2 joined, run start 5.000->4.400" in result.detail, result


def test_loss_fell_reads_only_the_rounds_that_measured_it(tmp_path: Path) -> None:
    """With `run.eval_every`, a round in between repeats the latest loss: the check reads the measured ones."""
    record = kill_restart_record(tmp_path)
    for r, peer_row in enumerate(record.rows["peer0"]):  # measured at rounds 0 and 9 only, 5.0 then 4.0
        peer_row["val_loss"], peer_row["evaluated"] = (4.0, True) if r == 9 else (5.0, r == 0)
    result = run_checks(record, ChecksSpec())[3]
    assert result.name == "loss_fell" and result.passed and "peer0 5.000->4.000" in result.detail, result


def test_unplanned_exits_unfired_events_and_timeouts_fail(tmp_path: Path) -> None:
    record = kill_restart_record(tmp_path)
    record.lives[0].end_reason, record.lives[0].exit_code = "crashed", 1
    record.unfired = ["heal partition (at 90 s)"]
    record.events.append(EventRecord(110.0, "stop", "stop peer7", "at 1 s", "script", False, "peer7 is not running"))
    record.outcome = "timeout"
    results = {r.name: r for r in run_checks(record, ChecksSpec(loss_fell=False))}
    assert not results["clean_exits"].passed and "peer0 (crashed, exit 1)" in results["clean_exits"].detail
    assert not results["events_fired"].passed and "never triggered" in results["events_fired"].detail
    assert "peer7 is not running" in results["events_fired"].detail
    assert not results["finished"].passed


def test_averaging_counts_rounds_alone_after_each_lifes_first_and_the_longest_streak(tmp_path: Path) -> None:
    record = kill_restart_record(tmp_path)
    checks = ChecksSpec(max_alone_fraction=0.1, max_rounds_alone=3)
    assert {r.name: r for r in run_checks(record, checks)}["averaging"].passed
    for r in (0, 2, 3, 4, 5):  # round 0 is a life's first: not counted; rounds 2-5 alone, 4 in a row
        record.rows["peer0"][r]["peers_averaged"] = 1
    record.rows["peer0"][5]["mix2_averaged"] = 3  # a Mix2 with partners: round 5 averaged
    record.rows["peer1"][2]["peers_averaged"] = 1  # the restarted life's first round: not counted
    result = {r.name: r for r in run_checks(record, checks)}["averaging"]
    # 3 of 13 counted rounds alone (peer0: 9 after its first; peer1: 1 and 3 in its two lives)
    assert not result.passed and result.detail == "23% of rounds alone (limit 10%)", result
    record.rows["peer0"][5]["mix2_averaged"] = 1
    result = {r.name: r for r in run_checks(record, ChecksSpec(max_rounds_alone=3))}["averaging"]
    assert not result.passed and result.detail == "peer0 alone 4 rounds in a row (limit 3)", result
    with pytest.raises(ConfigError, match="max_alone_fraction"):
        ChecksSpec(max_alone_fraction=1.5)


def test_stall_counts_the_tail_unless_the_peer_exited_after_its_last_round(tmp_path: Path) -> None:
    record = kill_restart_record(tmp_path)
    record.lives[0].ended = 150.0  # peer0 logged its last round at t=118 and took 32 s to shut down
    assert {r.name: r for r in run_checks(record, ChecksSpec(max_stall_s=4.0))}["max_stall_s"].passed
    record.lives[0].end_reason = "stopped_at_end"  # still running at the end, silent for 32 s
    result = {r.name: r for r in run_checks(record, ChecksSpec(max_stall_s=4.0))}["max_stall_s"]
    assert not result.passed and "peer0 32.0 s" in result.detail


def test_stall_limit_is_seconds_whatever_pace_another_peer_keeps(tmp_path: Path) -> None:
    """A peer training alone at ten rounds a second does not shrink the limit for the others (CI, Docker backend:
    a lone peer's 0.4 s rounds made the median, and the others' 7 s stalls read as 17 rounds)."""
    record = kill_restart_record(tmp_path)
    record.rows["peer2"] = [row(r, 100 + 0.1 * r, 5.0 - 0.01 * r) for r in range(190)]
    record.lives.append(Life("peer2", 4, 99.0, 119.0, 0, "finished"))
    result = {r.name: r for r in run_checks(record, ChecksSpec(max_stall_s=4.0))}["max_stall_s"]
    assert result.passed and "peer2 0.1 s" in result.detail, result


def test_longest_stall_discounts_time_stopped() -> None:
    # Rounds at 0, 2, 10 and the end at 11: gaps 2, 8, 1; stopped from 3 to 8 takes 5 s off the 8 s gap.
    assert longest_stall_s([0, 2, 10], 11, []) == 8
    assert longest_stall_s([0, 2, 10], 11, [(3, 8)]) == 3
    assert longest_stall_s([], 50, []) == 0  # start-up before the first round does not count


def test_consensus_distance_from_checkpoints(tmp_path: Path) -> None:
    record = kill_restart_record(tmp_path)
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])
    for peer, weights, rounds in (("peer0", a, (4, 5)), ("peer1", b, (5, 6))):
        for r in rounds:
            save_dir = tmp_path / peer / f"round-{r:06d}"
            save_dir.mkdir(parents=True)
            save_file({"w": weights if r == 5 else weights * 100}, str(save_dir / "model.safetensors"))
        record.checkpoint_dirs[peer] = str(tmp_path / peer)
    results = {r.name: r for r in run_checks(record, ChecksSpec(max_consensus_distance=1e-6))}
    assert results["max_consensus_distance"].passed and "at round 5" in results["max_consensus_distance"].detail
    b.copy_(torch.tensor([3.0, 4.0 + 1.0]))  # mean (3, 4.5): ‖a − mean‖ / ‖mean‖ = 0.5 / sqrt(9 + 20.25)
    save_file({"w": b}, str(tmp_path / "peer1" / "round-000005" / "model.safetensors"))
    result = {r.name: r for r in run_checks(record, ChecksSpec(max_consensus_distance=0.05))}["max_consensus_distance"]
    assert not result.passed and f"{0.5 / (9 + 20.25) ** 0.5:.2e}" in result.detail


def test_consensus_without_a_common_round_compares_each_survivors_newest_checkpoint(tmp_path: Path) -> None:
    """Gossip peers keep rounds of their own: stopped at the run's end, each one's newest checkpoint is of one
    moment."""
    record = kill_restart_record(tmp_path)
    for peer, states in (("peer0", {7: [9.0, 9.0], 9: [3.0, 4.0]}), ("peer1", {8: [0.0, 0.0], 12: [3.0, 4.0]})):
        for r, weights in states.items():
            save_dir = tmp_path / peer / f"round-{r:06d}"
            save_dir.mkdir(parents=True)
            save_file({"w": torch.tensor(weights)}, str(save_dir / "model.safetensors"))
        record.checkpoint_dirs[peer] = str(tmp_path / peer)
    result = {r.name: r for r in run_checks(record, ChecksSpec(max_consensus_distance=1e-6))}["max_consensus_distance"]
    assert result.passed and "0.00e+00 at each one's newest (rounds 9-12)" in result.detail, result
    record.checkpoint_dirs["peer1"] = str(tmp_path / "nowhere")
    result = {r.name: r for r in run_checks(record, ChecksSpec(max_consensus_distance=1e-6))}["max_consensus_distance"]
    assert not result.passed and "no checkpoints of >= 2 survivors" in result.detail, result


def test_report_json_and_plots(tmp_path: Path) -> None:
    record = kill_restart_record(tmp_path)
    record.rows["peer0"][2]["evaluated"] = False  # not in the loss plot (run.eval_every)
    results = run_checks(record, ChecksSpec())
    paths = write_report(record, results, tmp_path / "report")
    assert [p.name for p in paths] == ["report.json", "loss.png", "utilisation.png", "bytes.png"]
    for png in paths[1:]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    report = json.loads(paths[0].read_text())
    assert report["passed"] is True and report["outcome"] == "done"
    assert [life["end_reason"] for life in report["peers"]["peer1"]["lives"]] == ["killed", "finished"]
    assert len(report["peers"]["peer0"]["rounds"]) == 10 and report["peers"]["peer1"]["rate_mbit"] == 5.0
    assert [e["description"] for e in report["events"]] == ["kill peer1", "restart peer1"]


def test_plot_axes_read_as_values_and_bytes_start_at_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """13.2 MB a round, give or take a few kB, and a loss that moves in its fifth digit: matplotlib alone draws ticks
    0.006 to 0.008 under "+1.32e1", and the loss's under "+5.5"."""
    record = kill_restart_record(tmp_path)
    for index, row in enumerate(row for rows in record.rows.values() for row in rows):
        row.update(bytes_sent=6_600_000 + 1_000 * (index % 3), bytes_received=6_600_000, val_loss=5.5 + 1e-5 * index)
    drawn, save = {}, plots._save

    def keep(fig: Any, path: Path, plt: Any) -> Path:
        saved = save(fig, path, plt)
        fig.canvas.draw()  # as saved: after the formatting
        drawn[path.name] = [(ax.yaxis.get_offset_text().get_text(), ax.xaxis.get_offset_text().get_text(),
                             ax.get_ylim()) for ax in fig.axes]
        return saved

    monkeypatch.setattr(plots, "_save", keep)
    write_report(record, run_checks(record, ChecksSpec()), tmp_path / "report")
    assert set(drawn) == {"loss.png", "utilisation.png", "bytes.png"}
    assert all((y_offset, x_offset) == ("", "") for axes in drawn.values() for y_offset, x_offset, _ in axes), drawn
    [(_, _, (bottom, top))] = drawn["bytes.png"]
    assert bottom == 0 and top >= 13.2, drawn["bytes.png"]


# ---- launcher entry points that need no root -----------------------------------------------------------------------

def test_netns_testnet_without_root_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match="need root") as info:
        run_netns_testnet(NetnsTestnetOptions(num_peers=2, workdir=str(tmp_path)))
    assert "\n" not in str(info.value)
    assert not list(tmp_path.iterdir()), "nothing may be written before the privilege check"


def test_options_and_peer_config_are_checked_before_any_namespace(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not both"):
        NetnsTestnetOptions(rounds=3, duration_s=10)
    scenario = write_scenario(tmp_path, "peer_config: {model: {name: tiny, bogus: 1}}\n")
    config = tmp_path / "base.yaml"
    config.write_text("model: {max_seq_len: 64}\nrun: {checkpoint_every: 3}\n")
    plan = plan_run(load_scenario(scenario))
    with pytest.raises(ConfigError, match="model.bogus"):
        netns_run.merged_peer_config(NetnsTestnetOptions(config_path=str(config)), plan, tmp_path)
    plan = plan_run(parse_scenario({"peer_config": {"model": {"name": "tiny"}, "data": {"num_shards": 6}}}))
    path, num_shards = netns_run.merged_peer_config(NetnsTestnetOptions(config_path=str(config)), plan, tmp_path)
    assert num_shards == 6
    merged = path.read_text()
    assert "max_seq_len: 64" in merged and "name: tiny" in merged and "checkpoint_every: 3" in merged
    assert f"min_peers: {len(plan.initial_peers)}" in merged  # the initial peers begin together (swarm_start.py)
    plan = plan_run(parse_scenario({"peers": 4, "peer_config": {"run": {"min_peers": 2}}}))
    assert "min_peers: 2" in netns_run.merged_peer_config(NetnsTestnetOptions(), plan, tmp_path)[0].read_text()


def test_random_is_not_touched_globally() -> None:
    state = random.getstate()
    churn_events(ChurnSpec(10, 1, 1, 0, 60, seed=3), 4, None)
    assert random.getstate() == state


def test_null_still_turns_a_check_off_and_draws_churn_anew() -> None:
    """Scenario files written before the validators were unified used null for "off" and for a fresh seed."""
    scenario = parse_scenario({"duration_s": 60, "checks": {"loss_fell": None},
                               "churn": {"kills_per_min": 1, "seed": None}})
    assert not scenario.checks.loss_fell and scenario.checks.resumed_from_checkpoint
    assert scenario.churn is not None and scenario.churn.seed is None


def test_homes_relays_and_a_bootstrap_kill_are_planned_and_checked_against_the_run(tmp_path: Path) -> None:
    plan = plan_run(parse_scenario({"peers": 3, "nat": ["peer1", ["peer2", "peer3"]], "relays": ["peer0"],
                                    "events": [{"after_round": 2, "kill": "bootstrap"},
                                               {"at_s": 5, "add_peer": None}]}))
    assert plan.homes == {"peer1": "home0", "peer2": "home1", "peer3": "home1"}  # peer3: the added peer
    assert plan.relays == ("peer0",) and plan.events[0].peer == "bootstrap"
    for bad, message in (({"nat": ["peer1", "peer1"]}, "listed twice"), ({"nat": "peer1"}, "list the peers"),
                         ({"nat": [[]]}, "an empty home"), ({"nat": ["peer9"]}, "no peer 'peer9'"),
                         ({"relays": ["bootstrap"]}, "not a peer name"),
                         ({"events": [{"at_s": 1, "stop": "bootstrap"}]}, "not a peer name")):
        with pytest.raises(ConfigError, match=message):
            plan_run(parse_scenario({"peers": 2, **bad}))


def test_the_docker_backend_refuses_nat_in_one_line(tmp_path: Path) -> None:
    from p2ptrain.testnet.docker_run import run_docker_testnet

    path = write_scenario(tmp_path, "peers: 2\nnat: [peer1]\n")
    with pytest.raises(UserError, match="no NAT routers: run this scenario .* with --backend netns"):
        run_docker_testnet(NetnsTestnetOptions(scenario_path=str(path), workdir=str(tmp_path / "w")))


def test_nat_checks_read_the_reachability_lines_and_count_exchanges() -> None:
    rows = {p: [dict(row(r, 100 + r, 5.0 - r / 10), peers_averaged=2) for r in range(4)] for p in ("peer0", "peer1")}
    lives = [Life(p, i, 99.0, 110.0, 0, "finished") for i, p in enumerate(rows)]
    record = RunRecord(99.0, 110.0, rows, lives, [], [], {}, {}, "done", {"homes": {"peer1": "home0"}},
                       {"peer0": ["x reachability: reachable directly at /ip4/10.213.0.2/tcp/31337"],
                        "peer1": ["x reachability: behind NAT, reachable through relay QmR"]})
    results = {r.name: r for r in run_checks(record, ChecksSpec(reachability=True, min_nat_exchanges=4))}
    assert results["reachability"].passed and results["nat_exchanges"].passed
    assert not run_checks(record, ChecksSpec(min_nat_exchanges=5))[-1].passed
    record.reachability["peer1"] = ["x reachability: reachable directly at /ip4/10.213.1.2/tcp/31337"]
    assert not run_checks(record, ChecksSpec(reachability=True))[-1].passed  # a NATed peer cannot be direct


def test_a_probe_not_asked_is_no_reachability_verdict(tmp_path: Path) -> None:
    """A joiner whose probe found the bootstrap busy says so, then gives its verdict: only the verdict is read."""
    (tmp_path / "peer0.log").write_text(
        "2026-11-30 13:30:00,692 INFO p2ptrain.net.reachability: reachability not asked: Daemon failed to start\n"
        "2026-11-30 13:30:27,898 INFO p2ptrain.net.presence: reachability: reachable directly at /ip4/10.2.0.3/tcp/1\n")
    (tmp_path / "peer1.log").write_text(
        "2026-11-30 13:30:00,692 INFO p2ptrain.net.reachability: reachability not asked: Daemon failed to start\n")
    assert reachability_lines(tmp_path, ["peer0", "peer1"]) == {
        "peer0": ["2026-11-30 13:30:27,898 INFO p2ptrain.net.presence: reachability: reachable directly at "
                  "/ip4/10.2.0.3/tcp/1"], "peer1": []}


def test_a_failed_run_shows_each_peers_last_warnings_and_a_passed_one_does_not(tmp_path: Path) -> None:
    """CI keeps the test's output, not the peers' logs: a failed run's last line carries what the peers warned."""
    info = [f"2026-11-25 02:37:{i:02d},000 INFO p2ptrain.peer: round {i}" for i in range(20)]
    warns = [f"2026-11-25 02:38:{i:02d},000 WARN p2ptrain.joining: state download {i} failed" for i in range(12)]
    (tmp_path / "peer0.log").write_text("\n".join(info + warns + ["2026-11-25 02:39:00,000 ERROR p2ptrain: boom"]))
    (tmp_path / "peer1.log").write_text("\n".join(info))  # nothing to show
    record = kill_restart_record(tmp_path)
    logs = peer_logs(tmp_path, ["peer0", "peer1", "peer9"])  # peer9 never wrote a log
    record = dataclasses.replace(record, **logs)
    assert list(record.warnings) == ["peer0"] and len(record.warnings["peer0"]) == 8
    assert record.warnings["peer0"][-1].endswith("ERROR p2ptrain: boom")
    assert "state download 5 failed" in record.warnings["peer0"][0]  # the last 8: downloads 5-11 and the error
    line = verdict_line(False, record)
    assert line.startswith("testnet: FAILED") and "peer0: " in line and "download 11 failed" in line
    assert "round 3" not in line and "peer1" not in line
    assert verdict_line(True, record) == "testnet: every check passed"



class _ListedHosts:
    """A backend that runs nothing: every host is up, at 10.0.0.<its number>."""

    kind, poll_s = "fake", 0.1

    def __init__(self) -> None:
        self.started: dict[str, list[str]] = {}

    def start(self, host: str, command: str, args: list[str], log: Path) -> int:
        self.started[host] = args
        return 1000 + len(self.started)

    def refresh(self) -> None:
        pass

    def exit_code(self, host: str) -> int | None:
        return None

    def address(self, host: str) -> str:
        return f"10.0.0.{int(host.removeprefix('peer'))}"


def test_a_peer_started_mid_run_joins_through_the_bootstrap_and_two_running_public_peers(tmp_path: Path) -> None:
    """As a volunteer may copy any running peer's printed command: through the bootstrap alone, a joiner of the
    32-peer swarm got no answer for 120 s. Peers behind NAT, adversaries and peers not yet training are no entry."""
    from p2ptrain.testnet.engine import Fleet

    scenario = load_scenario(write_scenario(tmp_path, "peers: 5\nduration_s: 60\nnat: [peer1]\n"))
    plan = dataclasses.replace(plan_run(scenario), adversaries={"peer2": "sign_flip"})
    hosts = _ListedHosts()
    fleet = Fleet(hosts, tmp_path, plan, [], num_shards=5)  # type: ignore[arg-type]
    fleet.bootstrap_maddr = "/ip4/10.0.0.99/tcp/31337/p2p/QmBoot"
    for peer in plan.initial_peers:
        fleet.start_peer(peer, resume=False)
    assert fleet.entry_points("peer5") == [fleet.bootstrap_maddr]  # nobody trains yet: the bootstrap alone
    for peer in plan.initial_peers:
        fleet.rows[peer] = [{"time": time.time() + 1, "peer_id": f"Qm{peer}", "round": 0}]
    entry = fleet.entry_points("peer5")
    assert entry[0] == fleet.bootstrap_maddr and len(entry) == 3
    public = {f"/ip4/10.0.0.{i}/tcp/31337/p2p/Qmpeer{i}" for i in (0, 3, 4)}
    assert set(entry[1:]) <= public and len(set(entry[1:])) == 2
    fleet.start_peer("peer5", resume=False)
    args = hosts.started["peer5"]
    given = [args[i + 1] for i, a in enumerate(args) if a == "--initial-peers"]  # the flag once per address
    assert given[0] == fleet.bootstrap_maddr and len(given) == 3 and set(given[1:]) <= public


class _ExitingHosts(_ListedHosts):
    """A backend whose peers exit when a test says, and that remembers the signals sent."""

    def __init__(self) -> None:
        super().__init__()
        self.codes: dict[str, int] = {}
        self.signals: list[tuple[str, int]] = []

    def signal(self, host: str, sig: int) -> None:
        self.signals.append((host, sig))
        if sig == signal.SIGKILL:
            self.codes[host] = -signal.SIGKILL

    def exit_code(self, host: str) -> int | None:
        return self.codes.get(host)


def test_a_leave_does_not_hold_the_next_events_and_a_peer_past_its_grace_is_killed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leaving peer finishes its exchange (up to a minute) before it exits: three leaves waited for in turn held the
    32-peer swarm's next events 34 s, and a 20 s grace killed a peer on its way out. A leave now returns at once; the
    peer's life ends as `left` when it exits, and one still running past STOP_GRACE_S is SIGKILLed."""
    from p2ptrain.testnet import engine

    scenario = load_scenario(write_scenario(tmp_path, "peers: 3\nduration_s: 60\n"))
    hosts = _ExitingHosts()
    fleet = engine.Fleet(hosts, tmp_path, plan_run(scenario), [], num_shards=3)  # type: ignore[arg-type]
    fleet.bootstrap_maddr = "/ip4/10.0.0.99/tcp/31337/p2p/QmBoot"
    for peer in ("peer0", "peer1", "peer2"):
        fleet.start_peer(peer, resume=False)
        fleet.rows[peer] = [{"time": time.time() + 1, "peer_id": f"Qm{peer}", "round": 0}]
    started = time.monotonic()
    for peer in ("peer0", "peer1"):
        assert engine.apply_event(fleet, Event(at_s=1, action="leave", peer=peer)) == (True, "")
    # nobody waited for the peers to exit: both lives are open, neither killed at a grace's end
    assert not any(life.ended for life in fleet.lives) and {"peer0", "peer1"} <= set(fleet.current)
    assert hosts.signals == [("peer0", signal.SIGTERM), ("peer1", signal.SIGTERM)]
    assert fleet.entry_points("peer3") == [fleet.bootstrap_maddr, "/ip4/10.0.0.2/tcp/31337/p2p/Qmpeer2"]
    hosts.codes["peer0"] = 0  # it finished its exchange, wrote its checkpoint and exited
    fleet.poll()
    assert [(life.peer, life.end_reason) for life in fleet.lives if life.ended] == [("peer0", "left")]
    monkeypatch.setattr(engine.time, "monotonic", lambda: started + engine.STOP_GRACE_S + 1)
    fleet.poll()
    assert ("peer1", signal.SIGKILL) in hosts.signals
    ends = {life.peer: (life.end_reason, life.exit_code) for life in fleet.lives if life.ended}
    assert ends == {"peer0": ("left", 0), "peer1": ("killed_at_teardown", -signal.SIGKILL)}
    assert "peer2" in fleet.current
