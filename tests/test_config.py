"""Config: defaults, YAML/TOML files with sections, dotted overrides, unknown keys, types, ranges, file errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.config import PeerConfig, RunConfig, build_config, load_config, read_config_file
from p2ptrain.errors import ConfigError
from p2ptrain.maths.inner import InnerConfig
from p2ptrain.maths.outer_optimizer import OuterConfig
from p2ptrain.net.dht import NetworkConfig

YAML_TEXT = """
run:
  run_id: my-run
  rounds: 7
inner:
  steps: 5
  lr: 0.001
outer:
  momentum: 0.5
network:
  host_maddrs: [/ip4/127.0.0.1/tcp/0]
"""

TOML_TEXT = """
[run]
run_id = "my-run"
rounds = 7

[inner]
steps = 5
lr = 0.001

[outer]
momentum = 0.5

[network]
host_maddrs = ["/ip4/127.0.0.1/tcp/0"]
"""


def one_line_config_error(values: dict[str, Any]) -> str:
    """Build the config, expecting a one-line ConfigError; return its message."""
    with pytest.raises(ConfigError) as info:
        build_config(values)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def test_defaults_build_and_match_each_section_default() -> None:
    config = build_config()
    assert config == PeerConfig()
    assert config.inner == InnerConfig() and config.outer == OuterConfig() and config.run == RunConfig()
    assert load_config() == config


def test_the_start_up_line_shows_only_the_settings_that_differ_from_the_defaults() -> None:
    config = build_config({"run": {"run_id": "mine", "rounds": 3}, "sync": {"mode": "diloco", "gossip_peers": 2}})
    changed = config.changes_from_defaults()
    assert {"run.run_id": "mine", "run.rounds": 3, "sync.mode": "diloco"}.items() <= changed.items()
    assert all(key.split(".")[0] in ("run", "sync") for key in changed), changed
    assert build_config({}).changes_from_defaults() == {}


@pytest.mark.parametrize(
    ("name", "text"), [("peer.yaml", YAML_TEXT), ("peer.yml", YAML_TEXT), ("peer.toml", TOML_TEXT)]
)
def test_load_config_reads_nested_sections(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    config = load_config(path)
    assert config.run.run_id == "my-run" and config.run.rounds == 7
    assert config.inner.steps == 5 and config.inner.lr == 0.001
    assert config.outer.momentum == 0.5
    assert config.network.host_maddrs == ("/ip4/127.0.0.1/tcp/0",)
    # untouched fields keep their defaults
    assert config.inner.beta2 == InnerConfig().beta2 and config.outer.lr == OuterConfig().lr


def test_dotted_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "peer.yaml"
    path.write_text(YAML_TEXT)
    config = load_config(path, {"run.run_id": "override", "inner.steps": 9, "outer.lr": 0.5})
    assert config.run.run_id == "override" and config.inner.steps == 9 and config.outer.lr == 0.5
    assert config.run.rounds == 7  # the rest of the section still comes from the file


def test_override_without_a_file_builds_the_section() -> None:
    assert load_config(None, {"sync.matchmaking_s": 1.5}).sync.matchmaking_s == 1.5


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"bogus": {}}, "'bogus'"),
        ({"inner": {"stepz": 3}}, "'inner.stepz'"),
        ({"run": {"run_id": "x", "colour": "red"}}, "'run.colour'"),
    ],
)
def test_unknown_key_is_named(values: dict[str, Any], key: str) -> None:
    message = one_line_config_error(values)
    assert "unknown key" in message and key in message


def test_unknown_dotted_override_is_named() -> None:
    with pytest.raises(ConfigError, match="'outer.nesterof'"):
        load_config(None, {"outer.nesterof": False})


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"inner": {"steps": "20"}}, "inner.steps"),  # string for int
        ({"inner": {"steps": 2.5}}, "inner.steps"),  # float for int
        ({"inner": {"steps": 20.0}}, "inner.steps"),  # a whole float is still not an int
        ({"inner": {"steps": True}}, "inner.steps"),  # bool for int
        ({"outer": {"lr": True}}, "outer.lr"),  # bool for float
        ({"outer": {"lr": "0.7"}}, "outer.lr"),  # string for float
        ({"outer": {"nesterov": 1}}, "outer.nesterov"),  # int for bool
        ({"run": {"run_id": 5}}, "run.run_id"),  # int for str
        ({"network": {"host_maddrs": "/ip4/127.0.0.1/tcp/0"}}, "network.host_maddrs"),  # string for tuple
        ({"network": {"host_maddrs": [5]}}, "network.host_maddrs"),  # wrong item type in a tuple
        ({"sync": {"overlap_momentum": "0.5"}}, "sync.overlap_momentum"),  # string for float | None
        ({"inner": 5}, "inner"),  # a value where a section belongs
    ],
)
def test_wrong_type_is_a_config_error_naming_the_key(values: dict[str, Any], key: str) -> None:
    assert key in one_line_config_error(values)


def test_int_is_accepted_for_float_and_list_for_tuple() -> None:
    config = build_config({"outer": {"lr": 1}, "network": {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"]}})
    assert config.outer.lr == 1.0 and type(config.outer.lr) is float
    assert config.network.host_maddrs == ("/ip4/127.0.0.1/tcp/0",) and type(config.network.host_maddrs) is tuple


def test_null_section_and_null_optional_take_defaults() -> None:
    """`run:` with nothing under it in YAML is None: the section's defaults; None is a value of `float | None`."""
    assert build_config({"run": None, "sync": {"overlap_momentum": None}}) == PeerConfig()


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"inner": {"steps": 0}}, "inner.steps"),
        ({"inner": {"steps": 5, "min_steps": 6}}, "inner.min_steps"),
        ({"inner": {"lr": 0.0}}, "inner.lr"),
        ({"outer": {"momentum": 1.0}}, "outer.momentum"),
        ({"outer": {"momentum": -0.1}}, "outer.momentum"),
        ({"outer": {"lr": 0.0}}, "outer.lr"),
        ({"run": {"run_id": "my run"}}, "run.run_id"),
        ({"run": {"run_id": ""}}, "run.run_id"),
        ({"run": {"run_id": "a/b"}}, "run.run_id"),
        ({"run": {"device": "tpu"}}, "run.device"),
        ({"run": {"rounds": -1}}, "run.rounds"),
        ({"run": {"min_peers": 0}}, "run.min_peers"),
        ({"run": {"min_peers_wait_s": -1.0}}, "run.min_peers_wait_s"),
        ({"run": {"checkpoint_every": 0}}, "run.checkpoint_every"),
        ({"run": {"training_priority": "low"}}, "run.training_priority"),
        ({"run": {"eval_every": 0}}, "run.eval_every"),
        ({"run": {"wandb_project": "team/project"}}, "run.wandb_project"),
        ({"run": {"wandb_project": "x" * 129}}, "run.wandb_project"),
        ({"run": {"wandb_project": "a\nb"}}, "run.wandb_project"),
        ({"network": {"heartbeat_s": 8.0, "record_ttl_s": 8.0}}, "network.heartbeat_s"),
        ({"network": {"heartbeat_s": 9.0, "record_ttl_s": 8.0}}, "network.heartbeat_s"),
        ({"network": {"heartbeat_s": 0.0}}, "network.heartbeat_s"),
        # a bad multiaddr is reported by its text (the key is not named: see the report)
        ({"network": {"host_maddrs": ["not-a-multiaddr"]}}, "'not-a-multiaddr' is not a multiaddr"),
        ({"network": {"announce_maddrs": ["/ip4/999.1.1.1/tcp/1"]}}, "'/ip4/999.1.1.1/tcp/1' is not a multiaddr"),
        ({"network": {"host_maddrs": []}}, "network.host_maddrs"),
        ({"sync": {"mode": "nope"}}, "sync.mode"),
        ({"sync": {"matchmaking_s": 0.0}}, "sync.matchmaking_s"),
        ({"sync": {"mix2_transport": "carrier-pigeon"}}, "sync.mix2_transport"),
        ({"sync": {"mix2_transport": "gossip"}}, "sync.mix2_transport"),  # diloco has no Mix2
        ({"sync": {"mode": "gasloc", "mix2_transport": "gossip"}}, "sync.mix2_transport"),
        ({"sync": {"mode": "factored", "mix2_round_gap": 2}}, "sync.mix2_round_gap"),  # an all-reduce Mix2
        ({"sync": {"mode": "factored", "mix2_transport": "gossip", "mix2_round_gap": "2"}}, "sync.mix2_round_gap"),
        ({"sync": {"grad_codec": "int8"}}, "sync.grad_codec"),
        # hivemind's butterfly sums dense parts; gasloc sends no outer gradients
        ({"sync": {"grad_codec": "sparse", "allreduce_transport": "hivemind"}}, "sync.grad_codec"),
        ({"sync": {"mode": "factored", "grad_codec": "topk", "allreduce_transport": "hivemind"}}, "sync.grad_codec"),
        ({"sync": {"mode": "gasloc", "grad_codec": "sparse"}}, "sync.grad_codec"),
        ({"sync": {"sparse_bits": 0}}, "sync.sparse_bits"),
        ({"sync": {"sparse_bits": 9}}, "sync.sparse_bits"),
        ({"sync": {"topk_density": 0.0}}, "sync.topk_density"),
        ({"sync": {"topk_density": 1.5}}, "sync.topk_density"),
        ({"sync": {"topk_chunk_size": 0}}, "sync.topk_chunk_size"),
        ({"sync": {"topk_chunk_size": 65537}}, "sync.topk_chunk_size"),
        ({"sync": {"error_feedback_decay": 1.1}}, "sync.error_feedback_decay"),
        ({"sync": {"error_feedback_decay": -0.1}}, "sync.error_feedback_decay"),
        ({"model": {"max_seq_len": 4}}, "model.max_seq_len"),
        ({"data": {"seq_len": 1}}, "data.seq_len"),
    ],
)
def test_out_of_range_values_are_one_line_config_errors(values: dict[str, Any], named: str) -> None:
    assert named in one_line_config_error(values)


