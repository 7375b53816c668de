"""The byte-level pieces our codec formats share: input checks, chunking, the payload envelope, bounded reads.

Our formats (int8, topk, sparse) travel in ``runtime_pb2.Tensor`` with ``compression=NONE``, the original dtype
and shape, and a buffer that starts with a magic header. Every read of a received buffer goes through
:func:`read_array`, which refuses to read past the end: a truncated payload is a ValueError, never a crash.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import torch
from hivemind.proto import runtime_pb2

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2}
MAX_CHUNK_SIZE = 65536  # elements per chunk of the chunked codecs: indices within a chunk travel as uint16
Payload: TypeAlias = runtime_pb2.Tensor  # one encoded tensor, as hivemind's P2P handlers and serializer carry it
Payloads: TypeAlias = list[runtime_pb2.Tensor]
Tensors: TypeAlias = Sequence[torch.Tensor]  # one tensor per model parameter, in the same order everywhere


def prepare_input(tensor: torch.Tensor) -> torch.Tensor:
    """Detached CPU copy-free view, bfloat16 widened to float32; rejects non-float and non-finite tensors."""
    if not torch.is_floating_point(tensor):
        raise ValueError(f"codecs take floating-point tensors, got {tensor.dtype}")
    tensor = tensor.detach().cpu()
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError("refusing to compress a tensor with NaN or inf values")
    return tensor.float() if tensor.dtype == torch.bfloat16 else tensor


def payload_numel(msg: runtime_pb2.Tensor) -> int:
    """Elements of the shape a payload declares (Python ints: no overflow, whatever a peer wrote)."""
    return math.prod(int(s) for s in msg.size)


def chunk_layout(numel: int, chunk_size: int) -> tuple[int, int]:
    """(chunk, n_chunks): chunks of ``chunk_size`` elements, smaller for tensors shorter than one chunk."""
    chunk = max(1, min(chunk_size, numel))
    return chunk, -(-numel // chunk)


def as_chunks(flat: torch.Tensor, chunk: int, n_chunks: int) -> torch.Tensor:
    """(n_chunks, chunk) float32 view of ``flat``, zero-padded at the end."""
    padded = torch.zeros(n_chunks * chunk, dtype=torch.float32)
    padded[: flat.numel()] = flat.float()
    return padded.view(n_chunks, chunk)


def chunked_payload(source: torch.Tensor, parts: Sequence[bytes]) -> runtime_pb2.Tensor:
    """Our formats' envelope: compression NONE (hivemind cannot decode them), the original dtype and shape."""
    dtype = str(source.dtype).removeprefix("torch.")
    return runtime_pb2.Tensor(compression=runtime_pb2.NONE, buffer=b"".join(parts), size=source.shape, dtype=dtype)


def read_array(buffer: bytes, offset: int, dtype: type, count: int) -> np.ndarray:
    """``count`` items of ``dtype`` at ``offset``; ValueError if the buffer ends first."""
    nbytes = np.dtype(dtype).itemsize * count
    if offset < 0 or count < 0 or offset + nbytes > len(buffer):
        raise ValueError(f"payload truncated: needs {offset + nbytes} bytes, has {len(buffer)}")
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset)


def read_scales(buffer: bytes, offset: int, n_chunks: int) -> torch.Tensor:
    """``n_chunks`` float32 scales at ``offset``: finite and >= 0, else ValueError."""
    scales = torch.from_numpy(read_array(buffer, offset, np.float32, n_chunks).copy())
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ValueError("payload holds negative or non-finite scales")
    return scales
