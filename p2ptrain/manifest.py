"""The run manifest: what every peer of a run must share, handed to a volunteer by the peer it joins.

A run is its model (architecture, initial weights' seed, pretrained or not), tokenizer, dataset and its split rule,
and the inner, outer and sync rules: peers that differ in any of these do not train one model (other peers leave
them out of their rounds, or their rounds disagree). The manifest carries those settings (`SHARED_SECTIONS` and
`SHARED_RUN_KEYS`, less `LOCAL_KEYS`), the model's fingerprint, the dataset's digest and the protocol version. The
rest (device, batch size, micro-batches, precision, timeouts, checkpoints, the network) stays each volunteer's.

A peer started with `--initial-peers` asks the first of them for its manifest (net/run_manifest.py) and trains
exactly the run it describes: its own config may add local settings and may repeat a shared one, but a shared one
it contradicts is refused in one line. A manifest cannot choose files on the volunteer's machine: a dataset,
model or tokenizer that is a local path is taken from the volunteer (`--dataset`, `--model`, the config: its own
copy, at its own path); a copy of the dataset whose digest differs from the run's is refused. A manifest is a
stranger's input: its shape, size and every setting are validated (the config's own checks) before anything is
built from it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from p2ptrain import __version__
from p2ptrain.config import PeerConfig, build_config, flatten_settings, nest_settings
from p2ptrain.corpus import HUB_PREFIX, STDLIB_DATASET, corpus_digest
from p2ptrain.data import BYTE_TOKENIZER, build_tokenizer, corpus_source
from p2ptrain.errors import ConfigError, UserError, one_line
from p2ptrain.models import PRESETS, build_model, model_fingerprint
from p2ptrain.net.admission import (
    MAX_TICKET_CHARS,
    load_organiser_key,
    load_signing_key,
    sign_manifest,
    verify_manifest,
)
from p2ptrain.net.dht import is_loopback
from p2ptrain.net.discovery import PROTOCOL_VERSION
from p2ptrain.net.run_manifest import fetch_manifest
from p2ptrain.net.wire import WireError

logger = logging.getLogger(__name__)

MANIFEST_FORMAT = "p2ptrain-manifest-v1"
SHARED_SECTIONS = ("model", "data", "inner", "outer", "sync")
SHARED_RUN_KEYS = ("run.run_id", "run.seed")
# each volunteer's own: what its hardware holds and how patient its link needs it to be (not data.max_corpus_bytes:
# it cuts the piece table, so it sets the validation set every peer's loss checks compare on)
LOCAL_KEYS = frozenset({
    "data.batch_size", "inner.micro_batches", "inner.activation_checkpointing",
    "inner.precision", "inner.fp16_initial_scale", "outer.state_device", "sync.allreduce_timeout_s",
    "sync.exchange_safety_factor", "sync.state_download_timeout_s", "sync.adapt_inner_steps",
    "sync.keep_pace",
})
# settings whose value may name a file on this machine: taken from a manifest only when the volunteer names it too
PATH_KEYS = {"data.dataset": "--dataset", "model.name": "--model", "data.tokenizer": "data.tokenizer in --config"}
MAX_FIELD_CHARS = 512
DIGEST_CHARS = 32  # corpus_digest's hex digits
NODE_MANIFEST_ENV = "P2PTRAIN_NODE_MANIFEST"  # the manifest a node's first process fetched ("" for none served)


def shared_keys() -> frozenset[str]:
    """Every dotted setting a manifest carries."""
    keys = flatten_settings(PeerConfig().to_dict())
    return frozenset(k for k in keys if (k.split(".", 1)[0] in SHARED_SECTIONS and k not in LOCAL_KEYS)
                     or k in SHARED_RUN_KEYS)


@dataclasses.dataclass(frozen=True)
class RunManifest:
    """A run's shared settings (dotted keys), its model's fingerprint, its dataset's digest and the release that
    made it."""

    run_id: str
    fingerprint: str
    settings: dict[str, Any]
    protocol: int = PROTOCOL_VERSION
    version: str = __version__
    signature: str = ""  # the organiser's, in a signed run (`bootstrap --sign-with`); a peer hands it on as it got it
    data_digest: str = ""  # corpus_digest of the organiser's copy; "" for a hub dataset or a copy not at hand

    @classmethod
    def of(cls, config: PeerConfig, fingerprint: str, data_digest: str) -> RunManifest:
        keys = shared_keys()
        settings = {k: v for k, v in flatten_settings(config.to_dict()).items() if k in keys}
        return cls(config.run.run_id, fingerprint, json.loads(json.dumps(settings)), data_digest=data_digest)

    def to_document(self) -> dict[str, Any]:
        document = {"format": MANIFEST_FORMAT, "run_id": self.run_id, "fingerprint": self.fingerprint,
                    "protocol": self.protocol, "version": self.version, "settings": self.settings,
                    "data_digest": self.data_digest}
        return {**document, "signature": self.signature} if self.signature else document

    def signed_bytes(self) -> bytes:
        """What the organiser signs: the document less its signature, as canonical JSON."""
        return json.dumps(dataclasses.replace(self, signature="").to_document(), sort_keys=True,
                          separators=(",", ":")).encode()

    def signed_with(self, key_path: str) -> RunManifest:
        return dataclasses.replace(self, signature=sign_manifest(load_signing_key(key_path), self.signed_bytes()))

    @classmethod
    def from_document(cls, document: dict[str, Any], source: str) -> RunManifest:
        """Check a document a peer sent; a malformed one is a one-line UserError naming `source`."""
        def bad(why: str) -> UserError:
            return UserError(f"{source} sent a malformed run manifest ({why}); ask the organiser for another "
                             f"address to join")

        expected = {"format", "run_id", "fingerprint", "protocol", "version", "settings"}
        signature, data_digest = document.get("signature", ""), document.get("data_digest", "")
        if set(document) - {"signature", "data_digest"} != expected or document["format"] != MANIFEST_FORMAT:
            raise bad(f"fields {sorted(document)[:8]}, format {str(document.get('format'))[:40]!r}")
        protocol, settings = document["protocol"], document["settings"]
        if type(protocol) is not int or not 0 <= protocol <= 10**6:
            raise bad("protocol is not a version number")
        if not isinstance(signature, str) or len(signature) > MAX_TICKET_CHARS:
            raise bad("the signature is not a short string")
        if not isinstance(data_digest, str) or len(data_digest) not in (0, DIGEST_CHARS) or \
                data_digest.strip("0123456789abcdef"):
            raise bad("the data digest is not one")
        for name in ("run_id", "fingerprint", "version"):
            if not isinstance(document[name], str) or not 0 < len(document[name]) <= MAX_FIELD_CHARS:
                raise bad(f"{name} is not a short string")
        if protocol != PROTOCOL_VERSION:  # before the settings: another release may carry other ones
            return cls(document["run_id"], document["fingerprint"], {}, protocol, document["version"], signature,
                       data_digest)
        if not isinstance(settings, dict):
            raise bad("settings are not a mapping")
        unknown = sorted(set(settings) - shared_keys())
        if unknown:
            raise bad(f"settings this release does not share: {', '.join(k[:60] for k in unknown[:3])}")
        if settings.get("run.run_id") != document["run_id"]:
            raise bad("its run id and its settings' differ")
        try:
            build_config(nest_settings(settings))
        except ConfigError as e:
            raise bad(one_line(e, 200)) from None
        return cls(document["run_id"], document["fingerprint"], settings, protocol, document["version"], signature,
                   data_digest)

    def summary(self) -> str:
        """What a volunteer joins, in one line."""
        s = self.settings
        start = "pretrained" if s.get("model.pretrained") else f"from seed {s.get('run.seed')}"
        return (f"run {self.run_id!r}: model {s.get('model.name')} ({start}, fingerprint {self.fingerprint[:12]}), "
                f"tokenizer {s.get('data.tokenizer')}, data {s.get('data.dataset')}, sync {s.get('sync.mode')}, "
                f"p2ptrain {self.version}")


def check_release(manifest: RunManifest, source: str) -> None:
    """Refuse, in one line saying what to install, a run of another protocol version."""
    if manifest.protocol == PROTOCOL_VERSION:
        return
    if manifest.protocol > PROTOCOL_VERSION:
        advice = f"pip install -U 'p2ptrain=={manifest.version}'"
    else:
        advice = f"pip install 'p2ptrain=={manifest.version}' to join it, or ask its organiser to upgrade"
    raise UserError(f"run {manifest.run_id!r} (from {source}) runs p2ptrain {manifest.version} (protocol "
                    f"{manifest.protocol}) and this is p2ptrain {__version__} (protocol {PROTOCOL_VERSION}): {advice}")


def names_a_local_file(key: str, value: object) -> bool:
    """Whether a shared setting's value reads a file on this machine rather than a preset or the hub."""
    if not isinstance(value, str):
        return False
    if key == "data.dataset":
        return value != STDLIB_DATASET and not value.startswith(HUB_PREFIX)
    if key == "model.name" and value in PRESETS or key == "data.tokenizer" and value == BYTE_TOKENIZER:
        return False
    return value.startswith(("/", ".", "~")) or Path(value).expanduser().exists()


