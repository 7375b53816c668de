"""Garbage collection at safe points: finalizers of a loop's objects run on a loop thread, never concurrently with
another loop's libuv code (the cause of a rare SIGSEGV of peers, see p2ptrain/loop_gc.py)."""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
import threading
import time
from typing import Any

from p2ptrain.net import loop_gc
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.timing import TICK_S


class _Cyclic:
    """Garbage only the cyclic collector frees; records where and when it was finalized."""

    def __init__(self, log: list[Any], delay_s: float = 0.0) -> None:
        self.me, self.log, self.delay_s = self, log, delay_s

    def __del__(self) -> None:
        self.log.append(("start", threading.current_thread().name, time.monotonic()))
        time.sleep(self.delay_s)
        self.log.append(("end", threading.current_thread().name, time.monotonic()))


def test_automatic_gc_is_off_while_a_loop_runs_and_back_after_the_last_stops() -> None:
    assert gc.isenabled()
    first, second = BackgroundLoop(name="p2ptrain-loop-a"), BackgroundLoop(name="p2ptrain-loop-b")
    try:
        assert not gc.isenabled()
        first.stop()
        assert not gc.isenabled()
    finally:
        second.stop()
        first.stop()
    assert gc.isenabled()


def test_cyclic_garbage_is_finalized_on_a_loop_thread_while_the_other_loop_is_parked() -> None:
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.001)

    first, second = BackgroundLoop(name="p2ptrain-loop-a"), BackgroundLoop(name="p2ptrain-loop-b")
    try:
        ticking = second.submit(ticker())
        log: list[Any] = []
        _Cyclic(log, delay_s=0.3)
        assert loop_gc.collect_at_safe_point(2)
        (_, thread, started), (_, _, ended) = log
        assert thread == "p2ptrain-loop-a"  # the first registered loop hosts the collection
        during = [t for t in ticks if started + 0.01 < t < ended - 0.01]
        assert not during, f"loop b ran {len(during)} callbacks while a finalizer ran"
        assert _wait_for(lambda: [t for t in ticks if t > ended]), "loop b never resumed"
    finally:
        ticking.cancel()
        time.sleep(0.05)
        second.stop()
        first.stop()


def test_a_leaked_stream_writer_is_closed_on_its_own_loop_thread() -> None:
    """The hazard itself: Python 3.11's StreamWriter.__del__ closes its transport from the collecting thread."""
    closed_on: list[str] = []
    original_close = asyncio.StreamWriter.close

    def recording_close(self: asyncio.StreamWriter) -> None:
        closed_on.append(threading.current_thread().name)
        original_close(self)

    path = os.path.join(tempfile.mkdtemp(), "sock")
    loop = BackgroundLoop(name="p2ptrain-loop-a")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    async def leak() -> None:
        _, writer = await asyncio.open_unix_connection(path)
        holder: dict[str, Any] = {"writer": writer}  # dropped unclosed in a cycle, as hivemind's streams can be
        holder["self"] = holder

    asyncio.StreamWriter.close = recording_close  # type: ignore[method-assign]
    try:
        server = loop.run(asyncio.start_unix_server(serve, path), timeout=10)
        loop.run(leak(), timeout=10)
        kept = [[] for _ in range(10_000)]  # container allocations that trigger automatic collections here
        del kept
        assert _wait_for(lambda: closed_on, timeout_s=5 * TICK_S), "the leaked writer was never closed"
        assert set(closed_on) == {"p2ptrain-loop-a"}, closed_on  # (the server's own close is there too)
    finally:
        asyncio.StreamWriter.close = original_close  # type: ignore[method-assign]
        loop.run(_close_server(server), timeout=10)
        loop.stop()


async def _close_server(server: asyncio.AbstractServer) -> None:
    server.close()
    await server.wait_closed()


def _wait_for(probe: Any, timeout_s: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = probe()
        if result:
            return result
        time.sleep(0.01)
    return probe()


def test_a_task_exception_nobody_retrieved_goes_to_the_debug_log_not_stderr(caplog: Any, capfd: Any) -> None:
    """hivemind's stream handlers leave such tasks when a partner vanishes or the peer shuts down: asyncio printed
    them as ERROR lines with a traceback under a peer's one-line error (CI, a node leaving the swarm)."""
    import logging

    loop = BackgroundLoop(name="test-unretrieved")

    async def fail() -> None:
        raise ConnectionResetError("partner vanished")

    async def spawn_and_collect() -> None:
        asyncio.get_running_loop().create_task(fail())  # nobody keeps or awaits it
        await asyncio.sleep(0.05)
        gc.collect()

    try:
        with caplog.at_level(logging.DEBUG, logger="p2ptrain.net.event_loop"):
            loop.run(spawn_and_collect(), timeout=10)
    finally:
        loop.stop()
    records = [r for r in caplog.records if r.name == "p2ptrain.net.event_loop"]
    assert records and records[0].levelno == logging.DEBUG and "never retrieved" in records[0].getMessage()
    assert records[0].exc_info is not None and isinstance(records[0].exc_info[1], ConnectionResetError)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "Traceback" not in capfd.readouterr().err


def test_automatic_gc_resumes_only_after_the_loop_has_stopped(monkeypatch: Any) -> None:
    """Automatic GC in the stopping thread while the loop thread is still inside libuv is the hazard itself (a
    peer's shutdown allocates right after stopping its loop)."""
    running_when_left: list[bool] = []
    unregister = loop_gc.unregister

    def recording_unregister(entry: loop_gc.LoopThread) -> None:
        running_when_left.append(entry.loop.is_running())
        unregister(entry)

    monkeypatch.setattr(loop_gc, "unregister", recording_unregister)
    loop = BackgroundLoop(name="p2ptrain-loop-a")
    loop.run(asyncio.sleep(0), timeout=10)
    loop.stop()
    assert running_when_left == [False]
    assert gc.isenabled()
