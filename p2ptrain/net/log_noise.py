"""A peer's log says what happened, not hivemind's tracebacks for network events that are normal on the internet.

hivemind's stream handler (`P2P._handle_stream`) treats a stream its caller closed as normal, but logs a stream its
caller reset (ConnectionResetError: the caller timed out, crashed or left mid-request) with a full traceback at
WARNING. On a volunteer's screen that reads as a crash (one follows, for example, a gossip partner's exchange that
timed out); it is a partner giving up. `quiet_connection_errors` keeps the warning, as one line that names the error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

HIVEMIND_STREAM_LOGGERS = ("hivemind.p2p.p2p_daemon",)


class OneLineConnectionErrors(logging.Filter):
    """Log records whose exception is a ConnectionError (reset, broken pipe, aborted) become one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, ConnectionError):
            record.msg, record.args = f"{record.getMessage()} {error!r}", ()
            record.exc_info, record.exc_text = None, None
        return True


def quiet_connection_errors(names: Sequence[str] = HIVEMIND_STREAM_LOGGERS) -> None:
    """Install `OneLineConnectionErrors` on these loggers (once each)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OneLineConnectionErrors) for f in logger.filters):
            logger.addFilter(OneLineConnectionErrors())