@pytest.mark.parametrize("codec", ["sparse", "topk", "fp16", "none"])
def test_gossip_mix2_takes_every_grad_codec(codec: str) -> None:
    sync = build_config({"sync": {"mode": "factored", "mix2_transport": "gossip", "grad_codec": codec,
                                  "topk_density": 0.01, "topk_chunk_size": 1024}}).sync
    assert (sync.mix2_transport, sync.grad_codec, sync.topk_density, sync.topk_chunk_size) == (
        "gossip", codec, 0.01, 1024)


@pytest.mark.parametrize("mode", ["diloco", "factored"])
def test_the_exchange_all_reduce_takes_the_sparse_codecs(mode: str) -> None:
    sync = build_config({"sync": {"mode": mode, "grad_codec": "sparse", "topk_density": 0.02, "sparse_bits": 3}}).sync
    assert (sync.allreduce_transport, sync.grad_codec, sync.topk_density, sync.sparse_bits) == (
        "exchange", "sparse", 0.02, 3)


def test_mix2_defaults_keep_the_all_reduce() -> None:
    sync = build_config().sync
    assert (sync.mix2_transport, sync.grad_codec, sync.topk_density, sync.error_feedback_decay) == (
        "allreduce", "none", 1 / 32, 1.0)
    assert build_config({"sync": {"mode": "factored", "grad_codec": "fp16"}}).sync.mix2_transport == "allreduce"


