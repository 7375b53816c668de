"""The keys a run stores in the DHT, and the validator by which a node of the run stores no other.

A run's peers (and `status`) store and serve only:
- `{run_id}_peers`: the peer records (net/discovery.py), and, once a swarm outgrows one key, its shards
  `{run_id}_peers.{level}.{index}` (net/record_shards.py);
- `{run_id}_data.{block}`: the claims on the dataset's pieces (net/data_claims.py), `PIECES_PER_KEY` subkeys a key
  (a subkey is the piece's place in its block, the value the claimant's id);
- with `sync.allreduce_transport: hivemind`, the group keys of hivemind's averagers: `{run_id}_{name}.0b{bits}`
  for each averager name (`AVERAGER_NAMES`) and every `ROUND_BITS`-bit string (net/allreduce.py writes the round
  into the bits; hivemind reshuffles them after a group forms, within the same length).
Left to itself, a hivemind DHT node stores whatever another node sends it, under any key, as large and for as long
as the sender says: 400 values of 1 MiB under random keys took 443 MB of one peer's memory. `RunKeysValidator`
refuses a record under any other key, a value larger than `MAX_VALUE_BYTES` (group keys: `MAX_GROUP_VALUE_BYTES`), a
subkey larger than `MAX_SUBKEY_BYTES` (group keys: `MAX_GROUP_SUBKEY_BYTES`), and one set to expire more than
`MAX_LIFETIME_S` ahead. Identities are cheap, and each may add a subkey to the peers key or a group key:
`SubkeyBudget` holds each key to a number of live subkeys (`MAX_PEER_RECORDS` over the peers key and its shards
together, `MAX_SHARD_RECORDS` in one shard, `MAX_GROUP_RECORDS`; a claim key's subkeys are its pieces), refusing a new
one while the key is full. So a flood costs a node at most its run's keys, full: 4,096 peer records of ≤ 17 KiB
(68 MiB; a real one is under 3 kB), 512 group keys of 64 records of ≤ 320 bytes
(10 MiB) and 1,024 claim blocks of 64 claims (~10 MiB). Every node of a run installs both, its bootstrap included
(started with the run's `--run-id`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2ptrain.timing import MAX_CLOCK_SKEW_S

# rounds are told apart modulo 2**ROUND_BITS in the group key: a group's records live seconds, so rounds 256 apart
# never meet, and every key of a run can be listed (2 averagers x 256 keys)
ROUND_BITS = 8
# how many nodes near a key one of our reads or stores visits (hivemind's `beam_size`; its default, its bucket size
# 20, made each read and each store of a record ask every node of a swarm of up to 21 and 20 of a larger one). A
# key's values live on its `num_replicas` (hivemind's default, 5) nearest nodes, which a beam of as many finds
KEY_BEAM = 5
AVERAGER_NAMES = ("diloco", "mix2")  # DiLoCo's all-reduce, Factored's Mix2 (sync/build.py)
# the largest value a run stores: a signed peer record with a ticket is under 3 kB (signature and public key included)
MAX_VALUE_BYTES = 16 * 1024
# the farthest ahead a record may be set to expire (a peer record's TTL is checked, more tightly, by its own
# validator; the averagers' group records live for one matchmaking, seconds)
MAX_LIFETIME_S = 3600.0
MAX_SUBKEY_BYTES = 1024  # a peer record's subkey holds its signer's RSA public key (~400 bytes)
# a group record (hivemind's matchmaking) is a peer id under a bool: 40 and 1 bytes
MAX_GROUP_SUBKEY_BYTES, MAX_GROUP_VALUE_BYTES = 64, 256
MAX_PEER_RECORDS = 4096  # live subkeys of the peers key: a swarm of thousands, and a bound on a Sybil flood
MAX_GROUP_RECORDS = 64  # live subkeys of one group key: the averagers looking for a group in one round
PIECES_PER_KEY = 64  # subkeys of one data claim key: reading a block is one small record set
MAX_BLOCKS = 1024  # data claim keys of a run: 65,536 pieces (corpus.MAX_PIECES)
MAX_CLAIMANT_CHARS = 128  # a claim's value, a peer id (52 characters)
MAX_SHARD_LEVEL = 8  # the peers key splits into at most 2^8 = 256 shards (net/record_shards.py)
MAX_SHARD_RECORDS = 512  # live subkeys of one shard: 8 × the records a shard is kept near, a bound on a flood of one


def peers_key(run_id: str) -> str:
    return f"{run_id}_peers"


def shard_index(peer_id: str, level: int) -> int:
    """The shard of `peer_id` at `level`: the low `level` bits of a hash of its id (shards nest level to level)."""
    digest = hashlib.blake2b(peer_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**level


def shard_key(run_id: str, level: int, index: int) -> str:
    """The DHT key of a shard of the peer records; level 0's one shard is the run's peers key."""
    return peers_key(run_id) if level == 0 else f"{peers_key(run_id)}.{level}.{index}"


@functools.lru_cache(maxsize=16)
def shard_key_ids(run_id: str) -> dict[bytes, tuple[int, int]]:
    """Every shard key's DHT id (the peers key's included, as level 0), with its (level, index)."""
    return {key_id(shard_key(run_id, level, index)): (level, index)
            for level in range(MAX_SHARD_LEVEL + 1) for index in range(2**level)}


def claims_key(run_id: str, block: int) -> str:
    return f"{run_id}_data.{block}"


def averager_prefix(run_id: str, name: str) -> str:
    if name not in AVERAGER_NAMES:  # its group records would be refused by every node of the run
        raise ValueError(f"averager {name!r} is not one of the run's DHT keys {AVERAGER_NAMES}")
    return f"{run_id}_{name}"


def round_group_bits(round_: int) -> str:
    return format(round_ % 2**ROUND_BITS, f"0{ROUND_BITS}b")


@functools.lru_cache(maxsize=16)
def run_key_ids(run_id: str) -> frozenset[bytes]:
    """The DHT ids (hashes) of every key the run stores."""
    return frozenset(shard_key_ids(run_id)) | group_key_ids(run_id) | claim_key_ids(run_id)


@functools.lru_cache(maxsize=16)
def group_key_ids(run_id: str) -> frozenset[bytes]:
    """The DHT ids of the group keys of the run's averagers (hivemind's matchmaking)."""
    return frozenset(key_id(f"{averager_prefix(run_id, name)}.0b{round_group_bits(r)}")
                     for name in AVERAGER_NAMES for r in range(2**ROUND_BITS))


@functools.lru_cache(maxsize=64)
def key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


@functools.lru_cache(maxsize=16)
def claim_key_ids(run_id: str) -> frozenset[bytes]:
    """The DHT ids of the run's data claim keys."""
    return frozenset(DHTID.generate(source=claims_key(run_id, block)).to_bytes() for block in range(MAX_BLOCKS))


