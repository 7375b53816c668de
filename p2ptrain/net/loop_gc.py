"""Garbage collection at safe points for processes that run uvloop loops in background threads.

Why: Python's cyclic GC runs in whichever thread happens to allocate, and it finalizes asyncio objects there. A
leaked `asyncio.StreamWriter` (hivemind's P2P leaves one behind when a stream open is cancelled, and p2pd streams
form reader/writer/protocol cycles) closes its transport from its `__del__`: `uv_read_stop` on a uvloop handle
from a foreign thread, while the loop's own thread runs libuv without the GIL. If that handle is being read at that
instant, libuv calls the callback the other thread just cleared (`uv__read` with `alloc_cb == NULL`) and the peer
dies of SIGSEGV in the loop thread, typically while the main thread allocates heavily (writing a checkpoint).

So while any `BackgroundLoop` runs, automatic GC is off, and a collector thread collects every tick (`TICK_S`) on a
loop's own thread (a callback: libuv is idle there) with every other registered loop parked in a callback too.
Finalizers then touch uvloop handles only when no loop is inside libuv.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from typing import Protocol

from p2ptrain.timing import BRIEF_S, SETUP_FLOOR_S, TICK_S

logger = logging.getLogger(__name__)

FULL_EVERY = 30  # a full collection every this many ticks (~200 ms with torch loaded, ~0 after the freeze)


class LoopThread(Protocol):
    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...


_lock = threading.Lock()
_loops: list[LoopThread] = []
_collector: _Collector | None = None


def register(loop: LoopThread) -> None:
    """A loop thread started: collect only at safe points from now on."""
    global _collector
    with _lock:
        _loops.append(loop)
        if _collector is None:
            gc.disable()
            _collector = _Collector()
            _collector.start()


def unregister(loop: LoopThread) -> None:
    """A loop thread stopped; the last one gives automatic GC back."""
    global _collector
    with _lock:
        if loop in _loops:
            _loops.remove(loop)
        if _loops or _collector is None:
            return
        collector, _collector = _collector, None
    collector.stop()
    gc.enable()


def collect_at_safe_point(generation: int) -> bool:
    """Collect `generation` on a registered loop's thread with the other loops parked; False if skipped."""
    with _lock:
        loops = [entry for entry in _loops if entry.loop.is_running()]
    if not loops:
        gc.collect(generation)
        return True
    host, others = loops[0], loops[1:]
    release = threading.Event()
    try:
        parked = [(entry.loop, _park(entry.loop, release)) for entry in others]
        # a loop busier than BRIEF_S is not waited for: the collection is skipped, tried next tick
        if not all(_wait(event, loop, BRIEF_S) for loop, event in parked):
            logger.debug("a loop did not reach a safe point in time: collection skipped")
            return False
        started, done = threading.Event(), threading.Event()

        def collect() -> None:
            started.set()
            try:
                gc.collect(generation)
            finally:
                done.set()

        host.loop.call_soon_threadsafe(collect)
        if not _wait(started, host.loop, BRIEF_S):
            return False
        done.wait()  # the others stay parked until the collection is over, however long it takes
        return True
    except RuntimeError:  # a loop closed meanwhile
        return False
    finally:
        release.set()


def _wait(event: threading.Event, loop: asyncio.AbstractEventLoop, timeout_s: float) -> bool:
    """Wait until `event` is set, giving up after `timeout_s` or as soon as `loop` stops (it will never set it)."""
    for _ in range(max(1, int(timeout_s / 0.05))):
        if event.wait(0.05):
            return True
        if not loop.is_running():
            return False
    return False


def _park(loop: asyncio.AbstractEventLoop, release: threading.Event) -> threading.Event:
    parked = threading.Event()

    def wait_for_release() -> None:
        parked.set()
        release.wait(60.0)  # released right after the collection (`finally` below); the bound is only a backstop

    loop.call_soon_threadsafe(wait_for_release)
    return parked


class _Collector:
    def __init__(self) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2ptrain-gc", daemon=True)
        self.full_collections = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=BRIEF_S + SETUP_FLOOR_S)

    def _run(self) -> None:
        tick = 0
        while not self._stopped.wait(TICK_S):  # young generations: cyclic garbage lives at most about a tick
            tick += 1
            full = tick % FULL_EVERY == 0
            try:
                if collect_at_safe_point(2 if full else 1) and full:
                    self.full_collections += 1
                    if self.full_collections == 1:
                        gc.freeze()  # what outlived the first 30 s (modules, the model) is never scanned again
            except Exception:  # never let the collector die: skipped collections only cost memory
                logger.debug("garbage collection failed", exc_info=True)