def join_config(manifest: RunManifest, explicit: dict[str, Any], local: PeerConfig, source: str) -> PeerConfig:
    """The config a volunteer trains with: the manifest's shared settings, with `explicit` (the dotted settings its
    config file and flags set; `local` is the config they built) for everything local. A shared setting `explicit`
    contradicts, or a local file the manifest names that the volunteer did not, is a one-line UserError."""
    check_release(manifest, source)
    built = flatten_settings(local.to_dict())
    own_copies = {k for k in PATH_KEYS if names_a_local_file(k, manifest.settings[k])}  # the volunteer's path
    shared = {k: json.loads(json.dumps(built[k])) for k in explicit if k in manifest.settings and k not in own_copies}
    conflicts = [f"{k} {shared[k]!r} (the run's: {manifest.settings[k]!r})" for k in sorted(shared)
                 if shared[k] != manifest.settings[k]]
    if conflicts:
        raise UserError(f"your settings contradict run {manifest.run_id!r} (from {source}): {'; '.join(conflicts[:3])}"
                        f"; a run's model, data and sync settings are its organiser's: drop them from your config")
    unnamed = sorted(own_copies - set(explicit))
    if unnamed:
        key = unnamed[0]
        raise UserError(f"run {manifest.run_id!r} reads {key} {manifest.settings[key]!r}, a path on the organiser's "
                        f"machine: name your copy with {PATH_KEYS[key]} (a run cannot choose files on yours)")
    values = nest_settings({**built, **{k: v for k, v in manifest.settings.items() if k not in explicit}})
    return build_config(values)


