"""benchmarks/outer_step.py: a --quick run of each setting, and what its rows measure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import outer_step  # noqa: E402
from p2ptrain.maths.outer_optimizer import OuterConfig  # noqa: E402


def test_spikes_count_rounds_above_the_best_before_them() -> None:
    assert outer_step.spikes([5.0, 4.0, 3.0, 4.0, 2.9]) == (1, pytest.approx(4.0 / 3.0))  # 3.0 → 4.0
    assert outer_step.spikes([5.0, 4.0, 3.9]) == (0, 1.0)


@pytest.mark.slow
@pytest.mark.background  # CPU work, nothing timed (tests/README.md)
@pytest.mark.usefixtures("one_torch_thread")
def test_a_quick_run_measures_the_gain_of_each_recipe_against_the_shipped_default(tmp_path: Path) -> None:
    assert outer_step.main(["--quick", "--jobs", "1", "--output-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "outer_step.json").read_text())
    rows = {(r["H"], r["momentum"], r["lr"]): r for r in report["rows"]}
    assert len(rows) == len(outer_step.QUICK["inner_steps"]) * len(outer_step.RECIPES)
    default = (OuterConfig().momentum, OuterConfig().lr)
    assert default in outer_step.RECIPES
    for h in outer_step.QUICK["inner_steps"]:
        # without momentum the outer step moves θ by η × the mean Δ, exactly; γ 0.9 on aligned Δ moves it further
        assert rows[(h, *default)]["gain"] == pytest.approx(default[1], rel=1e-4)
        assert rows[(h, 0.9, 0.7)]["gain"] > 1.5
        assert all(len(trace) == outer_step.QUICK["total_steps"] // h + 1 for trace in rows[(h, *default)]["traces"])
    assert "| peers | H | γ | η |" in (tmp_path / "outer_step.md").read_text()


@pytest.mark.slow
@pytest.mark.background  # CPU work, nothing timed (tests/README.md)
@pytest.mark.usefixtures("one_torch_thread")
def test_the_modes_setting_trains_each_gossip_mode_at_each_outer_lr(tmp_path: Path) -> None:
    assert outer_step.main(["--quick", "--setting", "modes", "--jobs", "1", "--output-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "outer_step.json").read_text())["rows"]
    assert {(r["mode"], r["lr"]) for r in rows} == {(m, lr) for m in outer_step.MODE_ROWS for lr in outer_step.MODE_LRS}
    assert all(0 < r["final"] < 6 for r in rows)  # trained from θ_0's ~5.5, and finite


def test_bad_flags_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        outer_step.main(["--jobs", "0"])
    assert raised.value.code == 2 and "--jobs must be >= 1" in capsys.readouterr().err
