"""benchmarks/robustness_netns.py without a network: its scenarios are valid and put the attackers where the rows
judge them out, the rows it runs, and how a row is judged from a testnet report."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import robustness_netns as bench  # noqa: E402
from p2ptrain.testnet.plan import plan_run  # noqa: E402
from p2ptrain.testnet.scenario import parse_scenario  # noqa: E402


@pytest.mark.parametrize("kind", [None, *bench.CLASSES])
@pytest.mark.parametrize("defended", [True, False])
@pytest.mark.parametrize("mode", list(bench.MODE_SYNC))
def test_each_rows_scenario_parses_and_its_attackers_are_the_peers_judged_out(kind: str | None, defended: bool,
                                                                             mode: str) -> None:
    document = bench.scenario(mode, kind, defended, peers=8, attackers=2, rounds=30, fast_mbit=50)
    plan = plan_run(parse_scenario(document))
    assert plan.peer_config["sync"]["mode"] == mode.split("-")[0]
    assert document["peers"] == (6 if kind is None else 8), "the clean run: the honest peers alone"
    judged_out = bench.outsiders(kind, 8, 2)
    assert set(plan.adversaries) == (judged_out if kind in bench.LIES else set())
    assert set(plan.adversaries) <= judged_out
    slow = {f"peer{i}" for i, rate in enumerate(document["bandwidth"]) if rate == bench.SLOW_RATE}
    assert slow == (judged_out if kind == "slow" else set())
    assert (document["peer_config"]["sync"].get("robust", True), "reputation" in document["peer_config"]) == (
        (True, False) if defended else (False, True))


def test_rows_pair_each_lie_on_and_off_and_a_slow_member_has_one_row() -> None:
    rows = bench.rows_to_run(["gasloc", "diloco"], ["aimed", "free_rider", "slow"])
    assert rows == [("gasloc", None, True), ("gasloc", None, False), ("gasloc", "aimed", True),
                    ("gasloc", "aimed", False), ("gasloc", "free_rider", True), ("gasloc", "free_rider", False),
                    ("gasloc", "slow", True),
                    ("diloco", None, True), ("diloco", None, False), ("diloco", "aimed", True),
                    ("diloco", "aimed", False), ("diloco", "free_rider", True), ("diloco", "free_rider", False),
                    ("diloco", "slow", True)]


def rounds(losses: list[float], banned_from: int | None) -> list[dict[str, Any]]:
    return [{"round": i, "val_loss": loss, "peers_averaged": 1 if i == 0 else 3,
             "banned_peers": ["Qm-attacker"] if banned_from is not None and i >= banned_from else []}
            for i, loss in enumerate(losses)]


def report(bans: list[int | None], final: list[float]) -> dict[str, Any]:
    peers = {f"peer{i}": {"rounds": rounds([5.0, 4.0, 3.0, loss], ban)}
             for i, (ban, loss) in enumerate(zip(bans, final, strict=True))}
    return {"peers": peers | {"peer3": {"rounds": rounds([5.0, 9.0, 9.0, 9.0], None)}}}


def test_a_row_judges_the_honest_peers_only_and_bans_count_from_the_attacks_start() -> None:
    row = bench.summarise("gasloc", "aimed", True, report([2, 3, 3], [2.0, 2.2, 2.4]), {"peer3"}, {"Qm-attacker"})
    assert row["honest_peers"] == 3 and row["honest_val_loss"] == pytest.approx(2.2)
    assert row["honest_val_loss_spread"] == pytest.approx(0.4)
    assert row["rounds_to_ban"] == 3 - bench.ATTACK_FROM_ROUND + 1  # the last honest peer's first banned round
    assert row["alone"] == pytest.approx(0.25)
    never = bench.summarise("gasloc", "aimed", True, report([2, None, 3], [2.0, 2.2, 2.4]), {"peer3"},
                            {"Qm-attacker"})
    assert never["rounds_to_ban"] is None, "one honest peer that never banned it: never"


def test_on_rows_meet_the_target_within_it_and_off_rows_of_a_lie_beyond_it() -> None:
    base = {"honest_val_loss_spread": 0.0, "rounds_to_ban": None, "alone": 0.0, "honest_rounds": 30}
    rows = [base | {"mode": "gasloc", "class": "clean", "defences": "on", "honest_val_loss": 2.0},
            base | {"mode": "gasloc", "class": "clean", "defences": "off", "honest_val_loss": 2.02},
            base | {"mode": "gasloc", "class": "aimed", "defences": "on", "honest_val_loss": 2.06},
            base | {"mode": "gasloc", "class": "aimed", "defences": "off", "honest_val_loss": 2.5},
            base | {"mode": "gasloc", "class": "replay", "defences": "on", "honest_val_loss": 2.2},
            base | {"mode": "gasloc", "class": "replay", "defences": "off", "honest_val_loss": 2.04}]
    bench.judge(rows, target=0.05)
    assert [r["meets_target"] for r in rows] == [True, True, True, True, False, False]
    assert rows[3]["gap"] == pytest.approx(0.25)
    text = bench.table(rows, 0.05)
    assert "| gasloc | replay | on | 2.2000 (±0.000) | +10.0% | beyond ✗ | never |" in text
    assert text.count("\n") == len(rows) + 1


def test_repeated_runs_of_a_row_average_and_the_slowest_ban_counts() -> None:
    run = {"mode": "diloco", "class": "aimed", "defences": "on", "honest_val_loss_spread": 0.1, "alone": 0.0,
           "honest_rounds": 30, "wall_s": 30.0}
    row = bench.merged([run | {"honest_val_loss": 2.0, "rounds_to_ban": 1},
                        run | {"honest_val_loss": 2.3, "rounds_to_ban": 2}])
    assert row["honest_val_loss"] == pytest.approx(2.15) and row["rounds_to_ban"] == 2
    assert row["run_losses"] == [2.0, 2.3]
    assert bench.merged([run | {"honest_val_loss": 2.0, "rounds_to_ban": 1},
                         run | {"honest_val_loss": 2.0, "rounds_to_ban": None}])["rounds_to_ban"] is None
    bench.judge([row], 0.05)
    assert "2.1500 (±0.050; 2.000, 2.300)" in bench.table([row], 0.05)


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--modes", "gasloc,bogus"], ["--classes", "nan"],
                                  ["--attackers", "2"], ["--attackers", "0"], ["--rounds", "2"]])
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(argv)
    assert exited.value.code == 2 and "error:" in capsys.readouterr().err
