"""The red team's parts that need no network: parsing `--attack` and `adversary:`, the lies told, and the
report's `attackers_banned` check."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2ptrain.errors import ConfigError, UserError
from p2ptrain.tensor_layout import norm
from p2ptrain.testnet.adversary import ATTACKS, PUSH_STEPS, Attack, HostileConduct, tampered
from p2ptrain.testnet.plan import plan_run
from p2ptrain.testnet.report import Life, RunRecord, check_attackers_banned, run_checks
from p2ptrain.testnet.scenario import parse_scenario

REPO = Path(__file__).resolve().parents[1]


def test_red_team_flag_parses_kind_and_round_and_refuses_the_rest() -> None:
    assert Attack.parse("aimed@2") == Attack("aimed", 2)
    assert Attack.parse("state_liar") == Attack("state_liar", 0)
    for bad in ("", "aimed@", "aimed@-1", "aimed@x", "bogus", "nan@1.5"):
        with pytest.raises(UserError, match="--attack"):
            Attack.parse(bad)


def test_each_value_attack_lies_as_documented() -> None:
    value, stale = [torch.tensor([1.0, -2.0])], [torch.tensor([0.5, 0.5])]
    assert torch.equal(tampered("aimed", value, stale)[0], torch.tensor([-7.0, 14.0]))
    assert torch.equal(tampered("sign_flip", value, stale)[0], torch.tensor([-1000.0, 2000.0]))
    assert torch.equal(tampered("scale", value, stale)[0], torch.tensor([1000.0, -2000.0]))
    assert torch.equal(tampered("replay", value, stale)[0], stale[0])
    assert torch.isnan(tampered("nan", value, stale)[0]).all()
    assert torch.equal(value[0], torch.tensor([1.0, -2.0])), "the honest value is left alone"


def test_scenario_adversary_names_peers_or_takes_the_last_ones() -> None:
    named = plan_run(parse_scenario({"peers": 4, "adversary": {"kind": "aimed", "peers": ["peer1"], "from_round": 3}}))
    assert named.adversaries == {"peer1": "aimed@3"}
    counted = plan_run(parse_scenario({"peers": 5, "adversary": {"kind": "scale", "count": 2}}))
    assert counted.adversaries == {"peer3": "scale@0", "peer4": "scale@0"}
    assert plan_run(parse_scenario({"peers": 3})).adversaries == {}
    assert set(ATTACKS) >= {"aimed", "sign_flip", "scale", "replay", "nan", "state_liar"}


@pytest.mark.parametrize("adversary, message", [
    ({"kind": "bogus"}, "adversary.kind"),
    ({"kind": "aimed", "peers": ["peer9"]}, "no peer9"),
    ({"kind": "aimed", "count": 4}, "nobody honest"),
    ({"kind": "aimed", "peers": ["bob"]}, "not a peer name"),
    ({"kind": "aimed", "from_round": -1}, "from_round"),
    ({"kind": "aimed", "colour": "red"}, "colour"),
])
def test_a_bad_adversary_is_one_config_error(adversary: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_run(parse_scenario({"peers": 4, "adversary": adversary}))


def record_with(banned_by_peer0: list[str]) -> RunRecord:
    rows = {
        "peer0": [{"peer_id": "Qm0", "round": r, "time": 10.0 + r, "val_loss": 3.0 - r, "round_s": 1.0,
                   "banned_peers": banned_by_peer0 if r == 1 else []} for r in range(4)],
        "peer1": [{"peer_id": "QmBad", "round": r, "time": 10.0 + r, "val_loss": math.inf, "round_s": 1.0,
                   "banned_peers": []} for r in range(4)],
    }
    lives = [Life("peer0", 1, 0.0, 20.0, 0, "finished"), Life("peer1", 2, 0.0, 20.0, 0, "finished")]
    return RunRecord(0.0, 20.0, rows, lives, [], [], {}, {}, "done", plan={"adversaries": {"peer1": "aimed@0"}})


def test_attackers_banned_passes_only_when_every_honest_peer_banned_the_attacker() -> None:
    assert check_attackers_banned(record_with(["QmBad"])).passed
    failed = check_attackers_banned(record_with([]))
    assert not failed.passed and "peer0 never banned peer1" in failed.detail


def test_the_attacker_is_not_judged_as_an_honest_survivor() -> None:
    from p2ptrain.testnet.scenario import ChecksSpec

    record = record_with(["QmBad"])
    assert record.survivors() == ["peer0"]
    results = {r.name: r for r in run_checks(record, ChecksSpec(loss_fell=True, attackers_banned=True))}
    assert results["loss_fell"].passed, "peer1's infinite loss is the attacker's, not a failure of training"
    assert results["attackers_banned"].passed


def test_the_red_team_lies_through_the_exchange_all_reduce_of_a_diloco_peer() -> None:
    """The conduct forms what DiLoCo's exchange all-reduce sends, its `outgoing` (a lie on the wire only)."""
    from hivemind.p2p import PeerID

    from p2ptrain.maths.outer_optimizer import OuterConfig, OuterOptimizer
    from p2ptrain.sync.config import SyncConfig
    from p2ptrain.sync.diloco import DilocoSync
    from p2ptrain.sync.exchange_allreduce import ExchangeAllReduce
    from p2ptrain.sync.exchange_averager import ExchangeAverager

    params = [torch.nn.Parameter(torch.zeros(3))]
    fake_p2p = type("FakeP2P", (), {"peer_id": PeerID(b"attacker")})()
    conduct = HostileConduct(Attack("aimed", 0))
    exchange = ExchangeAllReduce(fake_p2p, "run", "fp", params, SyncConfig(), "allreduce.diloco", None,
                                 conduct=conduct)
    sync = DilocoSync(OuterOptimizer(params, OuterConfig()), ExchangeAverager(exchange, None, 1.0),  # type: ignore[arg-type]
                      SyncConfig())
    assert sync.averager.exchange is exchange
    sent = [torch.tensor([1.0, -2.0, 0.5])]
    assert torch.equal(exchange.outgoing(sent)[0], torch.tensor([-7.0, 14.0, -3.5]))


