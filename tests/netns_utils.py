"""Helpers shared by the tests that build network namespaces (they need root; see conftest.netns_ok)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from p2ptrain.testnet.netns import STATE_DIR

REPO_ROOT = Path(__file__).resolve().parents[1]


def stop_and_clean_up(owner: subprocess.Popen[bytes], prefix: str) -> None:
    """End a test's testbed owner (a launcher or a worker) and, should its guard have failed to delete the
    namespaces named `prefix`, delete them by hand: a failed test must still leave the machine clean."""
    if owner.poll() is None:
        owner.kill()
    owner.wait()
    if (STATE_DIR / f"{prefix}.json").exists():
        subprocess.run([sys.executable, "-m", "p2ptrain.testnet.netns", "--cleanup"], cwd=REPO_ROOT, check=False)
