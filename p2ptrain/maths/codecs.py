"""Codecs for what peers send, built on hivemind's ``CompressionBase``, plus error feedback and the adaptive choice.

Codecs, least lossy first: ``none`` (fp32), ``fp16`` (hivemind's Float16Compression), ``int8`` (ours: per-chunk
absmax scale), ``topk`` (ours: chunked top-k with 8-bit values and uint16 indices), ``sparse`` (ours, in
``sparse_codec``: chunked top-k with 1–8-bit values and Elias–Fano indices). Each documents its error bound.

Not hivemind's ``Uniform8BitQuantization``: its ``extract`` crashes under numpy 2, it clips beyond ±3σ (no
per-element bound) and uses one scale per tensor. Our formats travel in ``runtime_pb2.Tensor`` with
``compression=NONE`` and a magic header; hivemind cannot decode them, so every received payload goes through
:func:`decode` / :func:`decode_all`, which raise ValueError on anything malformed, mis-shaped or non-finite.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression, TensorRole
from hivemind.proto import runtime_pb2
from hivemind.utils.tensor_descr import TensorDescriptor

from p2ptrain.errors import ConfigError
from p2ptrain.maths.codec_format import (
    DTYPES,
    ITEMSIZE,
    MAX_CHUNK_SIZE,
    Payload,
    Payloads,
    Tensors,
    as_chunks,
    chunk_layout,
    chunked_payload,
    payload_numel,
    read_array,
    read_scales,
)
from p2ptrain.maths.codec_format import prepare_input as _prepare_input  # patched by tests/test_robust_gossip.py
from p2ptrain.maths.sparse_codec import SparseCodec


class NoneCodec(NoCompression):
    """Raw fp32/fp64/fp16 bytes (bfloat16 is sent as fp32). Exact: decoded == original."""

    name: ClassVar[str] = "none"

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return super().compress(_prepare_input(tensor), info, allow_inplace)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        _check_dense_length(serialized_tensor, ITEMSIZE.get(serialized_tensor.dtype, 0))
        return super().extract(serialized_tensor).detach().clone()


class Fp16Codec(Float16Compression):
    """IEEE half precision (hivemind). Bound per element, for |x| <= 65504: |x̂ − x| <= 2⁻¹¹·|x| + 2⁻²⁵.

    Larger magnitudes are clamped to ±65504; below 2⁻²⁴ values flush to zero (use ``relative_encode`` or
    ``int8`` for tiny values). Relative L2 error <= 2⁻¹¹ + 2⁻²⁵·√n / ‖x‖.
    """

    name: ClassVar[str] = "fp16"

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return super().compress(_prepare_input(tensor), info, allow_inplace)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        _check_dense_length(serialized_tensor, 2 if serialized_tensor.dtype in ITEMSIZE else 0)
        return super().extract(serialized_tensor).detach().clone()


def _check_dense_length(msg: runtime_pb2.Tensor, itemsize: int) -> None:
    if itemsize == 0:
        raise ValueError(f"payload declares unsupported dtype {msg.dtype!r}")
    if len(msg.buffer) != payload_numel(msg) * itemsize:
        raise ValueError(f"payload holds {len(msg.buffer)} bytes, its shape needs {payload_numel(msg) * itemsize}")


# ---- our chunked formats ------------------------------------------------------------------------------------------


def _quantize_absmax(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit per row: q = round(v / s) with s = absmax(row) / 127. Returns (int8 q, float32 s)."""
    scales = values.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(values / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return quantized, scales


class Int8Codec(CompressionBase):
    """Chunked symmetric 8-bit quantisation, one fp32 absmax scale per ``chunk_size`` elements (ours).

    Bound per element: |x̂ − x| <= absmax(chunk) / 254 (round to nearest with step absmax/127).
    Bytes: 1 per element + 4 per chunk + 16 header.
    """

    name: ClassVar[str] = "int8"
    compression_type = runtime_pb2.CompressionType.NONE
    _HEADER = struct.Struct("<4sIQ")  # magic, chunk, numel
    _MAGIC = b"P2I8"

    def __init__(self, chunk_size: int = 4096) -> None:
        if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
            raise ConfigError(f"int8 chunk_size must be in [1, {MAX_CHUNK_SIZE}], got {chunk_size}")
        self.chunk_size = chunk_size

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        source = _prepare_input(tensor)
        chunk, n_chunks = chunk_layout(source.numel(), self.chunk_size)
        quantized, scales = _quantize_absmax(as_chunks(source.reshape(-1), chunk, n_chunks))
        header = self._HEADER.pack(self._MAGIC, chunk, source.numel())
        values = quantized.reshape(-1)[: source.numel()]
        return chunked_payload(source, (header, scales.numpy().tobytes(), values.numpy().tobytes()))

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer, numel = serialized_tensor.buffer, payload_numel(serialized_tensor)
        magic, chunk, declared = self._HEADER.unpack_from(read_array(buffer, 0, np.uint8, self._HEADER.size).tobytes())
        if magic != self._MAGIC or declared != numel or not 1 <= chunk <= MAX_CHUNK_SIZE:
            raise ValueError(f"not an int8 payload for shape {list(serialized_tensor.size)}")
        n_chunks = chunk_layout(numel, chunk)[1]
        scales = read_scales(buffer, self._HEADER.size, n_chunks)
        offset = self._HEADER.size + 4 * n_chunks
        values = torch.from_numpy(read_array(buffer, offset, np.int8, numel).copy())
        if offset + numel != len(buffer):
            raise ValueError(f"int8 payload has {len(buffer) - offset - numel} trailing bytes")
        chunks = as_chunks(values, chunk, n_chunks).mul_(scales[:, None])
        return chunks.reshape(-1)[:numel].reshape(tuple(serialized_tensor.size))

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        numel = max(1, info.descriptor.numel())
        chunk, n_chunks = chunk_layout(numel, self.chunk_size)
        return (numel + 4 * n_chunks) / (numel * torch.finfo(info.descriptor.dtype).bits / 8)


class TopKCodec(CompressionBase):
    """Chunked top-k sparsification with 8-bit values (ours, SparseLoCo-style), for outer gradients with EF.

    The flattened tensor is cut into chunks of ``chunk_size`` elements (4096 = 64×64); in each, the
    k = round(density·chunk) entries of largest |value| are kept as (uint16 index within the chunk, int8 value)
    with one fp32 absmax scale per chunk. Bounds: dropped entries decode to 0; kept ones satisfy
    |x̂ − x| <= absmax(chunk)/254; per chunk ‖x − x̂‖² <= (1 − (k/m)(1 − k/254²))·‖x‖² (m = chunk length),
    a contraction, which is what error feedback needs. Bytes: 3 per kept entry + 4 per chunk + 20 header.
    """

    name: ClassVar[str] = "topk"
    compression_type = runtime_pb2.CompressionType.NONE
    _HEADER = struct.Struct("<4sIIQ")  # magic, chunk, k, numel
    _MAGIC = b"P2TK"

    def __init__(self, density: float = 1 / 128, chunk_size: int = 4096) -> None:
        if not 0.0 < density <= 1.0:
            raise ConfigError(f"topk density must be in (0, 1], got {density}")
        if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
            raise ConfigError(f"topk chunk_size must be in [1, {MAX_CHUNK_SIZE}], got {chunk_size}")
        self.density, self.chunk_size = density, chunk_size

    def _k(self, chunk: int) -> int:
        return max(1, min(chunk, round(self.density * chunk)))

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        source = _prepare_input(tensor)
        chunk, n_chunks = chunk_layout(source.numel(), self.chunk_size)
        k, chunks = self._k(chunk), as_chunks(source.reshape(-1), chunk, n_chunks)
        indices = chunks.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        quantized, scales = _quantize_absmax(chunks.gather(1, indices))
        header = self._HEADER.pack(self._MAGIC, chunk, k, source.numel())
        index_bytes = indices.numpy().astype(np.uint16).tobytes()
        return chunked_payload(source, (header, scales.numpy().tobytes(), index_bytes, quantized.numpy().tobytes()))

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer, numel = serialized_tensor.buffer, payload_numel(serialized_tensor)
        magic, chunk, k, declared = self._HEADER.unpack(read_array(buffer, 0, np.uint8, self._HEADER.size).tobytes())
        if magic != self._MAGIC or declared != numel or not 1 <= k <= chunk <= MAX_CHUNK_SIZE:
            raise ValueError(f"not a topk payload for shape {list(serialized_tensor.size)}")
        n_chunks = chunk_layout(numel, chunk)[1]
        if len(buffer) != self._HEADER.size + n_chunks * (4 + 3 * k):
            raise ValueError(f"topk payload holds {len(buffer)} bytes, its header needs {n_chunks * (4 + 3 * k) + 20}")
        scales = read_scales(buffer, self._HEADER.size, n_chunks)
        offset = self._HEADER.size + 4 * n_chunks
        raw_indices = read_array(buffer, offset, np.uint16, n_chunks * k)
        indices = torch.from_numpy(raw_indices.astype(np.int64)).view(n_chunks, k)
        values = torch.from_numpy(read_array(buffer, offset + 2 * n_chunks * k, np.int8, n_chunks * k).copy())
        if bool((indices >= chunk).any()) or bool((indices[:, 1:] <= indices[:, :-1]).any()):
            raise ValueError("topk payload holds out-of-range or unsorted indices")
        chunks = torch.zeros(n_chunks, chunk, dtype=torch.float32)
        chunks.scatter_(1, indices, values.view(n_chunks, k).float() * scales[:, None])
        return chunks.reshape(-1)[:numel].reshape(tuple(serialized_tensor.size))

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        numel = max(1, info.descriptor.numel())
        chunk, n_chunks = chunk_layout(numel, self.chunk_size)
        return n_chunks * (4 + 3 * self._k(chunk)) / (numel * torch.finfo(info.descriptor.dtype).bits / 8)


# ---- registry: the wire layer encodes with get_codec(...) and decodes with decode(name, msg) ----------------------

Codec = NoneCodec | Fp16Codec | Int8Codec | TopKCodec | SparseCodec
CODEC_NAMES = ("none", "fp16", "int8", "topk", "sparse")  # dense ones least lossy first, then the sparse ones
SPARSE_CODECS = ("sparse", "topk")  # sized by density; the adaptive choice takes the first available that fits
ADAPTIVE_CODECS = ("fp16", "int8", "topk")  # fp16 is lossless in practice for outer gradients (OpenDiLoCo)
_CODEC_TYPES: dict[str, type[Codec]] = {"none": NoneCodec, "fp16": Fp16Codec, "int8": Int8Codec, "topk": TopKCodec,
                                        "sparse": SparseCodec}
_DECODERS: dict[str, Codec] = {name: codec_type() for name, codec_type in _CODEC_TYPES.items()}


def get_codec(name: str, **kwargs: Any) -> Codec:
    """A codec by name; ``topk`` takes ``density`` and ``chunk_size``, ``sparse`` also ``bits``, ``int8``
    ``chunk_size``."""
    if name not in _CODEC_TYPES:
        raise ConfigError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    try:
        return _CODEC_TYPES[name](**kwargs)
    except TypeError as error:
        raise ConfigError(f"bad options for codec {name!r}: {error}") from None


def decode(name: str, msg: runtime_pb2.Tensor, expected_shape: Sequence[int] | None = None) -> torch.Tensor:
    """Decode a payload from a peer, validated: raises ValueError if it is malformed, truncated or non-finite.

    Pass ``expected_shape`` for untrusted payloads: it is checked before anything is allocated.
    """
    if name not in _DECODERS:
        raise ValueError(f"payload uses unknown codec {name!r}")
    codec = _DECODERS[name]
    if expected_shape is not None and tuple(msg.size) != tuple(expected_shape):
        raise ValueError(f"payload has shape {list(msg.size)}, expected {list(expected_shape)}")
    if msg.compression != codec.compression_type or msg.dtype not in DTYPES:
        raise ValueError(f"payload is not a {name} tensor (compression {msg.compression}, dtype {msg.dtype!r})")
    try:
        tensor = codec.extract(msg)
    except (RuntimeError, TypeError, IndexError, OverflowError, struct.error) as error:
        raise ValueError(f"malformed {name} payload: {error}") from None
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{name} payload holds NaN or inf values")
    return tensor.to(DTYPES[msg.dtype])


def compress_all(codec: Codec, tensors: Tensors, role: TensorRole = TensorRole.UNSPECIFIED) -> Payloads:
    """One ``runtime_pb2.Tensor`` per tensor, in order."""
    return [codec.compress(t, CompressionInfo.from_tensor(t, key=i, role=role)) for i, t in enumerate(tensors)]


def decode_all(name: str, msgs: Sequence[Payload], like: Tensors) -> list[torch.Tensor]:
    """Decode a list of payloads that must match ``like`` in count and shapes (ValueError otherwise)."""
    if len(msgs) != len(like):
        raise ValueError(f"got {len(msgs)} tensors, expected {len(like)}")
    return [decode(name, msg, expected_shape=ref.shape) for msg, ref in zip(msgs, like, strict=True)]


# ---- error feedback and parameter differences --------------------------------------------------------------------


class ErrorFeedback:
    """Error feedback for one peer's outer gradient: ``e ← β·e + Δ; send codec(e); e ← e − decoded(sent)``.

    Two steps so that a failed exchange changes nothing: :meth:`prepare` computes the payload without touching
    ``residual``; :meth:`commit_` subtracts what was sent, called only once the exchange succeeded. With β = 1
    the running sum of what was sent equals the running sum of Δ minus the (bounded) residual.
    """

    def __init__(self, codec: Codec, like: Tensors, decay: float = 1.0) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ConfigError(f"error feedback decay must be in [0, 1], got {decay}")
        self.codec, self.decay = codec, decay
        self.residual = [torch.zeros(t.shape, dtype=torch.float32) for t in like]
        self._pending: list[torch.Tensor] | None = None

    def prepare(self, delta: Tensors, codec: Codec | None = None) -> tuple[Payloads, list[torch.Tensor]]:
        """Return ``(payload_msgs, sent_tensors)`` for β·e + Δ (optionally with another codec for this exchange)."""
        codec = codec or self.codec
        if [tuple(d.shape) for d in delta] != [tuple(e.shape) for e in self.residual]:
            raise ValueError("outer gradient does not match the error-feedback buffers in count or shapes")
        candidate = [
            e.mul(self.decay).add_(d.detach().cpu().float()) for e, d in zip(self.residual, delta, strict=True)
        ]
        msgs = compress_all(codec, candidate, TensorRole.GRADIENT)
        sent = decode_all(codec.name, msgs, like=candidate)
        self._pending = candidate
        return msgs, [s.float() for s in sent]

    def commit_(self, sent_tensors: Tensors) -> None:
        """The exchange succeeded: ``e ← (β·e + Δ) − sent``."""
        if self._pending is None:
            raise RuntimeError("commit_ without a pending prepare()")
        if len(sent_tensors) != len(self._pending):
            raise ValueError(f"got {len(sent_tensors)} sent tensors, expected {len(self._pending)}")
        self.residual = [c.sub_(s.float()) for c, s in zip(self._pending, sent_tensors, strict=True)]
        self._pending = None

    def state_dict(self) -> dict[str, object]:
        return {"decay": self.decay, "residual": [e.clone() for e in self.residual]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        residual = state["residual"]
        if [tuple(e.shape) for e in residual] != [tuple(e.shape) for e in self.residual]:
            raise ValueError("stored error-feedback residual does not match the model's shapes")
        self.decay, self.residual, self._pending = float(state["decay"]), [e.float().clone() for e in residual], None


def relative_encode(tensors: Tensors, reference: Tensors, codec: str = "fp16") -> Payloads:
    """Encode parameters as ``codec(θ − reference)``: 16-bit differences from a reference both ends hold."""
    if len(tensors) != len(reference):
        raise ValueError(f"got {len(tensors)} tensors and {len(reference)} reference tensors")
    diffs = [t.detach().cpu().float() - r.detach().cpu().float() for t, r in zip(tensors, reference, strict=True)]
    return compress_all(get_codec(codec), diffs, TensorRole.PARAMETER)


def relative_decode(msgs: Sequence[Payload], reference: Tensors, codec: str = "fp16") -> list[torch.Tensor]:
    """Inverse of :func:`relative_encode`: ``reference + decode(msg)``, validated against the reference shapes."""
    return [r.float() + d.float() for r, d in zip(reference, decode_all(codec, msgs, like=reference), strict=True)]


# ---- adaptive choice (DiLoCoX) ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodecChoice:
    name: str  # a codec name from CODEC_NAMES
    density: float = 1.0  # fraction of entries kept (SPARSE_CODECS only)

    def make(self, chunk_size: int = 4096) -> Codec:
        sparse = self.name in SPARSE_CODECS
        return get_codec(self.name, **({"density": self.density, "chunk_size": chunk_size} if sparse else {}))


def estimated_payload_bytes(codec: Codec, raw_bytes: int) -> float:
    """Bytes ``codec`` would send for ``raw_bytes`` of fp32 data, from its ``estimate_compression_ratio``."""
    info = CompressionInfo(key=None, descriptor=TensorDescriptor(size=(max(1, raw_bytes // 4),), dtype=torch.float32))
    return raw_bytes * codec.estimate_compression_ratio(info)


def choose_codec_for_link(
    raw_bytes: int, throughput_bytes_per_s: float, budget_s: float, available: Sequence[str] = ADAPTIVE_CODECS
) -> CodecChoice:
    """The least lossy available dense codec whose payload fits ``budget_s`` on the link; else the first available
    of SPARSE_CODECS at the largest density that fits (at least one entry per chunk). Without a sparse codec, the
    most compressive available codec is returned even if it does not fit.
    """
    if raw_bytes <= 0 or not throughput_bytes_per_s > 0.0 or not budget_s > 0.0:
        raise ValueError(
            f"need raw_bytes, throughput, budget > 0; got {raw_bytes}, {throughput_bytes_per_s}, {budget_s}"
        )
    names = [name for name in CODEC_NAMES if name in available]
    if not names:
        raise ConfigError(f"no known codec in {list(available)}; choose among {', '.join(CODEC_NAMES)}")
    budget_bytes = throughput_bytes_per_s * budget_s
    dense = [name for name in names if name not in SPARSE_CODECS]
    for name in dense:
        if estimated_payload_bytes(get_codec(name), raw_bytes) <= budget_bytes:
            return CodecChoice(name)
    sparse = [name for name in SPARSE_CODECS if name in names]
    if sparse:
        return _densest_fitting(sparse[0], raw_bytes, budget_bytes)
    return CodecChoice(min(dense, key=lambda name: estimated_payload_bytes(get_codec(name), raw_bytes)))


def _densest_fitting(name: str, raw_bytes: int, budget_bytes: float) -> CodecChoice:
    """``name`` with the most entries per chunk whose payload fits ``budget_bytes`` (bisection: bytes grow with k)."""
    chunk = chunk_layout(max(1, raw_bytes // 4), MAX_CHUNK_SIZE)[0]
    chunk = min(chunk, get_codec(name).chunk_size)  # type: ignore[union-attr]
    low, high = 1, chunk
    while low < high:
        k = (low + high + 1) // 2
        fits = estimated_payload_bytes(get_codec(name, density=k / chunk, chunk_size=chunk), raw_bytes) <= budget_bytes
        low, high = (k, high) if fits else (low, k - 1)
    return CodecChoice(name, density=low / chunk)
