"""Who is training: signed, schema-checked peer records in the DHT, refreshed by a heartbeat, expiring when silent."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading

import hivemind
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from pydantic.v1 import BaseModel, StrictBool, StrictFloat, StrictStr, confloat, conint, constr

logger = logging.getLogger(__name__)


class PeerRecord(BaseModel):
    """What a peer announces about itself. Peers are untrusted: every record is parsed through this schema."""

    peer_id: constr(min_length=1, max_length=128, strict=True)  # type: ignore[valid-type]  # libp2p id (base58)
    round: conint(ge=0, strict=True)  # type: ignore[valid-type]  # the round its inner phase is in
    inner_step: conint(ge=0, strict=True)  # type: ignore[valid-type]  # inner steps done in this round
    phase: constr(regex=r"^(inner|sync|joining)$", strict=True)  # type: ignore[valid-type]
    round_eta: StrictFloat  # DHT time at which its inner phase of this round is expected to end
    train_loss: confloat(ge=0, strict=True) | None = None  # type: ignore[valid-type]
    val_loss: confloat(ge=0, strict=True) | None = None  # type: ignore[valid-type]
    tokens_per_s: confloat(ge=0, strict=True) = 0.0  # type: ignore[valid-type]
    bandwidth_bps: confloat(ge=0, strict=True) = 0.0  # type: ignore[valid-type]  # own link, bits/s (0: unknown)
    fingerprint: StrictStr = ""  # model fingerprint: peers of another architecture are ignored
    synced: StrictBool = True  # its last averaging group held every peer it expected
    updated: StrictFloat = 0.0  # DHT time of this heartbeat


class SwarmSchema(BaseModel):
    peers: dict[BytesWithPublicKey, PeerRecord | None]  # type: ignore[valid-type]


def peers_key(run_id: str) -> str:
    return f"{run_id}_peers"


def add_record_validators(dht: hivemind.DHT, run_id: str) -> RSASignatureValidator:
    """Install the schema and signature validators for this run; returns ours (its public key is our subkey).

    Each call makes a new RSA key: hivemind's default is one key per process, which would give every peer
    hosted in one process the same subkey, so they would overwrite each other's records.
    """
    signature_validator = RSASignatureValidator(RSAPrivateKey())
    dht.add_validators([SchemaValidator(SwarmSchema, prefix=run_id), signature_validator])
    return signature_validator


def parse_records(raw: object, ttl_s: float, now: float) -> list[PeerRecord]:
    """Records from a DHT `get` result, silently dropping malformed and stale ones (a bad record is not fatal)."""
    value = getattr(raw, "value", None)
    if not isinstance(value, dict):
        return []
    records = []
    for entry in value.values():
        try:
            record = PeerRecord.parse_obj(entry.value)
        except Exception:  # pydantic raises ValidationError, bad types raise TypeError
            logger.debug("ignoring a malformed peer record", exc_info=True)
            continue
        if now - record.updated <= ttl_s:
            records.append(record)
    by_peer: dict[str, PeerRecord] = {}
    keep_freshest_(by_peer, records)
    return sorted(by_peer.values(), key=lambda r: r.peer_id)


def keep_freshest_(known: dict[str, PeerRecord], records: list[PeerRecord]) -> None:
    """In place: `known` (peer id → record) keeps, for every peer, the record with the latest heartbeat."""
    for record in records:
        current = known.get(record.peer_id)
        if current is None or current.updated < record.updated:
            known[record.peer_id] = record


DHT_READ_TIMEOUT_S = 30.0
# hivemind's DHT hands each call to its process through one pipe, written without a lock; the heartbeat, the swarm
# watcher and the round loop call it from three threads, so each hand-over is serialised (waiting is not)
DHT_CALL_LOCK = threading.Lock()


def fetch_peers(dht: hivemind.DHT, run_id: str, ttl_s: float,
                timeout_s: float = DHT_READ_TIMEOUT_S) -> list[PeerRecord]:
    """The run's live peers, as of now; none (with a warning) when the DHT does not answer within `timeout_s`
    (hivemind's own `get` waits without a bound, and a training loop must not hang on one lost reply)."""
    with DHT_CALL_LOCK:
        future = dht.get(peers_key(run_id), latest=True, return_future=True)
    try:
        raw = future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:  # the builtin TimeoutError from Python 3.11
        future.cancel()
        logger.warning(f"the DHT did not answer within {timeout_s:g} s; carrying on as if alone this round")
        return []
    return parse_records(raw, ttl_s, get_dht_time())


class Announcer:
    """Publishes this peer's record every `heartbeat_s` from a background thread until stopped.

    The training loop calls `update(...)` with new figures; the thread stores the latest record. A DHT store takes
    a round trip or more (0.3–0.5 s measured on the loaded netns testnet), so `update(publish=True)` only wakes the
    thread: training never waits for the DHT. When the peer stops, the record stops being refreshed and expires
    after `record_ttl_s` for everyone else.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, record: PeerRecord, heartbeat_s: float, ttl_s: float):
        self.dht, self.run_id, self.heartbeat_s, self.ttl_s = dht, run_id, heartbeat_s, ttl_s
        self._validator = add_record_validators(dht, run_id)
        self._record = record
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._publish_now = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="p2ptrain-announcer", daemon=True)

    def start(self) -> None:
        self.publish()
        self._thread.start()

    @property
    def record(self) -> PeerRecord:
        with self._lock:
            return self._record

    def update(self, publish: bool = False, **fields: object) -> None:
        """Change fields of our record; with `publish`, store it now (in the background) instead of at the next
        heartbeat."""
        with self._lock:
            self._record = self._record.copy(update=fields)
        if publish:
            self._publish_now.set()

    def publish(self) -> bool:
        now = get_dht_time()
        with self._lock:
            self._record = self._record.copy(update=dict(updated=now))
            value = self._record.dict()
        try:
            with DHT_CALL_LOCK:
                future = self.dht.store(peers_key(self.run_id), subkey=self._validator.local_public_key,
                                        value=value, expiration_time=now + self.ttl_s, return_future=True)
            return bool(future.result(timeout=DHT_READ_TIMEOUT_S))
        except Exception:  # the DHT process may be shutting down; the next heartbeat tries again
            logger.debug("peer record not stored", exc_info=True)
            return False

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._publish_now.wait(self.heartbeat_s)
            self._publish_now.clear()
            if not self._stop.is_set():
                self.publish()

    def stop(self) -> None:
        self._stop.set()
        self._publish_now.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.heartbeat_s + 5)


class SwarmWatcher:
    """The run's live records, re-read from the DHT every `refresh_s` by a background thread.

    The round loop asks for the swarm twice a round; a DHT read there cost 0.2–3 s (netns testnet, 3 peers on 2
    cores), several times a 100-step round's compute. `records()` answers from what the reads found instead (at
    most `refresh_s` plus one read old); only the first call, before any read finished, and calls that ask for
    the `current` records wait for the DHT.

    Reads are merged, not replaced: a record stands until its own expiry (`ttl_s` after its heartbeat), as it
    does in the DHT. One read that timed out or reached only some of the nodes (seen: 0 of 3 records after 4.8 s)
    would otherwise leave the peer believing itself alone until the next read.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, ttl_s: float, refresh_s: float):
        self.dht, self.run_id, self.ttl_s, self.refresh_s = dht, run_id, ttl_s, refresh_s
        self._known: dict[str, PeerRecord] = {}
        self._read_once = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="p2ptrain-swarm-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def records(self, current: bool = False) -> list[PeerRecord]:
        """The freshest record of every peer whose record has not expired, sorted by peer id."""
        if current or not self._read_once:
            self.merge_(fetch_peers(self.dht, self.run_id, self.ttl_s))
        now = get_dht_time()
        with self._lock:
            live = [r for r in self._known.values() if now - r.updated <= self.ttl_s]
        return sorted(live, key=lambda r: r.peer_id)

    def merge_(self, records: list[PeerRecord]) -> None:
        """Keep each peer's freshest record; forget expired ones."""
        now = get_dht_time()
        with self._lock:
            keep_freshest_(self._known, records)
            self._known = {p: r for p, r in self._known.items() if now - r.updated <= self.ttl_s}
            self._read_once = True

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.merge_(fetch_peers(self.dht, self.run_id, self.ttl_s))
            except Exception:  # the DHT process may be shutting down; the next refresh tries again
                logger.debug("swarm records not read", exc_info=True)
            self._stop.wait(self.refresh_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.refresh_s + 2.0)  # a daemon thread: a hung read must not hold up shutdown


@dataclasses.dataclass
class SwarmView:
    """A snapshot of the live peers other than us, with the questions the round loop asks of it."""

    me: str
    records: list[PeerRecord]

    @property
    def others(self) -> list[PeerRecord]:
        return [r for r in self.records if r.peer_id != self.me]

    def at_round(self, round_: int) -> list[PeerRecord]:
        return [r for r in self.others if r.round == round_]

    def ahead_of(self, round_: int) -> list[PeerRecord]:
        return [r for r in self.others if r.round > round_ and r.phase != "joining"]
