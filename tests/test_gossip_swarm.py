"""GASLoC and Factored in a real swarm of in-process peers on loopback (real DHT, P2P and averager)."""

from __future__ import annotations

import itertools
import statistics
import uuid

import pytest
from swarm_utils import PeerThread, run_swarm, tiny_config

from p2ptrain.metrics import RoundMetrics
from p2ptrain.sync.interface import ExchangeRecord
from p2ptrain.tensor_layout import distance

pytestmark = [pytest.mark.network, pytest.mark.slow, pytest.mark.alone,  # counts exchanges in wall-clock rounds
              pytest.mark.usefixtures("one_torch_thread")]

ROUNDS = 5


def metrics_exchanges(metrics: RoundMetrics) -> list[ExchangeRecord]:
    return [ExchangeRecord(**e) for e in metrics.exchanges]


def run_mode(mode: str, peers: int, **sync: object) -> tuple[list[PeerThread], list]:
    return run_swarm(tiny_config(f"{mode}-{uuid.uuid4().hex[:6]}", run={"rounds": ROUNDS},
                                 sync={"mode": mode, **sync}), peers)


def test_gasloc_one_peer_swarm_trains_stays_close_and_sends_fp16() -> None:
    # fp16 named: the default (adaptive) sent int8 in a CI run, where fp16 did not fit these 5-step phases on the
    # loaded machine's measured loopback (tests/test_heterogeneous_netns.py covers the choice)
    threads, histories = run_mode("gasloc", peers=4, param_codec="fp16")
    model_bytes = sum(p.numel() * 4 for p in threads[0].peer.params)
    exchanges = failed = 0
    for history in histories:
        assert history[-1].round == history[0].round + ROUNDS - 1  # run.rounds, counted from its first round
        # a gossip peer's own val loss is noisy over 5 short rounds: the best round must beat the first
        assert min(m.val_loss for m in history[1:]) < history[0].val_loss
        assert history[-1].train_loss < history[0].train_loss
        assert all(metrics.consensus_distance for metrics in history[1:] if metrics.partners), history
        for metrics in history[1:]:
            assert [e.partner for e in metrics_exchanges(metrics)] == metrics.partners
            for record in metrics_exchanges(metrics):
                exchanges += 1
                assert metrics.codec == record.codec == "fp16"
                assert record.bytes_sent == pytest.approx(model_bytes / 2, rel=0.01)  # 16-bit
                assert record.bytes_received == pytest.approx(model_bytes / 2, rel=0.01) and record.seconds > 0
            failed += metrics.failed_exchanges
    assert exchanges >= 2 * (ROUNDS - 1), "peers hardly ever found a partner"
    # Agreement: the peers' last parameters are apart by a fraction of how far each moved since round 0 (the mean
    # pair over the mean move: 0.16-0.26 in 5 runs, 3 beside 2 CPU hogs); peers that never mix end as far apart as
    # they moved (0.97-1.07 with the pull made a no-op). Per exchange the gap is no test: a partner a round or two
    # apart on a loaded machine is that much further (CI: 3.2 rounds of progress once).
    last = ROUNDS - 1
    apart = [distance(a.params_after_round[last], b.params_after_round[last])
             for a, b in itertools.combinations(threads, 2)]
    moved = [distance(t.params_after_round[last], t.params_after_round[0]) for t in threads]
    assert statistics.mean(apart) < 0.6 * statistics.mean(moved), (apart, moved)
    sent = [sum(m.bytes_sent for m in h) for h in histories]
    opened = [sum(r.bytes_sent for m in h for r in metrics_exchanges(m)) for h in histories]
    # The rounds' bytes are measured on the streams (net/stream_bytes.py): each peer sent at least the payloads of
    # the exchanges it opened in its rounds ...
    assert all(s >= o > 0 for s, o in zip(sent, opened, strict=True)), (sent, opened)
    # ... and its streams count the answers too: each committed exchange carries a payload back, and what one peer's
    # streams sent, another's received. On the counters' totals, not the rounds' sum: an answer sent after its
    # sender's last round is in no round (a quarter of them under a CI run's load: 8.0 MB against 2 × 4.7 MB)
    totals = [thread.peer.traffic.counter.totals() for thread in threads]
    all_sent, all_received = sum(t[0] for t in totals), sum(t[1] for t in totals)
    assert all_sent >= 0.95 * 2 * sum(opened), (totals, opened)
    assert abs(all_sent - all_received) <= 0.05 * all_sent, totals
    # Exchanges between live peers on loopback complete (they failed about 1 in 25 while the responder closed its
    # end too early and p2pd reset the stream: gossip._drain). One is allowed to run out its deadline on a loaded
    # CI machine; a timed-out exchange leaves the initiator unchanged (tests/test_gossip.py).
    assert failed <= 1, (failed, exchanges)


def test_factored_swarm_trains_and_mixes_every_round() -> None:
    _threads, histories = run_mode("factored", peers=3)
    for history in histories:
        assert min(m.val_loss for m in history[1:]) < history[0].val_loss
        assert sum(m.peers_averaged > 1 for m in history) >= ROUNDS // 2