def test_the_conduct_lies_from_its_round_on_and_only_about_its_kind() -> None:
    """Honest before `from_round`; a value attack leaves the published state alone, the state liar the values."""
    round_ = [0]
    aimed, liar = HostileConduct(Attack("aimed", 2)), HostileConduct(Attack("state_liar", 2))
    for conduct in (aimed, liar):
        conduct.follow(lambda: round_[0])
    value, theta0 = [torch.tensor([1.0, -2.0])], [torch.tensor([0.5, 0.5])]
    named = [("param:w", torch.tensor([1.0])), ("outer:m", torch.tensor([2.0]))]
    assert aimed.sent_params(value, theta0) is value and aimed.sent_outer_gradient(value) is value
    assert liar.announced_round(1) == 1 and liar.served_state(named) is named
    round_[0] = 2
    assert torch.equal(aimed.sent_params(value, theta0)[0], torch.tensor([-7.0, 14.0]))
    assert torch.equal(aimed.own_outer_gradient(value)[0], torch.tensor([-7.0, 14.0]))
    assert aimed.announced_round(2) == 2 and aimed.served_state(named) is named
    assert liar.sent_params(value, theta0) is value and liar.sent_outer_gradient(value) is value
    assert liar.announced_round(2) == 2 + 100_000
    assert [(n, t.item()) for n, t in liar.served_state(named)] == [("param:w", -5.0), ("outer:m", 2.0)]


def test_a_free_rider_sends_a_millionth_of_its_outer_gradient_and_its_parameters_as_they_are() -> None:
    round_ = [0]
    rider = HostileConduct(Attack.parse("free_rider@1"))
    rider.follow(lambda: round_[0])
    value, theta0 = [torch.tensor([1.0, -2.0])], [torch.tensor([0.5, 0.5])]
    assert rider.sent_outer_gradient(value) is value
    round_[0] = 1
    for sent in (rider.sent_outer_gradient(value), rider.own_outer_gradient(value)):
        assert torch.allclose(sent[0], torch.tensor([1e-6, -2e-6]))
    assert rider.sent_params(value, theta0) is value and rider.announced_round(1) == 1


