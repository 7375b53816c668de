"""The CLI as a volunteer meets it: user mistakes exit 2 with one `error:` line and never a traceback.

Every command runs in a process of its own, as `python -m p2ptrain.cli` runs it. The runs that do not touch the
network start together in one module fixture, forked from a process that has imported torch, transformers and
hivemind once (tests/cli_zygote.py); the cases of REAL_PROCESSES start a fresh interpreter, as a volunteer's shell
does.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cli_zygote import ZygoteChild, zygote

from p2ptrain import __version__
from p2ptrain.checkpoint import TrainingCheckpoint, save_checkpoint
from p2ptrain.config import build_config
from p2ptrain.maths.inner import InnerTrainer
from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.models import build_model, model_fingerprint

pytestmark = pytest.mark.slow  # every test reads CLI runs made as subprocesses

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 240
UNREACHABLE_PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWD7zMSytpc5uPkJPRcM54GhnyBLrL5YDa6L4AAJqde25w"


@dataclasses.dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def cli_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def start_cli(args: list[str], workdir: Path, name: str,
              fresh: bool = False) -> tuple[subprocess.Popen[bytes] | ZygoteChild, Path, Path]:
    """Run `python -m p2ptrain.cli ARGS` in `workdir`, its output going to files (no pipe can fill up): forked from
    the zygote, or with `fresh`, in a new interpreter."""
    out, err = workdir / f"{name}.stdout", workdir / f"{name}.stderr"
    if not fresh:
        return zygote(cli_env()).start({"module": "p2ptrain.cli"}, args, workdir, out, err), out, err
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "p2ptrain.cli", *args], cwd=workdir, env=cli_env(),
                                   stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr)
    return process, out, err


def finish(process: subprocess.Popen[bytes] | ZygoteChild, out: Path, err: Path) -> Outcome:
    try:
        returncode = process.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return Outcome(returncode, out.read_text(errors="replace"), err.read_text(errors="replace"))


def run_cli(args: list[str], workdir: Path, name: str) -> Outcome:
    return finish(*start_cli(args, workdir, name))


def save_tiny_checkpoint(directory: Path, vocab_size: int = 257) -> None:
    """A valid checkpoint of the `tiny` preset with the CLI's default config otherwise (257: the byte tokenizer)."""
    config = build_config({"model": {"name": "tiny"}})
    model = build_model(config.model, vocab_size, config.run.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    inner, outer = InnerTrainer(model, config.inner, torch.device("cpu")), OuterOptimizer(params, config.outer)
    named = {n: p.detach() for n, p in model.named_parameters()}
    sync_state = {"mode": config.sync.mode, "tensors": [t for _, t in outer.state_tensors()]}
    save_checkpoint(directory, TrainingCheckpoint(0, named, inner.state_dict(), sync_state, config.to_dict(),
                                                  model_fingerprint(model)))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    (root / "wrong_key.yaml").write_text("inner:\n  stepz: 3\n")
    # `base` at 2048 x 512 tokens a step: about 350 GiB by the plan, more than any test machine has
    (root / "too_big.yaml").write_text("model:\n  name: base\n  max_seq_len: 512\ndata:\n  batch_size: 2048\n"
                                       "  seq_len: 512\n")
    (root / "empty-ckpt").mkdir()
    save_tiny_checkpoint(root / "other-model-ckpt", vocab_size=300)
    save_tiny_checkpoint(root / "corrupt-ckpt")
    safetensors = root / "corrupt-ckpt" / "round-000000" / "model.safetensors"
    safetensors.write_bytes(safetensors.read_bytes()[:1000])
    return root


TINY = ["peer", "--model", "tiny", "--no-progress", "--loopback"]

# name -> (arguments, a piece the error line must contain); the runs that stop before any network I/O
CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "bad flag": (lambda d: ["peer", "--no-such-flag"], "--no-such-flag"),
    "bad choice": (lambda d: ["peer", "--device", "tpu"], "tpu"),
    "unknown preset": (lambda d: ["peer", "--model", "nope", "--loopback"], "'nope'"),
    "wrong config key": (lambda d: ["peer", "--config", str(d / "wrong_key.yaml"), "--loopback"], "inner.stepz"),
    "missing config": (lambda d: ["peer", "--config", str(d / "absent.yaml"), "--loopback"], "absent.yaml"),
    "malformed multiaddr": (lambda d: [*TINY, "--initial-peers", "not/a/multiaddr"], "not/a/multiaddr"),
    "resume from empty dir": (lambda d: [*TINY, "--resume", "--checkpoint-dir", str(d / "empty-ckpt")],
                              "no checkpoint"),
    "resume from corrupt dir": (lambda d: [*TINY, "--resume", "--checkpoint-dir", str(d / "corrupt-ckpt")],
                                "corrupt"),
    "resume another model": (lambda d: [*TINY, "--resume", "--checkpoint-dir", str(d / "other-model-ckpt")],
                             "another model"),
    "no workers": (lambda d: ["peer", "--workers", "0"], "--workers"),
    "a node on a missing GPU": (lambda d: [*TINY, "--workers", "2", "--device", "cuda"], "CUDA is not available"),
    "a peer its device cannot hold": (lambda d: ["peer", "--config", str(d / "too_big.yaml"), "--loopback",
                                                 "--device", "cpu"], "does not fit its device"),
    "status --count without --watch": (lambda d: ["status", "--initial-peers", UNREACHABLE_PEER, "--count", "2"],
                                       "--count needs --watch"),
    "status with no address": (lambda d: ["status"], "give either --initial-peers"),
    "status --page of no web address": (lambda d: ["status", "--page", "127.0.0.1:8080"], "http:// address"),
    "status --page with --run-id": (lambda d: ["status", "--page", "http://127.0.0.1:1/", "--run-id", "r"],
                                    "neither --serve nor --run-id"),
    "export a missing checkpoint": (lambda d: ["export", str(d / "absent-ckpt"), str(d / "out")], "no checkpoint"),
    "export a corrupt checkpoint": (lambda d: ["export", str(d / "corrupt-ckpt"), str(d / "out")], "corrupt"),
    "sample without a prompt": (lambda d: ["sample", str(d / "other-model-ckpt")], "--prompt"),
    "export with no OUT": (lambda d: ["export", str(d / "corrupt-ckpt")], "CHECKPOINT OUT, or OUT with --from-swarm"),
    "export a checkpoint from a swarm": (lambda d: ["export", str(d / "corrupt-ckpt"), str(d / "out"), "--from-swarm",
                                                    UNREACHABLE_PEER], "CHECKPOINT OUT, or OUT with --from-swarm"),
    "export a checkpoint with network flags": (lambda d: ["export", str(d / "corrupt-ckpt"), str(d / "out"),
                                                          "--loopback"], "go with --from-swarm"),
    "bootstrap signing without a run file": (lambda d: ["bootstrap", "--sign-with", str(d / "key")], "needs --config"),
}
HELP_COMMANDS = [[], ["peer"], ["bootstrap"], ["status"], ["testnet"], ["export"], ["sample"]]
# in a fresh interpreter: a flag mistake (answered before torch loads) and one that builds the config
REAL_PROCESSES = {"bad flag", "wrong config key"}


