"""Who is training: signed, schema-checked peer records in the DHT, refreshed by a heartbeat, expiring when silent.

Peers are untrusted. A record is signed with its peer's identity key (net/identity.py), so its `peer_id` must be
its signer's: one signer speaks for one peer, with one record. Every node refuses, in its DHT validators (nothing
forged is stored or accepted from a lookup) and again when it reads the records (`parse_records`), a record that is
malformed, signed by another peer, from the future, stale, set to expire too late, or, in a signed run, without
the organiser's ticket (net/admission.py).

A peer that shuts down stores a last record of phase `left` (`Announcer.leave`): the others drop it at their next
read instead of after its TTL, during which they would have counted it in their rounds and dialled it as a donor (a
home peer gone offline answers no dial, and a catch-up would spend its whole dial timeout on it). Only its
owner can sign it; a reader keeps it as a tombstone until it expires, so an older record read from a slower replica
cannot bring the peer back.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterable

import hivemind
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.mpfuture import MPFuture
from pydantic.v1 import BaseModel, StrictBool, StrictFloat, confloat, conint, constr, validator

from p2ptrain.net.admission import MAX_TICKET_CHARS, Admission, AdmissionPolicy
from p2ptrain.net.dht import SwarmDHT
from p2ptrain.net.dht_keys import (
    KEY_BEAM,
    MAX_SHARD_LEVEL,
    RunKeysValidator,
    SubkeyBudget,
    shard_index,
    shard_key,
    shard_key_ids,
)
from p2ptrain.net.holder_read import read_from_one_holder
from p2ptrain.net.identity import peer_id_of_signer
from p2ptrain.net.record_shards import FRESH_HEARTBEATS, LINEAGE_EVERY, SHARD_TARGET, RecordShards, Shard
from p2ptrain.net.routing_refill import REFILL_EVERY_S, initial_peer_ids, refill_routing_table
from p2ptrain.timing import BRIEF_S, MAX_CLOCK_SKEW_S, PATIENCE_S, SETUP_FLOOR_S

logger = logging.getLogger(__name__)

# a publish the round waits for (DiLoCo's phase changes) waits at most this many heartbeats: a store that takes longer
# is waiting on a silent DHT node (hivemind gives each node 3 s), and the
# heartbeat stores the record again anyway
BLOCKING_PUBLISH_HEARTBEATS = 2
BASE58 = r"^[1-9A-HJ-NP-Za-km-z]*$"  # libp2p peer ids as text
LEFT = "left"  # the phase of a departed peer's last record
# What peers must share to train together: the records, the exchanges' formats and the agreement digests. A change to
# any of them raises it; peers of another protocol are left out of rounds and told apart in one line. 0: a record
# from before records carried it (those peers hashed their agreement digests with SHA-256, not BLAKE3). 2: the
# averagers' group keys hold 8 round bits, not 16, and nodes store only the run's keys (net/dht_keys.py). 3: the
# records split into shards as the swarm grows (net/record_shards.py), which nodes of protocol 2 refuse to store. 4:
# GASLoC's exchange headers show a sample of the round's outer gradient, without which a value is idle
# (sync/contribution.py). 5: records may name a start time for round 0 (`starts_at`, swarm_start.py), a field nodes
# of protocol 4 refuse to store in shards
PROTOCOL_VERSION = 5
MAX_VOUCHES = 8  # partners a record vouches for (sync/contribution.py): the ones judged most recently
SHORT_ID_CHARS = 8  # a vouch names a partner by the last characters of its peer id (status shows them)
MAX_TOKENS = 10**15  # a record's token counts beyond this are malformed
MAX_STEP_S = 3600.0  # an inner step that takes longer is no step a swarm can pace by
# stored values whose parse a DHT process remembers (`_parsed_record`): the records of the shards a read covers (up to
# 4 of twice SHARD_TARGET each), with room; at most this × MAX_VALUE_BYTES (2 MiB), typically a tenth of that
PARSED_REMEMBERED = 16 * SHARD_TARGET
SIGNATURES_REMEMBERED = 4096  # records whose valid signature a process remembers (a 16-byte digest each)


class PeerRecord(BaseModel):
    """What a peer announces about itself. Peers are untrusted: every record is parsed through this schema."""

    peer_id: constr(min_length=1, max_length=128, strict=True)  # type: ignore[valid-type]  # libp2p id (base58)
    round: conint(ge=0, strict=True)  # type: ignore[valid-type]  # the round its inner phase is in
    inner_step: conint(ge=0, strict=True)  # type: ignore[valid-type]  # inner steps done in this round
    phase: constr(regex=r"^(inner|sync|joining|left)$", strict=True)  # type: ignore[valid-type]
    round_eta: StrictFloat  # DHT time at which its inner phase of this round is expected to end
    train_loss: confloat(ge=0, strict=True) | None = None  # type: ignore[valid-type]
    val_loss: confloat(ge=0, strict=True) | None = None  # type: ignore[valid-type]
    tokens_per_s: confloat(ge=0, strict=True) = 0.0  # type: ignore[valid-type]
    step_s: confloat(ge=0, le=MAX_STEP_S, strict=True) = 0.0  # type: ignore[valid-type]  # s per inner step (0: unknown)
    bandwidth_bps: confloat(ge=0, strict=True) = 0.0  # type: ignore[valid-type]  # own link, bits/s (0: unknown)
    # model fingerprint: peers of another architecture are ignored
    fingerprint: constr(max_length=64, strict=True) = ""  # type: ignore[valid-type]
    synced: StrictBool = True  # its last averaging group held every peer it expected
    updated: StrictFloat = 0.0  # DHT time of this heartbeat
    banned: conint(ge=0, le=10**6, strict=True) = 0  # type: ignore[valid-type]  # peers it bans now (reputation)
    # bytes its latest round sent and received (measured on its streams): what `status` and its web page show
    bytes_sent: conint(ge=0, le=10**13, strict=True) = 0  # type: ignore[valid-type]
    bytes_received: conint(ge=0, le=10**13, strict=True) = 0  # type: ignore[valid-type]
    # how others reach it (net/reachability.py): "" not known yet, direct, relay (through relay_via), outbound only
    reach: constr(regex=r"^(|direct|relay|outbound)$", strict=True) = ""  # type: ignore[valid-type]
    relay_via: constr(max_length=64, regex=BASE58, strict=True) = ""  # type: ignore[valid-type]  # its relay's id
    seen_as: constr(max_length=45, regex=r"^[0-9a-fA-F.:]*$", strict=True) = ""  # type: ignore[valid-type]  # its IP
    relay: StrictBool = False  # it serves as a relay for peers behind NAT (net/relay.py)
    protocol: conint(ge=0, le=10**6, strict=True) = 0  # type: ignore[valid-type]  # its PROTOCOL_VERSION
    version: constr(max_length=32, regex=r"^[0-9A-Za-z.+-]*$", strict=True) = ""  # type: ignore[valid-type]  # release
    # signed runs: the organiser's signature of (run id, peer id), base64 (net/admission.py); "" in open runs
    ticket: constr(max_length=MAX_TICKET_CHARS, regex=r"^[A-Za-z0-9+/=]*$", strict=True) = ""  # type: ignore[valid-type]
    # the tokens its inner phases trained since it started (its claim), and the tokens it verified of its latest
    # partners' claims by their outer gradients (sync/contribution.py), by the last SHORT_ID_CHARS of their ids
    tokens: conint(ge=0, le=MAX_TOKENS, strict=True) = 0  # type: ignore[valid-type]
    # round 0 of peers launched together: the DHT time they begin it at (swarm_start.py); 0 not named
    starts_at: confloat(ge=0, strict=True) = 0.0  # type: ignore[valid-type]
    vouched: dict[constr(min_length=1, max_length=SHORT_ID_CHARS, regex=BASE58, strict=True),  # type: ignore[valid-type]
                  conint(ge=0, le=MAX_TOKENS, strict=True)] = {}  # type: ignore[valid-type]

    @validator("vouched")
    def _few_vouches(cls, vouched: dict[str, int]) -> dict[str, int]:
        if len(vouched) > MAX_VOUCHES:
            raise ValueError(f"at most {MAX_VOUCHES} vouches")
        return vouched


class SwarmSchema(BaseModel):
    peers: dict[BytesWithPublicKey, PeerRecord]  # type: ignore[valid-type]


def short_id(peer_id: str) -> str:
    """How a record's vouch names a peer: the last SHORT_ID_CHARS characters of its id."""
    return peer_id[-SHORT_ID_CHARS:]


