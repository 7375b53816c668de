"""Claims on the dataset's pieces: racing claimers read disjoint pieces, a later joiner reads what nobody has read,
claim records are bounded, and a peer's memory for data does not grow with the dataset."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2ptrain.data import ByteTokenizer, DataConfig, TextShards
from p2ptrain.net.data_claims import MAX_TRIES, ClaimedPieces
from p2ptrain.net.dht import NetworkConfig, start_dht, visible_maddrs
from p2ptrain.net.dht_keys import KEY_BEAM, PIECES_PER_KEY, RunKeysValidator, claims_key
from p2ptrain.net.discovery import add_record_validators

RUN = "claims-run"


class LastWriterDHT:
    """The DHT's rule for one subkey, in process: the value stored last is the one read (one replica, no delay)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[object, SimpleNamespace]] = {}
        self.lock = threading.Lock()

    def _done(self, result: object) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(result)
        return future

    def store(self, key: str, value: object, expiration_time: float, subkey: object = None,
              return_future: bool = False, beam_size: int = 0) -> concurrent.futures.Future:
        assert beam_size == KEY_BEAM
        with self.lock:
            self.values.setdefault(key, {})[subkey] = SimpleNamespace(value=value, expiration_time=expiration_time)
        return self._done(True)

    def get(self, key: str, latest: bool = False, return_future: bool = False,
            beam_size: int = 0) -> concurrent.futures.Future:
        assert beam_size == KEY_BEAM
        with self.lock:
            entries = dict(self.values.get(key, {}))
        return self._done(SimpleNamespace(value=entries) if entries else None)


