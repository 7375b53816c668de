"""The outer-sync strategy a peer's config names, with its transports started and registered."""

from __future__ import annotations

from collections.abc import Sequence

import hivemind
import torch
from hivemind.p2p import P2P

from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.maths.pacing import LinkSpeeds
from p2ptrain.net.allreduce import AllReduceAverager
from p2ptrain.net.dht_keys import averager_prefix
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.net.exchange import serve_exchanges
from p2ptrain.net.relay import RelayEntry
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.routes import Routes
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.contribution import Contributions
from p2ptrain.sync.diloco import DilocoSync, mean_check
from p2ptrain.sync.exchange_allreduce import ExchangeAllReduce
from p2ptrain.sync.exchange_averager import ExchangeAverager
from p2ptrain.sync.factored import AllReduceMix2, FactoredSync, GossipMix2
from p2ptrain.sync.gasloc import GaslocSync
from p2ptrain.sync.grad_gossip import GradGossip
from p2ptrain.sync.interface import HONEST, Averager, Conduct, OuterSync
from p2ptrain.sync.param_gossip import ParamGossip
from p2ptrain.sync.scatter_allreduce import ScatterAllReduce
from p2ptrain.sync.state_evidence import state_sample
from p2ptrain.timing import PATIENCE_S


def build_outer_sync(config: SyncConfig, dht: hivemind.DHT, p2p: P2P, loop: BackgroundLoop, outer: OuterOptimizer,
                     run_id: str, fingerprint: str, reference: Sequence[torch.Tensor], seed: int,
                     reputation: Reputation, routes: Routes | None = None,
                     entry: RelayEntry | None = None, conduct: Conduct = HONEST,
                     contributions: Contributions | None = None) -> OuterSync:
    """The strategy `config.mode` names, with its transports started (`reference` = the run's θ_0); every
    transport reports partners' offences to the peer's one `reputation` and refuses the peers it bans, opens its
    streams as the peer's `routes` say (directly or through a relay), is served through relays at `entry`, sends
    what the peer's `conduct` forms, and counts what partners' values show of their work (outer gradients, or GASLoC's
    samples of one) in the peer's one `contributions`."""
    def averager(prefix: str, group_size: int | None, shows_state: bool = False) -> Averager:
        if config.allreduce_transport == "hivemind":
            return AllReduceAverager(dht, averager_prefix(run_id, prefix), outer.params, config.matchmaking_s,
                                     config.allreduce_timeout_s, config.grad_codec, target_group_size=group_size,
                                     robust=config.robust, refuses=reputation.refuses)
        transport = ScatterAllReduce if config.allreduce_transport == "scatter" else ExchangeAllReduce
        exchange = transport(p2p, run_id, fingerprint, reference, config, kind=f"allreduce.{prefix}",
                             group_size=group_size, reputation=reputation, routes=routes, conduct=conduct,
                             contributions=contributions)
        loop.run(serve_exchanges(p2p, exchange.driver, entry), timeout=PATIENCE_S)
        state = (lambda round_: state_sample(outer.anchor, round_, run_id)) if shows_state else None
        return ExchangeAverager(exchange, loop, config.matchmaking_s, state)

    if config.mode == "diloco":  # its peers hold one state and show it (not with eager overlap, nor gossip modes)
        # hivemind's averager sends from its own process: the conduct forms the Δ it is handed
        own_conduct = conduct if config.allreduce_transport == "hivemind" else HONEST
        return DilocoSync(outer, averager("diloco", None, shows_state=not config.own_delta_first), config,
                          own_conduct)
    factored = config.mode == "factored"
    links = LinkSpeeds()  # one table of measured links for every exchange this peer starts
    mixer = ParamGossip(p2p, run_id, fingerprint, "mix1" if factored else "gasloc", reference, config, seed,
                        same_round_only=factored, overlapped=factored or config.overlap == "delayed", links=links,
                        reputation=reputation, routes=routes, conduct=conduct, contributions=contributions,
                        shows_work=not factored)
    loop.run(serve_exchanges(p2p, mixer.driver, entry), timeout=PATIENCE_S)
    if config.mode == "gasloc":
        return GaslocSync(outer, mixer, loop, config)
    if config.mix2_transport == "gossip":
        gossip = GradGossip(p2p, run_id, fingerprint, reference, config, seed, links=links, reputation=reputation,
                            routes=routes, conduct=conduct, contributions=contributions)
        loop.run(serve_exchanges(p2p, gossip.driver, entry), timeout=PATIENCE_S)
        return FactoredSync(outer, mixer, GossipMix2(gossip, loop, overlapped=config.overlap != "none"), loop, config)
    mix2_averager = averager("mix2", config.mix2_group_size)
    return FactoredSync(outer, mixer, AllReduceMix2(mix2_averager, config.grad_codec, mean_check(config)), loop, config,
                        closers=[mix2_averager.shutdown])
