"""Which piece of the dataset a peer reads next: claims in the DHT, so the swarm reads pieces nobody has read yet.

The run's pieces (corpus.py) are listed in blocks of `PIECES_PER_KEY` under `{run_id}_data.{block}`, one subkey per
piece whose value is the peer id that claimed it. A peer that needs a piece reads a block (blocks in an order of
its own), stores a claim on a random unclaimed piece, waits `SETTLE_S` and reads the block again: the DHT keeps,
per subkey, the value stored last, so of two peers that claimed one piece at once both see the same winner, and
the other picks again. A peer refreshes its claims before they expire (`CLAIM_TTL_S`, the longest lifetime a
run's node stores). When every piece is claimed the first pass is over: the peer then reads pieces in a random
order of its own.

Claims are hints, not locks: a peer that claims without reading (or a hostile one that claims everything) costs
the swarm coverage of the data, never correctness, and the worst case is every peer reading in its own random
order. A claim record is bounded (net/dht_keys.py): a subkey is a piece of the block, its value a short string.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import random
import time

import hivemind
from hivemind.utils import get_dht_time

from p2ptrain.net.dht_keys import KEY_BEAM, MAX_BLOCKS, MAX_LIFETIME_S, PIECES_PER_KEY, claims_key
from p2ptrain.net.discovery import DHT_CALL_LOCK
from p2ptrain.timing import BRIEF_S

logger = logging.getLogger(__name__)

CLAIM_TTL_S = MAX_LIFETIME_S  # a claim's lifetime: the longest a run's node stores a record
REFRESH_AFTER_S = CLAIM_TTL_S / 2  # a claim older than this is stored again when the peer next picks a piece
SETTLE_S = 1.0  # between storing a claim and reading who holds it: longer than a store takes to reach the DHT
# claims stored for one pick before a random piece is taken instead: a peer that overwrites every claim we make
# costs us this many settles a piece, not a stall of the training
MAX_TRIES = 8


class ClaimedPieces:
    """`data.PieceOrder` for a volunteer: the next piece nobody in the swarm has claimed, then random ones. The piece
    after the one handed out is claimed in the background meanwhile, so training does not wait on the DHT."""

    def __init__(self, dht: hivemind.DHT, run_id: str, claimant: str, num_pieces: int, seed: int,
                 timeout_s: float = BRIEF_S, settle_s: float = SETTLE_S) -> None:
        if not 0 < num_pieces <= PIECES_PER_KEY * MAX_BLOCKS:
            raise ValueError(f"num_pieces must be in [1, {PIECES_PER_KEY * MAX_BLOCKS}], got {num_pieces}")
        self.dht, self.run_id, self.claimant = dht, run_id, claimant
        self.num_pieces, self.timeout_s, self.settle_s = num_pieces, timeout_s, settle_s
        self.rng = random.Random(seed)  # used by one thread at a time: the caller's first pick, then the pool's
        self.blocks = list(range((num_pieces + PIECES_PER_KEY - 1) // PIECES_PER_KEY))
        self.rng.shuffle(self.blocks)
        self.claimed: dict[int, float] = {}  # piece → when we last stored our claim on it
        self.full_since: dict[int, float] = {}  # block → when we saw every piece of it claimed
        self.first_pass_over = False
        self._tries_left = MAX_TRIES  # claims this pick may still store
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-data-claims")
        self._ahead: concurrent.futures.Future[int] | None = None

    def next_piece(self) -> int:
        piece = self._ahead.result() if self._ahead is not None else self._pick()
        self._ahead = self._pool.submit(self._pick)
        return piece

    def _pick(self) -> int:
        self._refresh_claims()
        if not self.first_pass_over:
            now = time.monotonic()
            self._tries_left = MAX_TRIES
            for block in self.blocks:
                if now - self.full_since.get(block, -math.inf) < REFRESH_AFTER_S:
                    continue  # full when we last looked: its claims outlive this wait
                piece = self._claim_in(block)
                if piece is None:
                    break  # the DHT did not answer, or every try was lost: a random piece this time
                if piece >= 0:
                    return piece
                self.full_since[block] = now
            else:
                self.first_pass_over = True
                logger.info(f"data: every one of the {self.num_pieces} pieces is claimed; reading them again in a "
                            "random order")
        return self.rng.randrange(self.num_pieces)

    def _claim_in(self, block: int) -> int | None:
        """A piece of `block` we now hold the claim on, -1 when every piece of it is claimed, None when the DHT did
        not answer in time or this pick has used its tries."""
        first = block * PIECES_PER_KEY
        pieces = range(first, min(first + PIECES_PER_KEY, self.num_pieces))
        while self._tries_left > 0:  # each lost race removes a candidate
            holders = self._holders(block)
            if holders is None:
                return None
            free = [p for p in pieces if p - first not in holders]
            if not free:
                return -1
            self._tries_left -= 1
            piece = self.rng.choice(free)
            if not self._store(piece):
                return None
            time.sleep(self.settle_s)
            holders = self._holders(block)
            if holders is None:
                return None
            if holders.get(piece - first) == self.claimant:
                self.claimed[piece] = time.monotonic()
                return piece
        return None

    def _holders(self, block: int) -> dict[int, str] | None:
        """Piece offset → claimant of the block's live claims; None when the DHT does not answer in time."""
        with DHT_CALL_LOCK:
            future = self.dht.get(claims_key(self.run_id, block), latest=True, beam_size=KEY_BEAM,
                                  return_future=True)
        try:
            raw = future.result(timeout=self.timeout_s)
        except Exception:  # a time-out, or the DHT shutting down
            future.cancel()
            return None
        value = getattr(raw, "value", None)
        if not isinstance(value, dict):
            return {}
        # checked again here: a node of the DHT may not run our validator
        return {offset: entry.value for offset, entry in value.items() if type(offset) is int
                and 0 <= offset < PIECES_PER_KEY and isinstance(getattr(entry, "value", None), str)}

    def _store(self, piece: int) -> bool:
        """Store our claim on `piece`; whether the DHT confirmed it in time."""
        try:
            with DHT_CALL_LOCK:
                future = self.dht.store(claims_key(self.run_id, piece // PIECES_PER_KEY), subkey=piece % PIECES_PER_KEY,
                                        value=self.claimant, expiration_time=get_dht_time() + CLAIM_TTL_S,
                                        beam_size=KEY_BEAM, return_future=True)
            return bool(future.result(timeout=self.timeout_s))
        except Exception:  # a late store, or the DHT shutting down
            logger.debug("data claim not stored", exc_info=True)
            return False

    def _refresh_claims(self) -> None:
        now = time.monotonic()
        for piece, when in list(self.claimed.items()):
            if now - when > REFRESH_AFTER_S and self._store(piece):
                self.claimed[piece] = now