def test_racing_claimers_read_disjoint_pieces_then_fall_back_to_random() -> None:
    dht = LastWriterDHT()
    num_pieces = 3 * PIECES_PER_KEY + 5
    claimers = [ClaimedPieces(dht, RUN, f"peer-{i}", num_pieces, seed=i, settle_s=0.01) for i in range(4)]  # type: ignore[arg-type]
    taken: dict[str, list[int]] = {c.claimant: [] for c in claimers}

    def claim_all(claimer: ClaimedPieces) -> None:
        while not claimer.first_pass_over:
            piece = claimer.next_piece()
            if not claimer.first_pass_over:
                assert piece in claimer.claimed
        taken[claimer.claimant] = list(claimer.claimed)  # handed out, or claimed ahead of the next call

    threads = [threading.Thread(target=claim_all, args=(c,)) for c in claimers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    every = [p for pieces in taken.values() for p in pieces]
    assert sorted(every) == list(range(num_pieces)), "a piece was read twice, or never, in the first pass"
    assert all(len(pieces) > num_pieces / 8 for pieces in taken.values())  # every claimer got a share
    assert all(0 <= claimers[0].next_piece() < num_pieces for _ in range(20))  # the second pass: random pieces


def test_a_claim_that_is_overwritten_is_lost_and_the_claimer_picks_again() -> None:
    dht = LastWriterDHT()

    class Thief(LastWriterDHT):
        def store(self, key: str, value: object, expiration_time: float, subkey: object = None,
                  return_future: bool = False, beam_size: int = 0) -> concurrent.futures.Future:
            done = dht.store(key, value, expiration_time, subkey, beam_size=beam_size)
            if subkey == 0:  # someone else claims piece 0 just after us
                dht.store(key, "thief", expiration_time + 1, subkey, beam_size=beam_size)
            return done

        def get(self, key: str, latest: bool = False, return_future: bool = False,
                beam_size: int = 0) -> concurrent.futures.Future:
            return dht.get(key, beam_size=beam_size)

    claimer = ClaimedPieces(Thief(), RUN, "honest", 2, seed=0, settle_s=0.0)  # type: ignore[arg-type]
    assert claimer.next_piece() == 1  # piece 0's claim is always overwritten: lost, and the claimer takes piece 1
    claimer.next_piece()  # the first pass is over (computed ahead, in the background)
    assert claimer.first_pass_over and list(claimer.claimed) == [1]


def test_a_dht_that_does_not_answer_gives_a_random_piece_and_keeps_the_first_pass() -> None:
    class Silent(LastWriterDHT):
        def get(self, key: str, latest: bool = False, return_future: bool = False,
                beam_size: int = 0) -> concurrent.futures.Future:
            return concurrent.futures.Future()  # never answers

    claimer = ClaimedPieces(Silent(), RUN, "alone", 500, seed=1, timeout_s=0.05)  # type: ignore[arg-type]
    pieces = [claimer.next_piece() for _ in range(3)]
    assert all(0 <= p < 500 for p in pieces) and not claimer.first_pass_over and not claimer.claimed


def claim_record(subkey: object, value: object, block: int = 0, run_id: str = RUN) -> DHTRecord:
    return DHTRecord(key=DHTID.generate(source=claims_key(run_id, block)).to_bytes(),
                     subkey=MSGPackSerializer.dumps(subkey), value=MSGPackSerializer.dumps(value),
                     expiration_time=get_dht_time() + 60)


def test_a_node_stores_only_claims_of_a_claims_shape() -> None:
    validator = RunKeysValidator(RUN)
    assert validator.validate(claim_record(0, "12D3KooWpeer"))
    assert validator.validate(claim_record(PIECES_PER_KEY - 1, "x", block=1023))
    for bad in (claim_record(PIECES_PER_KEY, "x"), claim_record(-1, "x"), claim_record("0", "x"),
                claim_record(0, b"bytes"), claim_record(0, ""), claim_record(0, "x" * 129),
                claim_record(0, "x", block=1024), claim_record(0, "x", run_id="other-run")):
        assert not validator.validate(bad)


@pytest.mark.network
@pytest.mark.slow
def test_three_peers_read_disjoint_pieces_of_64_mb_and_a_joiner_reads_unread_ones(tmp_path: Path) -> None:
    """Three data stages on three DHT nodes share a 64 MB jsonl: no piece (so no document) is trained by two of them,
    a fourth that joins later reads only pieces nobody has read, and none holds more than a few pieces' worth of
    memory (the dataset is never loaded whole)."""
    path = tmp_path / "corpus.jsonl"
    with path.open("w") as file:
        line = 0
        while file.tell() < 64_000_000:
            file.write(json.dumps({"text": f"document {line}: " + "lorem ipsum dolor sit amet " * 20}) + "\n")
            line += 1
    config = DataConfig(dataset=str(path), seq_len=128, batch_size=64, val_batches=2)
    process = psutil.Process()
    nodes = [start_dht(NetworkConfig.loopback())]
    nodes += [start_dht(NetworkConfig.loopback(), visible_maddrs(nodes[0])) for _ in range(3)]
    try:
        for node in nodes:
            add_record_validators(node, RUN, 30.0)
        rss_before = process.memory_info().rss
        stages = [TextShards(config, ByteTokenizer(), 0,
                             lambda n, node=node: ClaimedPieces(node, RUN, str(node.peer_id), n, seed=hash(node)))
                  for node in nodes[:3]]
        batches = [stage.train_batches(seed=i) for i, stage in enumerate(stages)]
        num_pieces = len(stages[0].pieces)
        assert num_pieces >= 100  # 64 MB in pieces of about half a megabyte
        while min(len(stage.pieces_read) for stage in stages) < 4:  # each reads at least three pieces whole
            for stage_batches in batches:
                next(stage_batches)
        rss_per_stage = (process.memory_info().rss - rss_before) / 3
        read = [set(stage.pieces_read) for stage in stages]
        assert sum(len(r) for r in read) == len(set.union(*read)), f"a piece was read by two peers: {read}"
        joiner = TextShards(config, ByteTokenizer(), 0,
                            lambda n: ClaimedPieces(nodes[3], RUN, str(nodes[3].peer_id), n, seed=7))
        joiner_batches = joiner.train_batches(seed=3)
        while len(joiner.pieces_read) < 3:
            next(joiner_batches)
        assert not set(joiner.pieces_read) & set.union(*read), "the joiner read a piece another peer had read"
        assert rss_per_stage < 100e6, f"{rss_per_stage / 1e6:.0f} MB a peer for data"
    finally:
        for node in nodes:
            node.shutdown()


def test_a_peer_that_overwrites_every_claim_costs_a_few_tries_not_a_stall() -> None:
    dht = LastWriterDHT()

    class Overwriter(LastWriterDHT):
        stores = 0

        def store(self, key: str, value: object, expiration_time: float, subkey: object = None,
                  return_future: bool = False, beam_size: int = 0) -> concurrent.futures.Future:
            Overwriter.stores += 1
            dht.store(key, value, expiration_time, subkey, beam_size=beam_size)
            return dht.store(key, "attacker", expiration_time + 1, subkey, beam_size=beam_size)  # every claim, at once

        def get(self, key: str, latest: bool = False, return_future: bool = False,
                beam_size: int = 0) -> concurrent.futures.Future:
            return dht.get(key, beam_size=beam_size)

    claimer = ClaimedPieces(Overwriter(), RUN, "honest", 10 * PIECES_PER_KEY, seed=2, settle_s=0.0)  # type: ignore[arg-type]
    piece = claimer._pick()
    assert 0 <= piece < 10 * PIECES_PER_KEY and Overwriter.stores == MAX_TRIES and not claimer.claimed
    assert not claimer.first_pass_over  # free pieces remain: the next pick tries again
