"""The testnet report's plots: validation loss and utilisation against wall clock (events marked), bytes per
round, one series per peer and life."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Row = Mapping[str, Any]  # one metrics line of a peer


@dataclasses.dataclass(frozen=True)
class PlotData:
    """What the plots draw, taken from a run's record (report.py)."""

    started: float  # unix time the peers were started: x = 0
    rows: Mapping[str, Sequence[Row]]  # peer -> its metrics lines, in order
    lives: Mapping[str, Sequence[Sequence[Row]]]  # peer -> the metrics lines of each of its lives
    marks: Sequence[tuple[float, str]]  # (unix time, description) of each event that happened


def write_plots(data: PlotData, out: Path) -> list[Path]:
    """loss.png (validation loss vs wall clock, events marked), utilisation.png, bytes.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {
        "loss.png": ("validation loss", lambda row: row["val_loss"] if row.get("evaluated", True) else None),
        "utilisation.png": ("compute time / round time", lambda row: row["compute_s"] / max(row["round_s"], 1e-9)),
    }
    written = []
    for file_name, (label, value) in series.items():  # a value of None: not measured that round (run.eval_every)
        fig, ax = plt.subplots(figsize=(10, 5))
        for index, peer in enumerate(data.rows):
            for n, life_rows in enumerate(data.lives.get(peer, ())):
                rows = [row for row in life_rows if value(row) is not None]
                ax.plot([row["time"] - data.started for row in rows], [value(row) for row in rows], marker=".",
                        color=f"C{index % 10}", label=peer if n == 0 else None)
        _mark_events(ax, data)
        ax.set(xlabel="seconds since the peers started", ylabel=label, title=f"{label} per peer")
        ax.legend(loc="best", fontsize="small")
        written.append(_save(fig, out / file_name, plt))
    fig, ax = plt.subplots(figsize=(10, 5))
    for index, (peer, peer_rows) in enumerate(data.rows.items()):
        ax.plot([row["round"] for row in peer_rows],
                [(row["bytes_sent"] + row["bytes_received"]) / 1e6 for row in peer_rows],
                marker=".", linestyle="", color=f"C{index % 10}", label=peer)
    ax.set(xlabel="round", ylabel="MB sent + received", title="bytes per round per peer")
    ax.set_ylim(bottom=0)  # the same payload every round: an axis from zero shows it as level, not as noise
    ax.legend(loc="best", fontsize="small")
    written.append(_save(fig, out / "bytes.png", plt))
    return written


def _mark_events(ax: Any, data: PlotData) -> None:
    for when, description in data.marks:
        x = when - data.started
        ax.axvline(x, color="grey", linestyle=":", linewidth=1)
        ax.text(x, 0.98, f" {description}", rotation=90, va="top", ha="right", fontsize=7,
                transform=ax.get_xaxis_transform())


def _save(fig: Any, path: Path, plt: Any) -> Path:
    for ax in fig.axes:  # ticks that read as values: never "+1.32e1" over ticks of 0.006 to 0.008
        ax.ticklabel_format(axis="both", style="plain", useOffset=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
