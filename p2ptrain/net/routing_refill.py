"""A DHT node that lost its contacts finds the swarm again through the initial peers it joined by.

hivemind drops a node from its routing table at the first request that node does not answer within the request
timeout (`DHTProtocol.update_routing_table`), and refreshes the table only when asked to (`DHTNode`'s
`refresh_timeout`, off). A node whose requests all timed out for a while (a loaded machine, a link that stalled)
has lost everyone it knew: it stores its record and reads the run's key on itself alone, and nobody asks it
anything again, for the rest of the run. A node that knows fewer than `least` nodes (the key's holders, KEY_BEAM)
pings its initial peers and looks up its own id, as hivemind's join does; the peer's swarm watcher asks at most
every REFILL_EVERY_S, beside its reads (net/discovery.py). It runs in the DHT's own process
(`hivemind.DHT.run_coroutine`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain.timing import BRIEF_S

# between two looks at the routing table (a ping and a lookup only when it is short): a node cut off from the swarm
# finds it again within this of the cut's end
REFILL_EVERY_S = BRIEF_S


def initial_peer_ids(initial_peers: Sequence[str]) -> list[PeerID]:
    """The peer ids in the initial peers' multiaddrs (start_dht refused any without its /p2p/ part)."""
    return list(dict.fromkeys(PeerID.from_base58(Multiaddr(maddr)["p2p"]) for maddr in initial_peers))


async def refill_routing_table(_dht: object, node: Any, initial_peers: Sequence[PeerID], least: int
                               ) -> tuple[int, int]:
    """(nodes our routing table held, and holds now): when it held fewer than `least`, the initial peers were pinged
    (each that answers is added) and our own id looked up (each node met on the way is added)."""
    table = node.protocol.routing_table
    before = len(table.uid_to_peer_id)
    if before >= least:
        return before, before
    others = [peer for peer in initial_peers if peer != node.peer_id]
    await asyncio.gather(*(node.protocol.call_ping(peer) for peer in others), return_exceptions=True)
    await node.find_nearest_nodes([node.node_id])
    return before, len(table.uid_to_peer_id)
