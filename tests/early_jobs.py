"""Set-up jobs that take minutes and need nothing from a test (the type check; the Docker engine and images on a
fresh machine) start in the background once collection ends, so their minutes overlap the tests that run before
the ones that read them. A test then reads a step's outcome, waiting for it; a job that was not started early (its
reader was not among the selected tests at collection) runs when first read.

A started job is handed to init, not to the suite: the fixture that reaps what a test leaves behind must not kill it
mid-way. It still gets the terminal's Ctrl-C, as the suite does."""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from subreaper import orphans_go_to_init

POLL_S = 0.5
REPO = Path(__file__).resolve().parents[1]  # every step runs here
RUN_KEY = os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex  # one run of the suite, all its workers


@dataclasses.dataclass
class EarlyJob:
    """Named steps run in turn, each a command; the first that fails ends the job."""

    name: str
    steps: list[tuple[str, list[str]]]
    reader: str  # the fixture that reads its outcome: a selected test using it starts the job early
    timeout_s: float
    # "nice": niced, and the machine-wide tests wait for it to end; "idle": SCHED_IDLE, CPU time no test wants, and
    # no test but its reader waits for it (a job that writes little: a build's I/O is bounded by no CPU class)
    scheduling: str = "nice"
    workdir: Path | None = None  # where a started job writes each step's output and exit status
    ran: dict[str, subprocess.CompletedProcess[str]] = dataclasses.field(default_factory=dict)  # steps run when read

    def start(self) -> None:
        """Run the steps in the background, detached from the suite's process tree; once per run of the suite
        (under xdist, the first worker to get here starts it, and every worker reads the same files)."""
        self.workdir = Path(tempfile.gettempdir()) / f"p2ptrain-early-{RUN_KEY}-{self.name}"
        try:
            self.workdir.mkdir()
        except FileExistsError:
            return
        lines = [f"{shlex.join(argv)} >{self._file(step, 'out')} 2>{self._file(step, 'err')} </dev/null; "
                 f"rc=$?; echo $rc >{self._file(step, 'rc')}.tmp; mv {self._file(step, 'rc')}.tmp "
                 f"{self._file(step, 'rc')}; [ $rc = 0 ] || exit" for step, argv in self.steps]
        script = f"cd {shlex.quote(str(REPO))} || exit\n(\n" + "\n".join(lines) + f"\n); touch {self.workdir / 'ended'}"
        # niced: the tests beside it count exchanges in wall-clock rounds (a GASLoC swarm started none while dockerd
        # started); what the job starts (dockerd, its builds) inherits the niceness, or the idle class
        priority = ["chrt", "--idle", "0"] if self.scheduling == "idle" else ["nice", "-n", "10"]
        with orphans_go_to_init():  # the shell exits at once; its backgrounded child goes to init
            subprocess.run([*priority, "sh", "-c", f"( {script} ) >/dev/null 2>&1 &"], check=True, timeout=30)

    def outcome(self, step: str) -> subprocess.CompletedProcess[str]:
        """The step's exit status and output: waits for a started job; runs the steps up to this one otherwise."""
        if self.workdir is None:
            return self._run_now(step)
        deadline = time.monotonic() + self.timeout_s
        rc_file = self._file(step, "rc")
        while not rc_file.exists():
            if (self.workdir / "ended").exists() and not rc_file.exists():
                failed = next((name for name, _argv in self.steps if self._file(name, "rc").exists()
                               and self._file(name, "rc").read_text().strip() != "0"), "?")
                err = self._file(failed, "err")
                said = err.read_text(errors="replace")[-2000:] if err.exists() else ""
                return subprocess.CompletedProcess([step], -1, "", f"not run: step {failed} of {self.name} failed: "
                                                                   f"{said}")
            assert time.monotonic() < deadline, f"{self.name}: step {step} not done after {self.timeout_s:.0f} s"
            time.sleep(POLL_S)
        return subprocess.CompletedProcess(dict(self.steps)[step], int(rc_file.read_text()),
                                           self._file(step, "out").read_text(errors="replace"),
                                           self._file(step, "err").read_text(errors="replace"))

    def _run_now(self, step: str) -> subprocess.CompletedProcess[str]:
        for name, argv in self.steps:
            if name not in self.ran:
                with orphans_go_to_init():  # a daemon a step starts (dockerd) outlives single tests
                    self.ran[name] = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                                                    timeout=self.timeout_s)
            done = self.ran[name]
            if name == step:
                return done
            if done.returncode != 0:
                return subprocess.CompletedProcess(argv, -1, "", f"not run: step {name} of {self.name} failed: "
                                                                 f"{done.stderr[-2000:]}")
        raise KeyError(step)

    def _file(self, step: str, kind: str) -> Path:
        assert self.workdir is not None
        return self.workdir / f"{step}.{kind}"


