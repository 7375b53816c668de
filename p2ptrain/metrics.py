"""Per-round metrics: one JSON line per round in a file, scalars for TensorBoard and W&B, and a live progress bar."""

from __future__ import annotations

import dataclasses
import json
import logging
import netrc
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from p2ptrain.errors import UserError, one_line

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RoundMetrics:
    """What one round did. Seconds are wall-clock; `comm_blocked_s` is time training waited on the network."""

    peer_id: str
    round: int
    inner_steps: int
    train_loss: float
    val_loss: float
    tokens_per_s: float
    compute_s: float
    comm_blocked_s: float
    bytes_sent: int
    bytes_received: int
    peers_averaged: int  # group size of this round's averaging, ourselves included
    round_s: float  # wall-clock seconds of the whole round
    joined: bool = False  # this round started from state downloaded from a peer
    sync: str = "diloco"  # the outer-sync mode
    partners: list[str] = dataclasses.field(default_factory=list)  # peers this peer started exchanges with
    codec: str = "none"
    exchange_s: float = 0.0  # seconds spent in exchanges (overlapped with compute for factored's Mix1)
    consensus_distance: list[float] = dataclasses.field(default_factory=list)  # ‖θ_i − θ_j‖/‖θ_i‖ per exchange
    failed_exchanges: int = 0
    refused_exchanges: int = 0
    exchanges: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # partner, codec, bytes, seconds each
    banned_peers: list[str] = dataclasses.field(default_factory=list)  # peers this peer refuses at the round's end
    mix2_averaged: int = 0  # factored: the group size of the Mix2 applied this round (0: none)
    eval_s: float = 0.0  # seconds of the round's validation (in round_s; neither compute nor network)
    evaluated: bool = True  # val_loss was measured this round (false: the latest, `run.eval_every`)
    time: float = dataclasses.field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


class MetricsLog:
    """Appends RoundMetrics as JSON lines (flushed per line, so a crash loses at most the current round) to `path`,
    as TensorBoard scalars to `tensorboard_dir` and to the W&B project `wandb_project`; each may be None."""

    def __init__(self, path: str | Path | None, tensorboard_dir: str | Path | None = None,
                 wandb_project: str | None = None, run_id: str = "", run_config: dict[str, Any] | None = None):
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tensorboard = TensorBoardLog(tensorboard_dir) if tensorboard_dir else None
        self.wandb = WandbLog(wandb_project, run_id, run_config or {}) if wandb_project else None

    def write(self, metrics: RoundMetrics) -> None:
        if self.tensorboard is not None:
            self.tensorboard.write(metrics)
        if self.wandb is not None:
            self.wandb.write(metrics)
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(metrics.to_json() + "\n")

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()


# tag -> the RoundMetrics field it plots, one point per round (TensorBoard and W&B)
ROUND_SCALARS = {
    "loss/train": "train_loss", "loss/validation": "val_loss", "speed/tokens_per_s": "tokens_per_s",
    "time/round_s": "round_s", "time/compute_s": "compute_s", "time/comm_blocked_s": "comm_blocked_s",
    "network/bytes_sent": "bytes_sent", "network/bytes_received": "bytes_received",
    "swarm/peers_averaged": "peers_averaged",
}


def round_scalars(metrics: RoundMetrics) -> dict[str, float]:
    """The round's scalars by tag: the validation loss only where the round measured it, and the share of the
    round spent computing."""
    scalars = {tag: float(getattr(metrics, field)) for tag, field in ROUND_SCALARS.items()
               if field != "val_loss" or metrics.evaluated}
    if metrics.round_s > 0:
        scalars["time/compute_utilisation"] = metrics.compute_s / metrics.round_s
    return scalars


