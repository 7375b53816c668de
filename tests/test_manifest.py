"""The run manifest's rules, without a network: what it carries, what a volunteer's settings may add or contradict,
and every malformed document a stranger might send refused in one line."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from p2ptrain.config import PeerConfig, load_config
from p2ptrain.corpus import corpus_digest
from p2ptrain.data import TextShards, build_tokenizer, corpus_source
from p2ptrain.errors import UserError
from p2ptrain.export import byte_level_tokenizer
from p2ptrain.manifest import (
    LOCAL_KEYS,
    NODE_MANIFEST_ENV,
    RunManifest,
    check_data_copy,
    check_signature,
    founding_manifest,
    hand_to_node,
    join_command,
    join_config,
    join_run,
    shared_keys,
)
from p2ptrain.models import build_model
from p2ptrain.net.admission import generate_organiser_key, load_signing_key, sign_ticket
from p2ptrain.net.discovery import PROTOCOL_VERSION

PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
RUN = {"run.run_id": "myrun", "model.name": "tiny", "sync.mode": "gasloc", "inner.steps": 7}


def organiser(**more: Any) -> PeerConfig:
    return load_config(None, {**RUN, **more})


def document(**more: Any) -> dict[str, Any]:
    return founding_manifest(organiser(**more)).to_document()


def volunteer(manifest: RunManifest, **explicit: Any) -> PeerConfig:
    return join_config(manifest, explicit, load_config(None, explicit), "peer Q")


def test_the_manifest_carries_the_shared_settings_and_no_local_one() -> None:
    manifest = founding_manifest(organiser())
    assert set(manifest.settings) == shared_keys()
    assert {"model.name", "data.dataset", "data.tokenizer", "data.seq_len", "sync.mode", "outer.lr", "run.seed",
            "run.run_id"} <= shared_keys()
    assert not LOCAL_KEYS & shared_keys() and not any(k.startswith(("network.", "reputation.")) for k in shared_keys())
    assert not {"run.device", "run.rounds", "run.checkpoint_dir", "data.batch_size"} & shared_keys()
    assert RunManifest.from_document(json.loads(json.dumps(manifest.to_document())), "peer Q") == manifest


def test_a_volunteer_without_settings_trains_the_run_and_keeps_its_local_ones() -> None:
    manifest = founding_manifest(organiser())
    config = volunteer(manifest, **{"data.batch_size": 2, "run.device": "cpu", "sync.allreduce_timeout_s": 9.0})
    assert (config.run.run_id, config.model.name, config.sync.mode, config.inner.steps) == \
        ("myrun", "tiny", "gasloc", 7)
    assert (config.data.batch_size, config.run.device, config.sync.allreduce_timeout_s) == (2, "cpu", 9.0)
    assert volunteer(manifest, **{"sync.mode": "gasloc", "inner.steps": 7}).inner.steps == 7  # repeating is fine


def test_a_nodes_processes_take_the_manifest_its_first_process_fetched_and_ask_no_peer(monkeypatch) -> None:
    def no_fetch(*_args: object) -> None:
        raise AssertionError("a process of the node asked a peer for the manifest")

    monkeypatch.setattr("p2ptrain.manifest.fetch_manifest", no_fetch)
    monkeypatch.setenv(NODE_MANIFEST_ENV, "")  # restored after the test, whatever hand_to_node writes
    manifest = founding_manifest(organiser())
    hand_to_node(manifest)
    local = load_config(None, {"data.batch_size": 2})
    config, joined = join_run(local, {"data.batch_size": 2}, ["/ip4/127.0.0.1/tcp/1/p2p/" + PEER_ID])
    assert joined == manifest and (config.run.run_id, config.sync.mode, config.inner.steps) == ("myrun", "gasloc", 7)
    assert config.data.batch_size == 2
    hand_to_node(None)  # the run serves none: the local config, as the first process found
    assert join_run(local, {}, ["/ip4/127.0.0.1/tcp/1/p2p/" + PEER_ID]) == (local, None)
    monkeypatch.setenv(NODE_MANIFEST_ENV, "[1, 2]")
    with pytest.raises(UserError, match=f"{NODE_MANIFEST_ENV} in the environment holds no run manifest"):
        join_run(local, {}, [])


@pytest.mark.parametrize(("explicit", "named"), [
    ({"sync.mode": "diloco"}, "sync.mode 'diloco' (the run's: 'gasloc')"),
    ({"model.name": "small"}, "model.name 'small'"),
    ({"run.run_id": "other"}, "run.run_id 'other'"),
    ({"inner.steps": 8, "outer.lr": 0.5}, "inner.steps 8"),
])
def test_a_shared_setting_the_volunteer_contradicts_is_refused_in_one_line(explicit: dict[str, Any],
                                                                          named: str) -> None:
    with pytest.raises(UserError) as refused:
        volunteer(founding_manifest(organiser()), **explicit)
    message = str(refused.value)
    assert "\n" not in message and named in message and "peer Q" in message


def test_a_local_path_in_the_manifest_is_read_only_where_the_volunteer_names_its_copy(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    manifest = founding_manifest(organiser(**{"data.dataset": str(corpus)}))
    with pytest.raises(UserError, match="a path on the organiser's machine: name your copy with --dataset"):
        volunteer(manifest)
    copy_path = tmp_path / "mine.jsonl"
    assert volunteer(manifest, **{"data.dataset": str(copy_path)}).data.dataset == str(copy_path)
    local = f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_ID}"  # a peer id of the real form: join_command parses the address
    line = join_command(organiser(**{"data.dataset": str(corpus)}), local)
    assert line == f"p2ptrain peer --initial-peers {local} --dataset {corpus} --loopback"
    remote = f"/ip4/10.0.0.2/tcp/1/p2p/{PEER_ID}"
    assert join_command(organiser(), remote) == f"p2ptrain peer --initial-peers {remote}"


def test_a_run_of_another_protocol_says_which_release_to_install() -> None:
    newer = document() | {"protocol": PROTOCOL_VERSION + 1, "version": "9.9.9", "settings": {"future.key": 1}}
    with pytest.raises(UserError, match=r"p2ptrain 9\.9\.9 \(protocol \d+\).*pip install -U 'p2ptrain==9\.9\.9'"):
        volunteer(RunManifest.from_document(newer, "peer Q"))
    older = document() | {"protocol": PROTOCOL_VERSION - 1, "version": "0.0.1"}
    with pytest.raises(UserError, match=r"pip install 'p2ptrain==0\.0\.1' to join it, or ask its organiser"):
        volunteer(RunManifest.from_document(older, "peer Q"))


def _mutated(change: str) -> dict[str, Any]:
    doc = copy.deepcopy(document())
    if change == "extra field":
        doc["admin"] = True
    elif change == "missing field":
        del doc["fingerprint"]
    elif change == "format":
        doc["format"] = "p2ptrain-manifest-v0"
    elif change == "protocol as bool":
        doc["protocol"] = True
    elif change == "huge run id":
        doc["run_id"] = "x" * 10_000
    elif change == "settings as list":
        doc["settings"] = [1, 2]
    elif change == "unknown setting":
        doc["settings"]["network.host_maddrs"] = ["/ip4/0.0.0.0/tcp/1"]
    elif change == "local setting":
        doc["settings"]["run.checkpoint_dir"] = "/etc"
    elif change == "wrong type":
        doc["settings"]["inner.steps"] = "many"
    elif change == "out of range":
        doc["settings"]["inner.steps"] = -3
    elif change == "run id differs":
        doc["settings"]["run.run_id"] = "other"
    elif change == "data digest not hex":
        doc["data_digest"] = "z" * 32
    elif change == "data digest huge":
        doc["data_digest"] = "a" * 10_000
    return doc


@pytest.mark.parametrize("change", ["extra field", "missing field", "format", "protocol as bool", "huge run id",
                                    "settings as list", "unknown setting", "local setting", "wrong type",
                                    "out of range", "run id differs", "data digest not hex", "data digest huge"])
def test_a_malformed_manifest_is_one_line_naming_its_sender(change: str) -> None:
    with pytest.raises(UserError) as refused:
        RunManifest.from_document(_mutated(change), "peer Q")
    message = str(refused.value)
    assert message.startswith("peer Q sent a malformed run manifest") and "\n" not in message and len(message) < 400


@pytest.fixture(scope="module")
def organiser_keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return generate_organiser_key(tmp_path_factory.mktemp("keys") / "organiser.key")


def test_a_signed_runs_manifest_passes_only_with_the_organisers_signature_of_it(
        organiser_keys: tuple[Path, Path], tmp_path: Path) -> None:
    private, public = organiser_keys
    signed = founding_manifest(organiser()).signed_with(str(private))
    sent = RunManifest.from_document(json.loads(json.dumps(signed.to_document())), "peer Q")
    check_signature(sent, str(public), "peer Q")  # as handed on by any peer
    _, other_public = generate_organiser_key(tmp_path / "other.key")
    tampered = dataclasses.replace(sent, settings={**sent.settings, "outer.lr": 0.1})
    ticket = sign_ticket(load_signing_key(private), "myrun", "QmPeer")  # a signature, but of a ticket
    for manifest, key in ((tampered, public), (sent, other_public), (dataclasses.replace(sent, signature=""), public),
                          (dataclasses.replace(sent, signature=ticket), public)):
        with pytest.raises(UserError, match="is not signed by the organiser key"):
            check_signature(manifest, str(key), "peer Q")
    with pytest.raises(UserError, match="malformed run manifest"):
        RunManifest.from_document({**signed.to_document(), "signature": 12}, "peer Q")


def test_the_125m_recipe_builds_its_model_and_reads_its_data_on_local_stand_ins(tmp_path: Path) -> None:
    """peer/run-125m.yaml with its hub model, tokenizer and dataset swapped for local stand-ins of the same kind (a
    config.json of SmolLM-135M's shape, a saved fast tokenizer, a jsonl): the manifest volunteers get, the model's
    size, and a batch of its sequence length."""
    recipe = Path(__file__).resolve().parents[1] / "peer/run-125m.yaml"
    hub = load_config(recipe)
    assert (hub.model.pretrained, hub.data.dataset.startswith("hf:"), hub.sync.mode) == (False, True, "gasloc")
    LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                max_position_embeddings=2048).save_pretrained(tmp_path / "model")
    byte_level_tokenizer().save_pretrained(tmp_path / "tokenizer")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "words of text " * 200}) + "\n"
                              for i in range(300)))
    config = load_config(recipe, {"model.name": str(tmp_path / "model"), "data.tokenizer": str(tmp_path / "tokenizer"),
                                  "data.dataset": str(corpus), "data.batch_size": 2, "data.num_shards": 2})
    manifest = founding_manifest(config)  # the model on the meta device: its shapes, no weights
    assert manifest.settings["sync.overlap"] == "delayed" and manifest.settings["data.seq_len"] == 1024
    with torch.device("meta"):
        model = build_model(config.model, build_tokenizer(config.data).vocab_size, 0)
    assert 120e6 < sum(p.numel() for p in model.parameters()) < 150e6
    batch = next(TextShards(config.data, build_tokenizer(config.data), 0).train_batches(seed=0))
    assert batch.shape == (2, 1024)


def _dataset(root: Path, second: str = "b" * 40_000) -> Path:
    root.mkdir()
    (root / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(300)))
    (root / "sub").mkdir()
    (root / "sub" / "b.txt").write_text(second)
    (root / "notes.md").write_text("not read: not a dataset file")
    return root


def test_a_copy_of_the_dataset_has_the_organisers_digest_and_an_edited_one_does_not(tmp_path: Path) -> None:
    organisers = _dataset(tmp_path / "organiser")
    digest = corpus_digest(corpus_source(organiser(**{"data.dataset": str(organisers)}).data))

    def digest_of(root: Path, **settings: Any) -> str:
        return corpus_digest(corpus_source(organiser(**{"data.dataset": str(root), **settings}).data))

    assert len(digest) == 32 and digest_of(_dataset(tmp_path / "copy")) == digest  # another path, the same text
    (tmp_path / "copy" / "notes.md").write_text("a file the data loader does not read")
    assert digest_of(tmp_path / "copy") == digest
    edited = _dataset(tmp_path / "edited", second="b" * 19_990 + "EDIT!" + "b" * 20_005)  # same size, its middle
    longer = _dataset(tmp_path / "longer", second="b" * 40_001)
    renamed = _dataset(tmp_path / "renamed")
    (renamed / "sub" / "b.txt").rename(renamed / "sub" / "c.txt")
    assert len({digest, digest_of(edited), digest_of(longer), digest_of(renamed)}) == 4
    capped = 300 * len(json.dumps({"text": "document 0 " * 20})) // 2  # half of a.jsonl: b.txt is not read
    assert digest_of(organisers, **{"data.max_corpus_bytes": capped}) == \
        digest_of(longer, **{"data.max_corpus_bytes": capped})
    assert corpus_digest(corpus_source(organiser(**{"data.dataset": "hf:someone/corpus"}).data)) == ""


def test_a_volunteer_whose_copy_of_the_dataset_differs_is_refused_in_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    organisers, copy_path = _dataset(tmp_path / "organiser"), _dataset(tmp_path / "copy", second="c" * 40_000)
    manifest = founding_manifest(organiser(**{"data.dataset": str(organisers)}))
    sent = RunManifest.from_document(json.loads(json.dumps(manifest.to_document())), "peer Q")
    assert sent.data_digest == manifest.data_digest != ""
    check_data_copy(sent, volunteer(sent, **{"data.dataset": str(organisers)}), "peer Q")
    with pytest.raises(UserError) as refused:
        check_data_copy(sent, volunteer(sent, **{"data.dataset": str(copy_path)}), "peer Q")
    message = str(refused.value)
    assert message.startswith(f"your copy of the dataset ({copy_path}) differs from run 'myrun''s (from peer Q)")
    assert "\n" not in message and "get the organiser's copy" in message
    # a bootstrap without the organiser's copy serves no digest, and says that volunteers' copies go unchecked
    absent = founding_manifest(organiser(**{"data.dataset": str(tmp_path / "elsewhere.jsonl")}))
    assert absent.data_digest == "" and "not checked" in caplog.text
    check_data_copy(absent, volunteer(absent, **{"data.dataset": str(copy_path)}), "peer Q")
    other_python = dataclasses.replace(founding_manifest(organiser()), data_digest="0" * 32)  # the default: stdlib
    with pytest.raises(UserError, match="standard library: run the organiser's Python version"):
        check_data_copy(other_python, volunteer(other_python), "peer Q")