def record_problem(record: PeerRecord, now: float, ttl_s: float, policy: AdmissionPolicy, signer: str | None = None,
                   expiration_time: float | None = None) -> str | None:
    """Why a parsed record is refused, or None: the one check of the DHT validator and of `parse_records`.

    `signer`: the peer id whose identity key signed it, where known; `expiration_time`: the DHT's, where known.
    Clocks differ by up to MAX_CLOCK_SKEW_S: a heartbeat may be that far in the future, a record kept that long
    past its TTL."""
    if signer is not None and record.peer_id != signer:
        return f"it names peer {record.peer_id} but was signed by {signer}"
    if record.updated > now + MAX_CLOCK_SKEW_S:
        return f"its heartbeat is {record.updated - now:.0f} s in the future"
    if now - record.updated > ttl_s + MAX_CLOCK_SKEW_S:
        return f"its heartbeat is {now - record.updated:.0f} s old"
    if expiration_time is not None and expiration_time > now + ttl_s + MAX_CLOCK_SKEW_S:
        return f"it asks to be kept {expiration_time - now:.0f} s"
    return policy.ticket_problem(record.peer_id, record.ticket)


# a watcher keeps a peer's record this many lifetimes (`recently_seen`): on a 2-core box running 32 peers, reads that
# found nobody left 16 % of the gossip rounds alone ("no other peer of the run is live"), though the peers had not left
RECENT_LIFETIMES = 3


