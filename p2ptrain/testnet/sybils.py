"""The red team's cheap identities: one process announcing many peers of a run, each a record signed with a key of
its own, all through one DHT node.

Identities cost an RSA key each and nothing else: every record is well formed and signed by the peer id it names,
so every node stores it and every reader counts it. The records announce a round of the attacker's choice with a
heartbeat that keeps them live; behind them is no endpoint (a dial to one fails). Issue 31 measured 20 of them,
announcing a stale round, moving the quorum round of every honest DiLoCo peer (join_rules.py says what now counts).
"""

from __future__ import annotations

import threading

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from p2ptrain.net.dht import SwarmDHT
from p2ptrain.net.dht_keys import shard_index, shard_key
from p2ptrain.net.discovery import PROTOCOL_VERSION, PeerRecord, add_record_validators
from p2ptrain.net.identity import peer_id_of_signer

# keys handed to the DHT's process in one call: hivemind's pipe to it is read without blocking, so a message over
# PIPE_BUF (4 KiB, what Linux writes at once) can be read half-written and stops the process ("Resource temporarily
# unavailable"); a pickled key is 1.8 kB
KEYS_PER_MESSAGE = 1


class ManyKeysSigner(RecordValidatorBase):
    """Signs each record whose subkey names one of its keys with that key; checks nothing (the node's own signature
    validator checks every record). Plain data: hivemind pickles validators into its DHT process."""

    def __init__(self, keys: list[RSAPrivateKey]):
        self.signers = [RSASignatureValidator(key) for key in keys]

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        signer = next((s for s in self.signers if s.local_public_key in record.subkey), None)
        return record.value if signer is None else signer.sign_value(record)

    @property
    def priority(self) -> int:
        return 10  # as the signature validator's: signing comes after every validator that reads the value


class SybilRecords:
    """`count` identities of a run announcing round `round_` through `dht` (a node of the run) every `heartbeat_s`
    until `stop()`, with `fingerprint` (the run's model, or peers leave them out), each in its shard of `level`
    (net/record_shards.py; 0: the one peers key)."""

    def __init__(self, dht: SwarmDHT, run_id: str, count: int, round_: int, fingerprint: str, ttl_s: float,
                 heartbeat_s: float, level: int = 0):
        self.dht, self.run_id, self.round, self.ttl_s, self.heartbeat_s = dht, run_id, round_, ttl_s, heartbeat_s
        self.level = level
        keys = [RSAPrivateKey() for _ in range(count)]
        self.subkeys = [RSASignatureValidator(key).local_public_key for key in keys]
        self.peer_ids = [peer_id_of_signer(subkey) or "" for subkey in self.subkeys]
        add_record_validators(dht, run_id, ttl_s)
        for first in range(0, count, KEYS_PER_MESSAGE):
            dht.add_validators([ManyKeysSigner(keys[first:first + KEYS_PER_MESSAGE])])
        self.fingerprint = fingerprint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="p2ptrain-sybils", daemon=True)

    def start(self) -> SybilRecords:
        self.publish()
        self._thread.start()
        return self

    def publish(self) -> int:
        """Store every identity's record once, with a fresh heartbeat; how many the DHT confirmed."""
        now = get_dht_time()
        futures = [self.dht.store(shard_key(self.run_id, self.level, shard_index(peer_id, self.level)), subkey=subkey,
                                  expiration_time=now + self.ttl_s,
                                  value=PeerRecord(peer_id=peer_id, round=self.round, inner_step=0, phase="inner",
                                                   round_eta=now + 60.0, fingerprint=self.fingerprint,
                                                   protocol=PROTOCOL_VERSION, updated=now).dict(),
                                  return_future=True)
                   for peer_id, subkey in zip(self.peer_ids, self.subkeys, strict=True)]
        return sum(bool(future.result(timeout=30)) for future in futures)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.publish()
