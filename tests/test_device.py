"""At what CPU priority a peer trains (`run.training_priority`, p2ptrain/device.py)."""

from __future__ import annotations

import os
import threading

import pytest

from p2ptrain.device import train_at_idle_priority


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_idle_priority_is_the_calling_threads_and_its_later_threads_only() -> None:
    """The training thread goes idle; a thread started before it (the peer's event loop) keeps its policy, and one
    it starts afterwards inherits idle."""
    seen: dict[str, int] = {}
    before = os.sched_getscheduler(0)  # SCHED_OTHER, but under conftest's background tier SCHED_IDLE already
    started = threading.Event()
    release = threading.Event()

    def network_thread() -> None:
        started.set()
        release.wait(10)
        seen["network"] = os.sched_getscheduler(0)

    def training_thread() -> None:
        assert train_at_idle_priority()
        seen["training"] = os.sched_getscheduler(0)
        child = threading.Thread(target=lambda: seen.__setitem__("child", os.sched_getscheduler(0)))
        child.start()
        child.join()

    network = threading.Thread(target=network_thread)
    network.start()
    started.wait(10)
    training = threading.Thread(target=training_thread)
    training.start()
    training.join()
    release.set()
    network.join()
    assert seen == {"training": os.SCHED_IDLE, "child": os.SCHED_IDLE, "network": before}