def is_live(record: PeerRecord, now: float, ttl_s: float) -> bool:
    """Whether a record still stands: its last heartbeat is at most `ttl_s` old (a `left` record too, as a
    tombstone)."""
    return now - record.updated <= ttl_s


def other_protocol_note(record: PeerRecord, own_version: str) -> str:
    """One line for a peer left out because it speaks another protocol: which release to install, if ours is older."""
    theirs = f"p2ptrain {record.version or 'before 0.1.0'} (protocol {record.protocol})"
    if record.protocol > PROTOCOL_VERSION:
        release = f"p2ptrain=={record.version}" if record.version else "p2ptrain"
        return (f"peer {record.peer_id} runs {theirs}, newer than ours ({own_version}, protocol {PROTOCOL_VERSION}): "
                f"it is left out of our rounds; pip install -U '{release}' to train with it")
    return (f"peer {record.peer_id} runs {theirs}, older than ours ({own_version}, protocol {PROTOCOL_VERSION}): it is "
            f"left out of our rounds until it upgrades")


def other_model_note(record: PeerRecord, own_fingerprint: str) -> str:
    """One line for a peer left out because it trains another model than ours."""
    return (f"peer {record.peer_id} trains another model (fingerprint {record.fingerprint[:12] or 'none'}, ours "
            f"{own_fingerprint[:12]}): it is left out of our rounds; every peer of a run must start with the same "
            f"model settings (model.*, data.tokenizer)")


def present(records: list[PeerRecord]) -> list[PeerRecord]:
    """The records of peers still in the run: those that did not announce they left."""
    return [r for r in records if r.phase != LEFT]