def test_the_cli_builds_its_flags_without_torch_transformers_or_hivemind() -> None:
    """--help, --version and a mistyped flag answer at once: the heavy libraries load when a command runs."""
    probe = "import sys, p2ptrain.cli; print([m for m in ('torch', 'transformers', 'hivemind') if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=cli_env(), timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


@pytest.fixture(scope="module")
def outcomes(workdir: Path) -> dict[str, Outcome]:
    """Run every case and every --help at once; keyed by case name, or 'help <command>'."""
    before = {name: snapshot(workdir / name) for name in ("corrupt-ckpt", "other-model-ckpt", "empty-ckpt")}
    runs = {name: start_cli(args(workdir), workdir, name.replace(" ", "_"), fresh=name in REAL_PROCESSES)
            for name, (args, _) in CASES.items()}
    for command in HELP_COMMANDS:
        runs[f"help {' '.join(command)}"] = start_cli([*command, "--help"], workdir, f"help_{'_'.join(command)}")
    runs["no arguments"] = start_cli([], workdir, "no_arguments")
    runs["version"] = start_cli(["--version"], workdir, "version")
    results = {name: finish(*run) for name, run in runs.items()}
    for name, files in before.items():
        assert snapshot(workdir / name) == files, f"the CLI changed the files in {name}"
    return results


def assert_one_line_user_error(outcome: Outcome, expected_piece: str) -> None:
    assert "Traceback" not in outcome.stderr and "Traceback" not in outcome.stdout, outcome.stderr
    assert outcome.returncode == 2, outcome.stderr
    assert len(outcome.error_lines) == 1, outcome.stderr
    assert expected_piece in outcome.error_lines[0], outcome.error_lines[0]
    last_line = [line for line in outcome.stderr.splitlines() if line.strip()][-1]
    assert last_line == outcome.error_lines[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_user_mistake_is_one_error_line_and_exit_2(outcomes: dict[str, Outcome], case: str) -> None:
    assert_one_line_user_error(outcomes[case], CASES[case][1])


@pytest.mark.parametrize("case", ["bad flag", "bad choice"])
def test_bad_flag_stderr_is_exactly_one_line(outcomes: dict[str, Outcome], case: str) -> None:
    assert outcomes[case].stderr.strip().splitlines() == outcomes[case].error_lines


def test_corrupt_checkpoint_files_are_unchanged(outcomes: dict[str, Outcome], workdir: Path) -> None:
    # `outcomes` compares every checkpoint directory byte for byte before and after the runs
    assert (workdir / "corrupt-ckpt" / "latest").read_text().strip() == "round-000000"


@pytest.mark.parametrize("command", [" ".join(c) for c in HELP_COMMANDS])
def test_help_exits_0(outcomes: dict[str, Outcome], command: str) -> None:
    outcome = outcomes[f"help {command}"]
    assert outcome.returncode == 0, outcome.stderr
    assert "Usage:" in outcome.stdout and not outcome.error_lines and "Traceback" not in outcome.stderr


def test_version_is_one_line_with_the_package_version(outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes["version"]
    assert outcome.returncode == 0 and outcome.stdout == f"p2ptrain {__version__}\n", outcome.stdout + outcome.stderr


def test_no_arguments_shows_usage_not_an_error(outcomes: dict[str, Outcome]) -> None:
    """click 8.2+ raises NoArgsIsHelpError, which must not come out as 'error: Usage: ...' followed by the whole
    help text (many lines) on stderr."""
    outcome = outcomes["no arguments"]
    assert "Usage:" in outcome.stdout + outcome.stderr and "Traceback" not in outcome.stderr
    assert not outcome.error_lines, outcome.stderr


@pytest.mark.network
def test_unreachable_initial_peer_is_one_error_line(tmp_path: Path) -> None:
    """A well-formed address where no peer listens: p2pd fails to reach its bootstrap peer."""
    outcome = run_cli([*TINY, "--initial-peers", UNREACHABLE_PEER], tmp_path, "unreachable")
    assert_one_line_user_error(outcome, "cannot join the swarm")
    assert UNREACHABLE_PEER in outcome.error_lines[0]
