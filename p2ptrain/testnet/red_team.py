"""The red team's entry point: a training peer that turns hostile, for testnets.

    python -m p2ptrain.testnet.red_team --attack KIND[@ROUND] [any `p2ptrain peer` option]

runs the same peer as `p2ptrain peer`, built with the attack's conduct (adversary.py): from its round ROUND on it
sends what an attacker would. The testnet's `adversary:` key starts it in place of `p2ptrain peer`.
"""

from __future__ import annotations

import logging
from typing import Any

import click

from p2ptrain.console import LOG_LEVELS, configure_logging, run_command
from p2ptrain.peer_command import (
    PEER_SECTIONS,
    SectionedCommand,
    peer_options,
    peer_request,
    run_peer,
)
from p2ptrain.testnet.adversary import ATTACKS, Attack, HostileConduct

logger = logging.getLogger(__name__)


@click.command(cls=SectionedCommand, sections=(("Red team", ("attack", "log_level")), *PEER_SECTIONS),
               context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--attack", required=True, help=f"KIND[@ROUND]: play KIND ({', '.join(ATTACKS)}) from this peer's "
                                              f"round ROUND on (default 0), e.g. aimed@2.")
@click.option("--log-level", default="info", type=click.Choice(LOG_LEVELS))
@peer_options
def red_team(attack: str, log_level: str, **kwargs: Any) -> None:
    """Run a training peer that plays an attack (testnets only)."""
    configure_logging(log_level)
    conduct = HostileConduct(Attack.parse(attack))
    request = peer_request(kwargs)
    logger.warning(f"red team: this peer plays {conduct.attack.kind!r} from round {conduct.attack.from_round} on")
    run_peer(request, conduct, module="p2ptrain.testnet.red_team")  # the node's other processes: red team too


if __name__ == "__main__":
    run_command(red_team)
