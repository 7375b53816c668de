"""Per-round metrics for TensorBoard and W&B: what a run writes is what TensorBoard's own reader finds, and what
W&B's offline run file holds."""

from __future__ import annotations

import json
import logging
import struct
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import pytest
from early_jobs import WANDB
from swarm_utils import run_swarm, tiny_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from p2ptrain.errors import UserError
from p2ptrain.metrics import ROUND_SCALARS, MetricsLog, RoundMetrics, WandbLog


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in a TensorBoard log directory, as TensorBoard reads it."""
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def round_metrics(round_: int, evaluated: bool = True) -> RoundMetrics:
    return RoundMetrics(peer_id="QmPeer", round=round_, inner_steps=5, train_loss=3.0 - round_ / 4,
                        val_loss=3.5 - round_, tokens_per_s=1000.0 + round_, compute_s=3.0, comm_blocked_s=1.0,
                        bytes_sent=1000 * round_, bytes_received=2000 * round_, peers_averaged=2, round_s=4.0,
                        evaluated=evaluated)


def test_each_rounds_figures_are_tensorboard_scalars_at_its_round(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "m.jsonl", tmp_path / "tb")
    for round_ in range(3):
        log.write(round_metrics(round_, evaluated=round_ != 1))
    log.close()
    series = scalars(tmp_path / "tb")
    assert set(ROUND_SCALARS) | {"time/compute_utilisation"} == set(series)
    assert series["loss/train"] == [(0, 3.0), (1, 2.75), (2, 2.5)]
    assert series["loss/validation"] == [(0, 3.5), (2, 1.5)]  # round 1 measured none: not plotted as if it had
    assert series["network/bytes_received"] == [(0, 0.0), (1, 2000.0), (2, 4000.0)]
    assert series["time/compute_utilisation"] == [(0, 0.75), (1, 0.75), (2, 0.75)]
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3  # the JSON lines are written beside them


def test_a_tensorboard_directory_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError, match="cannot write TensorBoard logs to"):
        MetricsLog(None, tmp_path / "a-file" / "tb")


def test_without_tensorboard_installed_the_peer_says_what_to_install(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what an import finds when it is absent
    with pytest.raises(UserError, match=r"pip install 'p2ptrain\[tensorboard\]'"):
        MetricsLog(None, tmp_path / "tb")


@pytest.fixture
def wandb_module() -> Any:
    """W&B, installed into this venv by an early job (setup.cfg's `wandb` extra)."""
    done = WANDB.outcome("install")
    assert done.returncode == 0, f"installing W&B failed: {done.stderr[-2000:]}"
    import wandb

    return wandb


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def wandb_records(root: Path) -> list[Any]:
    """The records of the one offline run under `root`: W&B's run file is a LevelDB log (32 KiB blocks, each record
    in chunks with a 7-byte header: CRC, length, type) after a 7-byte file header, of its protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    [path] = root.glob("wandb/offline-run-*/run-*.wandb")
    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    position, chunks, records = 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if length == kind == 0:
            position += left
            continue
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        chunks = chunk if kind in (1, 2) else chunks + chunk  # full | first, then middle | last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
    return records


def wandb_history(root: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for record in wandb_records(root):
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)  # a tag with a slash is stored as its parts
                if not key.startswith("_"):
                    series.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return series


@pytest.mark.slow  # W&B's service process
def test_each_rounds_figures_go_to_a_wandb_run_named_for_the_peer(wandb_module: Any, wandb_offline: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    log = MetricsLog(None, None, "p2ptrain-tests", "myrun", {"run": {"run_id": "myrun"}, "sync": {"mode": "gasloc"}})
    for round_ in range(3):
        log.write(round_metrics(round_, evaluated=round_ != 1))
    log.close()
    series = wandb_history(wandb_offline)
    assert set(ROUND_SCALARS) | {"time/compute_utilisation"} == set(series)
    assert series["loss/train"] == [(0, 3.0), (1, 2.75), (2, 2.5)]
    assert series["loss/validation"] == [(0, 3.5), (2, 1.5)]  # round 1 measured none: not plotted as if it had
    assert series["network/bytes_received"] == [(0, 0.0), (1, 2000.0), (2, 4000.0)]
    [run] = [r.run for r in wandb_records(wandb_offline) if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.run_group, run.project) == ("QmPeer", "myrun", "p2ptrain-tests")
    assert run.host == "QmPeer" and not run.git.remote_url  # nothing of the volunteer's machine: not its name,
    assert not list(wandb_offline.glob("wandb/offline-run-*/files/requirements.txt"))  # nor its packages
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["sync"] == {"mode": "gasloc"} and config["run"] == {"run_id": "myrun"}
    assert "W&B: run QmPeer of project 'p2ptrain-tests', offline in" in caplog.text


def test_wandb_is_offline_without_an_api_key_and_says_what_to_install_when_absent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))  # installed (stands in for it)
    assert WandbLog("p", "run", {}).mode == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert WandbLog("p", "run", {}).mode == "online"
    monkeypatch.setenv("WANDB_MODE", "offlien")
    with pytest.raises(UserError, match="WANDB_MODE must be one of online, offline, disabled, shared"):
        WandbLog("p", "run", {})
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an import finds when it is absent
    with pytest.raises(UserError, match=r"pip install 'p2ptrain\[wandb\]'"):
        MetricsLog(None, None, "p2ptrain-tests")


def test_a_wandb_that_fails_is_logged_once_and_the_rounds_go_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    broken = types.ModuleType("wandb")

    def init(**_kwargs: Any) -> None:
        raise ConnectionError("api.wandb.ai unreachable")

    broken.init = init  # type: ignore[attr-defined]
    broken.Settings = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", broken)
    log = MetricsLog(tmp_path / "m.jsonl", None, "p2ptrain-tests")
    for round_ in range(3):
        log.write(round_metrics(round_))
    log.close()
    assert caplog.text.count("W&B logging stopped: ConnectionError: api.wandb.ai unreachable") == 1
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3


@pytest.mark.network
@pytest.mark.usefixtures("one_torch_thread")
def test_a_peer_writes_its_rounds_for_tensorboard_and_wandb(tmp_path: Path, wandb_module: Any,
                                                            wandb_offline: Path) -> None:
    config = tiny_config(f"tb-{uuid.uuid4().hex[:6]}", run={"rounds": 3, "tensorboard_dir": str(tmp_path / "tb"),
                                                             "wandb_project": "p2ptrain-tests"})
    _threads, histories = run_swarm(config, peers=1)
    for series in (scalars(tmp_path / "tb"), wandb_history(wandb_offline)):
        assert [step for step, _ in series["loss/train"]] == [m.round for m in histories[0]] == [0, 1, 2]
        assert [value for _, value in series["loss/validation"]] == pytest.approx([m.val_loss for m in histories[0]])
