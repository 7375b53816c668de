"""The release artefacts: an sdist and a wheel build from the tree, pass `twine check` (what PyPI checks of the
metadata and the README), and carry the package, its console script, the license and the one torch pin."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from p2ptrain import __version__

REPO = Path(__file__).resolve().parents[1]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done


# what a clean checkout does not hold (caches, environments, earlier builds, a local run's checkpoints)
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__",
                                     ".mypy_cache", ".ruff_cache", ".pytest_cache", "checkpoints", "*.safetensors",
                                     "*.pt")


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("dist")
    # Built from a copy: in the tree itself a CI run's sdist failed on a file that vanished between its listing and
    # its copy (the Docker set-up's `pip download .` prepares the package's metadata in the tree beside the tests).
    source = tmp_path_factory.mktemp("source") / "p2ptrain"
    shutil.copytree(REPO, source, ignore=NOT_SOURCES)
    # the wheel is built from the sdist, as pip builds it for a user who installs the sdist
    run("build", "--no-isolation", "--outdir", str(out), str(source))
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return sdist, wheel


@pytest.mark.slow
def test_the_sdist_and_the_wheel_pass_twine_check(artefacts: tuple[Path, Path]) -> None:
    done = run("twine", "check", "--strict", *map(str, artefacts))
    assert done.stdout.count("PASSED") == 2, done.stdout


@pytest.mark.slow
def test_the_wheel_carries_the_package_its_script_license_and_the_torch_pin(artefacts: tuple[Path, Path]) -> None:
    sdist, wheel = artefacts
    assert wheel.name == f"p2ptrain-{__version__}-py3-none-any.whl" and sdist.name == f"p2ptrain-{__version__}.tar.gz"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"p2ptrain-{__version__}.dist-info"
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert {"p2ptrain/cli.py", "p2ptrain/choices.py", "p2ptrain/sync/exchange_driver.py"} <= names
    assert not any(name.startswith(("tests/", "benchmarks/")) for name in names)
    assert any(name.startswith(f"{info}/") and name.endswith("LICENSE") for name in names)
    assert "p2ptrain = p2ptrain.cli:main" in entry_points
    # torch itself, not the packages named after it (the bench extra's torchft)
    pins = [line for line in metadata.splitlines() if re.match(r"Requires-Dist: torch\b(?![-_\w])", line)]
    assert pins == ["Requires-Dist: torch==2.13.0"]
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert "torch==2.13.0" in cfg.get("options", "install_requires")  # the pin's one place
    with tarfile.open(sdist) as archive:
        members = {Path(m.name).relative_to(f"p2ptrain-{__version__}").as_posix() for m in archive.getmembers()
                   if m.name != f"p2ptrain-{__version__}"}
    assert {"setup.cfg", "pyproject.toml", "README.md", "LICENSE", "p2ptrain/cli.py"} <= members
