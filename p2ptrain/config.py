"""The peer's resolved configuration: one frozen dataclass per stage, composed here, loaded from YAML or TOML.

Each stage module owns its section (defaults and validation live beside the code that uses them); this module
composes the sections, reads config files and applies command-line overrides; `dict_to_dataclass` rejects unknown
keys and values of the wrong type with a one-line `ConfigError` that names the key.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from p2ptrain.data import DataConfig
from p2ptrain.dict_to_dataclass import build_dataclass
from p2ptrain.errors import ConfigError, one_line
from p2ptrain.maths.inner import InnerConfig
from p2ptrain.maths.outer_optimizer import OuterConfig
from p2ptrain.models import ModelConfig
from p2ptrain.net.dht import NetworkConfig
from p2ptrain.net.reputation import ReputationConfig
from p2ptrain.sync.config import SyncConfig
from p2ptrain.timing import HUNG_AFTER_S, LAUNCH_S

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What a training run is and where its files go."""

    run_id: str = "p2ptrain-demo"  # peers with the same run id train one model together
    rounds: int = 0  # outer rounds to run from our first one (the run ends at that round + rounds); 0 = until stopped
    # a fresh peer waits before its first round until it sees this many peers of the run (itself included), at most
    # min_peers_wait_s, so that peers launched together begin together (swarm_start.py); 1 = start at once
    min_peers: int = 1
    min_peers_wait_s: float = LAUNCH_S
    seed: int = 0  # model initialisation seed: the same for every peer of a run
    shard_index: int = -1  # read the data pieces of this shard (data.py); -1: pieces the swarm has not read yet
    device: str = "auto"  # auto | cpu | cuda | mps
    torch_threads: int = 0  # intra-op threads for this peer; 0 = torch's default
    # normal | idle: the training thread runs only when no other process wants the CPU (Linux SCHED_IDLE), so that
    # the peer's DHT, p2pd and exchanges answer at once on a machine shared by many peers (the testnets)
    training_priority: str = "normal"
    checkpoint_dir: str = ""  # empty = no checkpoints
    checkpoint_every: int = 10  # rounds between checkpoints (also written on Ctrl-C)
    # rounds between validations: a round in between reports the latest val_loss (`evaluated` false in its metrics);
    # a peer's first round, a round that adopted a state and the last of a run with `rounds` set are evaluated
    eval_every: int = 1
    metrics_path: str = ""  # JSON lines, one per round; empty = none
    tensorboard_dir: str = ""  # per-round scalars for TensorBoard (pip install 'p2ptrain[tensorboard]'); empty = none
    wandb_project: str = ""  # per-round scalars to this W&B project (pip install 'p2ptrain[wandb]'); empty = none
    progress: bool = True  # show a progress bar
    # a node of several processes (torchrun, --workers): how long a worker waits for the others at a step or between
    # rounds (rank 0's sync, joins and checkpoints included) before the node stops; a dead worker is seen at once
    node_timeout_s: float = HUNG_AFTER_S
    # at start, the peer's memory plan (`p2ptrain plan`) for its device: a peer it says does not fit stops in one
    # line with the plan's advice (the plan is within ~15 % of the measured peak); false starts it anyway
    check_memory: bool = True

    def __post_init__(self) -> None:
        if not self.run_id or any(c in self.run_id for c in " ./:"):
            raise ConfigError(f"run.run_id {self.run_id!r} must be non-empty without spaces, '.', '/' or ':'")
        if self.rounds < 0:
            raise ConfigError(f"run.rounds must be >= 0 (0 = run until stopped), got {self.rounds}")
        if not 1 <= self.min_peers <= 10_000 or not 0 <= self.min_peers_wait_s <= 86400:
            raise ConfigError(f"run.min_peers must be in [1, 10000] and run.min_peers_wait_s in [0, 86400] seconds, "
                              f"got {self.min_peers} and {self.min_peers_wait_s}")
        if self.device not in ("auto", "cpu", "cuda", "mps") and not self.device.startswith("cuda:"):
            raise ConfigError(f"run.device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        if self.checkpoint_every < 1:
            raise ConfigError(f"run.checkpoint_every must be >= 1 round, got {self.checkpoint_every}")
        if self.training_priority not in ("normal", "idle"):
            raise ConfigError(f"run.training_priority must be normal or idle, got {self.training_priority!r}")
        if self.eval_every < 1:
            raise ConfigError(f"run.eval_every must be >= 1 round, got {self.eval_every}")
        if not 10 <= self.node_timeout_s <= 86400:
            raise ConfigError(f"run.node_timeout_s must be in [10, 86400] seconds, got {self.node_timeout_s}")
        if self.torch_threads < 0:
            raise ConfigError(f"run.torch_threads must be >= 0, got {self.torch_threads}")
        if len(self.wandb_project) > 128 or any(c in self.wandb_project for c in "/\\#?%:") or \
                not self.wandb_project.isprintable():
            raise ConfigError(f"run.wandb_project must be a W&B project name (at most 128 characters, none of "
                              f"/ \\ # ? % :), got {self.wandb_project[:40]!r}")


@dataclasses.dataclass(frozen=True)
class PeerConfig:
    """Everything one training peer needs; stored in checkpoints and logged at start."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    inner: InnerConfig = dataclasses.field(default_factory=InnerConfig)
    outer: OuterConfig = dataclasses.field(default_factory=OuterConfig)
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    network: NetworkConfig = dataclasses.field(default_factory=NetworkConfig)
    reputation: ReputationConfig = dataclasses.field(default_factory=ReputationConfig)

    def __post_init__(self) -> None:
        if self.inner.micro_batches > self.data.batch_size:
            raise ConfigError(f"inner.micro_batches ({self.inner.micro_batches}) must not exceed data.batch_size "
                              f"({self.data.batch_size}): a micro-batch holds at least one sample")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def changes_from_defaults(self) -> dict[str, Any]:
        """The settings that differ from PeerConfig()'s, as dotted keys (what the start-up line shows)."""
        defaults = flatten_settings(PeerConfig().to_dict())
        return {key: value for key, value in flatten_settings(self.to_dict()).items()
                if defaults.get(key, _MISSING) != value}


_MISSING = object()


def flatten_settings(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys: {"run": {"rounds": 2}} -> {"run.rounds": 2}."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(flatten_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def nest_settings(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys as nested sections, the inverse of `flatten_settings`."""
    values: dict[str, Any] = {}
    for dotted_key, value in flat.items():
        _set_dotted(values, dotted_key, value)
    return values


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (.yaml/.yml) or TOML (.toml) file into a dict; any problem is a one-line ConfigError."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror or e}") from None
    try:
        if path.suffix == ".toml":
            loaded: Any = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml", ".json"):
            loaded = yaml.safe_load(text)
        else:
            raise ConfigError(f"config file {str(path)!r} must end in .yaml, .yml, .json or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} is not valid {path.suffix[1:].upper()}: {one_line(e)}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded


def build_config(values: dict[str, Any] | None = None) -> PeerConfig:
    """Build a PeerConfig from nested dicts (file contents merged with overrides), validating every key."""
    return build_dataclass(PeerConfig, values or {})


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PeerConfig:
    """Read `path` (optional), merge dotted `overrides` such as {"run.run_id": "x"} on top, and validate."""
    values = read_config_file(path) if path else {}
    for dotted_key, value in (overrides or {}).items():
        _set_dotted(values, dotted_key, value)
    return build_config(values)


def explicit_settings(path: str | Path | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The dotted settings a config file and the flags set (what a run's manifest may not fill in)."""
    return {**(flatten_settings(read_config_file(path)) if path else {}), **overrides}


def _set_dotted(values: dict[str, Any], dotted_key: str, value: Any) -> None:
    *sections, key = dotted_key.split(".")
    node = values
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config key {dotted_key!r}: {section!r} is not a section")
    node[key] = value
