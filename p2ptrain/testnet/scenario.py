"""Testnet scenarios: how many peers, how fast their links are, what happens to them and when, what must hold.

A scenario is a YAML file; every key is optional and the command line overrides peers, bandwidth, rounds and
duration_s (full examples in testnet/scenarios/)::

    peers: 4
    bandwidth: [50mbit, 50mbit, 50mbit, 5mbit]   # one rate per peer or one for all; "none" = unshaped
    rounds: 20                                   # or duration_s: 300 (peers then run until stopped)
    peer_config: {model: {name: tiny}}           # merged over --config for every peer
    events:                                      # in the order written, each once its trigger holds
      - {after_round: 2, of: peer2, kill: peer2} # SIGKILL (also kill: bootstrap); stop/continue (SIGSTOP/SIGCONT)
      - {after_round: 3, of: peer1, leave: peer1} # SIGTERM: a clean shutdown (Ctrl-C), its record says it left
      - {at_s: 60, restart: peer2}               # from its latest checkpoint (fresh if it has none)
      - {at_s: 80, set_rate: {peer: peer3, rate: 1mbit}}
      - {at_s: 90, partition: [peer2, peer3]}    # cut off from the rest (and the bootstrap); heal: partition
      - {at_s: 130, add_peer: {rate: 20mbit}}    # a new peer, named peer<N> after the others
    churn: {kills_per_min: 2, min_alive: 2, down_s: 20, start_s: 30, stop_s: 240, seed: 0}
    adversary: {kind: aimed, peers: [peer3], from_round: 2}   # red team (testnet/adversary.py); or count: N
    nat: [peer2, [peer3, peer4]]                 # behind NAT (netns only): peer2 at its own home, 3 and 4 share one
    relays: [peer0]                              # peers started with --relay (the bootstrap always serves as one)
    checks: {loss_fell: true, max_stall_s: 8, max_consensus_distance: 0.05, attackers_banned: true,
             reachability: true, min_nat_exchanges: 3, max_heal_s: 15}

``at_s`` counts from the moment the peers are started; ``after_round: N`` fires once peer ``of`` (default: any
peer) has logged round N. Every mistake is a one-line ConfigError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from p2ptrain.dict_to_dataclass import build_dataclass, check_mapping, parsed_by
from p2ptrain.errors import ConfigError, one_line
from p2ptrain.testnet.adversary import ATTACKS

PEER_ACTIONS = ("kill", "leave", "stop", "continue", "restart")  # value: the peer's name (kill: or "bootstrap")
BOOTSTRAP = "bootstrap"
ACTIONS = (*PEER_ACTIONS, "set_rate", "partition", "heal", "add_peer")
TRIGGERS = ("at_s", "after_round", "of")  # an event's keys besides its action: Event's fields of the same names
DEFAULT_ROUNDS = 8
DEFAULT_PEERS = 4
_PEER_NAME_RE = re.compile(r"^peer(\d{1,3})$")
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)?$")
_RATE_UNITS = {"bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, None: 1.0}
UNSHAPED = ("none", "unlimited", "unshaped")


def parse_rate(value: object, where: str = "rate") -> float | None:
    """A link rate in Mbit/s from ``50mbit``, ``800kbit``, ``1gbit`` or a bare number of Mbit/s; None = unshaped."""
    if value is None or (isinstance(value, str) and value.strip().lower() in UNSHAPED):
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {value!r} is not a rate; write e.g. 50mbit, 800kbit, 1gbit or none")
    match = _RATE_RE.match(str(value).strip().lower())
    if match is None:
        raise ConfigError(f"{where}: {value!r} is not a rate; write e.g. 50mbit, 800kbit, 1gbit or none "
                          f"(tc's mbps means megabytes, so it is not accepted)")
    rate_mbit = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if not 0.01 <= rate_mbit <= 100_000:
        raise ConfigError(f"{where}: rate {value!r} is outside 10kbit..100gbit")
    return rate_mbit


def parse_bandwidth(value: object, where: str = "bandwidth") -> tuple[float | None, ...]:
    """Rates from ``"50mbit,50mbit,5mbit"`` (the command line) or a YAML list; one rate per peer or one for all."""
    items: list[object] = list(value.split(",")) if isinstance(value, str) else \
        list(value) if isinstance(value, list) else [value]
    rates = tuple(parse_rate(item, f"{where}[{i}]") for i, item in enumerate(items))
    if not rates:
        raise ConfigError(f"{where}: give at least one rate, e.g. 50mbit")
    return rates


def peer_index(name: str, where: str) -> int:
    match = _PEER_NAME_RE.match(name) if isinstance(name, str) else None
    if match is None:
        raise ConfigError(f"{where}: {name!r} is not a peer name; peers are called peer0, peer1, ...")
    return int(match.group(1))


@dataclasses.dataclass(frozen=True)
class Event:
    """One scripted action and its trigger (exactly one of ``at_s`` and ``after_round``)."""

    action: str  # one of ACTIONS
    peer: str | None = None  # target of kill/stop/continue/restart/set_rate; the new peer's name for add_peer
    at_s: float | None = None  # seconds after the peers were started
    after_round: int | None = None  # fire once peer `of` (None: any peer) has logged this round
    of: str | None = None
    rate_mbit: float | None = None  # set_rate and add_peer; None = unshaped
    group: tuple[str, ...] = ()  # partition: the peers cut off from the rest

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ConfigError(f"unknown action {self.action!r}: use one of {', '.join(ACTIONS)}")
        if (self.at_s is None) == (self.after_round is None):
            raise ConfigError(f"{self.action}: give exactly one trigger, at_s: SECONDS or after_round: N")
        if (self.at_s is not None and not self.at_s >= 0) or (self.after_round is not None and self.after_round < 0):
            raise ConfigError(f"{self.action}: at_s and after_round must be >= 0")
        if self.of is not None and self.after_round is None:
            raise ConfigError(f"{self.action}: `of` goes with after_round")
        if self.action == "partition" and not self.group:
            raise ConfigError("partition: list the peers to cut off, e.g. partition: [peer2, peer3]")
        if self.action in (*PEER_ACTIONS, "set_rate", "add_peer") and self.peer is None:
            raise ConfigError(f"{self.action}: name the peer, e.g. {self.action}: peer1")

    @property
    def trigger(self) -> str:
        if self.at_s is not None:
            return f"at {self.at_s:g} s"
        return f"after round {self.after_round} of {self.of or 'any peer'}"

    def describe(self) -> str:
        if self.action == "partition":
            return f"partition {','.join(self.group)}"
        if self.action == "heal":
            return "heal partition"
        rate = "unshaped" if self.rate_mbit is None else f"{self.rate_mbit:g} Mbit/s"
        return f"{self.action} {self.peer}" + (f" {rate}" if self.action in ("set_rate", "add_peer") else "")


def parse_events(raw: object, key: str = "events") -> tuple[Event, ...]:
    """Events from a scenario's list of mappings like ``{at_s: 30, kill: peer1}``."""
    if not isinstance(raw, list):
        raise ConfigError(f"{key} must be a list of mappings like {{at_s: 30, kill: peer1}}")
    events = []
    for i, entry in enumerate(raw):
        try:
            events.append(parse_event(entry))
        except ConfigError as e:
            raise ConfigError(f"{key}[{i}]: {e}") from None
    return tuple(events)


