"""Reading a key from its holders: from one drawn at random (what the swarm watcher's background reads do), or from
all of them (a read that must see the round's latest records: an all-reduce's).

A key's values live on its KEY_BEAM nearest nodes, its holders. hivemind's read for the latest value asks every
holder, each answering with its whole copy, and every reader asks the same ones: a peer downloaded 5 copies of its
shard's records a heartbeat, and each holder served a copy to every reader, 11-20 Mbit/s for the busiest peer of a
32- to 1,024-peer swarm (benchmarks/discovery_scale.py). Here one holder answers a background read, a different one
at random each time. Background reads are merged until the records expire (net/discovery.py), so a record one holder
lacks comes in with a read of another.

A holder on a slow link answers late, and hivemind waits for it up to its request timeout (3 s, a DiLoCo read's
whole patience): with one DiLoCo member on 64 kbit/s among a key's holders, every read of that key timed out on the
fast members (issue 31). Here a holder that has not answered within HEDGE_S is asked beside another (one holder),
a read of all holders ends a grace after most of them answered (every holder keeps every record of its key), and a
holder that did not answer in time is drawn after the others, and not waited for, for a while (`SilentHolders`).

Both run in the DHT's own process (`hivemind.DHT.run_coroutine`), on its node's routing table and protocol.
"""

from __future__ import annotations

import asyncio
import random
import time
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
# a holder that has not answered a one-holder read by then is asked beside another: a loopback or home-link holder
# answers in milliseconds, a loaded 2-core machine's within about a second (the request timeout stays hivemind's)
HEDGE_S = 1.0
# a read of every holder waits for the rest, once more than half of those asked answered, as long again as that
# took, within these bounds: a holder that answers late every time (a 64 kbit/s member's, answering in 1-2 s) held
# each DiLoCo read for all of a fixed 1 s (rounds of 0.7 s took 1.5-2.5 s on the netns testnet)
MIN_GRACE_S, GRACE_S = 0.25, 1.0
# a holder that did not answer is drawn after the others for this long, twice as long for each silence in a row
SILENT_S, MAX_SILENT_S = 10.0, 300.0
MAX_REMEMBERED = 256  # silent holders remembered at most (node ids are free): the oldest are forgotten first

Answer = tuple[ValueWithExpiration | None, dict[DHTID, Any]]  # a holder's value (None: it has none), nearer nodes


class SilentHolders:
    """Holders that did not answer a read of ours lately: each is drawn after those that did, until its time is up
    (SILENT_S, doubled for each silence in a row, up to MAX_SILENT_S); an answer forgets it."""

    def __init__(self) -> None:
        self.silences: dict[DHTID, tuple[int, float]] = {}  # node → (silences in a row, drawn last until)

    def silent_(self, holder: DHTID, now: float) -> None:
        count = self.silences.pop(holder, (0, 0.0))[0] + 1
        self.silences[holder] = count, now + min(MAX_SILENT_S, SILENT_S * 2 ** (count - 1))
        while len(self.silences) > MAX_REMEMBERED:
            del self.silences[next(iter(self.silences))]

    def answered_(self, holder: DHTID) -> None:
        self.silences.pop(holder, None)

    def lately(self, holder: DHTID, now: float) -> bool:
        """Whether `holder` is silent lately (drawn last, not waited for)."""
        return self.silences.get(holder, (0, 0.0))[1] > now

    def draw(self, candidates: list[DHTID], now: float) -> DHTID:
        """One of `candidates` at random, among those not silent lately if there are any."""
        heard = [c for c in candidates if not self.lately(c, now)]
        return random.choice(heard or candidates)


SILENT_HOLDERS = SilentHolders()  # one per DHT process: what its node's reads learnt


