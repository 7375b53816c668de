"""How a command runs in a terminal: log lines on stderr, and a user's mistake as one `error:` line, exit 2.

Shared by every entry point (`p2ptrain` and the testnet's red team), so each behaves the same at the prompt.
"""

from __future__ import annotations

import logging
import sys

import click

from p2ptrain.errors import UserError
from p2ptrain.net.log_noise import quiet_connection_errors

EXIT_USER_ERROR = 2
LOG_LEVELS = ("debug", "info", "warning", "error")  # `p2ptrain --log-level`, which testnet processes inherit


def configure_logging(log_level: str) -> None:
    """Log lines on stderr at `log_level`; the libraries' chatter only from warnings up."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for noisy in ("hivemind", "transformers", "datasets", "httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    quiet_connection_errors()  # a partner resetting a stream is a warning line, not a traceback


def run_command(command: click.Command) -> None:
    """Run `command` on sys.argv: user mistakes are one `error:` line and exit 2, never a traceback."""
    if not sys.argv[1:]:
        sys.argv.append("--help")
    try:
        command.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        ctx = getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        click.echo(f"error: {e.format_message()}{hint}", err=True)
        sys.exit(EXIT_USER_ERROR)
    except UserError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USER_ERROR)
