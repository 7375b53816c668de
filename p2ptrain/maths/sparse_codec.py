"""The ``sparse`` codec (ours, SparseLoCo-style): chunked top-k, low-bit values, compact indices; for outer gradients
sent with error feedback (``ErrorFeedback``: what a payload leaves out is sent in a later round).

Per chunk of ``chunk_size`` elements (4096 = 64×64, as SparseLoCo), the k = round(density·chunk) entries of largest
|value| are kept. Their positions travel Elias–Fano or bitmap coded, whichever is smaller (``index_coding``); each
value travels as ``bits`` bits: a sign bit and a (bits − 1)-bit code of its magnitude on L = 2^(bits−1) levels
spaced evenly from ``lo`` to ``hi``, two fp32 numbers per chunk (one when L = 1). The encoder fits them per chunk:

- L = 1 (1 bit, sign only, as DeMo): lo = mean |v|, the magnitude that minimises the squared error.
- L = 2 (2 bits, SparseLoCo's setting): two-means of the magnitudes (lo, hi = the means of the two groups).
- L ≥ 3: lo = min |v|, hi = max |v|; every kept entry then satisfies |x̂ − x| <= (hi − lo) / (2(L − 1)).

Every kept entry keeps its sign and decodes to a magnitude within [min |v|, max |v|] of its chunk; dropped entries
decode to 0, so a chunk's squared error is below its squared norm (a contraction, what error feedback needs).
Bytes per chunk: 4 or 8 (scales) + ~k·(bits + log2(chunk/k) + 2)/8 (values and indices), plus a 24-byte header
per tensor. At chunk 4096 and 2 bits, 1 %, 2 % and 3 % density send 1/248, 1/148 and 1/107 of the fp32 bytes
(a 128×344 tensor; tests/test_sparse_codec.py).

The payload is self-describing (bits, coding, chunk and k in its header), so :func:`p2ptrain.maths.codecs.decode`
needs no options. Decoding is a bounded parse: the exact byte count follows from the header and the declared shape
and is checked before anything is allocated; bad scales, codes or indices are a ValueError.
"""

from __future__ import annotations

import struct
from typing import ClassVar

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

from p2ptrain.errors import ConfigError
from p2ptrain.maths.codec_format import (
    MAX_CHUNK_SIZE,
    as_chunks,
    chunk_layout,
    chunked_payload,
    payload_numel,
    prepare_input,
    read_array,
)
from p2ptrain.maths.index_coding import (
    INDEX_CODINGS,
    best_coding,
    decode_indices,
    encode_indices,
    index_bytes,
    pack_uint,
    packed_bytes,
    unpack_uint,
)

MAX_BITS = 8
TWO_MEANS_ITERATIONS = 4  # Lloyd steps of the 2-level fit (it settles in 2–3 on gradient-like values)


def kept_per_chunk(density: float, chunk: int) -> int:
    """k, the entries kept of a chunk of `chunk` values: at least one, at most all."""
    return max(1, min(chunk, round(density * chunk)))


def magnitude_levels(bits: int) -> int:
    """L, the magnitude levels of ``bits``-bit values (one bit is the sign)."""
    return 1 << (bits - 1)


