"""benchmarks/gpu_check.py on CPU at toy sizes: every line the GPU run takes (the plan beside three precision
settings, the outer step on the device, two peers sharing the device) runs here, and passes its own verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import gpu_check  # noqa: E402

pytestmark = [pytest.mark.network, pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def test_the_cpu_path_runs_every_section_and_passes(tmp_path: Path) -> None:
    report = gpu_check.run(torch.device("cpu"), gpu_check.QUICK, tmp_path / "gpu_check.json")
    assert report["problems"] == [], report["problems"]
    assert [(r["model"], r["precision"]) for r in report["memory"]] == [
        ("tiny", "fp32"), ("llama-124m", "fp32"), ("llama-124m", "fp16/dev"), ("llama-124m", "bf16+ckpt")]
    assert all(r["finite"] and r["planned_bytes"] > 0 and r["measured_bytes"] is None for r in report["memory"])
    swarm = report["swarm"]
    assert swarm["rounds"] == [2, 2] and swarm["state_distance"] < 1e-6 and not swarm["errors"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["swarm"]["rounds_asked"] == 2
    # a CPU raises no out-of-memory error: only the refusal at start runs here
    [refused] = report["peer_command"]
    assert refused["case"] == "does not fit" and refused["exit"] == 2 and not refused["traceback"]
    assert refused["last_line"].startswith("error: this peer does not fit its device: cpu ")
    table = gpu_check.table(report)
    assert table.splitlines()[-1] == "PASS" and "llama-124m" in table


def test_the_verdict_fails_a_plan_below_the_peak_a_split_swarm_a_loss_that_did_not_fall_and_a_traceback() -> None:
    row = {"model": "m", "precision": "bf16", "finite": True, "plan_error": -0.1}
    swarm = {"errors": [], "rounds": [3, 3], "rounds_asked": 3, "val_loss": [[4.0, 3.0], [4.0, 4.1]],
             "peers_averaged": [[1, 1], [1, 1]], "state_distance": 0.5}
    out_of_memory = {"case": "out of memory", "exit": 1, "traceback": True, "error_lines": 0,
                     "last_line": "torch.OutOfMemoryError: CUDA out of memory."}
    problems = gpu_check.verdict({"memory": [row], "swarm": swarm, "peer_command": [out_of_memory]})
    assert len(problems) == 5 and "plan is -10.0 %" in problems[0] and "out of memory: exit 1" in problems[4]