@dataclasses.dataclass
class PeerRecordValidator(RecordValidatorBase):
    """hivemind validator for one run's peer records (`record_problem`, with the signer taken from the subkey).

    It runs below the signature validator, which checks the signature and strips it first, so it sees the plain
    value. Plain data: hivemind pickles validators into its DHT process."""

    run_id: str
    ttl_s: float
    policy: AdmissionPolicy

    def validate(self, record: DHTRecord) -> bool:
        shard = shard_key_ids(self.run_id).get(record.key)
        if shard is None:
            return True  # not a peer record of this run
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # msgpack raises many types; every one means a malformed record
            logger.debug("refusing a peer record with a malformed subkey", exc_info=True)
            return False
        parsed, in_schema_types = _parsed_record(record.value) if isinstance(record.value, bytes) else (None, False)
        if parsed is None:
            return False
        signer = peer_id_of_signer(subkey) if isinstance(subkey, bytes) else None
        if signer is None:
            logger.debug(f"refusing a peer record of {parsed.peer_id}: its subkey names no signer")
            return False
        level, index = shard
        if level > 0 and (shard_index(signer, level) != index or not in_schema_types):
            # the schema validator checks level 0's records for conversions; a shard holds only its own peers
            logger.debug(f"refusing a peer record of {parsed.peer_id} in shard {index} of level {level}: not its "
                         f"shard, or not in the schema's types")
            return False
        problem = record_problem(parsed, get_dht_time(), self.ttl_s, self.policy, signer, record.expiration_time)
        if problem is not None:
            logger.debug(f"refusing a peer record of {parsed.peer_id}: {problem}")
        return problem is None

    @property
    def priority(self) -> int:
        return 5  # below RSASignatureValidator's 10: validated after it, on the value it stripped

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return other == self  # the same check twice is one; another (e.g. stricter) one is applied as well


@functools.lru_cache(maxsize=PARSED_REMEMBERED)
def _parsed_record(value: bytes) -> tuple[PeerRecord | None, bool]:
    """A stored value as a record (None: malformed), and whether it holds the schema's own types (`parsed.dict()`
    gives it back). Remembered by its bytes: a read gets each record from several nodes, and a peer reads its shards
    more often than records change; the returned record is shared, read only. Time-dependent checks are not here."""
    try:
        value_ = MSGPackSerializer.loads(value)
        parsed = PeerRecord.parse_obj(value_)
    except Exception:  # msgpack and pydantic raise many types; every one means a malformed record
        logger.debug("refusing a malformed peer record", exc_info=True)
        return None, False
    return parsed, parsed.dict() == value_


class RememberingSignatureValidator(RSASignatureValidator):
    """hivemind's signature check, its positive verdicts remembered by the record's digest (key, subkey, signed
    value, expiry: what the signature covers, so the verdict is a function of the digest alone). A read gets each
    record from several nodes, and RSA verification was an eighth of a DHT process's CPU in an 8-peer swarm.
    Refusals are not remembered: a flood of bad signatures costs what it did, and cannot evict good verdicts
    faster than any other new record."""

    def validate(self, record: DHTRecord) -> bool:
        digest = hashlib.blake2b(MSGPackSerializer.dumps(dataclasses.astuple(record)), digest_size=16).digest()
        with _SIGNATURES_LOCK:
            if digest in _VALID_SIGNATURES:
                _VALID_SIGNATURES.move_to_end(digest)
                return True
        if not super().validate(record):
            return False
        with _SIGNATURES_LOCK:
            _VALID_SIGNATURES[digest] = None
            while len(_VALID_SIGNATURES) > SIGNATURES_REMEMBERED:
                _VALID_SIGNATURES.popitem(last=False)
        return True


_VALID_SIGNATURES: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # per process, least recent first
_SIGNATURES_LOCK = threading.Lock()


def _new_signatures_lock() -> None:
    """A forked DHT process starts with a lock of its own: another thread may have held the parent's at the fork."""
    global _SIGNATURES_LOCK
    _SIGNATURES_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_signatures_lock)


def add_record_validators(dht: SwarmDHT, run_id: str, ttl_s: float,
                          admission: Admission | None = None) -> RSASignatureValidator:
    """Install this run's validators (the run's keys only: net/dht_keys.py; signature, schema,
    `PeerRecordValidator`); returns the signature validator, whose public key, that of the node's identity key
    (`dht.signing_key`), is the subkey of our record."""
    policy = admission.policy if admission is not None else AdmissionPolicy(run_id)
    signature_validator = RememberingSignatureValidator(dht.signing_key)
    dht.add_validators([RunKeysValidator(run_id), SchemaValidator(SwarmSchema, prefix=run_id), signature_validator,
                        PeerRecordValidator(run_id, ttl_s, policy), SubkeyBudget(run_id)])
    return signature_validator