def parse_event(raw: object) -> Event:
    """One event: its trigger keys (typed by Event's fields) and exactly one action."""
    entry = check_mapping(raw, "", (*ACTIONS, *TRIGGERS))
    actions = [key for key in entry if key in ACTIONS]
    if len(actions) != 1:
        raise ConfigError(f"give exactly one action ({', '.join(ACTIONS)}), got {actions or 'none'}")
    if "of" in entry:
        peer_index(entry["of"], "of")
    triggers = {key: entry[key] for key in TRIGGERS if key in entry}
    return build_dataclass(Event, {"action": actions[0], **triggers, **_action_fields(actions[0], entry[actions[0]])})


def _action_fields(action: str, value: Any) -> dict[str, Any]:
    """Event's fields from an action's value: the target peer, a rate, a group."""
    if action in PEER_ACTIONS:
        if not (action == "kill" and value == BOOTSTRAP):  # the bootstrap (and relay) may be killed too
            peer_index(value, action)
        return {"peer": value}
    if action == "set_rate":
        spec = check_mapping(value, "set_rate", ("peer", "rate"))
        if "peer" not in spec or "rate" not in spec:
            raise ConfigError("set_rate: write set_rate: {peer: peer1, rate: 5mbit}")
        peer_index(spec["peer"], "set_rate.peer")
        return {"peer": spec["peer"], "rate_mbit": parse_rate(spec["rate"], "set_rate.rate")}
    if action == "partition":
        if not isinstance(value, list) or not value:
            raise ConfigError("partition: list the peers to cut off, e.g. partition: [peer2, peer3]")
        for i, name in enumerate(value):
            peer_index(name, f"partition[{i}]")
        return {"group": value}
    if action == "heal":
        if value not in ("partition", True):
            raise ConfigError("heal: write heal: partition")
        return {}
    spec = check_mapping({} if value in (None, True) else value, "add_peer", ("rate",))  # named by plan_run
    return {"peer": "peer?", "rate_mbit": parse_rate(spec.get("rate"), "add_peer.rate")}


