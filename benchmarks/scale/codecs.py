"""Which outer-gradient codecs the scale simulation runs: fp16, and the codec the algorithm benchmark delivered.

The delivered codec is read from the algorithm benchmark's results (benchmarks/results/algorithms.json): among its
codec-frontier rows whose loss gap against the better fp32 DiLoCo is at most GAP_LIMIT_PERCENT (mean over seeds),
the one with the fewest bytes; its measured payload ÷ fp32 bytes is the simulation's Δ payload ratio. A ratio
given on the command line replaces it (and says so).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from benchmarks.scale.model import FP16_RATIO
from p2ptrain.errors import ConfigError, UserError

GAP_LIMIT_PERCENT = 1.0
CODECS = ("fp16", "delivered")


@dataclasses.dataclass(frozen=True)
class CodecPoint:
    name: str  # a label for the tables
    delta_ratio: float  # an outer-gradient payload ÷ its fp32 bytes
    sparse: bool  # sparse payloads: an all-reduce of them is an all-gather
    source: str  # where the ratio comes from


def delivered(results: Path, ratio: float | None = None) -> CodecPoint:
    """The delivered codec: from ``results`` (see the module docstring), or ``ratio`` when given."""
    if ratio is not None:
        if not 0 < ratio <= 1:
            raise ConfigError(f"--delivered-ratio {ratio}: give payload bytes ÷ fp32 bytes in (0, 1]")
        return CodecPoint("sparse", ratio, True, "set on the command line")
    try:
        rows = json.loads(results.read_text())["aggregate"]
    except (OSError, KeyError, TypeError, ValueError) as error:
        raise UserError(f"cannot read the codec frontier from {results} ({error}): run benchmarks/algorithms.py "
                        f"or give --delivered-ratio") from None
    within = [r for r in rows if r.get("section") == "codecs" and r["gap_best_percent"]["mean"] <= GAP_LIMIT_PERCENT]
    if not within:
        raise UserError(f"no codec row of {results} is within {GAP_LIMIT_PERCENT:g} % of fp32 DiLoCo: give "
                        f"--delivered-ratio")
    best = min(within, key=lambda r: r["payload_vs_fp32"])
    gap = best["gap_best_percent"]
    return CodecPoint(best["name"], best["payload_vs_fp32"], True,
                      f"{results.name}: {best['name']}, 1/{1 / best['payload_vs_fp32']:.0f} of fp32 bytes at "
                      f"{gap['mean']:+.2f} ± {gap['sd']:.2f} % loss against the better fp32 DiLoCo")


def codec_points(names: str, results: Path, ratio: float | None) -> list[CodecPoint]:
    """The codecs of ``--codecs`` (comma-separated names of CODECS)."""
    points = []
    for name in names.split(","):
        if name not in CODECS:
            raise ConfigError(f"unknown codec {name!r} in --codecs: use {', '.join(CODECS)}")
        points.append(CodecPoint("fp16", FP16_RATIO, False, "dense fp16") if name == "fp16"
                      else delivered(results, ratio))
    return points