def join_run(config: PeerConfig, explicit: dict[str, Any],
             initial_peers: list[str]) -> tuple[PeerConfig, RunManifest | None]:
    """The config to train with and the manifest it follows: asked of the initial peers (the first that answers),
    or handed down by the node's first process (`hand_to_node`); `config` as it is where none of them serves a
    manifest (a bootstrap started without the run's config)."""
    served = handed_manifest() if NODE_MANIFEST_ENV in os.environ else \
        served_manifest(config, initial_peers, "ask the organiser for another address to join")
    if served is None:
        return config, None
    source, manifest = served
    if manifest is None:
        logger.info(f"{source} serves no run manifest (a bootstrap started without the run file): training run "
                    f"{config.run.run_id!r} with this config")
        return config, None
    if config.network.admission == "signed":
        check_signature(manifest, config.network.organiser_key, source)
    joined = join_config(manifest, explicit, config, source)
    check_data_copy(manifest, joined, source)
    return joined, manifest


def hand_to_node(manifest: RunManifest | None) -> None:
    """Hand the manifest this process fetched to the node's other processes (`--workers N`: node/launcher.py
    starts them with our environment), which then ask no peer for it: one fetch a node, not one a process."""
    os.environ[NODE_MANIFEST_ENV] = "" if manifest is None else json.dumps(manifest.to_document())


