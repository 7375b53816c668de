"""The sparse codec (maths/sparse_codec.py) and its index coding (maths/index_coding.py): round trips within the
stated bounds, exact byte counts, and decoding of malformed payloads as a bounded parse (ValueError, never a crash
or a huge allocation)."""

from __future__ import annotations

import random
import struct
import time

import numpy as np
import pytest
import torch
from hivemind.compression import CompressionInfo

from p2ptrain.errors import ConfigError
from p2ptrain.maths import index_coding
from p2ptrain.maths.codecs import choose_codec_for_link, decode, get_codec
from p2ptrain.maths.sparse_codec import payload_share
from p2ptrain.net.wire import payload_bytes

SHAPES = [(), (1,), (7,), (33, 17), (4096,), (3, 5000)]  # scalars, odd sizes, a partial last chunk
HEADER = struct.Struct("<4sBBHIIQ")  # the codec's header: magic, bits, index coding, zero, chunk, k, numel


def _sample(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Gaussian values with a few large outliers, as outer gradients have."""
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    flat = tensor.view(-1)
    flat[:: max(1, flat.numel() // 5)] *= 50.0
    return tensor


def _encode(tensor: torch.Tensor, **options: float) -> object:
    return get_codec("sparse", **options).compress(tensor, CompressionInfo.from_tensor(tensor))


def _chunks(tensor: torch.Tensor, chunk_size: int) -> list[torch.Tensor]:
    flat = tensor.reshape(-1)
    return list(flat.split(max(1, min(chunk_size, flat.numel()))))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("density", [0.01, 0.03, 0.3, 1.0])
def test_round_trip_keeps_the_largest_with_their_signs_within_bounds(shape: tuple[int, ...], bits: int,
                                                                     density: float) -> None:
    tensor = _sample(shape, seed=bits)
    decoded = decode("sparse", _encode(tensor, density=density, bits=bits, chunk_size=1024), expected_shape=shape)
    assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
    chunk = max(1, min(1024, tensor.numel()))
    k, levels = max(1, round(density * chunk)), 2 ** (bits - 1)
    for original, restored in zip(_chunks(tensor, 1024), _chunks(decoded, 1024), strict=True):
        kept = restored != 0
        assert int(kept.sum()) <= k
        if int(kept.sum()) < original.numel():  # nothing dropped is larger than anything kept
            assert float(original[~kept].abs().max()) <= float(original[kept].abs().min())
        assert bool((torch.sign(restored[kept]) == torch.sign(original[kept])).all())
        low, high = float(original[kept].abs().min()), float(original[kept].abs().max())
        if k > original.numel():  # a short last chunk: its zero padding is among the kept entries
            low = 0.0
        assert low * (1 - 1e-6) <= float(restored[kept].abs().min()) <= float(restored[kept].abs().max()) \
            <= high * (1 + 1e-6)
        if levels >= 3:
            bound = (high - low) / (2 * (levels - 1))
            assert float((restored[kept] - original[kept]).abs().max()) <= bound * (1 + 1e-5) + 1e-6
        assert float((restored - original).pow(2).sum()) < float(original.pow(2).sum())  # a contraction


def test_two_bit_levels_are_the_means_of_two_groups() -> None:
    values = torch.tensor([1.0, -1.2, 0.9, 5.0, -5.4, 0.0, 0.0, 0.0])  # k = 5 of 8: the zeros are dropped
    decoded = decode("sparse", _encode(values, density=5 / 8, bits=2), expected_shape=(8,))
    small, large = (1.0 + 1.2 + 0.9) / 3, (5.0 + 5.4) / 2
    assert torch.allclose(decoded, torch.tensor([small, -small, small, large, -large, 0, 0, 0]), atol=1e-6)
    sign_only = decode("sparse", _encode(values, density=5 / 8, bits=1), expected_shape=(8,))
    mean = (1.0 + 1.2 + 0.9 + 5.0 + 5.4) / 5  # one level: the mean magnitude, which minimises the squared error
    assert torch.allclose(sign_only, torch.tensor([mean, -mean, mean, mean, -mean, 0, 0, 0]), atol=1e-6)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_bytes_are_exact_and_follow_density_and_bits(bits: int) -> None:
    tensor = torch.randn(128, 344)
    raw_bytes = 4 * tensor.numel()
    for density in (0.01, 0.02, 0.03, 0.5):
        codec = get_codec("sparse", density=density, bits=bits)
        msg = codec.compress(tensor, CompressionInfo.from_tensor(tensor))
        assert payload_bytes([msg]) == len(msg.buffer) == codec.payload_bytes_for(tensor.numel())
        ratio = codec.estimate_compression_ratio(CompressionInfo.from_tensor(tensor))
        assert ratio == pytest.approx(len(msg.buffer) / raw_bytes)
        k, n_chunks = round(density * 4096), -(-tensor.numel() // 4096)
        index_bits = 8.0 * index_coding.index_bytes(index_coding.best_coding(n_chunks, k, 4096), n_chunks, k, 4096)
        assert index_bits / (n_chunks * k) <= 2 + max(1.0, np.log2(1 / density))  # Elias–Fano, or the bitmap
        whole_chunks = torch.randn(8 * 4096)  # the share memory plans and benchmarks use: the same bytes
        share = payload_share(density, bits, 4096) * 4 * whole_chunks.numel() + 24
        assert share == pytest.approx(len(codec.compress(whole_chunks, CompressionInfo.from_tensor(whole_chunks))
                                          .buffer), rel=0.01, abs=4 * 8)  # (indices round per tensor)
    two_bit = [1 / get_codec("sparse", density=d, bits=2).estimate_compression_ratio(
        CompressionInfo.from_tensor(tensor)) for d in (0.01, 0.02, 0.03)]
    assert [round(r) for r in two_bit] == [248, 148, 107]  # the figures in the module docstring


def test_index_codings_round_trip_and_the_smaller_one_is_chosen() -> None:
    rng = np.random.default_rng(0)
    for chunk, k in ((4096, 41), (4096, 123), (4096, 2048), (100, 100), (1, 1), (5000, 3)):
        rows = np.sort(np.stack([rng.choice(chunk, size=k, replace=False) for _ in range(3)]), axis=1)
        coding, data = index_coding.encode_indices(rows, chunk)
        assert coding == index_coding.best_coding(3, k, chunk)
        assert len(data) == index_coding.index_bytes(coding, 3, k, chunk)
        assert np.array_equal(index_coding.decode_indices(data, 0, coding, 3, k, chunk), rows)
    assert index_coding.best_coding(1, 41, 4096) == index_coding.ELIAS_FANO
    assert index_coding.best_coding(1, 2048, 4096) == index_coding.BITMAP
    assert index_coding.index_bytes(index_coding.ELIAS_FANO, 1, 41, 4096) * 8 / 41 < 9  # 8.6 bits per index
    values = rng.integers(0, 2**5, size=50)
    assert np.array_equal(index_coding.unpack_uint(index_coding.pack_uint(values, 5), 0, 50, 5), values)


def _corrupt(msg: object, buffer: bytes) -> object:
    bad = type(msg)()  # type: ignore[operator]
    bad.CopyFrom(msg)
    bad.buffer = buffer
    return bad


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("density", [0.02, 0.5])  # Elias–Fano and bitmap indices
def test_fuzzed_payloads_decode_to_a_valid_tensor_or_raise_value_error(bits: int, density: float) -> None:
    tensor = torch.randn(3, 700, generator=torch.Generator().manual_seed(bits))
    msg = _encode(tensor, density=density, bits=bits, chunk_size=512)
    rng = random.Random(bits)
    for _ in range(300):
        buffer = bytearray(msg.buffer)
        if rng.random() < 0.3:
            buffer = buffer[: rng.randrange(len(buffer))]
        else:
            for _ in range(rng.randint(1, 6)):
                where = rng.randrange(min(len(buffer), HEADER.size + 64) if rng.random() < 0.5 else len(buffer))
                buffer[where] = rng.randrange(256)
        try:
            decoded = decode("sparse", _corrupt(msg, bytes(buffer)), expected_shape=(3, 700))
        except ValueError:
            continue
        assert decoded.shape == (3, 700) and bool(torch.isfinite(decoded).all())


def _with_header(msg: object, **fields: int) -> object:
    magic, bits, coding, zero, chunk, k, numel = HEADER.unpack_from(msg.buffer)  # type: ignore[attr-defined]
    values = dict(bits=bits, coding=coding, zero=zero, chunk=chunk, k=k, numel=numel) | fields
    header = HEADER.pack(magic, values["bits"], values["coding"], values["zero"], values["chunk"], values["k"],
                         values["numel"])
    return _corrupt(msg, header + msg.buffer[HEADER.size:])  # type: ignore[attr-defined]


def test_malformed_headers_scales_and_indices_raise_value_error() -> None:
    tensor = torch.randn(2, 512, generator=torch.Generator().manual_seed(5))
    tensor[:, :26] += 100.0  # the kept indices are 0..25 in both chunks: high parts 0 (0..15) and 1 (16..25)
    msg = _encode(tensor, density=0.05, bits=2, chunk_size=512)  # 2 chunks, k = 26, Elias–Fano
    _, _, coding, _, chunk, k, _ = HEADER.unpack_from(msg.buffer)
    assert (coding, chunk, k) == (index_coding.ELIAS_FANO, 512, 26)
    scales, low_bits = HEADER.size, HEADER.size + 16
    nan, negative = struct.pack("<f", float("nan")), struct.pack("<f", -1.0)
    bad = {
        "magic": _corrupt(msg, b"XXXX" + msg.buffer[4:]),
        "bits 0": _with_header(msg, bits=0), "bits 9": _with_header(msg, bits=9), "bits 4": _with_header(msg, bits=4),
        "unknown coding": _with_header(msg, coding=2), "bitmap coding": _with_header(msg, coding=index_coding.BITMAP),
        "reserved field": _with_header(msg, zero=1), "chunk above numel": _with_header(msg, chunk=2048),
        "chunk 0": _with_header(msg, chunk=0), "k above chunk": _with_header(msg, k=600), "k 0": _with_header(msg, k=0),
        "declared numel": _with_header(msg, numel=1023),
        "nan level": _corrupt(msg, msg.buffer[:scales] + nan + msg.buffer[scales + 4:]),
        "negative level": _corrupt(msg, msg.buffer[:scales] + negative + msg.buffer[scales + 4:]),
        "inverted levels": _corrupt(msg, msg.buffer[:scales] + msg.buffer[scales + 4: scales + 8]
                                    + msg.buffer[scales: scales + 4] + msg.buffer[scales + 8:]),
        "trailing byte": _corrupt(msg, msg.buffer + b"\0"),
        "missing byte": _corrupt(msg, msg.buffer[:-1]),
    }
    lows = bytearray(msg.buffer)
    lows[low_bits: low_bits + 4] = b"\xff\xff\xff\xff"  # the first 8 indices' low bits all ones: 15 eight times
    bad["repeated or unsorted indices"] = _corrupt(msg, bytes(lows))
    highs = bytearray(msg.buffer)
    high_start = low_bits + index_coding.packed_bytes(2 * 26 * index_coding.low_bits(26, 512))
    highs[high_start] ^= 0xFF  # the first high-part byte: the count of set bits changes
    bad["set bits"] = _corrupt(msg, bytes(highs))
    moved = bytearray(msg.buffer)  # chunk 0's last index (25: high part 1, bit 1 + 25) moved to the vector's end,
    for position, on in ((26, False), (57, True)):  # bit 57 of 26 + 32: high part 32, index 512 >= chunk
        moved[high_start + position // 8] ^= 0x80 >> (position % 8)
        assert bool(moved[high_start + position // 8] & (0x80 >> (position % 8))) == on
    bad["index out of range"] = _corrupt(msg, bytes(moved))
    for what, payload in bad.items():
        if what == "bits 4":  # another width fits no longer in the same bytes
            assert len(payload.buffer) != get_codec("sparse", density=0.05, bits=4, chunk_size=512).payload_bytes_for(
                1024)
        with pytest.raises(ValueError):
            decode("sparse", payload, expected_shape=(2, 512))
            pytest.fail(f"accepted a payload with a bad {what}")


def test_a_huge_declared_shape_is_refused_before_anything_is_allocated() -> None:
    msg = _encode(torch.randn(4096), density=0.01)
    huge = _with_header(msg, numel=2**40)
    del huge.size[:]  # type: ignore[attr-defined]
    huge.size.extend([2**20, 2**20])  # type: ignore[attr-defined]
    started = time.perf_counter()
    with pytest.raises(ValueError):
        decode("sparse", huge)
    with pytest.raises(ValueError):
        decode("sparse", huge, expected_shape=(4096,))
    assert time.perf_counter() - started < 1.0


def test_options_are_checked() -> None:
    for options in ({"density": 0.0}, {"density": 1.5}, {"bits": 0}, {"bits": 9}, {"chunk_size": 0},
                    {"chunk_size": 65537}, {"rank": 3}):
        with pytest.raises(ConfigError):
            get_codec("sparse", **options)
    with pytest.raises(ValueError):
        get_codec("sparse").compress(torch.tensor([1.0, float("inf")]), CompressionInfo.from_tensor(torch.ones(2)))


def test_the_adaptive_choice_sizes_the_sparse_codec_to_the_link() -> None:
    raw_bytes, budget_s = 100_000_000, 10.0
    everything = ("fp16", "int8", "topk", "sparse")
    assert choose_codec_for_link(raw_bytes, 1e9, budget_s, available=everything).name == "fp16"
    choice = choose_codec_for_link(raw_bytes, 1e5, budget_s, available=everything)  # 1 MB for 100 MB: 1/100
    assert choice.name == "sparse"
    fits = get_codec("sparse", density=choice.density).payload_bytes_for(raw_bytes // 4)
    denser = get_codec("sparse", density=choice.density + 1 / 4096).payload_bytes_for(raw_bytes // 4)
    assert fits <= 1e6 < denser
    assert choose_codec_for_link(raw_bytes, 1e5, budget_s, available=("fp16", "topk")).name == "topk"
