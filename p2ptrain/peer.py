"""A training peer's round loop: batch → inner steps → outer gradient → averaging → outer step, on the swarm.

This is the one module that joins the maths side (inner, outer) with the network side (discovery, state
sharing, averaging). Each round runs over the peer's state (peer_state.py) in stages:
1. observe the swarm and catch up: if this peer is behind (or new, or fell out of its last group), the joiner
   (joining.py) decides whose round-start state to adopt, and the loop applies it;
2. open the round: publish a snapshot of the round-start state for peers that join;
3. run the inner phase, ending no later than the peers of this round expect to (a late joiner takes fewer steps);
4. sync: average with the peers of this round (sync/), leaving the parameters at the next anchor;
5. settle (in step with the swarm or not, the next round, evaluation) and report (metrics, our record).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import torch
from hivemind.utils import get_dht_time

from p2ptrain import __version__
from p2ptrain.config import PeerConfig
from p2ptrain.corpus import corpus_digest
from p2ptrain.data import build_tokenizer, corpus_source, shard_for_peer
from p2ptrain.device import resolve_device, train_at_idle_priority
from p2ptrain.errors import CheckpointError, UserError, one_line
from p2ptrain.join_rules import peers_to_outnumber, voters
from p2ptrain.joining import Joiner
from p2ptrain.manifest import RunManifest
from p2ptrain.maths.data_parallel import STOP, TRAIN, NodeError, NodeGroup
from p2ptrain.maths.inner import InnerTrainer, PhaseResult
from p2ptrain.maths.outer_optimizer import OuterOptimizer
from p2ptrain.maths.pacing import PACE_MIN_PEERS, inner_steps_for_link, inner_steps_for_pace, swarm_step_s
from p2ptrain.metrics import MetricsLog, ProgressBar, RoundMetrics
from p2ptrain.models import build_model, count_parameters, model_fingerprint
from p2ptrain.net.admission import Admission
from p2ptrain.net.data_claims import ClaimedPieces
from p2ptrain.net.dht import start_dht
from p2ptrain.net.discovery import (
    BLOCKING_PUBLISH_HEARTBEATS,
    MAX_STEP_S,
    MAX_TOKENS,
    PROTOCOL_VERSION,
    Announcer,
    PeerRecord,
    SwarmView,
    SwarmWatcher,
    other_model_note,
    other_protocol_note,
)
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.net.reachability import reachable_before_joining
from p2ptrain.net.record_shards import RecordShards
from p2ptrain.net.remote_hosts import RemoteHosts
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.run_manifest import NAMESPACE as MANIFEST_NAMESPACE
from p2ptrain.net.run_manifest import ManifestServer
from p2ptrain.net.services import start_services
from p2ptrain.net.state_sharing import StateServer, StateSnapshot
from p2ptrain.net.stream_bytes import Traffic, counter_of
from p2ptrain.node.worker import NodeStart, node_batches, node_data
from p2ptrain.peer_checkpoint import (
    default_checkpoint_dir,
    load_peer_checkpoint,
    load_sync_state_,
    save_peer_checkpoint,
)
from p2ptrain.peer_state import PeerState
from p2ptrain.swarm_start import wait_for_peers
from p2ptrain.sync.build import build_outer_sync
from p2ptrain.sync.contribution import Contributions
from p2ptrain.sync.interface import HONEST, Conduct, OuterSync, RoundContext, RoundSync, round_peers, why_alone

logger = logging.getLogger(__name__)
MAX_TOLD_APART = 64  # peers of another protocol or model a peer tells apart by name in its log


@dataclasses.dataclass(frozen=True)
class SyncOutcome:
    """What a round's sync stage read and did."""

    view: SwarmView  # the swarm, read as the sync began
    context: RoundContext
    result: RoundSync
    blocked_s: float  # seconds training waited on the sync


