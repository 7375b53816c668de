"""A cap on the frames hivemind reads from a peer's stream, checked before the frame is allocated.

hivemind's `P2P.receive_raw_data` reads an 8-byte length prefix, then `readexactly(length)`: a peer that announces
2**40 bytes makes this process buffer whatever it sends, byte for byte, until memory runs out. Every
stream handler hivemind runs for us (our exchange and state servicers, the averager's matchmaking and all-reduce)
and every stream we open reads its messages through that one static method, so we replace it with a copy that
refuses a frame longer than MAX_FRAME_BYTES before reading its body. Importing this module installs it (at most
once); p2ptrain.net.exchange and p2ptrain.net.dht import it, so hivemind's DHT and averager processes, which fork
from a process that has imported them, inherit it.

MAX_FRAME_BYTES, from what legitimate frames are (each frame is one protobuf message):
- ours (gossip exchange, state sharing): one chunk of `wire.CHUNK_BYTES` (1 MiB) of tensor data plus a few bytes of
  dtype and size fields, and on a stream's first message up to `wire.MAX_METADATA_BYTES` (64 KiB) of JSON header;
- hivemind's all-reduce: parts of `averaging.partition.DEFAULT_PART_SIZE_BYTES` (512 KiB, after compression) plus
  a few fields; its state download (which we turn off) chunks of 64 KiB; matchmaking messages are small;
- DHT requests are unary calls over p2pd's persistent connection, which p2pd itself caps at
  `persistent_conn_max_msg_size` (4 MiB, p2p_daemon_bindings/control.py): they never come through here;
- hivemind.moe streams chunks of 4 MiB (DEFAULT_MAX_MSG_SIZE): we run no MoE experts.
So twice our largest message, 2 × (1 MiB + 64 KiB): room for the protobuf envelope and for a codec whose chunk grows
a little, and about half of hivemind's own 4 MiB message limit. hivemind buffers up to 5 messages of an inbound
stream before its handler reads them (max_prefetch), so one stream holds at most ~13 MiB, whatever its peer sends.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

from p2ptrain.net.wire import CHUNK_BYTES, MAX_METADATA_BYTES, WireOversize

MAX_FRAME_BYTES = 2 * (CHUNK_BYTES + MAX_METADATA_BYTES)


class FrameTooLarge(WireOversize):
    """A peer announced a stream frame longer than MAX_FRAME_BYTES (refused before reading it)."""


async def receive_bounded(reader: asyncio.StreamReader) -> bytes:
    """hivemind's `P2P.receive_raw_data`, refusing a frame longer than MAX_FRAME_BYTES before reading its body."""
    header = await reader.readexactly(P2P.HEADER_LEN)
    length = int.from_bytes(header, P2P.BYTEORDER)
    if length > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"peer announced a frame of {length} bytes (at most {MAX_FRAME_BYTES} are read)")
    return await reader.readexactly(length)


def install() -> None:
    """Make hivemind read every stream frame through `receive_bounded` (idempotent).

    `P2P.receive_protobuf` looks `P2P.receive_raw_data` up on the class at each call, so replacing the static method
    covers every P2P instance, including ones created earlier."""
    if P2P.__dict__["receive_raw_data"].__func__ is not receive_bounded:
        P2P.receive_raw_data = staticmethod(receive_bounded)  # type: ignore[method-assign]


install()
