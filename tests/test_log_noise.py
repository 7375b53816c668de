"""net/log_noise.py: a partner resetting a stream reaches the log as one warning line, not hivemind's traceback
(a Docker swarm's log once held one, and the compose test, which forbids tracebacks in a peer's log, failed)."""

from __future__ import annotations

import io
import logging

import pytest

from p2ptrain.net.log_noise import HIVEMIND_STREAM_LOGGERS, quiet_connection_errors


def logged(error: BaseException) -> str:
    """What hivemind's stream handler writes for `error` (`logger.warning(..., exc_info=True)`), filtered."""
    logger = logging.getLogger(HIVEMIND_STREAM_LOGGERS[0])
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    try:
        quiet_connection_errors()
        quiet_connection_errors()  # installed once, however often called
        try:
            raise error
        except BaseException:
            logger.warning("Exception while receiving requests:", exc_info=True)
    finally:
        logger.removeHandler(handler)
    return out.getvalue()


@pytest.mark.parametrize("error", [ConnectionResetError(104, "Connection reset by peer"), BrokenPipeError()])
def test_a_reset_stream_is_one_warning_line(error: BaseException):
    text = logged(error)
    assert "Traceback" not in text and text.count("\n") == 1, text
    assert text.startswith("Exception while receiving requests:") and type(error).__name__ in text


def test_other_errors_keep_their_traceback():
    text = logged(ValueError("a bug"))
    assert "Traceback" in text and "ValueError: a bug" in text
    assert sum(isinstance(f, logging.Filter) for f in logging.getLogger(HIVEMIND_STREAM_LOGGERS[0]).filters) == 1
