"""What a benchmark does once its report is made: the Markdown table beside the JSON, printed, and where both went."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def publish(report: dict[str, Any], output: Path, markdown: Callable[[dict[str, Any]], str]) -> None:
    """Write `markdown(report)` next to the JSON at `output` (same name, .md), print it and the wall time."""
    table = markdown(report)
    output.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"wall time {report['wall_s']:.0f} s; written to {output} and {output.with_suffix('.md')}")
