"""The model comes out: a checkpoint exported as a Hugging Face directory loads with transformers alone and gives
the same outputs; a peer run without a checkpoint directory keeps its model where it says; `sample` continues a
prompt."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
from swarm_utils import PeerThread, run_swarm, start_peer, tiny_config
from test_cli_errors import save_tiny_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from p2ptrain.config import load_config
from p2ptrain.data import ByteTokenizer
from p2ptrain.errors import CheckpointError, UserError
from p2ptrain.export import (
    byte_level_tokenizer,
    export_checkpoint,
    export_from_swarm,
    load_exportable,
    sample_text,
)
from p2ptrain.manifest import join_run

TEXTS = ["plain ascii", "héllo wörld: ünïcode", "日本語のテキスト", "tabs\tnewlines\n\x00 control \x7f", "  two spaces"]


def test_the_byte_tokenizer_exports_as_a_fast_tokenizer_with_the_same_ids() -> None:
    exported, ours = byte_level_tokenizer(), ByteTokenizer()
    for text in TEXTS:
        ids = exported(text, add_special_tokens=False)["input_ids"]
        assert ids == ours.encode(text), text
        assert exported.decode(ids) == text
    assert exported.eos_token_id == ours.eos_token_id == 256 and len(exported) == ours.vocab_size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("export") / "ckpt"
    save_tiny_checkpoint(directory)
    return directory


def test_an_exported_checkpoint_loads_with_transformers_alone_and_gives_the_same_logits(
        checkpoint: Path, tmp_path: Path) -> None:
    ours = export_checkpoint(checkpoint, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tokenizer("a test sentence", return_tensors="pt")["input_ids"]
    assert ids.tolist() == [ByteTokenizer().encode("a test sentence")]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ours.model(ids).logits)
    generated = pipeline("text-generation", model=model, tokenizer=tokenizer)("def ", max_new_tokens=8,
                                                                             do_sample=False)
    assert generated[0]["generated_text"].startswith("def ") and len(generated[0]["generated_text"]) > 4


def test_export_writes_only_into_an_empty_directory_and_leaves_a_full_one_as_it_was(
        checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not an empty directory"):
        export_checkpoint(checkpoint, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    export_checkpoint(checkpoint, tmp_path / "empty")
    assert (tmp_path / "empty" / "config.json").exists() and (tmp_path / "empty" / "tokenizer.json").exists()


def test_a_checkpoint_whose_weights_do_not_fit_its_model_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    meta = json.loads((checkpoint / "round-000000" / "meta.json").read_text())
    meta["config"]["model"]["name"] = "small"  # the config now builds another model than the weights are of
    forged = tmp_path / "forged"
    forged.mkdir()
    for part in ("model.safetensors", "train_state.pt"):
        (forged / part).write_bytes((checkpoint / "round-000000" / part).read_bytes())
    (forged / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="does not match the model"):
        load_exportable(forged)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_exportable(tmp_path / "nothing-here")


def test_sampling_is_seeded_greedy_at_temperature_0_and_refuses_an_empty_prompt(checkpoint: Path) -> None:
    exported = load_exportable(checkpoint)
    assert sample_text(exported, "the ", 12, 0.8, seed=1) == sample_text(exported, "the ", 12, 0.8, seed=1)
    greedy = sample_text(exported, "the ", 12, 0.0, seed=1)
    assert greedy == sample_text(exported, "the ", 12, 0.0, seed=2) and greedy.startswith("the ")
    with pytest.raises(UserError, match="prompt"):
        sample_text(exported, "", 5, 0.8, seed=0)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_peer_without_a_checkpoint_dir_keeps_its_model_in_the_data_dir_and_it_exports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    caplog.set_level("INFO", logger="p2ptrain")
    run_id = f"keep-{uuid.uuid4().hex[:6]}"
    threads, histories = run_swarm(tiny_config(run_id, run={"rounds": 2}), peers=1)
    peer_id = threads[0].peer.peer_id
    kept = tmp_path / "data" / "p2ptrain" / "checkpoints" / run_id / peer_id
    assert (kept / "latest").read_text().strip() == "round-000002", caplog.text
    assert f"kept in {kept / 'round-000002'}" in caplog.text

    exported = export_checkpoint(kept, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    trained = [p for p in model.parameters() if p.requires_grad]
    final = threads[0].params_after_round[1]
    assert exported.round == 2 and len(trained) == len(final)
    assert all(torch.equal(a, b) for a, b in zip(trained, final, strict=True))
    with torch.no_grad():  # the exported model's validation loss is the one the peer reported last
        losses = [float(model(input_ids=b, labels=b).loss) for b in threads[0].peer.val_batches]
    assert sum(losses) / len(losses) == pytest.approx(histories[0][-1].val_loss, rel=1e-5)


@pytest.mark.network
@pytest.mark.usefixtures("one_torch_thread")
def test_the_organiser_takes_the_swarms_model_from_a_live_peer_without_training(tmp_path: Path) -> None:
    """`export --from-swarm`: two DiLoCo peers train; the export takes a state from one of them as a joiner would
    (their manifest, a download, a witness's sketch, the loss check), writes it, and leaves. The model written is
    the parameters its donor had after some round, to the bit: usually both peers', as DiLoCo's peers hold one state,
    but a round they average alone under load sets them apart."""
    config = tiny_config(f"from-swarm-{uuid.uuid4().hex[:6]}")  # rounds 0: until stopped
    founder = PeerThread(start_peer(config)).start()
    second = PeerThread(start_peer(config, founder.peer.maddrs)).start()
    try:
        founder.wait_for_round(3, timeout_s=180)
        local = load_config(None, {"run.run_id": "ignored", "network.host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
                                   "network.nat_port_map": False, "network.auto_nat": False,
                                   "network.use_relay": False})
        joined, manifest = join_run(local, {}, founder.peer.maddrs)
        assert manifest is not None and joined.run.run_id == config.run.run_id
        exported, taken = export_from_swarm(joined, founder.peer.maddrs, tmp_path / "out", manifest)
    finally:
        for thread in (founder, second):
            thread.peer.stop()
            thread.join(timeout_s=120)
            thread.peer.shutdown()
    assert taken.startswith(f"the state of round {exported.round} from"), taken
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    written = [p for p in model.parameters() if p.requires_grad]
    seen = [thread.params_after_round[r] for thread in (founder, second) for r in sorted(thread.params_after_round)]
    assert any(all(torch.equal(a, b) for a, b in zip(written, params, strict=True)) for params in seen), taken
    assert AutoTokenizer.from_pretrained(tmp_path / "out").eos_token_id == ByteTokenizer().eos_token_id


def test_an_export_from_a_swarm_writes_into_a_new_directory_only(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="is not an empty directory"):
        export_from_swarm(tiny_config("x"), ["/ip4/127.0.0.1/tcp/1/p2p/QmPeer"], tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
