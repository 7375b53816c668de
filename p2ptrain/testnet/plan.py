"""A scenario resolved for one run: peers, rates, homes and relays, the run's bound, events (scripted and churn),
and the timeline that fires them (scenario.py parses the file; the command line overrides it here)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from typing import Any

from p2ptrain.errors import ConfigError
from p2ptrain.testnet.scenario import (
    BOOTSTRAP,
    DEFAULT_PEERS,
    DEFAULT_ROUNDS,
    AdversarySpec,
    ChecksSpec,
    ChurnSpec,
    Event,
    Scenario,
    parse_bandwidth,
    peer_index,
)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What the launcher runs: resolved peers and rates, the bound of the run, events (scripted and churn)."""

    peer_rates_mbit: tuple[float | None, ...]  # the initial peers peer0..peerN-1
    added_peers: tuple[str, ...]  # peers that add_peer events start later
    rounds: int | None  # the run ends when every peer has logged round rounds-1 (or exited) ...
    duration_s: float | None  # ... or after this many seconds (then peers run until stopped)
    events: tuple[Event, ...]
    churn_events: tuple[Event, ...]
    checks: ChecksSpec
    peer_config: Mapping[str, Any]
    adversaries: Mapping[str, str] = dataclasses.field(default_factory=dict)  # peer → its red team's --attack
    homes: Mapping[str, str] = dataclasses.field(default_factory=dict)  # peer behind NAT → its home network's name
    relays: tuple[str, ...] = ()  # peers started with --relay

    @property
    def initial_peers(self) -> list[str]:
        return [f"peer{i}" for i in range(len(self.peer_rates_mbit))]


def plan_run(scenario: Scenario, num_peers: int | None = None, bandwidth: str | None = None,
             rounds: int | None = None, duration_s: float | None = None) -> RunPlan:
    """Resolve a scenario with the command line's overrides; names in events must be peers of the run."""
    rates = parse_bandwidth(bandwidth, "--bandwidth") if bandwidth else scenario.bandwidth_mbit
    count = num_peers or scenario.peers or (len(rates) if len(rates) > 1 else DEFAULT_PEERS)
    if len(rates) > 1 and len(rates) != count:
        raise ConfigError(f"bandwidth lists {len(rates)} rates for {count} peers: give one rate per peer or one "
                          f"for all")
    peer_rates = tuple(rates) * count if len(rates) == 1 else tuple(rates) or (None,) * count
    if rounds is None and duration_s is None:
        rounds, duration_s = scenario.rounds, scenario.duration_s
        if rounds is None and duration_s is None:
            rounds = DEFAULT_ROUNDS
    events, added = _name_added_peers(scenario.events, count)
    known = {f"peer{i}" for i in range(count)} | set(added)
    named = [(f"events[{i}] ({event.describe()})", name) for i, event in enumerate(events)
             for name in (event.peer, event.of, *event.group) if (name, event.action) != (BOOTSTRAP, "kill")]
    named += [("nat", name) for home in scenario.nat for name in home] + [("relays", n) for n in scenario.relays]
    for where, name in named:
        if name is not None and name not in known:
            raise ConfigError(f"{where}: no peer {name!r} in this run "
                              f"(peers: {', '.join(sorted(known, key=lambda n: peer_index(n, 'peer')))})")
    churn = churn_events(scenario.churn, count, duration_s) if scenario.churn else ()
    adversaries = plan_adversaries(scenario.adversary, count) if scenario.adversary else {}
    homes = {name: f"home{k}" for k, home in enumerate(scenario.nat) for name in home}
    return RunPlan(peer_rates, tuple(added), rounds, duration_s, events, churn, scenario.checks,
                   dict(scenario.peer_config), adversaries, homes, scenario.relays)


def plan_adversaries(spec: AdversarySpec, num_peers: int) -> dict[str, str]:
    """The hostile peers and their red team's `--attack KIND@ROUND`; at least one peer of the run stays honest."""
    names = list(spec.peers) or [f"peer{i}" for i in range(max(0, num_peers - spec.count), num_peers)]
    unknown = [n for n in names if peer_index(n, "adversary.peers") >= num_peers]
    if unknown:
        raise ConfigError(f"adversary.peers: no {', '.join(unknown)} among the {num_peers} initial peers")
    if len(set(names)) >= num_peers:
        raise ConfigError(f"adversary: {len(set(names))} hostile peers of {num_peers} leaves nobody honest")
    return {name: f"{spec.kind}@{spec.from_round}" for name in names}


def _name_added_peers(events: tuple[Event, ...], num_peers: int) -> tuple[tuple[Event, ...], list[str]]:
    added: list[str] = []
    named = []
    for event in events:
        if event.action == "add_peer":
            added.append(f"peer{num_peers + len(added)}")
            event = dataclasses.replace(event, peer=added[-1])
        named.append(event)
    return tuple(named), added


def churn_events(churn: ChurnSpec, num_peers: int, duration_s: float | None) -> tuple[Event, ...]:
    """Kill and restart events for random churn: deterministic for a seed, never fewer than min_alive alive."""
    stop_s = churn.stop_s if churn.stop_s is not None else duration_s
    if stop_s is None:
        raise ConfigError("churn.stop_s: give the last second at which churn may kill a peer (needed when the run "
                          "is bounded by rounds, not duration_s)")
    rng = random.Random(churn.seed)
    back_at: dict[str, float] = {}  # peer -> when its restart fires
    events: list[Event] = []
    t = churn.start_s
    while True:
        t += rng.expovariate(churn.kills_per_min / 60.0)
        if t >= stop_s:
            break
        alive = sorted((f"peer{i}" for i in range(num_peers) if back_at.get(f"peer{i}", -1.0) <= t),
                       key=lambda n: peer_index(n, "peer"))
        if len(alive) <= churn.min_alive:
            continue
        victim = rng.choice(alive)
        back_at[victim] = t + churn.down_s
        events += [Event("kill", victim, at_s=round(t, 3)), Event("restart", victim, at_s=round(t + churn.down_s, 3))]
    return tuple(sorted(events, key=lambda e: e.at_s or 0.0))


class Timeline:
    """Events fired in order: each waits for its trigger and for the one before it."""

    def __init__(self, events: tuple[Event, ...] | list[Event]):
        self.pending = list(events)

    def due(self, elapsed_s: float, last_round: Mapping[str, int]) -> list[Event]:
        """Pop the events whose trigger holds now (``last_round``: the highest round each peer has logged)."""
        fired = []
        while self.pending and _triggered(self.pending[0], elapsed_s, last_round):
            fired.append(self.pending.pop(0))
        return fired


def _triggered(event: Event, elapsed_s: float, last_round: Mapping[str, int]) -> bool:
    if event.at_s is not None:
        return elapsed_s >= event.at_s
    reached = last_round.get(event.of, -1) if event.of is not None else max(last_round.values(), default=-1)
    return reached >= (event.after_round or 0)
