"""net/holder_read.py on a node whose holders answer as the test says: a holder that does not answer costs a read
HEDGE_S (one holder) or GRACE_S (all holders), not hivemind's request timeout, and is drawn last for a while.
The real-node reads are in tests/test_records.py."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from p2ptrain.net import holder_read
from p2ptrain.net.holder_read import (
    GRACE_S,
    HEDGE_S,
    MAX_REMEMBERED,
    MIN_GRACE_S,
    SILENT_S,
    SilentHolders,
    read_from_holders,
    read_from_one_holder,
)

KEY = "records"
REQUEST_TIMEOUT_S = 3.0  # hivemind's: what a silent holder held a read for before


def copy_of(entries: dict[str, tuple[int, float]]) -> ValueWithExpiration:
    """A holder's copy of a dictionary key: subkey → (value, expires in s)."""
    now, value = get_dht_time(), DictionaryDHTValue()
    for subkey, (number, expires_in_s) in entries.items():
        value.store(subkey, MSGPackSerializer.dumps(number), now + expires_in_s)
    return ValueWithExpiration(value, value.latest_expiration_time)


class Holders:
    """A node and the holders it knows: `copies` maps a holder's name to its copy (None: it has none), `silent`
    names those that answer only after the request timeout, with nothing."""

    def __init__(self, copies: dict[str, ValueWithExpiration | None], silent: set[str], own: ValueWithExpiration | None
                 = None, late: dict[str, float] | None = None):
        self.ids = {name: DHTID.generate(source=name) for name in copies}
        self.copies, self.silent, self.asked = copies, silent, []
        self.late = late or {}  # holder → seconds it takes to answer
        self.node_id, self.own = DHTID.generate(source="reader"), own
        self.protocol = self
        self.routing_table, self.storage = self, self
        self.record_validator, self.serializer = None, MSGPackSerializer

    def get_nearest_neighbors(self, key_id: DHTID, k: int, exclude: DHTID) -> list[tuple[DHTID, str]]:
        return sorted(((i, name) for name, i in self.ids.items()), key=lambda x: key_id.xor_distance(x[0]))[:k]

    def get(self, key_id: DHTID) -> ValueWithExpiration | None:
        return self.own

    async def call_find(self, peer: str, keys: list[DHTID]) -> dict[DHTID, Any] | None:
        self.asked.append(peer)
        if peer in self.silent:
            await asyncio.sleep(REQUEST_TIMEOUT_S)
            return None
        await asyncio.sleep(self.late.get(peer, 0.0))
        return {keys[0]: (self.copies[peer], {})}


def timed(read: Any, holders: Holders) -> tuple[Any, float]:
    started = time.monotonic()
    found = asyncio.run(read(None, holders, KEY))
    return found, time.monotonic() - started


@pytest.fixture(autouse=True)
def fresh_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holder_read, "SILENT_HOLDERS", SilentHolders())


def test_a_one_holder_read_asks_another_holder_when_the_first_is_silent_and_draws_it_last_next_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    copy = copy_of({"a": (1, 60)})
    holders = Holders({"slow": copy, "fast": copy}, silent={"slow"})
    # the nearest holder other than the reader (whose own storage has no copy: a holder without the key ends a read)
    monkeypatch.setattr(holder_read.random, "choice",
                        lambda candidates: next((c for c in candidates if c != holders.node_id), candidates[0]))
    first = holders.get_nearest_neighbors(DHTID.generate(source=KEY), 5, holders.node_id)[0][1]
    holders.silent = {first}  # the holder drawn first is the silent one
    found, took = timed(read_from_one_holder, holders)
    assert found is not None and found.value["a"].value == 1
    assert holders.asked[0] == first and len(holders.asked) == 2
    assert HEDGE_S <= took < REQUEST_TIMEOUT_S  # asked beside it after HEDGE_S, not after the request timeout
    # it did not answer within the read: drawn last from now on
    holders.asked.clear()
    found, took = timed(read_from_one_holder, holders)
    assert found is not None and holders.asked == [next(n for n in holders.ids if n != first)] and took < HEDGE_S


def test_a_read_of_every_holder_merges_their_copies_and_waits_for_a_silent_one_only_its_grace() -> None:
    holders = Holders({"h1": copy_of({"a": (1, 60), "b": (2, 30)}), "h2": copy_of({"b": (3, 90)}),
                       "h3": copy_of({"c": (4, 60)}), "h4": None}, silent={"h4"}, own=copy_of({"a": (5, 10)}))
    found, took = timed(read_from_holders, holders)
    assert found is not None
    # each subkey's latest entry of any copy (ours included): "a" from h1 (60 s against our 10), "b" from h2
    assert {k: v.value for k, v in found.value.items()} == {"a": 1, "b": 3, "c": 4}
    assert sorted(holders.asked) == ["h1", "h2", "h3", "h4"]
    assert took < GRACE_S + 1.0 < REQUEST_TIMEOUT_S  # most answered at once: the silent one had its grace
    holders.asked.clear()
    found, took = timed(read_from_holders, holders)  # silent lately: asked, but not waited for
    assert found is not None and len(found.value) == 3 and "h4" in holders.asked and took < GRACE_S


