"""Real peers on loopback (real hivemind DHT, averager and P2P): DiLoCo training, agreement, status, joining."""

from __future__ import annotations

import json
import uuid

import pytest
from swarm_utils import (
    PeerThread,
    max_param_difference,
    replace_section,
    run_peers,
    run_swarm,
    start_peer,
    tiny_config,
    wait_until,
)

from p2ptrain.status import print_status

pytestmark = [pytest.mark.network, pytest.mark.slow, pytest.mark.alone,  # rounds end on matchmaking deadlines
              pytest.mark.usefixtures("one_torch_thread")]

AGREEMENT_TOLERANCE = 1e-5


def test_three_peers_train_agree_and_are_listed(capsys):
    # min_peers: the three begin round 0 together (in a CI run a peer's loss rose by round 3, 5.00 > 4.85, in 0.7 s
    # rounds, the pace of a peer averaging alone, when the default outer step was γ 0.9 / η 0.7).
    config = tiny_config(f"swarm-{uuid.uuid4().hex[:6]}", run={"rounds": 4, "min_peers": 3})
    first = start_peer(config)
    peers = [first] + [start_peer(config, first.maddrs) for _ in range(2)]
    threads = [PeerThread(p) for p in peers]
    try:
        for thread in threads:
            thread.start()
        histories = [thread.join(timeout_s=240) for thread in threads]
        for history in histories:
            assert history[-1].round == history[0].round + 3  # run.rounds 4, counted from its first round
            assert history[-1].train_loss < history[0].train_loss
            assert history[-1].val_loss < history[0].val_loss
        full_rounds = [r for r in range(10) if all(
            any(m.round == r and m.peers_averaged == 3 for m in h) for h in histories)]
        assert full_rounds, f"no round averaged all 3 peers: {[[m.peers_averaged for m in h] for h in histories]}"
        last_full = max(full_rounds)
        reference = threads[0].params_after_round[last_full]
        for thread in threads[1:]:
            assert max_param_difference(reference, thread.params_after_round[last_full]) < AGREEMENT_TOLERANCE
        status_config = replace_section(config, "network", client_mode=True)
        document = print_status(status_config, first.maddrs)
        assert {p["peer_id"] for p in document["peers"]} == {p.peer_id for p in peers}
        capsys.readouterr()
        print_status(status_config, first.maddrs, as_json=True, every_s=0.5, count=2)  # `status --json --watch`
        documents = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(documents) == 2 and all({p["peer_id"] for p in d["peers"]} == {p.peer_id for p in peers}
                                           for d in documents)
    finally:
        for p in peers:
            p.shutdown()


def test_a_peer_validates_every_eval_every_rounds_its_first_and_its_last():
    config = tiny_config(f"eval-{uuid.uuid4().hex[:6]}", run={"rounds": 5, "eval_every": 3})
    peer = start_peer(config)
    try:
        history = PeerThread(peer).start().join(timeout_s=120)
    finally:
        peer.shutdown()
    assert [m.evaluated for m in history] == [True, False, False, True, True]
    assert [m.eval_s > 0 for m in history] == [True, False, False, True, True]
    assert history[1].val_loss == history[2].val_loss == history[0].val_loss  # the latest, reported again
    assert history[3].val_loss != history[0].val_loss and history[4].val_loss < history[0].val_loss
    assert peer.announcer.record.val_loss == history[4].val_loss


