"""The testnet report's plots: validation loss and utilisation against wall clock (events marked), bytes per
round, one series per peer and life."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2ptrain.testnet.report import RunRecord


def write_plots(record: RunRecord, out: Path) -> list[Path]:
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
        for index, peer in enumerate(record.rows):
            for n, life in enumerate(record.lives_of(peer)):
                rows = [row for row in record.rows_of(life) if value(row) is not None]
                ax.plot([row["time"] - record.started for row in rows], [value(row) for row in rows], marker=".",
                        color=f"C{index % 10}", label=peer if n == 0 else None)
        _mark_events(ax, record)
        ax.set(xlabel="seconds since the peers started", ylabel=label, title=f"{label} per peer")
        ax.legend(loc="best", fontsize="small")
        written.append(_save(fig, out / file_name, plt))
    fig, ax = plt.subplots(figsize=(10, 5))
    for index, (peer, rows) in enumerate(record.rows.items()):
        ax.plot([row["round"] for row in rows], [(row["bytes_sent"] + row["bytes_received"]) / 1e6 for row in rows],
                marker=".", linestyle="", color=f"C{index % 10}", label=peer)
    ax.set(xlabel="round", ylabel="MB sent + received", title="bytes per round per peer")
    ax.legend(loc="best", fontsize="small")
    written.append(_save(fig, out / "bytes.png", plt))
    return written


def _mark_events(ax: Any, record: RunRecord) -> None:
    for event in record.events:
        if not event.ok:
            continue
        x = event.time - record.started
        ax.axvline(x, color="grey", linestyle=":", linewidth=1)
        ax.text(x, 0.98, f" {event.description}", rotation=90, va="top", ha="right", fontsize=7,
                transform=ax.get_xaxis_transform())


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