def parse_records(raw: object, ttl_s: float, now: float, admission: Admission | None = None) -> list[PeerRecord]:
    """The live records of a DHT `get` result, silently dropping refused ones (`record_problem`: a bad record is
    not fatal); in a signed run, the peers of the records kept are noted as admitted."""
    value = getattr(raw, "value", None)
    if not isinstance(value, dict):
        return []
    policy = admission.policy if admission is not None else AdmissionPolicy("")
    records = []
    for subkey, entry in value.items():
        try:
            record = PeerRecord.parse_obj(entry.value)
        except Exception:  # pydantic raises ValidationError, bad types raise TypeError
            logger.debug("ignoring a malformed peer record", exc_info=True)
            continue
        # a subkey that names no signer came from a DHT without our validators (which refuse it): a test's stand-in
        signer = peer_id_of_signer(subkey) if isinstance(subkey, bytes) else None
        problem = record_problem(record, now, ttl_s, policy, signer, getattr(entry, "expiration_time", None))
        if problem is not None:
            logger.debug(f"ignoring the peer record of {record.peer_id}: {problem}")
        elif is_live(record, now, ttl_s):
            records.append(record)
            if admission is not None:
                admission.admit_(record.peer_id)
    by_peer: dict[str, PeerRecord] = {}
    keep_freshest_(by_peer, records)
    return sorted(by_peer.values(), key=lambda r: r.peer_id)


def keep_freshest_(known: dict[str, PeerRecord], records: list[PeerRecord]) -> None:
    """In place: `known` (peer id → record) keeps, for every peer, the record with the latest heartbeat."""
    for record in records:
        current = known.get(record.peer_id)
        if current is None or current.updated < record.updated:
            known[record.peer_id] = record


# hivemind's DHT hands each call to its process through one pipe, written without a lock; the heartbeat, the swarm
# watcher and the round loop call it from three threads, so each hand-over is serialised (waiting is not)
DHT_CALL_LOCK = threading.Lock()


def fetch_shards(dht: hivemind.DHT, run_id: str, shards: Iterable[Shard], ttl_s: float,
                 timeout_s: float = PATIENCE_S, admission: Admission | None = None,
                 one_holder: bool = False) -> dict[Shard, list[PeerRecord]]:
    """The live records (`parse_records`) of each shard whose read the DHT answered within `timeout_s`, all read at
    once (hivemind's own `get` waits without a bound, and a training loop must not hang on one lost reply); a
    warning when none answered. Each shard as every one of its holders has it, or with `one_holder` as one holder
    drawn at random has it (net/holder_read.py)."""
    futures = {}
    for shard in dict.fromkeys(shards):
        key = shard_key(run_id, *shard)
        with DHT_CALL_LOCK:
            futures[shard] = dht.run_coroutine(functools.partial(read_from_one_holder, key=key), return_future=True) \
                if one_holder else dht.get(key, latest=True, beam_size=KEY_BEAM, return_future=True)
    deadline = time.monotonic() + timeout_s
    found = {}
    for shard, future in futures.items():
        try:
            raw = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:  # the builtin TimeoutError from Python 3.11
            future.cancel()
            continue
        found[shard] = parse_records(raw, ttl_s, get_dht_time(), admission)
    if futures and not found:
        logger.warning(f"the DHT did not answer within {timeout_s:g} s; carrying on with the records read before")
    return found


# shards of each level that `fetch_peers` reads first: a level in use holds two records a shard or more
# (record_shards.py), and n records miss all of them with probability (1 − 4/2^L)^n, at most e^−8 (the first shard
# alone: e^−2, and 3 % for 12 records over 4 shards, as `status` missed them)
PROBED_SHARDS = 4


def fetch_peers(dht: hivemind.DHT, run_id: str, ttl_s: float, timeout_s: float = PATIENCE_S,
                admission: Admission | None = None) -> list[PeerRecord]:
    """Every live record of the run, as of now (what `status` lists): the first PROBED_SHARDS shards of every level
    are read, then every shard of the levels where they found records (net/record_shards.py); none when the DHT
    does not answer."""
    deadline = time.monotonic() + timeout_s
    probed = [(level, index) for level in range(MAX_SHARD_LEVEL + 1) for index in range(min(2**level, PROBED_SHARDS))]
    probes = fetch_shards(dht, run_id, probed, ttl_s, timeout_s, admission)
    in_use = sorted({level for (level, _), records in probes.items() if records})
    rest = [(level, index) for level in in_use for index in range(min(2**level, PROBED_SHARDS), 2**level)]
    found = fetch_shards(dht, run_id, rest, ttl_s, max(0.0, deadline - time.monotonic()), admission) if rest else {}
    by_peer: dict[str, PeerRecord] = {}
    for records in [*probes.values(), *found.values()]:
        keep_freshest_(by_peer, records)
    return sorted(by_peer.values(), key=lambda r: r.peer_id)