def fit_levels(magnitudes: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of (n_chunks, k) magnitudes, the (lo, hi) of the level grid (see the module docstring)."""
    if levels == 1:
        mean = magnitudes.mean(dim=1)
        return mean, mean
    lo, hi = magnitudes.amin(dim=1), magnitudes.amax(dim=1)
    if levels > 2:
        return lo, hi
    for _ in range(TWO_MEANS_ITERATIONS):
        upper = magnitudes > ((lo + hi) / 2)[:, None]
        n_upper = upper.sum(dim=1)
        sum_upper = torch.where(upper, magnitudes, 0.0).sum(dim=1)
        sum_lower = magnitudes.sum(dim=1) - sum_upper
        k = magnitudes.shape[1]
        hi = torch.where(n_upper > 0, sum_upper / n_upper.clamp(min=1), hi)
        lo = torch.where(n_upper < k, sum_lower / (k - n_upper).clamp(min=1), lo)
    return lo, hi


def quantize_magnitudes(magnitudes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int) -> torch.Tensor:
    """The nearest level's code in [0, L) for each magnitude (int64)."""
    if levels == 1:
        return torch.zeros(magnitudes.shape, dtype=torch.int64)
    step = (hi - lo) / (levels - 1)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round((magnitudes - lo[:, None]) / safe[:, None]).clamp_(0, levels - 1)
    return torch.where(step[:, None] > 0, codes, torch.zeros_like(codes)).to(torch.int64)


def level_values(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int) -> torch.Tensor:
    """Magnitudes of ``codes``: lo + code·(hi − lo)/(L − 1)."""
    if levels == 1:
        return lo[:, None].expand(codes.shape).clone()
    return lo[:, None] + codes.float() * ((hi - lo) / (levels - 1))[:, None]


class SparseCodec(CompressionBase):
    """Chunked top-k, ``bits``-bit values, Elias–Fano or bitmap indices (see the module docstring)."""

    name: ClassVar[str] = "sparse"
    compression_type = runtime_pb2.CompressionType.NONE
    _HEADER = struct.Struct("<4sBBHIIQ")  # magic, bits, index coding, zero, chunk, k, numel
    _MAGIC = b"P2SP"

    def __init__(self, density: float = 1 / 64, bits: int = 2, chunk_size: int = 4096) -> None:
        if not 0.0 < density <= 1.0:
            raise ConfigError(f"sparse density must be in (0, 1], got {density}")
        if not 1 <= bits <= MAX_BITS:
            raise ConfigError(f"sparse bits must be in [1, {MAX_BITS}], got {bits}")
        if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
            raise ConfigError(f"sparse chunk_size must be in [1, {MAX_CHUNK_SIZE}], got {chunk_size}")
        self.density, self.bits, self.chunk_size = density, bits, chunk_size

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        source = prepare_input(tensor)
        chunk, n_chunks = chunk_layout(source.numel(), self.chunk_size)
        k, levels = kept_per_chunk(self.density, chunk), magnitude_levels(self.bits)
        chunks = as_chunks(source.reshape(-1), chunk, n_chunks)
        indices = chunks.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        values = chunks.gather(1, indices)
        magnitudes = values.abs()
        lo, hi = fit_levels(magnitudes, levels)
        codes = quantize_magnitudes(magnitudes, lo, hi, levels) | ((values < 0).to(torch.int64) << (self.bits - 1))
        coding, index_part = encode_indices(indices.numpy(), chunk)
        scales = torch.stack([lo, hi], dim=1) if levels > 1 else lo
        header = self._HEADER.pack(self._MAGIC, self.bits, coding, 0, chunk, k, source.numel())
        parts = (header, scales.numpy().astype(np.float32).tobytes(), index_part, pack_uint(codes.numpy(), self.bits))
        return chunked_payload(source, parts)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer, numel = serialized_tensor.buffer, payload_numel(serialized_tensor)
        fields = self._HEADER.unpack(read_array(buffer, 0, np.uint8, self._HEADER.size).tobytes())
        magic, bits, coding, zero, chunk, k, declared = fields
        if magic != self._MAGIC or declared != numel or zero != 0 or coding not in INDEX_CODINGS:
            raise ValueError(f"not a sparse payload for shape {list(serialized_tensor.size)}")
        if not 1 <= bits <= MAX_BITS or not 1 <= k <= chunk <= MAX_CHUNK_SIZE or chunk != chunk_layout(numel, chunk)[0]:
            raise ValueError(f"sparse payload declares bits {bits}, chunk {chunk}, k {k} for {numel} elements")
        n_chunks, levels = chunk_layout(numel, chunk)[1], magnitude_levels(bits)
        n_scales = n_chunks * (2 if levels > 1 else 1)
        index_offset = self._HEADER.size + 4 * n_scales
        values_offset = index_offset + index_bytes(coding, n_chunks, k, chunk)
        if len(buffer) != values_offset + packed_bytes(n_chunks * k * bits):
            raise ValueError(f"sparse payload holds {len(buffer)} bytes, its header needs "
                             f"{values_offset + packed_bytes(n_chunks * k * bits)}")
        lo, hi = self._read_levels(buffer, n_chunks, levels)
        indices = torch.from_numpy(decode_indices(buffer, index_offset, coding, n_chunks, k, chunk))
        codes = torch.from_numpy(unpack_uint(buffer, values_offset, n_chunks * k, bits)).view(n_chunks, k)
        magnitude_codes = codes & (levels - 1)
        values = level_values(magnitude_codes, lo, hi, levels)
        values = torch.where((codes >> (bits - 1)) > 0, -values, values)
        chunks = torch.zeros(n_chunks, chunk, dtype=torch.float32)
        chunks.scatter_(1, indices, values)
        return chunks.reshape(-1)[:numel].reshape(tuple(serialized_tensor.size))

    def _read_levels(self, buffer: bytes, n_chunks: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
        count = n_chunks * (2 if levels > 1 else 1)
        scales = torch.from_numpy(read_array(buffer, self._HEADER.size, np.float32, count).copy())
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise ValueError("sparse payload holds negative or non-finite magnitude levels")
        if levels == 1:
            return scales, scales
        lo, hi = scales.view(n_chunks, 2).unbind(dim=1)
        if bool((lo > hi).any()):
            raise ValueError("sparse payload holds a level grid whose low end exceeds its high end")
        return lo, hi

    def payload_bytes_for(self, numel: int) -> int:
        """Exact buffer bytes of a tensor of ``numel`` elements."""
        chunk, n_chunks = chunk_layout(max(1, numel), self.chunk_size)
        k = kept_per_chunk(self.density, chunk)
        n_scales = n_chunks * (2 if magnitude_levels(self.bits) > 1 else 1)
        return (self._HEADER.size + 4 * n_scales + index_bytes(best_coding(n_chunks, k, chunk), n_chunks, k, chunk)
                + packed_bytes(n_chunks * k * self.bits))

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        numel = max(1, info.descriptor.numel())
        return self.payload_bytes_for(numel) / (numel * torch.finfo(info.descriptor.dtype).bits / 8)


def payload_share(density: float, bits: int, chunk_size: int) -> float:
    """Payload bytes per fp32 byte of a tensor of whole chunks (its one header left out): what memory plans and
    benchmarks take a sparse payload to cost."""
    codec = SparseCodec(density, bits, chunk_size)
    return (codec.payload_bytes_for(chunk_size) - SparseCodec._HEADER.size) / (4 * chunk_size)
