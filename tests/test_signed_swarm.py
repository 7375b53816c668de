"""A signed run end to end: two volunteers with the organiser's tickets train together; a peer without a ticket,
which knows the address and the run id, sees them, but every gossip exchange it offers is refused, and an
exchange all-reduce refuses it too; with `sync.allreduce_transport: hivemind`, a group it slips into (hivemind's
matchmaking knows no tickets) is not used by the ticketed peers."""

from __future__ import annotations

from pathlib import Path

import pytest
from hivemind.p2p import P2P, PeerID
from swarm_utils import run_peers, start_peer, tiny_config

from p2ptrain.metrics import RoundMetrics
from p2ptrain.net.admission import admit_peer, generate_organiser_key
from p2ptrain.peer import TrainingPeer

pytestmark = [pytest.mark.network, pytest.mark.slow]

RUN = "signed-swarm"


def volunteer_files(tmp_path: Path, name: str, organiser_key: Path) -> dict[str, str]:
    """An identity for a volunteer and the organiser's ticket for its peer id: the `network` section it runs with."""
    identity = tmp_path / f"{name}.id"
    P2P.generate_identity(str(identity))
    peer_id = PeerID.from_identity(identity.read_bytes()).to_base58()
    ticket = tmp_path / f"{name}.ticket"
    admit_peer(organiser_key, RUN, peer_id, ticket)
    return {"identity_path": str(identity), "admission_ticket": str(ticket)}


def signed_swarm(tmp_path: Path, mode: str, intruder_inner: dict[str, object] | None = None,
                 intruder_sync: dict[str, object] | None = None,
                 **sync: object) -> tuple[set[str], list[list[RoundMetrics]], TrainingPeer]:
    """Alice and Bob (ticketed) and an intruder (its inner and sync sections changed by `intruder_inner` and
    `intruder_sync`) run 5 rounds: the ticketed ids, the three histories, Alice. All three begin round 0 together:
    the volunteers wait for each other (they see no unticketed record), the intruder for both. (An intruder that
    came in a round late was refused the volunteers' state, stayed a round behind, and met them in no round.)"""
    key, public_key = generate_organiser_key(tmp_path / "organiser.key")
    signed = {"admission": "signed", "organiser_key": str(public_key)}
    rounds = {"run": {"run_id": RUN, "device": "cpu", "progress": False, "rounds": 5, "min_peers": 2},
              "sync": {"mode": mode, "matchmaking_s": 2.0, **sync}}
    alice = start_peer(tiny_config(RUN, **rounds, network={**signed, **volunteer_files(tmp_path, "alice", key)}))
    bob = start_peer(tiny_config(RUN, **rounds, network={**signed, **volunteer_files(tmp_path, "bob", key)}),
                     alice.maddrs)
    intruder_rounds = {"run": {**rounds["run"], "min_peers": 3}, "sync": {**rounds["sync"], **(intruder_sync or {})}}
    intruder = start_peer(tiny_config(RUN, **intruder_rounds, inner=intruder_inner or {}), alice.maddrs)  # no ticket
    _threads, histories = run_peers([alice, bob, intruder], timeout_s=240, attackers=1)
    return {alice.peer_id, bob.peer_id}, histories, alice


def test_only_ticketed_peers_gossip_together_in_a_signed_run(tmp_path: Path) -> None:
    ticketed, histories, alice = signed_swarm(tmp_path, "gasloc")
    for name, history in zip(("alice", "bob"), histories[:2], strict=True):
        partners = {p for m in history for p in m.partners}
        assert partners and partners <= ticketed, f"{name} exchanged with {partners - ticketed or 'nobody'}"
        assert history[-1].val_loss < history[0].val_loss
    intruder_history = histories[2]
    assert not any(m.partners for m in intruder_history), "an exchange without a ticket went through"
    assert sum(m.refused_exchanges + m.failed_exchanges for m in intruder_history) > 0, "it never even tried"
    assert {r.peer_id for r in alice.swarm().records} <= ticketed


def test_an_intruder_gets_into_no_exchange_all_reduce_of_a_signed_run(tmp_path: Path) -> None:
    # refused every state, the intruder waits for the volunteers' next round each round, at most its all-reduce
    # timeout: 5 s, not the default 30 s (the test took 130 s)
    ticketed, histories, alice = signed_swarm(tmp_path, "diloco", intruder_sync={"allreduce_timeout_s": 5.0})
    for name, history in zip(("alice", "bob"), histories[:2], strict=True):
        assert all(m.peers_averaged <= 2 for m in history), f"{name} averaged with the intruder"
        assert any(m.peers_averaged == 2 for m in history), f"{name} never averaged with its ticketed partner"
        assert history[-1].val_loss < history[0].val_loss
    assert all(m.peers_averaged == 1 for m in histories[2]), "an exchange of the intruder went through"


def test_a_hivemind_all_reduce_group_with_an_intruder_is_not_used_in_a_signed_run(tmp_path: Path) -> None:
    """The intruder runs 1 inner step to the volunteers' 5, so it reaches each round's matchmaking first and is
    the leader the volunteers try first. (Left to chance, the volunteers' own groups, whose target is the two
    ticketed peers their records show, often filled before it came: nothing was tested.) Under load it still came
    too late in all 5 rounds of one CI run: a swarm where it got into no group is run once more, as nothing was
    tested, and a second such swarm fails."""
    for attempt in range(2):
        (workdir := tmp_path / str(attempt)).mkdir()
        ticketed, histories, _alice = signed_swarm(workdir, "diloco",
                                                   intruder_inner={"steps": 1, "warmup_steps": 0},
                                                   allreduce_transport="hivemind")
        intruder_rounds = {m.round for m in histories[2] if m.peers_averaged >= 2}  # with Alice or Bob or both
        if intruder_rounds:
            break
    assert intruder_rounds, "the intruder never got into a group in two swarms: nothing tested"
    for name, history in zip(("alice", "bob"), histories[:2], strict=True):
        assert all(m.peers_averaged <= 2 for m in history), f"{name} averaged with the intruder"
        # of three peers, one in a group with the intruder leaves no pair of volunteers: both applied their own Δ
        assert all(m.peers_averaged == 1 for m in history if m.round in intruder_rounds), f"{name} used its group"
        assert min(m.val_loss for m in history[1:]) < history[0].val_loss