class Announcer:
    """Publishes this peer's record every `heartbeat_s` from a background thread until stopped.

    The training loop calls `update(...)` with new figures; the thread stores the latest record. A DHT store takes
    a round trip or more (tenths of a second on a loaded swarm), so `update(publish=True)` only wakes the
    thread: training never waits for the DHT. When the peer stops, the record stops being refreshed and expires
    after `record_ttl_s` for everyone else. The record is signed with the node's identity key; in a signed run
    it carries this peer's ticket (`admission.ticket`). It is stored in our shard at the level `shards` keeps
    (net/record_shards.py; shared with the peer's `SwarmWatcher`, which moves it).
    """

    def __init__(self, dht: SwarmDHT, run_id: str, record: PeerRecord, heartbeat_s: float, ttl_s: float,
                 admission: Admission | None = None, shards: RecordShards | None = None):
        self.dht, self.run_id, self.heartbeat_s, self.ttl_s = dht, run_id, heartbeat_s, ttl_s
        self.shards = shards or RecordShards(run_id, record.peer_id)
        self._validator = add_record_validators(dht, run_id, ttl_s, admission)
        if admission is not None and admission.ticket:
            record = record.copy(update=dict(ticket=admission.ticket))
        self._record = record
        self._stored_at: dict[Shard, float] = {}  # the shards our record was stored in, and when
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._publish_now = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="p2ptrain-announcer", daemon=True)

    def start(self) -> None:
        self.publish()
        self._thread.start()

    @property
    def subkey(self) -> bytes:
        """Our record's DHT subkey: the public half of the identity key that signs it."""
        return self._validator.local_public_key

    @property
    def stored_shards(self) -> list[Shard]:
        """The shards our record was stored in since we started (one, until the swarm outgrows a shard)."""
        return sorted(self._stored_at)

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

    def publish(self, timeout_s: float = PATIENCE_S, shards: Iterable[Shard] | None = None) -> bool:
        """Store our record now, in our shard (or in `shards`); whether the DHT confirmed every store within
        `timeout_s` (else they go on in the background)."""
        now = get_dht_time()
        with self._lock:
            self._record = self._record.copy(update=dict(updated=now))
            value = self._record.dict()
        targets = list(shards) if shards is not None else [self.shards.publish_shard()]
        try:
            futures = []
            for shard in targets:
                self._stored_at[shard] = now
                with DHT_CALL_LOCK:
                    futures.append(self.dht.store(shard_key(self.run_id, *shard), subkey=self.subkey, value=value,
                                                  expiration_time=now + self.ttl_s, beam_size=KEY_BEAM,
                                                  return_future=True))
            deadline = time.monotonic() + timeout_s
            return all([bool(f.result(timeout=max(0.0, deadline - time.monotonic()))) for f in futures])
        except Exception:  # a late store, or the DHT process shutting down: the next heartbeat tries again
            logger.debug("peer record not stored", exc_info=True)
            return False

    def leave(self, timeout_s: float = BRIEF_S) -> None:
        """Stop the heartbeat and store a last record saying we left (the others drop us at their next read), in
        every shard that may still hold our record, waiting at most `timeout_s` for the DHT to store it."""
        self.stop()
        self.update(phase=LEFT)
        now = get_dht_time()
        live = [shard for shard, stored in self._stored_at.items() if now - stored <= self.ttl_s]
        if not self.publish(timeout_s, live or None):
            logger.debug("the record saying this peer left was not stored in time: it expires after its TTL instead")

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._publish_now.wait(self.heartbeat_s)
            self._publish_now.clear()
            if not self._stop.is_set():
                self.publish(timeout_s=self.heartbeat_s)  # a store slowed by a silent node must not delay the next

    def stop(self) -> None:
        self._stop.set()
        self._publish_now.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.heartbeat_s + SETUP_FLOOR_S)


