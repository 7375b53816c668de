"""Reading a key from one of its holders, drawn at random: what the swarm watcher's background reads do.

A key's values live on its KEY_BEAM nearest nodes, its holders. hivemind's read for the latest value asks every
holder, each answering with its whole copy, and every reader asks the same ones: a peer downloaded 5 copies of its
shard's records a heartbeat, and each holder served a copy to every reader, 11-20 Mbit/s for the busiest peer of a
32- to 1,024-peer swarm (benchmarks/discovery_scale.py). Here one holder answers a read, a different one at random
each time. Background reads are merged until the records expire (net/discovery.py), so a record one holder lacks
comes in with a read of another; reads that must see the round's latest records (an all-reduce's) still ask every
holder. It runs in the DHT's own process (`hivemind.DHT.run_coroutine`), on its node's routing table and protocol.
"""

from __future__ import annotations

import random
from typing import Any

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils import ValueWithExpiration

from p2ptrain.net.dht_keys import KEY_BEAM

# nodes a read asks at most: in a swarm whose routing tables do not hold the key's holders, each answer names nodes
# nearer to the key, as in a Kademlia lookup (log2 of a 1,000-node swarm is 10; most hops halve the distance more)
MAX_ASKED = 12


async def read_from_one_holder(_dht: object, node: Any, key: str) -> ValueWithExpiration | None:
    """`key`'s value as one of its holders has it, as hivemind's `get` would return it; None when no holder has it
    or none answered. Asks one of the KEY_BEAM nodes nearest to the key that this node knows (ourselves among
    them: then our own storage), at random; a node that has no value names nearer ones, asked in turn. A holder
    that has no value, and knows none nearer to the key than the holders, ends the read: the key is empty."""
    key_id = DHTID.generate(source=key)
    protocol = node.protocol
    known = {node_id: peer for node_id, peer in protocol.routing_table.get_nearest_neighbors(
        key_id, KEY_BEAM, exclude=node.node_id)}
    asked: set[DHTID] = set()

    def holders() -> list[DHTID]:  # the KEY_BEAM nodes nearest to the key that we know of, ourselves included
        return sorted([*known, node.node_id], key=key_id.xor_distance)[:KEY_BEAM]

    for _ in range(MAX_ASKED):
        candidates = [node_id for node_id in holders() if node_id not in asked]
        if not candidates:
            return None
        holder = random.choice(candidates)
        asked.add(holder)
        if holder == node.node_id:
            found, named = protocol.storage.get(key_id), {}
        else:
            response = await protocol.call_find(known[holder], [key_id])
            if not response:  # did not answer: another holder
                continue
            found, named = response[key_id]
        if found is not None:
            return _loaded(protocol, key_id, found)
        known.update((node_id, peer) for node_id, peer in named.items() if node_id != node.node_id)
        if holder in holders():
            return None  # a holder, by what it knows too, without the key
    return None


def _loaded(protocol: DHTProtocol, key_id: DHTID, found: ValueWithExpiration) -> ValueWithExpiration:
    """A holder's value as hivemind's `get` returns it: each record's value without its signature, deserialised."""

    def loads(subkey_bytes: bytes, value_bytes: bytes, expiration_time: float) -> object:
        if protocol.record_validator is not None:
            value_bytes = protocol.record_validator.strip_value(
                DHTRecord(key_id.to_bytes(), subkey_bytes, value_bytes, expiration_time))
        return protocol.serializer.loads(value_bytes)

    if isinstance(found.value, DictionaryDHTValue):
        return ValueWithExpiration({
            subkey: ValueWithExpiration(loads(protocol.serializer.dumps(subkey), value, expiration), expiration)
            for subkey, (value, expiration) in found.value.items()}, found.expiration_time)
    return ValueWithExpiration(loads(DHTProtocol.IS_REGULAR_VALUE, found.value, found.expiration_time),
                               found.expiration_time)
