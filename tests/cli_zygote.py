"""Command-line runs forked from a process which has already imported torch, transformers and hivemind: the
testnet's fork server (p2ptrain/testnet/forkserver.py), with what the CLI's error paths import preloaded too.

A CLI or benchmark run spends 4 to 8 s of CPU importing those libraries before it reads its first flag; a suite that
runs fifty of them to check their error lines spends minutes on imports alone. What it does not check is the
interpreter's own start-up; tests/test_cli_errors.py keeps real subprocesses for that.
"""

from __future__ import annotations

from collections.abc import Mapping

from p2ptrain.testnet.forkserver import PRELOADED as TESTNET_PRELOADED
from p2ptrain.testnet.forkserver import ForkedProcess, ForkServer, kept_server

PRELOADED = (*TESTNET_PRELOADED, "p2ptrain.node", "p2ptrain.testnet.netns_run")
ZygoteChild = ForkedProcess  # one command run by the zygote


def zygote(env: Mapping[str, str]) -> ForkServer:
    """The zygote of this process for `env`: a fork server it keeps, started on first use and closed at exit."""
    return kept_server(env, PRELOADED)
