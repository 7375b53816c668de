"""The red team's cheap identities: one process announcing many peers of a run, each a record signed with a key of
its own, all through one DHT node.

Identities cost an RSA key each and nothing else: every record is well formed and signed by the peer id it names,
so every node stores it and every reader counts it. The records announce a round of the attacker's choice with a
heartbeat that keeps them live; behind them is no endpoint (a dial to one fails). Issue 31 measured 20 of them,
announcing a stale round, moving the quorum round of every honest DiLoCo peer (join_rules.py says what now counts).

`StallingIdentities` put a libp2p node behind each: it takes every gossip offer, says it holds it for its next
round or says nothing, and never answers, so each costs an initiator that draws it the exchange's deadline
(docs/threat-model.md says what that now comes to: a 'held' nobody granted is banned, silence costs a set-up floor).
Serving state too, each takes a joiner's download and sends nothing: a chunk deadline for the first of its host.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from p2ptrain.net.dht import NetworkConfig, SwarmDHT, start_dht
from p2ptrain.net.dht_keys import shard_index, shard_key
from p2ptrain.net.discovery import PROTOCOL_VERSION, PeerRecord, add_record_validators
from p2ptrain.net.event_loop import BackgroundLoop
from p2ptrain.net.exchange import GossipServicer
from p2ptrain.net.identity import fresh_identity_path, load_identity_key, peer_id_of_signer
from p2ptrain.net.inbound_exchange import InboundExchange
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.responder_limits import ResponderLimits
from p2ptrain.net.state_sharing import StateServer

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
                 heartbeat_s: float, level: int = 0, keys: list[RSAPrivateKey] | None = None,
                 claims: dict[str, object] | None = None):
        """`keys`: the identities' own (of libp2p nodes that answer as them); fresh ones if None, behind which is
        no endpoint. `claims`: other fields of their records (a link speed, a reach)."""
        self.dht, self.run_id, self.round, self.ttl_s, self.heartbeat_s = dht, run_id, round_, ttl_s, heartbeat_s
        self.level, self.claims = level, dict(claims or {})
        keys = keys if keys is not None else [RSAPrivateKey() for _ in range(count)]
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
                                                   protocol=PROTOCOL_VERSION, updated=now,
                                                   **self.claims).dict(),  # type: ignore[arg-type]
                                  return_future=True)
                   for peer_id, subkey in zip(self.peer_ids, self.subkeys, strict=True)]
        return sum(bool(future.result(timeout=30)) for future in futures)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.publish()


# how long a stalling identity holds an offer: past any initiator's deadline, and the stream is then closed
STALL_S = 600.0
# what it grants initiators at once: no responder's limits (an attacker keeps none), but a bound for this process
UNLIMITED = ResponderLimits(per_peer=10**6, per_host=10**6, total=10**6)


class _Stall:
    """An `ExchangeHandler` that holds every offer and never opens one."""

    def __init__(self, namespace: str):
        self.namespace, self.max_payload_bytes, self.chunk_timeout_s = namespace, 1 << 30, STALL_S
        self.reputation = Reputation()

    def hold(self, header: dict[str, Any]) -> Awaitable[Any] | None:
        return asyncio.sleep(STALL_S)

    def open(self, header: dict[str, Any]) -> str:
        return "busy"


class _SilentServicer(GossipServicer):
    """Takes an offer's stream and says nothing on it: not 'held', not a refusal."""

    async def _respond(self, inbound: InboundExchange) -> AsyncIterator[averaging_pb2.DownloadData]:
        await asyncio.sleep(STALL_S)
        return
        yield  # an async generator, as the servicer's


_SilentServicer.__name__ = GossipServicer.__name__  # hivemind names a handler by its class: dialled as the peers'


class _SilentStateServer(StateServer):
    """Takes a state download's stream, or a sketch request, and says nothing on it."""

    def __init__(self) -> None:
        super().__init__(lambda: None)

    async def rpc_download_state(self, request: averaging_pb2.DownloadData,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        await asyncio.sleep(STALL_S)
        return
        yield  # an async generator, as the server's

    async def rpc_state_sketch(self, request: averaging_pb2.DownloadData,
                               context: P2PContext) -> averaging_pb2.DownloadData:
        await asyncio.sleep(STALL_S)
        return averaging_pb2.DownloadData()


_SilentStateServer.__name__ = StateServer.__name__


class StallingIdentities:
    """`count` libp2p nodes of run `run_id` (through `initial_peers`, as `network` says to listen) that take
    gossip offers of each of `kinds` and never answer, and their records (`SybilRecords`: `claims`, e.g. a fast
    link, so that the slow-link rule does not leave them out) through a DHT node of their own, until `stop()`.
    `says_held`: they say they hold each offer (the protocol's 'held') before they fall silent. `serves_state`:
    they take state downloads and sketch requests too, and say nothing on them."""

    def __init__(self, network: NetworkConfig, initial_peers: Sequence[str], run_id: str, count: int,
                 fingerprint: str, ttl_s: float, heartbeat_s: float, kinds: Sequence[str] = ("gasloc",),
                 claims: dict[str, object] | None = None, round_: int = 0, says_held: bool = True,
                 serves_state: bool = False):
        self.loop = BackgroundLoop("p2ptrain-stalling")
        self.p2ps: list[P2P] = []
        self.dht: SwarmDHT | None = None
        self.records: SybilRecords | None = None
        try:
            paths = [fresh_identity_path() for _ in range(count)]
            for path in paths:
                self.p2ps.append(self.loop.run(self._node(network, initial_peers, path, run_id, kinds, says_held,
                                                          serves_state), timeout=60))
            self.dht = start_dht(network, initial_peers)
            self.records = SybilRecords(self.dht, run_id, count, round_, fingerprint, ttl_s, heartbeat_s,
                                        keys=[load_identity_key(path) for path in paths], claims=claims).start()
        except BaseException:
            self.stop()
            raise
        self.peer_ids = [p2p.peer_id.to_base58() for p2p in self.p2ps]

    @staticmethod
    async def _node(network: NetworkConfig, initial_peers: Sequence[str], identity_path: str, run_id: str,
                    kinds: Sequence[str], says_held: bool, serves_state: bool) -> P2P:
        p2p = await P2P.create(identity_path=identity_path, initial_peers=list(initial_peers),
                               host_maddrs=list(network.host_maddrs), nat_port_map=network.nat_port_map,
                               auto_nat=network.auto_nat, use_relay=network.use_relay)
        servicer_type = GossipServicer if says_held else _SilentServicer
        for kind in kinds:
            stall = _Stall(f"{run_id}.{kind}")
            await servicer_type(stall, stall.max_payload_bytes, STALL_S, limits=UNLIMITED).add_p2p_handlers(
                p2p, namespace=stall.namespace)
        if serves_state:
            await _SilentStateServer().add_p2p_handlers(p2p, namespace=run_id)
        return p2p

    def stop(self) -> None:
        if self.records is not None:
            self.records.stop()
        if self.dht is not None:
            self.dht.shutdown()
        for p2p in self.p2ps:
            self.loop.run(p2p.shutdown(), timeout=30)
        self.loop.stop()