class SwarmWatcher:
    """The run's live records, re-read from the DHT every `refresh_s` by a background thread.

    The round loop asks for the swarm twice a round; a DHT read can take seconds on a loaded swarm, several times
    a small round's compute. `records()` answers from what the reads found instead (at
    most `refresh_s` plus one read old); only the first call, before any read finished, and calls that ask for
    the `current` records wait for the DHT.

    Reads are merged, not replaced: a record stands until its own expiry (`ttl_s` after its heartbeat), as it
    does in the DHT. One read that timed out or reached only some of the nodes (it may find none of the records)
    would otherwise leave the peer believing itself alone until the next read. With `admission`, reads keep its
    list of admitted peers current (`Admission.allows`). Which shards a read covers, `shards` says
    (net/record_shards.py): a background read, our own and one at random, each from one of its holders at random
    (net/holder_read.py); a `current` read, every shard of our level and the two next to it, from all its holders;
    every few reads and a read that found nobody, our shard at every level as well.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, ttl_s: float, refresh_s: float,
                 admission: Admission | None = None, shards: RecordShards | None = None):
        self.dht, self.run_id, self.ttl_s, self.refresh_s = dht, run_id, ttl_s, refresh_s
        self.admission = admission
        self.shards = shards or RecordShards(run_id, "")
        self._known: dict[str, PeerRecord] = {}
        self._read_once = False
        self._reads = 0
        self._lineage_due = False  # our shard at every level is to be read (LINEAGE_EVERY, or a read found nobody)
        self._alone = False  # the read that made it due found nobody: it draws another shard of every level too
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="p2ptrain-swarm-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def records(self, current: bool = False, timeout_s: float = PATIENCE_S) -> list[PeerRecord]:
        """The freshest record of every peer whose record has not expired and that did not leave, sorted by peer
        id. A `current` read waits at most `timeout_s` (the first read, PATIENCE_S): a DHT slowed by a
        silent node then leaves the records of the last read."""
        if current or not self._read_once:
            self.read_(self.shards.every_shard(), timeout_s if self._read_once else PATIENCE_S)
        now = get_dht_time()
        with self._lock:
            live = [r for r in self._known.values() if is_live(r, now, self.ttl_s)]
        return sorted(present(live), key=lambda r: r.peer_id)

    def read_(self, shards: list[Shard], timeout_s: float = PATIENCE_S, one_holder: bool = False) -> None:
        """Read `shards` and merge what they hold; tell `self.shards` how many fresh records of others each held.
        Every LINEAGE_EVERY reads, and after a read that found nobody but us, read our shard at every level as well
        (a swarm that split before we came, or part of which moved to a level we do not read); after one that found
        nobody, another shard of every level drawn at random too (`RecordShards.lineage`). `one_holder`: each
        shard from one of its holders at random (`fetch_shards`), as background reads do."""
        deadline = time.monotonic() + timeout_s
        found = fetch_shards(self.dht, self.run_id, shards, self.ttl_s, timeout_s, admission=self.admission,
                             one_holder=one_holder)
        me = self.shards.peer_id
        self._reads += 1
        alone = bool(found) and not any(r.peer_id != me for records in found.values() for r in records)
        self._lineage_due |= alone or self._reads % LINEAGE_EVERY == 0
        self._alone |= alone
        # within the same wait, when at least half of it is left; else at the next read (with what little was left,
        # its keys timed out and the read warned that the DHT did not answer, though the first keys had)
        lineage = self._lineage_due and deadline - time.monotonic() >= timeout_s / 2
        if lineage:
            missing = [shard for shard in self.shards.lineage(roaming=self._alone) if shard not in found]
            self._lineage_due = self._alone = False
            found.update(fetch_shards(self.dht, self.run_id, missing, self.ttl_s,
                                      max(0.0, deadline - time.monotonic()), self.admission, one_holder))
        freshest: dict[str, PeerRecord] = {}
        keep_freshest_(freshest, [r for records in found.values() for r in records])
        self.merge_(list(freshest.values()))
        # a peer that moved to another level leaves its older record behind until it expires: counted once, where
        # its latest record is; where it is now, only if refreshed within the last few heartbeats
        counted = {shard: [r for r in records if freshest[r.peer_id] is r and r.phase != LEFT and r.peer_id != me]
                   for shard, records in found.items()}
        fresh_after = get_dht_time() - FRESH_HEARTBEATS * self.refresh_s
        fresh = {shard: sum(r.updated >= fresh_after for r in records) for shard, records in counted.items()}
        self.shards.observe_({shard: len(records) for shard, records in counted.items()}, lineage, fresh)

    def merge_(self, records: list[PeerRecord]) -> None:
        """Keep each peer's freshest record; forget those expired RECENT_LIFETIMES lifetimes ago."""
        now = get_dht_time()
        with self._lock:
            keep_freshest_(self._known, records)
            self._known = {p: r for p, r in self._known.items() if is_live(r, now, RECENT_LIFETIMES * self.ttl_s)}
            self._read_once = True

    def recently_seen(self) -> list[PeerRecord]:
        """The freshest record of every peer live within RECENT_LIFETIMES record lifetimes that did not leave, as
        `records` sorts them: gossip's partners while no record stands (our DHT node stopped answering for a while:
        a loaded machine, a link that stalled), which an exchange with them verifies."""
        now = get_dht_time()
        with self._lock:
            recent = [r for r in self._known.values() if is_live(r, now, RECENT_LIFETIMES * self.ttl_s)]
        return sorted(present(recent), key=lambda r: r.peer_id)

    def _loop(self) -> None:
        # a look at the routing table runs in the DHT process beside the reads: its ping of an initial peer out of
        # reach (a cut) would otherwise hold our reads for the ping's whole time-out
        refill: MPFuture | None = None
        refill_at = time.monotonic()
        while not self._stop.is_set():
            if refill is not None and (refill.done() or time.monotonic() >= refill_at + PATIENCE_S):
                self._refilled(refill)
                refill = None
            if refill is None and time.monotonic() >= refill_at:
                refill_at = time.monotonic() + REFILL_EVERY_S
                try:
                    refill = self._start_refill()
                except Exception:  # as a read's: the next look tries again
                    logger.debug("the DHT's routing table not looked at", exc_info=True)
            try:
                self.read_(self.shards.refresh_shards(), one_holder=True)
            except Exception:  # the DHT process may be shutting down; the next refresh tries again
                logger.debug("swarm records not read", exc_info=True)
            self._stop.wait(self.refresh_s)

    def refill_routing_table(self) -> None:
        """Find the swarm again through the initial peers when our DHT node knows fewer than the key's holders
        (net/routing_refill.py), and wait for it; a DHT started without initial peers has nobody to ask."""
        refill = self._start_refill()
        if refill is not None:
            self._refilled(refill, PATIENCE_S)

    def _start_refill(self) -> MPFuture | None:
        """The DHT process's future of a refill (`refill_routing_table`), None without initial peers."""
        initial = initial_peer_ids(self.dht.initial_peers) if isinstance(self.dht, SwarmDHT) else []
        if not initial:
            return None
        return self.dht.run_coroutine(functools.partial(refill_routing_table, initial_peers=initial, least=KEY_BEAM),
                                      return_future=True)

    @staticmethod
    def _refilled(refill: MPFuture, wait_s: float = 0.0) -> None:
        """Log what a refill found (waiting `wait_s` for it); one that failed or is still running is let go."""
        try:
            before, after = refill.result(wait_s)
        except Exception:  # a time-out, the DHT process shutting down: the next look tries again
            logger.debug("the DHT's routing table not refilled", exc_info=True)
            return
        if before == 0 and after > 0:
            logger.info(f"the DHT node had lost every contact; it knows {after} node(s) again")
        elif after > before:
            logger.debug(f"the DHT node knew {before} node(s), {after} after asking the initial peers")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            # a daemon thread: a hung read must not hold up shutdown
            self._thread.join(timeout=self.refresh_s + BRIEF_S)


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
