"""The test suite adopts the processes its tests orphan (a child subreaper, Linux), so that a daemon left behind by
a killed DHT process still counts as the suite's own and is reaped. Services that must outlive single tests (the
Docker engine the docker tests start) are started with the flag cleared, so they are not the suite's to reap."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def set_child_subreaper(enabled: bool) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(enabled), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans go to init and are not tracked
        pass


@contextlib.contextmanager
def orphans_go_to_init() -> Iterator[None]:
    """Daemons started inside are adopted by init, not by the suite (nor are their own children, later)."""
    set_child_subreaper(False)
    try:
        yield
    finally:
        set_child_subreaper(True)