def test_a_read_of_every_holder_waits_for_more_than_half_and_says_none_when_none_has_the_key() -> None:
    holders = Holders({"h1": None, "h2": None, "h3": None, "h4": None}, silent={"h3", "h4"})
    found, took = timed(read_from_holders, holders)
    # we and two of four answered, 3 of 5: more than half; the two silent ones had GRACE_S
    assert found is None and took < GRACE_S + 1.0
    holders = Holders({"h1": None, "h2": copy_of({"a": (1, 60)}), "h3": None, "h4": None}, silent={"h1", "h3", "h4"})
    found, took = timed(read_from_holders, holders)
    # 2 of 5 answered: not more than half, so the read waits for the silent ones' requests to end
    assert found is not None and found.value["a"].value == 1 and took >= REQUEST_TIMEOUT_S


def test_a_holder_that_answers_late_costs_a_read_a_short_grace_then_nothing():
    """A holder behind a saturated 64 kbit/s link answers, in 1-2 s: waited for a fixed second after the others, it
    slowed every DiLoCo read by that much. The grace is as long as the others took (at least MIN_GRACE_S); the late
    holder's copy is missed, the others' hold every record, and the next read does not wait for it at all."""
    copy = copy_of({"a": (1, 60)})
    holders = Holders({"h1": copy, "h2": copy, "h3": copy, "late": copy}, silent=set(), own=copy, late={"late": 2.0})
    found, took = timed(read_from_holders, holders)
    assert found is not None and list(found.value) == ["a"] and took < 2.0 - MIN_GRACE_S
    holders.late["late"] = 0.6  # faster now, but still silent lately: asked, not waited for
    found, took = timed(read_from_holders, holders)
    assert found is not None and holders.asked.count("late") == 2 and took < 0.6


def test_holders_silent_lately_are_waited_for_until_most_holders_answered():
    """Under a loaded start, holders cut short by earlier reads were all silent lately, and a read ended with our own
    copy and one other's: a DiLoCo peer that had just seen its 3 partners began round 0 seeing none of them."""
    holders = Holders({"h1": copy_of({"a": (1, 60)}), "h2": copy_of({"b": (2, 60)}), "h3": copy_of({"c": (3, 60)}),
                       "h4": copy_of({"d": (4, 60)})}, silent=set(), own=copy_of({"ours": (5, 60)}),
                      late={"h2": 0.3, "h3": 0.3, "h4": 0.3})
    for name in ("h2", "h3", "h4"):
        holder_read.SILENT_HOLDERS.silent_(holders.ids[name], time.monotonic())
    found, _ = timed(read_from_holders, holders)
    assert found is not None and len(found.value) >= 3, found  # a majority of our 5 holders answered, not 2


@pytest.mark.parametrize("own", [None, copy_of({"ours": (1, 60)})])
def test_a_read_of_every_holder_ends_when_no_other_holder_answers(own: ValueWithExpiration | None) -> None:
    """Every other holder silent (our own link saturated, as a 64 kbit/s member's): the read ends once their requests
    do, with what our own storage holds. It once spun on, holding the DHT process's loop, whose pipe then filled and
    blocked the peer's main thread for good (a netns run of issue 31's slow member)."""
    holders = Holders({"h1": None, "h2": None}, silent={"h1", "h2"}, own=own)
    result: list[Any] = []
    reading = threading.Thread(target=lambda: result.append(timed(read_from_holders, holders)), daemon=True)
    reading.start()
    reading.join(REQUEST_TIMEOUT_S + 10)
    assert result, "the read did not end"
    found, _ = result[0]
    assert (found is None) if own is None else (found is not None and found.value["ours"].value == 1)


def test_silent_holders_are_drawn_last_for_a_time_that_doubles_and_an_answer_forgets_it() -> None:
    silent, now = SilentHolders(), 1000.0
    slow, fast = DHTID.generate(source="slow"), DHTID.generate(source="fast")
    silent.silent_(slow, now)
    assert {silent.draw([slow, fast], now + SILENT_S - 1) for _ in range(20)} == {fast}
    assert silent.draw([slow], now) == slow  # the only one: drawn anyway
    assert fast in {silent.draw([slow, fast], now + SILENT_S + 1) for _ in range(50)}
    silent.silent_(slow, now)
    assert {silent.draw([slow, fast], now + 2 * SILENT_S - 1) for _ in range(20)} == {fast}  # the second: twice
    silent.answered_(slow)
    assert slow not in silent.silences
    for i in range(MAX_REMEMBERED + 10):  # identities are free: the table stays bounded
        silent.silent_(DHTID.generate(source=f"sybil-{i}"), now)
    assert len(silent.silences) == MAX_REMEMBERED
