"""The peer's own event loop: uvloop in a background thread, for P2P handlers and calls made from sync code."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

from p2ptrain.net import loop_gc
from p2ptrain.timing import SETUP_FLOOR_S

T = TypeVar("T")
logger = logging.getLogger(__name__)


class BackgroundLoop:
    """A uvloop event loop running in a daemon thread; `run(coro)` blocks the caller until the coroutine is done.

    While it runs, cyclic garbage is collected only at safe points (`loop_gc`): a collection in another thread
    would close leaked transports of this loop while its thread is inside libuv.
    """

    def __init__(self, name: str = "p2ptrain-loop"):
        self.loop = uvloop.new_event_loop()
        self.loop.set_exception_handler(log_loop_error)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        loop_gc.register(self)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"timed out after {timeout} s") from None

    def stop(self) -> None:
        """Stop the loop, then leave safe-point GC: automatic GC may resume only once this thread is out of libuv
        (a loop that did not stop within the join's bound stays registered, its garbage still collected safely)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=SETUP_FLOOR_S)
        if not self._thread.is_alive():
            loop_gc.unregister(self)


def log_loop_error(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """What asyncio would print as an ERROR with a traceback goes to the debug log: a task's exception nobody
    retrieved or a task destroyed while pending are hivemind's stream handlers when a partner vanishes or the peer
    shuts down (several, and a traceback, would follow a node's one-line error as its rank 0 leaves the swarm)."""
    logger.debug(f"event loop: {context.get('message', 'error')}", exc_info=context.get("exception"))