def test_late_joiner_ends_its_first_round_equal_to_the_swarm():
    run_id = f"join-{uuid.uuid4().hex[:6]}"
    # rounds of a few seconds, as a joiner needs to download a state and reach the round its donor is in (rounds of
    # 5 steps end in 0.3 s, before a joiner is up: it then lands a round late and syncs alone)
    config = tiny_config(run_id, run={"rounds": 0}, inner={"steps": 40})
    a = start_peer(config)
    b = start_peer(config, a.maddrs)
    threads = [PeerThread(a), PeerThread(b)]
    joiner = None
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.wait_for_round(3, timeout_s=180)
        joiner = start_peer(replace_section(config, "run", rounds=1), a.maddrs)
        joiner_thread = PeerThread(joiner).start()
        (first_round,) = joiner_thread.join(timeout_s=120)
        assert first_round.joined and first_round.round >= 3
        assert first_round.peers_averaged == 3
        for thread in threads:
            thread.wait_for_round(first_round.round, timeout_s=60)
            difference = max_param_difference(joiner_thread.params_after_round[first_round.round],
                                              thread.params_after_round[first_round.round])
            assert difference < AGREEMENT_TOLERANCE
    finally:
        for peer in (a, b):
            peer.stop()
        for thread in threads:
            thread.thread.join(timeout=60)
        for peer in (a, b, joiner):
            if peer is not None:
                peer.shutdown()


def test_a_peer_that_finds_the_swarm_in_round_0_needs_no_state_download():
    """Every peer builds θ_0 from the run's seed: a fresh peer whose swarm is in round 0 compares sketches instead
    of downloading the state (a home link would spend minutes on it)."""
    config = tiny_config(f"start-{uuid.uuid4().hex[:6]}", run={"rounds": 3}, inner={"steps": 300})
    first = start_peer(config)
    threads = [PeerThread(first).start()]
    second = None
    try:
        wait_until(lambda: first._snapshot is not None, 60, "the first peer to announce round 0")
        second = start_peer(config, first.maddrs)
        threads.append(PeerThread(second).start())
        histories = [thread.join(timeout_s=300) for thread in threads]
    finally:
        for peer in (first, second):
            if peer is not None:
                peer.shutdown()
    assert histories[1][0].round == 0 and not histories[1][0].joined
    assert max_param_difference(threads[0].params_after_round[2], threads[1].params_after_round[2]) \
        < AGREEMENT_TOLERANCE


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_one_step_delay_overlap_trains_and_applies_the_swarm_average_one_round_late(overlap):
    config = tiny_config(f"overlap-{uuid.uuid4().hex[:6]}", run={"rounds": 5}, sync={"overlap": overlap})
    threads, histories = run_swarm(config, peers=2)
    for history in histories:
        assert min(m.val_loss for m in history[1:]) < history[0].val_loss
        # round r reports the all-reduce of round r-1, which ran in the background during round r
        assert history[0].peers_averaged == 1
        assert sum(m.peers_averaged == 2 for m in history[1:]) >= 3
    if overlap == "delayed":  # both peers apply the same delayed average: they stay equal
        last = max(threads[0].params_after_round)
        a, b = threads[0].params_after_round[last], threads[1].params_after_round[last]
        if all(m.peers_averaged == 2 for h in histories for m in h[1:]):
            assert max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) < AGREEMENT_TOLERANCE


def test_a_peer_out_of_step_stays_so_until_it_adopts_a_state_or_its_group_shows_it_holds_the_groups():
    """Without samples `synced` is sticky: averaging with the others again does not make a peer's parameters
    theirs. Where the group showed its states (DiLoCo's exchange all-reduce), they decide, in a group that held
    the majority of the round."""
    import types

    from p2ptrain.peer_state import PeerState

    peer = types.SimpleNamespace(synced=True, joined_this_round=False)
    steps = ((3, False, None, True), (1, False, None, False), (3, False, None, False), (3, True, None, True),
             (3, False, False, False), (3, False, True, True), (1, False, True, False), (3, False, None, False))
    for group, joined, shown, expected in steps:
        peer.joined_this_round = joined
        PeerState.record_step_(peer, group_size=group, others_here=2, shown=shown)  # type: ignore[arg-type]
        assert peer.synced is expected, (group, joined, shown)