def handed_manifest() -> tuple[str, RunManifest | None]:
    """The manifest handed down by `hand_to_node` (None: the run serves none), checked as a peer's would be."""
    source, handed = "the node's first process", os.environ[NODE_MANIFEST_ENV]
    if not handed:
        return source, None
    try:
        document = json.loads(handed)
    except ValueError:
        document = None
    if not isinstance(document, dict):
        raise UserError(f"{NODE_MANIFEST_ENV} in the environment holds no run manifest: unset it")
    return source, RunManifest.from_document(document, source)


def check_data_copy(manifest: RunManifest, config: PeerConfig, source: str) -> None:
    """Refuse a copy of the dataset that differs from the organiser's: its pieces would hold other text under the
    same indices (claims, the shared validation set). Nothing to compare where the manifest carries no digest."""
    if not manifest.data_digest:
        return
    digest = corpus_digest(corpus_source(config.data))
    if digest != manifest.data_digest:
        advice = ("it is this Python's standard library: run the organiser's Python version"
                  if config.data.dataset == STDLIB_DATASET else "get the organiser's copy")
        raise UserError(f"your copy of the dataset ({config.data.dataset}) differs from run {manifest.run_id!r}'s "
                        f"(from {source}): its files, their sizes or their text (digest {digest[:12]}, the run's "
                        f"{manifest.data_digest[:12]}); {advice}")


def served_manifest(config: PeerConfig, initial_peers: list[str],
                    advice: str) -> tuple[str, RunManifest | None] | None:
    """(which peer answered, the manifest it serves or None), checked; None when no initial peer answered. A peer
    that answers nonsense is a one-line UserError ending with `advice`."""
    try:
        answer = fetch_manifest(config.network, initial_peers)
    except WireError as e:
        raise UserError(f"{one_line(e, 200)}; {advice}") from None
    if answer is None:
        return None
    source = f"peer {answer[0]}"
    return source, None if answer[1] is None else RunManifest.from_document(answer[1], source)


def served_run_id(config: PeerConfig, initial_peers: list[str]) -> str | None:
    """The id of the run the initial peers serve a manifest of (for `status`, which trains nothing); None if none."""
    served = served_manifest(config, initial_peers, "pass --run-id")
    return served[1].run_id if served is not None and served[1] is not None else None


def check_signature(manifest: RunManifest, organiser_key_path: str, source: str) -> None:
    """Refuse, in a signed run, a manifest the organiser did not sign."""
    if not verify_manifest(load_organiser_key(organiser_key_path), manifest.signed_bytes(), manifest.signature):
        raise UserError(f"the run manifest from {source} is not signed by the organiser key {organiser_key_path!r}: "
                        f"join through the organiser's bootstrap (started with --sign-with), or check the key")


def join_command(config: PeerConfig, maddr: str) -> str:
    """The one command a volunteer types to join this run through `maddr`: with the local paths it must name (ours,
    resolved), and `--loopback` for an address on this machine (the volunteer is then here too)."""
    words = ["p2ptrain peer --initial-peers", maddr]
    settings = flatten_settings(config.to_dict())
    for key, flag in (("data.dataset", "--dataset"), ("model.name", "--model")):
        if names_a_local_file(key, settings[key]):
            path = Path(settings[key]).expanduser()
            words += [flag, str(path.resolve()) if path.exists() else str(path)]
    if is_loopback(maddr):
        words.append("--loopback")
    return " ".join(words)


def founding_manifest(config: PeerConfig) -> RunManifest:
    """A run's manifest from its config alone (what a bootstrap started with the run's config serves): the model is
    built on the meta device, which holds shapes and dtypes (the fingerprint) and no weights."""
    import torch

    tokenizer = build_tokenizer(config.data)
    with torch.device("meta"):
        model = build_model(config.model, tokenizer.vocab_size, config.run.seed)
    try:
        data_digest = corpus_digest(corpus_source(config.data))
    except UserError as e:  # a bootstrap on a machine without the organiser's copy: the founder's peers carry it
        logger.warning(f"volunteers' copies of the dataset are not checked against this one: {one_line(e, 200)}")
        data_digest = ""
    return RunManifest.of(config, model_fingerprint(model), data_digest)