def is_claim_record(record: DHTRecord) -> bool:
    """Whether a record of a claim key has a claim's shape: a subkey in [0, PIECES_PER_KEY), a short string."""
    try:
        subkey, value = MSGPackSerializer.loads(record.subkey), MSGPackSerializer.loads(record.value)
    except Exception:  # msgpack raises many types; every one means a malformed record
        return False
    return (type(subkey) is int and 0 <= subkey < PIECES_PER_KEY
            and isinstance(value, str) and 0 < len(value) <= MAX_CLAIMANT_CHARS)


@dataclasses.dataclass
class RunKeysValidator(RecordValidatorBase):
    """hivemind validator: only the run's keys, values of at most MAX_VALUE_BYTES, lifetimes of at most
    MAX_LIFETIME_S (plus the clock skew allowed between peers), data claims of a claim's shape. Plain data:
    hivemind pickles validators into its DHT process."""

    # only the id travels to hivemind's process, where the key ids are listed: its pipe breaks on messages of tens
    # of KiB, and the pickled list is 12 KB
    run_id: str

    def validate(self, record: DHTRecord) -> bool:
        group = record.key in group_key_ids(self.run_id)
        return (record.key in run_key_ids(self.run_id)
                and len(record.value) <= (MAX_GROUP_VALUE_BYTES if group else MAX_VALUE_BYTES)
                and len(record.subkey) <= (MAX_GROUP_SUBKEY_BYTES if group else MAX_SUBKEY_BYTES)
                and record.expiration_time <= get_dht_time() + MAX_LIFETIME_S + MAX_CLOCK_SKEW_S
                and (record.key not in claim_key_ids(self.run_id) or is_claim_record(record)))

    @property
    def priority(self) -> int:
        return 20  # before the signature validator (10): a foreign key costs no signature check

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return other == self


@dataclasses.dataclass
class SubkeyBudget(RecordValidatorBase):
    """hivemind validator: at most `peer_records` live subkeys under the peers key and its shards together (and
    `shard_records` in one shard), and `group_records` under each group key; a new subkey of a full key is refused
    until one of its subkeys expires, a known one is always taken (a heartbeat renews its record). It counts every
    record it passes, stored or read (a read of a full key's dictionary from another node is refused whole, as
    hivemind refuses a dictionary with any invalid record), so it runs last, on records every other validator
    passed: an unsigned or foreign record takes no place. State lives in hivemind's DHT process, where validators
    are unpickled: it starts empty there."""

    run_id: str
    peer_records: int = MAX_PEER_RECORDS
    group_records: int = MAX_GROUP_RECORDS
    shard_records: int = MAX_SHARD_RECORDS
    live: dict[bytes, dict[bytes, float]] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def validate(self, record: DHTRecord) -> bool:
        shards = shard_key_ids(self.run_id)
        if record.key not in shards and record.key not in group_key_ids(self.run_id):
            return True
        subkeys = self.live.setdefault(record.key, {})
        if record.key in shards:  # one budget over the peer records' keys, and one per shard
            budget = self.peer_records if shards[record.key][0] == 0 else self.shard_records
            family = [key for key in self.live if key in shards]
        else:
            budget, family = self.group_records, []
        if record.subkey not in subkeys and not self._room(record.key, budget, family):
            now = get_dht_time()
            for key in [record.key, *family]:
                self.live[key] = {s: expires for s, expires in self.live[key].items() if expires >= now}
            if not self._room(record.key, budget, family):
                return False
        subkeys = self.live[record.key]
        subkeys[record.subkey] = max(subkeys.get(record.subkey, record.expiration_time), record.expiration_time)
        return True

    def _room(self, key: bytes, budget: int, family: list[bytes]) -> bool:
        """Whether `key` may take one more subkey: under its own budget, and its family's (the peer records' keys)."""
        return (len(self.live[key]) < budget
                and (not family or sum(len(self.live[k]) for k in family) < self.peer_records))

    @property
    def priority(self) -> int:
        return 0  # the last: below the peer records' validator (5), after the signature's (10)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return other == self