def test_a_diloco_swarm_whose_peers_each_applied_their_own_delta_agrees_on_one_state_again():
    """The netns testnet's kill: a round whose members split two and two, each applying its own Δ, left four
    states, every peer out of step and none to catch up from; they trained on apart. Here each of 3 peers moves its
    parameters by a noise of its own after round 1 (unknown to its `synced` flag): the states they show pick one
    (the lowest peer id's, all three alike), its holder is synced, the others take its state, and by the last
    round all three hold the same parameters again."""
    import torch

    # rounds of ~1 s (40 inner steps): a state download must fit in a round or two, as it does at any real size
    config = tiny_config(f"diverged-{uuid.uuid4().hex[:6]}", run={"rounds": 12}, inner={"steps": 40})
    first = start_peer(config)
    peers = [first] + [start_peer(config, first.maddrs) for _ in range(2)]

    def diverge(peer, metrics):
        if metrics.round == 1:
            generator = torch.Generator().manual_seed(hash(peer.peer_id) % 2**31)
            peer.outer.set_params_([p.detach() + 0.05 * torch.randn(p.shape, generator=generator)
                                    for p in peer.params])

    for peer in peers:
        peer.round_callbacks.insert(0, diverge)
    threads, histories = run_peers(peers, timeout_s=300)
    rounds = [[(m.round, m.joined, m.peers_averaged) for m in h] for h in histories]
    assert max_param_difference(threads[0].params_after_round[1], threads[1].params_after_round[1]) > 0.01
    assert sum(m.joined for h in histories for m in h if m.round > 1) >= 2, rounds  # two took the third's state
    full = [r for r in range(2, 12) if all(any(m.round == r and m.peers_averaged == 3 for m in h) for h in histories)]
    assert full and max(full) >= 8, rounds
    last = threads[0].params_after_round[max(full)]
    differences = [max_param_difference(last, t.params_after_round[max(full)]) for t in threads[1:]]
    assert max(differences) < AGREEMENT_TOLERANCE, (differences, rounds)


@pytest.mark.parametrize("transport", ["exchange", "hivemind"])
def test_a_round_reports_the_bytes_its_streams_carried(transport):
    """Measured on the streams (net/stream_bytes.py), not derived: at least the Δ each peer sent (fp32, the tiny
    model's S = 4 × 117,120 bytes; hivemind's butterfly sends its half of it twice, 2·S·(n − 1)/n = S for a pair,
    from the averager's own process), and within a small multiple of it (headers, digests, matchmaking)."""
    config = tiny_config(f"bytes-{uuid.uuid4().hex[:6]}", run={"rounds": 3}, sync={"allreduce_transport": transport})
    _threads, histories = run_swarm(config, peers=2)
    model_bytes = 4 * 117_120
    for history in histories:
        averaged = [m for m in history if m.peers_averaged == 2]
        assert len(averaged) >= 2, [m.peers_averaged for m in history]
        for m in averaged:
            assert model_bytes <= m.bytes_sent <= 3 * model_bytes, (transport, m.bytes_sent)
            assert model_bytes <= m.bytes_received <= 3 * model_bytes, (transport, m.bytes_received)


def test_the_hivemind_all_reduce_forms_its_group_once_the_rounds_peers_have_joined():
    """The group's target size is the round's live peers (their DHT records), set before each step: the leader
    assembles the group once they have joined, not after the whole matchmaking window (20 s here), and the butterfly
    sends the ideal all-reduce's bytes, 2·S·(n − 1)/n = S for a pair, plus headers."""
    window_s = 20.0
    config = tiny_config(f"target-{uuid.uuid4().hex[:6]}", run={"rounds": 4},
                         sync={"allreduce_transport": "hivemind", "matchmaking_s": window_s})
    _threads, histories = run_swarm(config, peers=2)
    model_bytes = 4 * 117_120
    for history in histories:
        averaged = [m for m in history if m.peers_averaged == 2]
        assert len(averaged) >= 2, [m.peers_averaged for m in history]
        assert sorted(m.comm_blocked_s for m in averaged)[len(averaged) // 2] < window_s / 4, \
            [m.comm_blocked_s for m in averaged]
        assert all(model_bytes <= m.bytes_sent <= 1.1 * model_bytes for m in averaged), [m.bytes_sent for m in averaged]