class TensorBoardLog:
    """Each round's figures as TensorBoard scalars (step: the round), written at once so a live run can be
    watched: `tensorboard --logdir DIR`. The validation loss is written for rounds that measured it only."""

    def __init__(self, directory: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("run.tensorboard_dir (--tensorboard) needs TensorBoard: pip install 'p2ptrain[tensorboard]'"
                            ) from None
        try:
            self.writer = SummaryWriter(log_dir=str(directory))
        except OSError as e:
            raise UserError(f"cannot write TensorBoard logs to {str(directory)!r}: {e.strerror or e}") from None

    def write(self, metrics: RoundMetrics) -> None:
        for tag, value in round_scalars(metrics).items():
            self.writer.add_scalar(tag, value, metrics.round, walltime=metrics.time)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


WANDB_MODES = ("online", "offline", "disabled", "shared")


class WandbLog:
    """Each round's scalars to a Weights & Biases run (step: the round; name: the peer id, group: the run id).
    Online where a W&B API key is set up (WANDB_API_KEY, or `wandb login`), else offline under ./wandb (WANDB_DIR),
    which `wandb sync` uploads later; WANDB_MODE chooses outright. The run starts at the first round, once the peer
    id is known; a W&B that fails then or later is logged once and dropped: training goes on without it. It sends
    the round figures and the config, nothing of the volunteer's machine (no host facts, system stats, git state)."""

    def __init__(self, project: str, group: str, run_config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise UserError("run.wandb_project (--wandb) needs W&B: pip install 'p2ptrain[wandb]'") from None
        self._wandb, self.project, self.group, self.run_config = wandb, project, group, run_config
        self.mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_key_set_up() else "offline")
        if self.mode not in WANDB_MODES:
            raise UserError(f"WANDB_MODE must be one of {', '.join(WANDB_MODES)}, got {self.mode[:40]!r}")
        self.run: Any = None
        self.failed = False

    def write(self, metrics: RoundMetrics) -> None:
        if self.failed:
            return
        try:
            if self.run is None:
                self.run = self._wandb.init(
                    project=self.project, name=metrics.peer_id, group=self.group or None, config=self.run_config,
                    mode=self.mode,  # type: ignore[arg-type]  # one of WANDB_MODES
                    # a volunteer's round figures only: no console capture, git state, code, host facts or stats
                    settings=self._wandb.Settings(console="off", silent=True, disable_git=True, disable_code=True,
                                                  save_code=False, x_save_requirements=False,
                                                  x_disable_meta=True, x_disable_stats=True,
                                                  x_disable_machine_info=True, host=metrics.peer_id))
                where = "online" if self.mode == "online" else \
                    f"offline in {Path(self.run.dir).parent} (`wandb sync` uploads it)"
                logger.info(f"W&B: run {metrics.peer_id} of project {self.project!r}, {where}")
            self.run.log(round_scalars(metrics), step=metrics.round)
        except Exception as e:  # W&B's own errors (no network, a bad key, a full disk): metrics are not the training
            self.failed = True
            logger.warning(f"W&B logging stopped: {type(e).__name__}: {one_line(e, 200)}")

    def close(self) -> None:
        """Finish the run and stop W&B's service process with it (not at exit: a peer's end is the run's)."""
        if self.run is not None:
            try:
                self.run.finish()
                self._wandb.teardown()
            except Exception as e:
                logger.warning(f"W&B could not finish its run: {type(e).__name__}: {one_line(e, 200)}")


def _wandb_key_set_up() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All well-formed lines of a metrics file (a torn last line is skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class ProgressBar:
    """A tqdm bar over rounds, with the inner step and live figures in its postfix, on a terminal; one line per
    round where stderr is not a terminal (a container's or a service's log); silent when disabled."""

    def __init__(self, enabled: bool, total_rounds: int, stream: TextIO | None = None):
        self._stream = stream or sys.stderr
        self._lines = enabled and not self._stream.isatty()  # carriage-return frames would flood a log file
        self._total, self._done = total_rounds, 0
        self._bar = tqdm(total=total_rounds or None, unit="round", disable=not enabled or self._lines,
                         dynamic_ncols=True, file=self._stream)

    def inner_step(self, round_: int, step: int, loss: float, peers: int) -> None:
        self._bar.set_postfix_str(f"round {round_} step {step} loss {loss:.3f} peers {peers}", refresh=False)
        self._bar.refresh()

    def round_done(self, metrics: RoundMetrics) -> None:
        figures = f"val {metrics.val_loss:.3f} {metrics.tokens_per_s:.0f} tok/s peers {metrics.peers_averaged}"
        self._done += 1
        if self._lines:
            of_total = f"/{self._total}" if self._total else ""
            print(f"round {metrics.round} ({self._done}{of_total}) train {metrics.train_loss:.3f} {figures} "
                  f"{metrics.round_s:.1f} s" + (" (joined)" if metrics.joined else ""), file=self._stream, flush=True)
        self._bar.set_postfix_str(f"round {metrics.round} {figures}", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