@dataclasses.dataclass(frozen=True)
class ChurnSpec:
    """Random SIGKILLs of the initial peers (a Poisson process), each followed by a restart from checkpoint."""

    kills_per_min: float  # mean kills per minute across the swarm
    min_alive: int = 1  # never kill when only this many peers are alive
    down_s: float = 20.0  # a killed peer is restarted this many seconds later
    start_s: float = 0.0  # no kill before this (let the swarm form)
    stop_s: float | None = None  # no kill after this; default: the scenario's duration_s
    seed: int | None = 0  # of the kill times; null: a different draw every run

    def __post_init__(self) -> None:
        if not 0 < self.kills_per_min <= 600:
            raise ConfigError(f"churn.kills_per_min must be in (0, 600], got {self.kills_per_min}")
        if self.min_alive < 1:
            raise ConfigError(f"churn.min_alive must be >= 1, got {self.min_alive}")
        if self.down_s < 0 or self.start_s < 0:
            raise ConfigError("churn.down_s and churn.start_s must be >= 0 seconds")
        if self.stop_s is not None and self.stop_s <= self.start_s:
            raise ConfigError(f"churn.stop_s ({self.stop_s}) must be after churn.start_s ({self.start_s})")


@dataclasses.dataclass(frozen=True)
class AdversarySpec:
    """Red-team peers: which attack (testnet/adversary.py), played by which peers, from which of their rounds."""

    kind: str
    peers: tuple[str, ...] = ()  # the hostile peers by name; default: the last `count` initial peers
    count: int = 1
    from_round: int = 0  # each plays honest before this round of its own

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise ConfigError(f"adversary.kind must be one of {', '.join(ATTACKS)}, got {self.kind!r}")
        for i, name in enumerate(self.peers):
            peer_index(name, f"adversary.peers[{i}]")
        if self.count < 1 or self.from_round < 0:
            raise ConfigError("adversary.count must be >= 1 and adversary.from_round >= 0")


