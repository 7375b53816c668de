"""benchmarks/robustness.py: the attackers' values by hand; a --quick run (every row, the JSON, attacks bite)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import robustness  # noqa: E402

HONEST = [torch.tensor([3.0, 4.0])]
REFERENCE = [torch.tensor([0.0, 1.0])]
STALE = [torch.tensor([7.0, 7.0])]


def test_attackers_values() -> None:
    def sent(attack: str, reach: float = 0.0) -> list[float]:
        return robustness.tampered(attack, HONEST, REFERENCE, STALE, reach)[0].tolist()

    assert sent("sign_flip") == [-3000.0, -2999.0]  # payload (3, 3) from the reference, ×(−1000)
    assert sent("scale") == [3000.0, 3001.0]
    assert sent("replay") == [7.0, 7.0]
    assert all(math.isnan(x) for x in sent("nan"))
    aimed = sent("aimed", reach=100.0)  # toward the reference (direction −(1, 1)/√2) by 0.99 × 100
    assert aimed == pytest.approx([3.0 - 99.0 / math.sqrt(2), 4.0 - 99.0 / math.sqrt(2)])


@pytest.mark.slow
@pytest.mark.background  # CPU work, nothing timed (tests/README.md)
def test_quick_run(tmp_path: Path) -> None:
    settings, _ = robustness.parse_args(["--quick"])
    output = tmp_path / "robustness.json"
    report = robustness.run(settings, output, command="pytest")
    written = json.loads(output.read_text())  # strict JSON: non-finite losses are written as null
    keys = ("mode", "attack", "attackers", "defended")
    expected = [tuple(getattr(case, key) for key in keys) for case in robustness.CASES]
    assert [tuple(row[key] for key in keys) for row in written["rows"]] == expected
    assert len(expected) == 2 * (2 + 5 * 2 * 2)  # per mode: clean on/off, 5 attacks × 1 or 2 attackers × on/off
    assert written["command"] == "pytest" and written["wall_s"] > 0 and written["cpu_s"] > 0
    assert all(row["met"] in ("yes", "no", "") for row in written["rows"])

    rows = {tuple(row[key] for key in keys): row for row in written["rows"]}
    for mode in robustness.MODES:
        clean, clean_on = rows[(mode, "clean", 0, False)], rows[(mode, "clean", 0, True)]
        assert clean["val_loss"] < 5.4 and clean_on["val_loss"] < 5.4  # trained: ln 257 = 5.55 for a uniform guess
        assert clean_on["tokens_ratio"] > 0 and 0 < clean_on["defence_cpu_percent"] < 100
        worse = [rows[(mode, attack, 1, False)]["val_loss"] for attack in ("aimed", "scale")]
        assert any(loss is None or loss > 1.05 * clean["val_loss"] for loss in worse), (mode, worse)

    table = robustness.markdown(report)
    assert table.count("\n| gasloc |") == table.count("\n| diloco |") == len(expected) // 2
    assert "Targets missed (defences on):" in table and "Attacks too weak" in table