def test_cuda_index_device_is_accepted() -> None:
    assert build_config({"run": {"device": "cuda:1"}}).run.device == "cuda:1"


def test_bad_multiaddr_error_shows_the_address() -> None:
    assert "not-a-multiaddr" in one_line_config_error({"network": {"host_maddrs": ["not-a-multiaddr"]}})


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("bad.yaml", "run:\n  run_id: [unclosed\n"),
        ("bad.yml", "a: b: c\n"),
        ("bad.toml", "[run\nrun_id = 'x'\n"),
        ("bad2.toml", "x = = 1\n"),
        ("list.yaml", "- run\n- inner\n"),  # valid YAML, but not a mapping of sections
    ],
)
def test_invalid_file_is_a_one_line_config_error(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message and name in message


def test_missing_file_is_a_one_line_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.yaml")
    assert "\n" not in str(info.value) and "absent.yaml" in str(info.value)


def test_wrong_extension_is_a_one_line_config_error(tmp_path: Path) -> None:
    path = tmp_path / "peer.ini"
    path.write_text("[run]\nrun_id = x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "\n" not in str(info.value) and ".toml" in str(info.value)


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n")
    assert read_config_file(path) == {} and load_config(path) == PeerConfig()


def non_default_config() -> PeerConfig:
    return build_config({
        "run": {"run_id": "rt", "rounds": 3, "device": "cpu", "checkpoint_dir": "/tmp/x"},
        "model": {"name": "tiny", "max_seq_len": 64},
        "data": {"seq_len": 32, "batch_size": 2},
        "inner": {"steps": 4, "lr": 0.01, "grad_clip": 0.0},
        "outer": {"lr": 0.5, "momentum": 0.0, "nesterov": False},
        "sync": {"matchmaking_s": 1.0},
        "network": {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "announce_maddrs": ["/ip4/1.2.3.4/tcp/31337"],
                    "heartbeat_s": 0.5, "record_ttl_s": 4.0},
    })


def test_to_dict_round_trips_through_build_config() -> None:
    config = non_default_config()
    assert config != PeerConfig()
    assert build_config(config.to_dict()) == config
    # the form checkpoints store (JSON turns tuples into lists) round-trips too
    assert build_config(json.loads(config.to_json())) == config


def test_sections_are_frozen() -> None:
    config = PeerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.inner.steps = 3  # type: ignore[misc]


def test_network_loopback_constructor_is_valid() -> None:
    network = NetworkConfig.loopback(heartbeat_s=0.5)
    assert network.host_maddrs == ("/ip4/127.0.0.1/tcp/0",) and not network.nat_port_map and network.heartbeat_s == 0.5