@dataclasses.dataclass(frozen=True)
class ChecksSpec:
    """What must hold at the end of the run; false or null turns a check off."""

    loss_fell: bool | None = True  # every surviving peer's validation loss ended below its first value
    resumed_from_checkpoint: bool | None = True  # a restarted peer's first round is >= its checkpoint's round
    max_stall_s: float | None = None  # no running peer went longer than this many seconds without a round
    # max ‖θ_i − θ̄‖/‖θ̄‖ over survivors at their newest common checkpoint round, or without one (gossip) at each
    # one's newest checkpoint (written when the run stops them)
    max_consensus_distance: float | None = None
    attackers_banned: bool | None = None  # every honest survivor banned every adversary at some point
    reachability: bool | None = None  # every peer's reachability line says what its network makes it
    min_nat_exchanges: int | None = None  # every peer behind NAT completed this many exchanges (group members)
    # of each survivor's rounds after its first (an overlapped round 0 has nothing to collect), at most this
    # fraction averaged with nobody (neither the round's averaging nor a Mix2 found a partner)
    max_alone_fraction: float | None = None
    max_rounds_alone: int | None = None  # no survivor averaged with nobody in more rounds than this in a row
    # after each heal, every peer of either side opened an exchange across the cut within this many seconds (gossip)
    max_heal_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_stall_s", "max_consensus_distance", "min_nat_exchanges", "max_rounds_alone", "max_heal_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigError(f"checks.{name} must be > 0 (or null to turn it off), got {getattr(self, name)}")
        if self.max_alone_fraction is not None and not 0 <= self.max_alone_fraction <= 1:
            raise ConfigError(f"checks.max_alone_fraction must be in [0, 1] (or null), got {self.max_alone_fraction}")


def parse_homes(value: object, where: str = "nat") -> tuple[tuple[str, ...], ...]:
    """Home networks from ``[peer2, [peer3, peer4]]``: a name alone has a NAT of its own, a list shares one."""
    if not isinstance(value, list):
        raise ConfigError(f"{where}: list the peers behind NAT, e.g. nat: [peer2, [peer3, peer4]]")
    homes = []
    for i, entry in enumerate(value):
        members = entry if isinstance(entry, list) else [entry]
        if not members:
            raise ConfigError(f"{where}[{i}]: an empty home; list its peers, e.g. [peer3, peer4]")
        homes.append(tuple(members))
        for name in members:
            peer_index(name, f"{where}[{i}]")
    names = [name for home in homes for name in home]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: a peer is listed twice; each peer lives in one home")
    return tuple(homes)


def parse_peer_names(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: list peer names, e.g. [peer0]")
    return tuple(value[i] for i in range(len(value)) if peer_index(value[i], f"{where}[{i}]") >= 0)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A scenario file, parsed; ``plan_run`` resolves it against the command line."""

    description: str = ""
    peers: int | None = None
    bandwidth_mbit: tuple[float | None, ...] = dataclasses.field(  # the file's key: bandwidth
        default=(), metadata=parsed_by(parse_bandwidth, key="bandwidth"))
    rounds: int | None = None
    duration_s: float | None = None
    peer_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # merged over --config
    events: tuple[Event, ...] = dataclasses.field(default=(), metadata=parsed_by(parse_events))
    churn: ChurnSpec | None = None
    adversary: AdversarySpec | None = None
    nat: tuple[tuple[str, ...], ...] = dataclasses.field(default=(), metadata=parsed_by(parse_homes))  # homes
    relays: tuple[str, ...] = dataclasses.field(default=(), metadata=parsed_by(parse_peer_names))
    checks: ChecksSpec = dataclasses.field(default_factory=ChecksSpec)

    def __post_init__(self) -> None:
        if self.peers is not None and not 1 <= self.peers <= 200:
            raise ConfigError(f"peers must be between 1 and 200, got {self.peers}")
        for name in ("rounds", "duration_s"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.rounds is not None and self.duration_s is not None:
            raise ConfigError("give rounds or duration_s, not both")


# ---- parsing ----------------------------------------------------------------------------------------------------

def parse_scenario(raw: object, where: str = "scenario") -> Scenario:
    """A Scenario from the loaded YAML document; every mistake is a one-line ConfigError starting with `where`."""
    if isinstance(raw, dict):  # every key is optional: one left empty keeps its default
        raw = {key: value for key, value in raw.items() if value is not None}
    try:
        return build_dataclass(Scenario, raw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and parse a scenario file; every problem is a one-line ConfigError naming the file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read scenario file {str(path)!r}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"scenario file {str(path)!r} is not valid YAML: {one_line(e)}") from None
    return parse_scenario(raw, where=str(path))