def wait_ended(jobs: list[EarlyJob], timeout_s: float = 900) -> list[str]:
    """Wait until the niced jobs this run started have ended (at most `timeout_s`: then go on beside them); the
    names of those that were still running. The tests that count rounds in wall-clock time call this: beside a
    cold type check and a Docker build on 2 cores, a GASLoC swarm started no exchange."""
    give_up_at = time.monotonic() + timeout_s
    running = [job for job in jobs if job.scheduling == "nice" and job.workdir is not None
               and not (job.workdir / "ended").exists()]
    for job in running:
        while job.workdir is not None and not (job.workdir / "ended").exists() and time.monotonic() < give_up_at:
            time.sleep(POLL_S)
    return [job.name for job in running]


def remove_ended(jobs: list[EarlyJob]) -> None:
    """The files of the jobs this run started and that have ended (one still running keeps them until it ends)."""
    for job in jobs:
        if job.workdir is not None and (job.workdir / "ended").exists():
            shutil.rmtree(job.workdir, ignore_errors=True)


def start_wanted(jobs: list[EarlyJob], items: list[pytest.Item]) -> None:
    """Start each job that a selected test reads."""
    for job in jobs:
        if job.workdir is None and any(job.reader in getattr(item, "fixturenames", ()) for item in items):
            job.start()


# Debian's Chromium, for the status page's browser test (root: apt-get; ~20 s where the package lists are fresh)
BROWSER_INSTALL = ("command -v chromium >/dev/null || { export DEBIAN_FRONTEND=noninteractive; "
                   "apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends chromium || "
                   "{ apt-get -o DPkg::Lock::Timeout=600 update -qq && "
                   "apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends chromium; }; }")
BROWSER = EarlyJob("chromium", [("install", ["sh", "-c", BROWSER_INSTALL])], reader="chromium", timeout_s=900)
# W&B for the metrics test: the `wandb` extra of setup.cfg into this venv (its download overlaps the tests), held to
# the versions installed now: it must not replace a package that the tests running beside it import
_PYTHON = shlex.quote(sys.executable)
WANDB_INSTALL = (f"held=$(mktemp) && {_PYTHON} -m pip freeze --exclude-editable >\"$held\" && "
                 f"{_PYTHON} -m pip install -q -c \"$held\" \"$({_PYTHON} -c \"import configparser; "
                 "c = configparser.ConfigParser(); c.read('setup.cfg'); "
                 "print(c['options.extras_require']['wandb'].split()[0])\")\"; rc=$?; rm -f \"$held\"; exit $rc")
WANDB = EarlyJob("wandb", [("install", ["sh", "-c", WANDB_INSTALL])], reader="wandb_module", timeout_s=900)
# in the idle class: 86 s of CPU from a cold cache, taken from what the machine-wide tests leave idle; its test is a
# `background` one, after them
TYPE_CHECK = EarlyJob("mypy", [("check", [sys.executable, "-m", "mypy", "p2ptrain"])], reader="type_check",
                      timeout_s=1800, scheduling="idle")