def test_push_adds_a_few_steps_in_one_direction_every_round_and_every_value_of_a_round_alike() -> None:
    """Beyond τ (2 steps at least) and inside the hard radius (8 typical distances), always the same way."""
    round_ = [0]
    push = HostileConduct(Attack("push", 0))
    push.follow(lambda: round_[0])
    theta0 = [torch.zeros(3), torch.zeros(2)]
    start = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0])]
    assert all(torch.equal(s, v) for s, v in zip(push.sent_params(start, theta0), start, strict=True))  # no step yet
    pushes = []
    for r, step in ((1, 0.5), (2, 0.25)):
        round_[0] = r
        moved = [v + step / math.sqrt(5) for v in start]  # ‖moved − start‖ = step
        for _ in range(2):  # every value of a round pushes by that round's step
            pushed = push.sent_params(moved, theta0)
            offset = [p - m for p, m in zip(pushed, moved, strict=True)]
            assert math.isclose(norm(offset), PUSH_STEPS * step, rel_tol=1e-5)
        pushes.append(offset)
        start = moved
    assert math.isclose(sum(float((a * b).sum()) for a, b in zip(*pushes, strict=True)),
                        norm(pushes[0]) * norm(pushes[1]), rel_tol=1e-5)  # one direction
    gradient = [torch.tensor([3.0, 4.0])]
    assert math.isclose(norm([p - g for p, g in zip(push.sent_outer_gradient(gradient), gradient, strict=True)]),
                        PUSH_STEPS * 5.0, rel_tol=1e-5)


def test_replay_sends_theta0_for_parameters_and_the_first_outer_gradient_it_lied_about() -> None:
    replay = HostileConduct(Attack("replay", 0))
    theta0 = [torch.tensor([0.5, 0.5])]
    assert torch.equal(replay.sent_params([torch.tensor([3.0, 4.0])], theta0)[0], theta0[0])
    first = replay.sent_outer_gradient([torch.tensor([1.0, 2.0])])
    assert torch.equal(replay.sent_outer_gradient([torch.tensor([9.0, 9.0])])[0], first[0])


def test_noisy_replay_sends_the_stale_value_plus_fresh_noise_one_step_long() -> None:
    round_ = [0]
    replay = HostileConduct(Attack("noisy_replay", 0))
    replay.follow(lambda: round_[0])
    theta0 = [torch.zeros(3), torch.zeros(2)]
    start = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0])]
    assert norm(replay.sent_params(start, theta0)) == 0.0  # no step measured yet: θ_0 itself
    round_[0] = 1
    moved = [v + 0.5 / math.sqrt(5) for v in start]  # ‖moved − start‖ = 0.5
    sent = [replay.sent_params(moved, theta0) for _ in range(2)]
    for value in sent:  # θ_0 plus noise as long as the round's step
        assert math.isclose(norm(value), 0.5, rel_tol=1e-5)
    assert not torch.equal(sent[0][0], sent[1][0])  # never the same bits twice
    first = [torch.tensor([3.0, 4.0])]
    gradients = [replay.sent_outer_gradient(first)]
    assert torch.equal(replay.own_outer_gradient(first)[0], gradients[0][0])  # one lie a round: it reduces it too
    round_[0] = 2
    gradients.append(replay.sent_outer_gradient([torch.tensor([6.0, 8.0])]))
    assert math.isclose(norm([a - b for a, b in zip(gradients[0], first, strict=True)]), 5.0, rel_tol=1e-5)
    assert math.isclose(norm([a - b for a, b in zip(gradients[1], first, strict=True)]), 10.0, rel_tol=1e-5)


@pytest.mark.slow
def test_a_bad_attack_on_the_red_team_command_is_one_error_line(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "p2ptrain.testnet.red_team", "--attack", "bogus", "--loopback"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert [line for line in done.stderr.splitlines() if line.strip()] == [
        f"error: --attack 'bogus': the attack must be one of {', '.join(ATTACKS)} (e.g. aimed@2)"]
