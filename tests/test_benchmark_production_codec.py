"""benchmarks/production_codec.py: a --quick run (real peers on loopback) gives both rows for the seed, every round
averaged by both peers, the sparse row's bytes a small fraction of fp32's, and the JSON and table."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import production_codec  # noqa: E402

pytestmark = [pytest.mark.network, pytest.mark.slow]


@pytest.mark.alone  # every round averaged by both peers: wall-clock rounds of 3 steps (a loaded CI run lost one)
def test_quick_run(tmp_path: Path) -> None:
    settings, _ = production_codec.parse_args(["--quick"])
    assert settings == production_codec.QUICK
    output = tmp_path / "production_codec.json"
    report = production_codec.run(settings, output, command="pytest")
    written = json.loads(output.read_text())
    assert [(r["row"], r["seed"]) for r in written["runs"]] == [("fp32", 0), ("sparse2-2%", 0)]
    for r in written["runs"]:
        assert not r["errors"] and not r["timed_out"] and r["rounds_done"] == [settings.rounds] * settings.peers
        assert r["full_groups"] == 1.0 and math.isfinite(r["val_loss"])
    fp32, sparse = written["runs"]
    assert fp32["bytes_per_round"] >= 4 * fp32["parameters"]  # a pair swaps one fp32 Δ each
    assert sparse["bytes_per_round"] < fp32["bytes_per_round"] / 20
    assert written["summary"]["bytes_ratio"] == pytest.approx(sparse["bytes_per_round"] / fp32["bytes_per_round"])
    assert written["summary"]["verdict"] in ("PASS", "MISS")
    table = production_codec.markdown(report)
    assert table.count("\n| 0 | ") == 2 and "sparse2-2% against fp32" in table


def test_bad_settings_are_refused_with_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        production_codec.parse_args(["--seeds", "0"])
    assert exit_info.value.code == 2 and "--seeds" in capsys.readouterr().err
