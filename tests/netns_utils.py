"""Helpers shared by the tests that build network namespaces (they need root; see conftest.netns_ok)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from p2ptrain.testnet.netns import STATE_DIR
from p2ptrain.testnet.netns_run import NetnsTestnetOptions, run_netns_testnet

REPO_ROOT = Path(__file__).resolve().parents[1]


def stop_and_clean_up(owner: subprocess.Popen[bytes], prefix: str) -> None:
    """End a test's testbed owner (a launcher or a worker) and, should its guard have failed to delete the
    namespaces named `prefix`, delete them by hand: a failed test must still leave the machine clean."""
    if owner.poll() is None:
        owner.kill()
    owner.wait()
    if (STATE_DIR / f"{prefix}.json").exists():
        subprocess.run([sys.executable, "-m", "p2ptrain.testnet.netns", "--cleanup"], cwd=REPO_ROOT, check=False)


def run_shipped_scenario(name: str, workdir: Path, timeout_s: int) -> tuple[bool, dict[str, Any]]:
    """Run `testnet/scenarios/<name>` as written into `workdir`: (whether the run trained, its report)."""
    ok = run_netns_testnet(NetnsTestnetOptions(scenario_path=str(REPO_ROOT / "testnet" / "scenarios" / name),
                                               workdir=str(workdir), timeout_s=timeout_s,
                                               name_prefix=f"{name[:2]}{os.getpid() % 100000}"))
    return ok, json.loads((workdir / "report" / "report.json").read_text())