class TrainingPeer:
    """One volunteer's training client. `run()` trains until `config.run.rounds` or `stop()`. On a node of several
    processes (`node`), this is rank 0: the others train beside it (node/worker.py)."""

    def __init__(self, config: PeerConfig, initial_peers: Sequence[str] = (), resume: bool = False,
                 node: NodeGroup | None = None, conduct: Conduct | None = None, manifest: RunManifest | None = None):
        self.config = config
        self.manifest = manifest  # the run's, as a volunteer got it (signature and all); None: we found the run
        self.conduct = conduct or HONEST  # forms what we send and announce (testnet/red_team.py plays a liar)
        self.stop_event = threading.Event()
        if config.run.torch_threads:
            torch.set_num_threads(config.run.torch_threads)
        self.node = node or NodeGroup(device=resolve_device(config.run.device))
        self.device = self.node.device
        self.tokenizer = build_tokenizer(config.data)
        self.model = build_model(config.model, self.tokenizer.vocab_size, config.run.seed)
        self.model.to(self.device)  # type: ignore[arg-type]  # transformers' decorator hides nn.Module.to
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self.fingerprint = model_fingerprint(self.model)
        logger.info(f"model {config.model.name}: {count_parameters(self.model):,} parameters on {self.device}")
        self.initial_params = [p.detach().float().cpu().clone() for p in self.params]  # θ_0: gossip's reference
        self.inner = InnerTrainer(self.model, config.inner, self.device, self.node)
        self.outer = OuterOptimizer(self.params, dataclasses.replace(
            config.outer, momentum=config.sync.outer_momentum(config.outer.momentum)))
        self.rounds_run, self.val_loss = 0, math.nan  # rounds this process ran; the latest validation loss
        self.alone_reason: str | None = None  # why the latest round averaged alone (None: it did not)
        self.told_apart: set[str] = set()  # peers already named for their protocol or model (at most a bound)
        # with run.rounds: the round at which we stop, counted from our first round (a round lost while joining is
        # not run again at the end, alone: the others have stopped by then, and the swarm's last states would differ)
        self.end_round: int | None = None
        self.step_time_s = math.nan  # measured seconds per inner step (EMA)
        self.swarm_step_s = math.nan  # the swarm's pace: the median step time others announce (`sync.keep_pace`)
        self.paced_steps = self.config.inner.steps  # H, or fewer to keep the swarm's pace (`_pace`, each round)
        self.blocked_s = math.nan  # measured seconds per round that training waited on the network (EMA)
        self.expected_blocking_s = math.nan  # the sync's own forecast of that, from its link speeds (if it has one)
        self.swarm_blocking_s = 0.0  # that forecast for the fastest link in the swarm
        self._sync_view: tuple[float, SwarmView | None] = (-math.inf, None)  # (when read, the view) at the last sync
        # before the network: a TensorBoard directory that cannot be written, or W&B not installed, stops the peer in
        # one line, at once
        self.metrics_log = MetricsLog(config.run.metrics_path or None, config.run.tensorboard_dir or None,
                                      config.run.wandb_project or None, config.run.run_id, config.to_dict())
        checkpoint = load_peer_checkpoint(config, self.fingerprint, self.named_params, self.outer,
                                          self.inner) if resume else None
        self._start_network(initial_peers, start_round=checkpoint.round if checkpoint is not None else 0)
        if checkpoint is not None:
            try:
                load_sync_state_(self.state, checkpoint, config.run.checkpoint_dir)
            except CheckpointError:
                self.shutdown()
                raise
        shard = config.run.shard_index if config.run.shard_index >= 0 else shard_for_peer(
            self.peer_id, config.data.num_shards)
        claims = None if config.run.shard_index >= 0 else functools.partial(
            ClaimedPieces, self.dht, config.run.run_id, self.peer_id, seed=hash((config.run.seed, self.peer_id)))
        self.data = node_data(config, self.tokenizer, shard, self.node.world_size, claims)
        self.batches = node_batches(config, self.data, shard)
        self.node.broadcast_object(NodeStart(shard, self.inner.state_dict() if checkpoint is not None else None))
        self.val_batches: list[torch.Tensor] = self.data.validation_batches()
        self.round_callbacks: list[Callable[[TrainingPeer, RoundMetrics], None]] = []  # called after each round

    # ---- network set-up -------------------------------------------------------------------------------------
    def _start_network(self, initial_peers: Sequence[str], start_round: int) -> None:
        cfg, network = self.config, self.config.network
        if reachable_before_joining(network, initial_peers) is False:  # nobody can connect to us: a DHT client
            network = dataclasses.replace(network, client_mode=True)
        self.dht = start_dht(network, initial_peers)
        self.peer_id = str(self.dht.peer_id)
        self.traffic = Traffic(counter_of(self.peer_id))  # made before the averager's process forks: it counts here
        self.loop = BackgroundLoop()
        try:
            self.admission = Admission.from_config(cfg.network, cfg.run.run_id, self.peer_id)
        except UserError:
            self.dht.shutdown()
            raise
        # one record of offences for every transport of this peer; it also refuses peers the run does not admit
        self.reputation = Reputation(cfg.reputation, admits=self.admission.admits_)
        self.contributions = Contributions()  # what partners' outer gradients showed of their work
        self.tokens_trained = 0  # by our inner phases since this process started: what our record claims
        self._snapshot: StateSnapshot | None = None
        self.p2p = self.loop.run(self.dht.replicate_p2p(), timeout=cfg.network.startup_timeout_s)
        self.services = start_services(self.p2p, self.loop, cfg.network, self.admission)
        self.routes = self.services.routes  # who reaches whom: read from the records every round
        state_server = StateServer(lambda: self._snapshot, self.reputation.refuses, self.reputation.penalise,
                                   cfg.sync.state_download_timeout_s, host_of=RemoteHosts.of(self.p2p).host_of)
        self.loop.run(state_server.add_p2p_handlers(self.p2p, namespace=cfg.run.run_id))
        state_server.serve_relayed(self.services.entry, cfg.run.run_id)
        served = self.manifest or RunManifest.of(  # what a volunteer joining through us gets
            cfg, self.fingerprint, corpus_digest(corpus_source(cfg.data)))
        self.manifest_server = ManifestServer(served.to_document())
        self.loop.run(self.manifest_server.add_p2p_handlers(self.p2p, namespace=MANIFEST_NAMESPACE))
        self.sync: OuterSync = build_outer_sync(cfg.sync, self.dht, self.p2p, self.loop, self.outer, cfg.run.run_id,
                                                self.fingerprint, self.initial_params, seed=hash(self.peer_id),
                                                reputation=self.reputation, routes=self.routes,
                                                entry=self.services.entry, conduct=self.conduct,
                                                contributions=self.contributions)
        self.conduct.follow(lambda: self.state.round)
        self.state = PeerState([n for n, _ in self.named_params], self.outer, self.sync, start_round)
        self.joiner = Joiner(self)
        record = PeerRecord(peer_id=self.peer_id, round=self.state.round, inner_step=0, phase="joining", round_eta=0.0,
                            fingerprint=self.fingerprint, relay=cfg.network.relay, protocol=PROTOCOL_VERSION,
                            version=__version__)
        # where our record goes, and which records we read
        shards = RecordShards(cfg.run.run_id, self.peer_id, cfg.network.records_per_shard)
        self.announcer = Announcer(self.dht, cfg.run.run_id, record, cfg.network.heartbeat_s,
                                   cfg.network.record_ttl_s, admission=self.admission, shards=shards)
        self.announcer.start()
        self.services.start_presence(self.p2p, self.loop, cfg.network, initial_peers,
                                     lambda **fields: self.announcer.update(publish=True, **fields))
        self.watcher = SwarmWatcher(self.dht, cfg.run.run_id, cfg.network.record_ttl_s, cfg.network.heartbeat_s,
                                    admission=self.admission, shards=shards)
        if not self.sync.needs_current_swarm:  # all-reduce modes read the DHT themselves: no background load
            self.watcher.start()

    @property
    def maddrs(self) -> list[str]:
        """Our addresses, from p2pd itself, with a bound on the wait (the DHT process's answer has none)."""
        return [str(m) for m in self.loop.run(self.p2p.get_visible_maddrs(latest=True),
                                              timeout=self.config.network.startup_timeout_s)]

    def swarm(self) -> SwarmView:
        # an all-reduce's read waits at most its matchmaking window: a DHT slowed by a silent node leaves the last read
        # (not less: behind NAT, where reads go through relays, a shorter wait gives stale views that split rounds)
        records = self.watcher.records(current=self.sync.needs_current_swarm,
                                       timeout_s=self.config.sync.matchmaking_s)
        self.routes.update_(records)
        self._note_left_out(records)
        return self._view_of(records)

    def _view_of(self, records: list[PeerRecord]) -> SwarmView:
        """The records of peers of our run's model and protocol."""
        return SwarmView(self.peer_id, [r for r in records if r.fingerprint == self.fingerprint
                                        and r.protocol == PROTOCOL_VERSION])

    def _note_left_out(self, records: list[PeerRecord]) -> None:
        """One line per peer of another protocol or model, the first time it is seen, so that a peer is never alone
        without saying why (identities are cheap: at most MAX_TOLD_APART peers are remembered, then a run of them
        is said no more)."""
        for record in records:
            if record.peer_id in self.told_apart or len(self.told_apart) >= MAX_TOLD_APART:
                continue
            if record.protocol != PROTOCOL_VERSION:
                self.told_apart.add(record.peer_id)
                logger.warning(other_protocol_note(record, __version__))
            elif record.fingerprint != self.fingerprint and record.peer_id != self.peer_id:
                self.told_apart.add(record.peer_id)
                logger.warning(other_model_note(record, self.fingerprint))

    def _round_start_view(self) -> SwarmView:
        """The swarm at a round's start: the view read for the round before's sync if younger than a heartbeat (an
        overlapped sync that returned at once, or an all-reduce that took less: the others of its group are
        publishing their own round starts just now, so a second read finds about the same records, at the cost of a
        wait before the inner phase: 0.17-0.24 s for 8 loopback DiLoCo peers); otherwise read now."""
        read_at, view = self._sync_view
        if view is not None and time.monotonic() - read_at < self.config.network.heartbeat_s:
            return view
        return self.swarm()

    def announce(self, wait: bool = False, **fields: object) -> None:
        """Publish a change of round or phase at once: in the background, or, with `wait` (a joiner's phase) where
        peers sync by all-reduce, waiting for the DHT. The wait is bounded by the heartbeat: a store waiting on a
        silent node must not hold the round."""
        waits = wait and self.sync.needs_current_swarm
        self.announcer.update(publish=not waits, **fields)
        if waits:
            self.announcer.publish(BLOCKING_PUBLISH_HEARTBEATS * self.config.network.heartbeat_s)

    # ---- the round loop -------------------------------------------------------------------------------------
    def run(self) -> list[RoundMetrics]:
        history: list[RoundMetrics] = []
        bar = ProgressBar(self.config.run.progress, self.config.run.rounds)
        saved_round, finished = None, False  # the round of the latest checkpoint; whether the rounds ran out
        if self.config.run.training_priority == "idle" and not train_at_idle_priority():
            logger.warning("run.training_priority idle needs Linux's SCHED_IDLE: training at normal priority")
        try:
            if self.state.round == 0 and not self.state.joined_ever:  # launched with others: begin with them
                wait_for_peers(self.swarm, self.config.run, self.stop_event, self.config.network.heartbeat_s,
                               in_round_0=self._publish_round_start,
                               propose=lambda at: self.announce(starts_at=at))  # (swarm_start.py)
            while not self.stop_event.is_set() and (self.end_round is None or self.state.round < self.end_round):
                metrics = self.run_round(bar)
                if metrics is None:
                    break
                history.append(metrics)
                self.rounds_run += 1
                bar.round_done(metrics)
                for callback in self.round_callbacks:
                    callback(self, metrics)
                if self.config.run.checkpoint_dir and self.state.round % self.config.run.checkpoint_every == 0:
                    self.save_checkpoint()
                    saved_round = self.state.round
            finished = True
            self.node.command(STOP)  # the node's other workers end with us
        except NodeError:  # a worker of this node died: keep the round's anchor, checkpoint it, leave the swarm
            self.outer.restore_anchor_()
            self.stop_event.set()
            raise
        finally:
            bar.close()
            self._save_at_the_end(finished or self.stop_event.is_set(), saved_round)
        return history

    def _save_at_the_end(self, ended: bool, saved_round: int | None) -> None:
        """The rounds ran out or a stop came: the final checkpoint (unless the last round's is written), or a line
        that the model trained here is not kept."""
        if not ended or self.state.round == saved_round:
            return
        if self.config.run.checkpoint_dir:
            self.save_checkpoint()
        elif self.rounds_run > 0:
            directory = default_checkpoint_dir(self.config.run.run_id, self.peer_id)
            try:
                path = save_peer_checkpoint(self.state, self.inner, self.config, self.fingerprint, directory)
            except OSError as e:
                logger.warning(f"the model of round {self.state.round} is not kept: no --checkpoint-dir, and "
                               f"{directory} cannot be written ({one_line(e)})")
                return
            logger.info(f"no --checkpoint-dir: the model of round {self.state.round} is kept in {path} "
                        f"(p2ptrain export {directory} OUT_DIR; --resume --checkpoint-dir {directory} goes on)")

    def run_round(self, bar: ProgressBar) -> RoundMetrics | None:
        """One round, as its stages; None when stopped mid-round (the parameters are put back at the round's anchor)."""
        started = time.monotonic()
        view = self._round_start_view()
        self._catch_up(view)
        round_ = self.state.round
        self._open_round(view)
        phase = self._inner_phase(bar, view)
        if phase is None:
            return None
        synced = self._sync(phase)
        evaluated = self._settle(round_, synced)
        self.reputation.note_round_s(time.monotonic() - started)
        return self._report(round_, started, phase, synced, evaluated)

    def _catch_up(self, view: SwarmView) -> None:
        """Take the swarm's state where the joiner decides so (joining.py); our first round sets the one we stop at."""
        decision = self.joiner.catch_up_(view)
        self.state.take_(decision)
        if decision.snapshot is not None:
            logger.info(f"joined round {self.state.round} with the state of {decision.donor} ({decision.detail})")
        self._count_from(self.state.round)

    def _open_round(self, view: SwarmView) -> None:
        """Publish the round's start (our snapshot and record); the sync may start its background work."""
        self._pace(view)
        self._publish_round_start()
        self.sync.start_round(self._context(view, inner_steps=0))

    def _inner_phase(self, bar: ProgressBar, view: SwarmView) -> PhaseResult | None:
        """The inner steps, on every worker of the node, ending no later than the round's peers expect to; None when
        stopped (the parameters are put back at the anchor)."""
        round_ = self.state.round
        deadline = self._inner_deadline(view)
        peers_in_round = 1 + len(view.at_round(round_))
        self.node.command(TRAIN)
        self.node.broadcast_(self.params)  # the round's parameters, on every worker of the node
        phase = self.inner.run_phase(
            self.batches, self._inner_steps(), deadline,
            on_step=lambda step, loss: self._on_inner_step(bar, round_, step, loss, peers_in_round),
            stop=self.stop_event)
        if self.stop_event.is_set():
            self.outer.restore_anchor_()
            return None
        self._update_step_time(phase.compute_s / max(1, phase.steps))
        return phase

    def _sync(self, phase: PhaseResult) -> SyncOutcome:
        """Say we sync, read the swarm and combine with its peers (sync/): the parameters end at the next anchor."""
        # in the background: an all-reduce expects the peers of its round and those a round behind, so a member's
        # round is seen in time without a wait; "sync" tells joiners and ETAs, which read it a moment later anyway
        self.announce(phase="sync", inner_step=phase.steps, train_loss=phase.mean_loss)
        sync_started = time.monotonic()
        view = self.swarm()
        self._sync_view = (time.monotonic(), view)
        context = self._context(view, inner_steps=phase.steps, tokens=phase.tokens)
        result = self.sync.finish_round(context)
        blocked_s = time.monotonic() - sync_started
        self.blocked_s = _ema(self.blocked_s, blocked_s)
        self.expected_blocking_s, self.swarm_blocking_s = result.expected_blocking_s, result.swarm_blocking_s
        return SyncOutcome(view, context, result, blocked_s)

    def _settle(self, round_: int, synced: SyncOutcome) -> bool:
        """Whether we are in step with the swarm, the next round, and its validation loss where it is measured
        (`_evaluates_this_round`); whether it was."""
        # In step with the swarm when our group held a majority of the peers of our round or beyond (a joiner that
        # arrived too late for its round's all-reduce averaged alone while the others moved on: not in step). A
        # liar's round must not unsettle us, nor a banned peer's, nor identities that never did any work
        others_here = peers_to_outnumber(synced.view.others, round_, self.config.sync.join_max_round_lead,
                                         self.reputation.is_banned, self.contributions.vouches_for)
        if not synced.result.nothing_due:
            self.state.record_step_(synced.result.group_size, others_here, synced.result.in_step)
        self.state.round += 1
        evaluated = self._evaluates_this_round()  # every run.eval_every rounds; in between, the latest loss
        self.val_loss = self.inner.evaluate(self.val_batches) if evaluated else self.val_loss
        return evaluated

    def _report(self, round_: int, started: float, phase: PhaseResult, synced: SyncOutcome,
                evaluated: bool) -> RoundMetrics:
        """The round's metrics, written to the metrics file, and our record's figures; a line saying why, when the
        round combined only our own contribution (said again only when the reason changes)."""
        result = synced.result
        reason = why_alone(synced.context, result, self.sync.aligned_rounds) if result.group_size == 1 else None
        if reason is not None and reason != self.alone_reason:
            logger.info(f"round {round_} averaged alone: {reason}")
        self.alone_reason = reason
        bytes_sent, bytes_received = self.traffic.take_()  # measured: net/stream_bytes.py
        metrics = RoundMetrics(
            peer_id=self.peer_id, round=round_, inner_steps=phase.steps, train_loss=phase.mean_loss,
            val_loss=self.val_loss, tokens_per_s=phase.tokens / max(phase.compute_s, 1e-9),
            compute_s=phase.compute_s, comm_blocked_s=synced.blocked_s, bytes_sent=bytes_sent,
            bytes_received=bytes_received, peers_averaged=result.group_size, round_s=time.monotonic() - started,
            joined=self.state.joined_this_round, sync=self.config.sync.mode, partners=result.partners,
            codec=result.codec, exchange_s=result.exchange_s, consensus_distance=result.consensus_distance,
            failed_exchanges=result.failed, refused_exchanges=result.refused,
            exchanges=[dataclasses.asdict(e) for e in result.exchanges], banned_peers=sorted(self.reputation.banned()),
            mix2_averaged=result.mix2_group_size, eval_s=self.inner.last_eval_s if evaluated else 0.0,
            evaluated=evaluated)
        self.metrics_log.write(metrics)
        self.tokens_trained = min(self.tokens_trained + phase.tokens, MAX_TOKENS)
        self.announcer.update(val_loss=self.val_loss, tokens_per_s=metrics.tokens_per_s, synced=self.state.synced,
                              bandwidth_bps=8 * result.link_bytes_per_s, banned=len(metrics.banned_peers),
                              bytes_sent=bytes_sent, bytes_received=bytes_received, tokens=self.tokens_trained,
                              step_s=min(self.step_time_s, MAX_STEP_S) if math.isfinite(self.step_time_s) else 0.0,
                              vouched=self.contributions.vouches())
        return metrics

    def _count_from(self, round_: int) -> None:
        """Our first round sets the round we stop at (`run.rounds` later)."""
        if self.end_round is None and self.config.run.rounds:
            self.end_round = round_ + self.config.run.rounds

    def _evaluates_this_round(self) -> bool:
        every = self.config.run.eval_every
        return self.rounds_run % every == 0 or self.state.joined_this_round or self.state.round == self.end_round

    def _context(self, view: SwarmView, inner_steps: int, tokens: int = 0) -> RoundContext:
        others = [r for r in view.others if r.phase != "joining"]
        if not others and not self.sync.needs_current_swarm:  # gossip: partners seen lately, an exchange verifies
            others = [r for r in self._view_of(self.watcher.recently_seen()).others if r.phase != "joining"]
        # this round's own inner phase (a paced peer runs fewer steps): what an overlapped transfer must fit in
        phase_s = self._inner_steps() * self.step_time_s if not math.isnan(self.step_time_s) else math.inf
        round_ = self.state.round
        return RoundContext(round_, inner_steps, [r.peer_id for r in others], len(view.at_round(round_)),
                            phase_s, {r.peer_id: r.bandwidth_bps / 8 for r in others if r.bandwidth_bps > 0},
                            round_peers=round_peers(others, round_, self.config.sync.overlap != "none"),
                            full_steps=self._inner_steps(), tokens=tokens)

    def _inner_steps(self) -> int:
        """H, or fewer when our steps are slower than the swarm's (`sync.keep_pace`, gossip modes) or our link is
        (`sync.adapt_inner_steps`: GASLoC's pacing rule). The target round is that of a peer on the swarm's fastest
        link running all H steps at the swarm's pace, so a fast peer keeps H and a slower one gives up the steps its
        slower compute, or its extra communication time, would take."""
        steps = self.paced_steps
        if math.isnan(self.expected_blocking_s):  # no link forecast (all-reduce modes): what blocking measured
            comm_s, base_s = self.blocked_s, 0.0
        else:
            comm_s, base_s = self.expected_blocking_s, min(self.swarm_blocking_s, self.expected_blocking_s)
        if not self.config.sync.adapt_inner_steps or math.isnan(self.step_time_s) or math.isnan(comm_s):
            return steps
        return inner_steps_for_link(steps * self.step_time_s + base_s, self.step_time_s, comm_s,
                                    self.config.inner.min_steps, steps)

    def _pace(self, view: SwarmView) -> None:
        """The round's H at the swarm's pace (`sync.keep_pace`, gossip modes), from the step times in `view`; one
        line when it changes, so that a volunteer sees why its peer runs fewer steps. Once we verified the work of
        PACE_MIN_PEERS live peers, only theirs count: a step time is a free claim, and 20 identities claiming fast
        steps would otherwise halve every honest peer's inner phase. Until then every record counts: a median of
        fewer swung with one partner's noise (a fast peer whose one verified partner was faster ran half its steps
        in 4 rounds of 6 on a loaded machine)."""
        if not self.config.sync.keep_pace or self.sync.aligned_rounds:
            return
        live = [r for r in view.others if not self.reputation.is_banned(r.peer_id)]
        verified = [r for r in live if self.contributions.vouches_for(r.peer_id)]
        pace = swarm_step_s([r.step_s for r in (verified if len(verified) >= PACE_MIN_PEERS else live)])
        self.swarm_step_s = pace if not math.isnan(pace) else self.swarm_step_s  # a read that found few: as it was
        steps = inner_steps_for_pace(self.config.inner.steps, self.step_time_s, self.swarm_step_s,
                                     self.config.inner.min_steps)
        if steps != self.paced_steps:
            logger.info(f"round {self.state.round}: {steps} of {self.config.inner.steps} inner steps to keep the "
                        f"swarm's pace (ours {self.step_time_s:.3g} s a step, the swarm's {self.swarm_step_s:.3g} s)")
        self.paced_steps = steps

    def _on_inner_step(self, bar: ProgressBar, round_: int, step: int, loss: float, peers: int) -> None:
        self.announcer.update(inner_step=step, train_loss=loss)
        bar.inner_step(round_, step, loss, peers)

    def _update_step_time(self, seconds: float) -> None:
        self.step_time_s = _ema(self.step_time_s, seconds)

    def _publish_round_start(self) -> None:
        """Snapshot our state for joiners and announce this round with the time we expect to finish it."""
        eta = get_dht_time() + self._inner_steps() * self.step_time_s if not math.isnan(self.step_time_s) else 0.0
        round_ = self.conduct.announced_round(self.state.round)
        self._snapshot = StateSnapshot.capture(dict(round=round_, fingerprint=self.fingerprint,
                                                    run_id=self.config.run.run_id),
                                               self.conduct.served_state(self.state.named_tensors()))
        self.announce(round=round_, inner_step=0, phase="inner", round_eta=eta)  # as "sync" (`_sync`)

    def _inner_deadline(self, view: SwarmView) -> float:
        """End the inner phase when the latest peer already in this round expects to end it (monotonic time);
        only when peers sync round by round (gossip peers never wait for each other).

        Peers of this round already syncing count too (their ETA has passed: end after the fewest steps and join
        them). Otherwise a group that starts its rounds a matchmaking window after another averages on its own,
        round after round, and the swarm stays split in two. A banned peer's ETA does not count: a CI run saw two
        honest peers end round 1 after one step at a banned member's ETA while the third, which had not seen it,
        ran all five, came too late and fell out of step for the rest of the run.

        Once we verified any live peer's work, only such peers' ETAs count: an ETA is a free claim, and an identity
        first in a round with one in the past would otherwise cut every honest peer's phase to the fewest steps,
        round after round. A peer with no verified partner yet (fresh, resumed) counts every one.
        """
        if not self.sync.aligned_rounds:
            return math.inf
        records = [r for r in view.at_round(self.state.round)
                   if r.phase in ("inner", "sync") and r.round_eta > 0 and not self.reputation.is_banned(r.peer_id)]
        # who counts among all live peers, not among this round's: there the identity may be alone
        counted = {r.peer_id for r in voters(view.others, self.contributions.vouches_for)}
        etas = [r.round_eta for r in records if r.peer_id in counted]
        if not etas:
            return math.inf
        return time.monotonic() + max(0.0, max(etas) - get_dht_time())

    # ---- checkpoints (peer_checkpoint.py) ----------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        save_peer_checkpoint(self.state, self.inner, self.config, self.fingerprint)

    def take_swarm_state(self, wait_s: float) -> str:
        """Catch up once and train nothing (`p2ptrain export --from-swarm`): wait up to `wait_s` for other peers'
        records, then take a state as a joiner does (the same donors, downloads, witnesses and loss checks). Says
        what was taken; a UserError when there is no live peer or no state passed the checks."""
        deadline = time.monotonic() + wait_s
        view = self.swarm()
        while not view.others and time.monotonic() < deadline and not self.stop_event.is_set():
            self.stop_event.wait(self.config.network.heartbeat_s)
            view = self.swarm()
        run_id = self.config.run.run_id
        if not view.others:
            raise UserError(f"no live peer of run {run_id!r} with this model within {wait_s:g} s: is the run on?")
        decision = self.joiner.catch_up_(view)
        self.state.take_(decision)
        if decision.snapshot is not None:
            return f"the state of round {self.state.round} from {decision.donor} ({decision.detail})"
        if decision.member and all(r.round == 0 for r in view.others):
            return "the swarm's initial state (it is in round 0)"
        raise UserError(f"no peer of run {run_id!r} shared a state that passed a joiner's checks (the log says why)")

    # ---- shutdown -----------------------------------------------------------------------------------------------
    def stop(self) -> None:
        self.stop_event.set()

    def shutdown(self) -> None:
        closers = (self.metrics_log.close, self.announcer.leave, lambda: self.services.stop(self.loop),
                   self.watcher.stop, self.sync.shutdown, lambda: self.loop.run(self.p2p.shutdown(), timeout=10),
                   self.loop.stop, self.dht.shutdown, self.node.close)
        for close in closers:
            try:
                close()
            except Exception:  # shutting down: report, continue closing the rest
                logger.debug("error while shutting down", exc_info=True)


def _ema(previous: float, sample: float, weight: float = 0.3) -> float:
    return sample if math.isnan(previous) else (1 - weight) * previous + weight * sample
