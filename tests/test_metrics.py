"""Per-round metrics for TensorBoard: what a run writes is what TensorBoard's own reader finds."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest
from swarm_utils import run_swarm, tiny_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from p2ptrain.errors import UserError
from p2ptrain.metrics import TENSORBOARD_SCALARS, MetricsLog, RoundMetrics


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
    assert set(TENSORBOARD_SCALARS) | {"time/compute_utilisation"} == set(series)
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


@pytest.mark.network
@pytest.mark.usefixtures("one_torch_thread")
def test_a_peer_writes_its_rounds_for_tensorboard(tmp_path: Path) -> None:
    config = tiny_config(f"tb-{uuid.uuid4().hex[:6]}", run={"rounds": 3, "tensorboard_dir": str(tmp_path / "tb")})
    _threads, histories = run_swarm(config, peers=1)
    series = scalars(tmp_path / "tb")
    assert [step for step, _ in series["loss/train"]] == [m.round for m in histories[0]] == [0, 1, 2]
    assert [value for _, value in series["loss/validation"]] == pytest.approx([m.val_loss for m in histories[0]])