class HolderRead:
    """One read of `key`: the nodes nearest to it that we know (the KEY_BEAM nearest are its holders, ourselves
    among them: then our own storage answers), those asked, and the requests in flight."""

    def __init__(self, node: Any, key: str):
        self.node, self.protocol, self.key_id = node, node.protocol, DHTID.generate(source=key)
        self.known: dict[DHTID, Any] = dict(self.protocol.routing_table.get_nearest_neighbors(
            self.key_id, KEY_BEAM, exclude=node.node_id))
        self.asked: set[DHTID] = set()
        self.asking: dict[asyncio.Future, DHTID] = {}

    def holders(self) -> list[DHTID]:
        """The KEY_BEAM nodes nearest to the key that we know of, ourselves included."""
        return sorted([*self.known, self.node.node_id], key=self.key_id.xor_distance)[:KEY_BEAM]

    def unasked(self) -> list[DHTID]:
        return [h for h in self.holders() if h not in self.asked] if len(self.asked) < MAX_ASKED else []

    def ask_(self, holder: DHTID) -> Answer | None:
        """Ask `holder`: our own storage's answer at once, another node's later (`answers`)."""
        self.asked.add(holder)
        if holder == self.node.node_id:
            return self.protocol.storage.get(self.key_id), {}
        self.asking[asyncio.ensure_future(self.protocol.call_find(self.known[holder], [self.key_id]))] = holder
        return None

    async def answers(self, timeout_s: float | None) -> list[tuple[DHTID, Answer | None]]:
        """The requests that ended within `timeout_s` (None: the first to end): each holder's answer, None for one
        that did not answer. The nodes an answer names nearer to the key join those we know."""
        if not self.asking:
            return []
        done, _ = await asyncio.wait(self.asking, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        ended: list[tuple[DHTID, Answer | None]] = []
        for request in done:
            holder = self.asking.pop(request)
            response = None if request.cancelled() or request.exception() else request.result()
            if not response or self.key_id not in response:
                SILENT_HOLDERS.silent_(holder, time.monotonic())
                ended.append((holder, None))
                continue
            SILENT_HOLDERS.answered_(holder)
            found, named = response[self.key_id]
            self.known.update((n, peer) for n, peer in named.items() if n != self.node.node_id)
            ended.append((holder, (found, named)))
        return ended

    def close(self) -> None:
        """The read is over: requests still in flight are cancelled, their holders noted as silent (they did not
        answer within what the read gave them; one silent lately already was not waited for, and stays as it is)."""
        now = time.monotonic()
        for request, holder in self.asking.items():
            request.cancel()
            if not SILENT_HOLDERS.lately(holder, now):
                SILENT_HOLDERS.silent_(holder, now)
        self.asking.clear()


async def read_from_one_holder(_dht: object, node: Any, key: str) -> ValueWithExpiration | None:
    """`key`'s value as one of its holders has it, as hivemind's `get` would return it; None when no holder has it
    or none answered. Asks one of the holders this node knows at random (not one silent lately, if it can), and
    another beside it when it has not answered within HEDGE_S; a node that has no value names nearer ones, asked in
    turn. A holder that has no value, and knows none nearer to the key than the holders, ends the read: the key is
    empty."""
    read = HolderRead(node, key)
    try:
        while True:
            candidates = read.unasked()
            if candidates:
                holder = SILENT_HOLDERS.draw(candidates, time.monotonic())
                own = read.ask_(holder)
                ended = [(holder, own)] if own is not None else await read.answers(HEDGE_S)
            elif read.asking:
                ended = await read.answers(None)
            else:
                return None
            for holder, answer in ended:
                if answer is None:  # did not answer: another holder
                    continue
                if answer[0] is not None:
                    return _loaded(read.protocol, read.key_id, answer[0])
                if holder in read.holders():
                    return None  # a holder, by what it knows too, without the key
    finally:
        read.close()


async def read_from_holders(_dht: object, node: Any, key: str) -> ValueWithExpiration | None:
    """`key`'s value merged from all its holders (a dictionary's entries, each the latest of any holder's, as
    hivemind's `get(latest=True)` merges them); None when no holder has it. Every holder is asked at once (and nodes
    their answers name nearer to the key, up to MAX_ASKED); once more than half of those asked answered, the read
    ends after a grace (as long again as that took, within MIN_GRACE_S and GRACE_S), at once if those left are silent
    lately (`SilentHolders`): a silent or slow holder costs the read that grace, not the request timeout, and
    nothing while it stays silent."""
    read, started = HolderRead(node, key), time.monotonic()
    found: list[ValueWithExpiration] = []
    answered, most_at, grace_s = 0, None, GRACE_S
    try:
        while True:
            for holder in read.unasked():
                own = read.ask_(holder)
                if own is not None:
                    answered += 1
                    found += [own[0]] if own[0] is not None else []
            if not read.asking:
                break  # every holder asked has answered, or ended without an answer
            now = time.monotonic()
            if most_at is None and 2 * answered > len(read.asked):
                most_at, grace_s = now, min(GRACE_S, max(MIN_GRACE_S, now - started))
            # once most answered, holders silent lately get no grace: their answers would come late if at all (before
            # that, every holder is waited for: holders cut short under a loaded start had reads end with our own
            # storage's copy and one other, and a peer begin its first round alone)
            if most_at is not None and (now >= most_at + grace_s or all(
                    SILENT_HOLDERS.lately(holder, now) for holder in read.asking.values())):
                break
            for _, answer in await read.answers(None if most_at is None else most_at + grace_s - now):
                if answer is not None:
                    answered += 1
                    found += [answer[0]] if answer[0] is not None else []
    finally:
        read.close()
    merged = _merged(found)
    return None if merged is None else _loaded(read.protocol, read.key_id, merged)


def _merged(values: list[ValueWithExpiration]) -> ValueWithExpiration | None:
    """Holders' copies as one: a dictionary holds each subkey's latest entry of any copy (a new object: a copy is
    our own storage's), a plain value is the latest; a dictionary wins over plain values, as a store makes it."""
    dictionaries = [v for v in values if isinstance(v.value, DictionaryDHTValue)]
    if not dictionaries:
        return sorted(values, key=_expiration)[-1] if values else None
    merged = DictionaryDHTValue()
    latest: dict[Any, tuple[Any, float]] = {}
    for copy in dictionaries:
        for subkey, (value, expiration) in copy.value.items():
            if subkey not in latest or expiration > latest[subkey][1]:
                latest[subkey] = value, expiration
    for subkey, (value, expiration) in latest.items():
        merged.store(subkey, value, expiration)
    return ValueWithExpiration(merged, max(copy.expiration_time for copy in dictionaries))


def _expiration(value: ValueWithExpiration) -> float:
    return float(value.expiration_time)


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
