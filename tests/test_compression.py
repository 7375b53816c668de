"""Codecs round-trip within their stated bounds and reject bad payloads; error feedback; adaptive codec choice."""

from __future__ import annotations

import random

import pytest
import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor

from p2ptrain.errors import ConfigError
from p2ptrain.maths.codecs import (
    CODEC_NAMES,
    ErrorFeedback,
    compress_all,
    decode,
    decode_all,
    get_codec,
    relative_decode,
    relative_encode,
)
from p2ptrain.maths.codecs import (
    choose_codec_for_link as choose,
)
from p2ptrain.net.wire import payload_bytes

SHAPES = [(), (1,), (7,), (33, 17), (4096,), (3, 5000)]  # scalars, odd sizes, a partial last chunk


def _sample(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Gaussian values with a few large outliers, as outer gradients have."""
    generator = torch.Generator().manual_seed(seed)
    tensor = torch.randn(shape, generator=generator)
    flat = tensor.view(-1)
    flat[:: max(1, flat.numel() // 5)] *= 50.0
    return tensor


def _round_trip(name: str, tensor: torch.Tensor, **kwargs: float) -> torch.Tensor:
    msg = get_codec(name, **kwargs).compress(tensor, CompressionInfo.from_tensor(tensor))
    decoded = decode(name, msg, expected_shape=tensor.shape)
    assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
    return decoded


def _chunks(tensor: torch.Tensor, chunk_size: int) -> list[torch.Tensor]:
    flat = tensor.reshape(-1)
    chunk = max(1, min(chunk_size, flat.numel()))
    return list(flat.split(chunk))


@pytest.mark.parametrize("shape", SHAPES)
def test_none_is_exact(shape: tuple[int, ...]) -> None:
    tensor = _sample(shape, 0)
    assert torch.equal(_round_trip("none", tensor), tensor)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp16_within_bound(shape: tuple[int, ...]) -> None:
    tensor = _sample(shape, 1) * 1e-3
    error = (_round_trip("fp16", tensor) - tensor).abs()
    assert bool((error <= tensor.abs() * 2**-11 + 2**-25).all())


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_within_bound(shape: tuple[int, ...]) -> None:
    tensor = _sample(shape, 2)
    decoded = _round_trip("int8", tensor, chunk_size=1000)
    for original, restored in zip(_chunks(tensor, 1000), _chunks(decoded, 1000), strict=True):
        bound = original.abs().max() / 254 * (1 + 1e-5)
        assert float((restored - original).abs().max()) <= float(bound)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("density", [1 / 128, 0.05, 1.0])
def test_topk_keeps_the_largest_within_bound(shape: tuple[int, ...], density: float) -> None:
    tensor = _sample(shape, 3)
    decoded = _round_trip("topk", tensor, density=density, chunk_size=4096)
    chunk = max(1, min(4096, tensor.numel()))
    for original, restored in zip(_chunks(tensor, 4096), _chunks(decoded, 4096), strict=True):
        m = original.numel()  # the last chunk may be shorter: it is zero-padded, k stays that of a full chunk
        k = min(m, max(1, round(density * chunk)))
        kept = restored != 0
        assert int(kept.sum()) <= k
        if int(kept.sum()) < m:  # nothing dropped is larger than anything kept
            assert float(original[~kept].abs().max()) <= float(original[kept].abs().min())
        absmax = float(original.abs().max())
        assert float((restored[kept] - original[kept]).abs().max()) <= absmax / 254 * (1 + 1e-5)
        contraction = 1 - (k / m) * (1 - k / 254**2)
        assert float((restored - original).pow(2).sum()) <= contraction * float(original.pow(2).sum()) * (1 + 1e-5)


def test_topk_bytes_follow_density() -> None:
    tensor = torch.randn(256, 4096)
    raw_bytes = tensor.numel() * 4
    for density in (1 / 128, 1 / 32, 0.1):
        codec = get_codec("topk", density=density)
        sent = payload_bytes([codec.compress(tensor, CompressionInfo.from_tensor(tensor))])
        k = round(density * 4096)
        expected = 256 * (4 + 3 * k) / raw_bytes  # 3 bytes per kept entry + one fp32 scale per chunk
        assert sent / raw_bytes == pytest.approx(expected, rel=0.01)
        assert codec.estimate_compression_ratio(CompressionInfo.from_tensor(tensor)) == pytest.approx(expected)
    int8_bytes = payload_bytes([get_codec("int8").compress(tensor, CompressionInfo.from_tensor(tensor))])
    assert int8_bytes / raw_bytes == pytest.approx(0.25, rel=0.01)


def test_payload_bytes_count_the_tensor_data_without_the_protobuf_envelope() -> None:
    msgs = compress_all(get_codec("fp16"), [torch.randn(10), torch.randn(3, 3)])
    assert payload_bytes(msgs) == 2 * (10 + 9)  # fp16: 2 bytes per value
    assert payload_bytes(msgs) < sum(len(msg.SerializeToString()) for msg in msgs)


def test_fp16_payload_is_hivemind_format() -> None:
    tensor = torch.randn(20)
    msg = get_codec("fp16").compress(tensor, CompressionInfo.from_tensor(tensor))
    assert torch.equal(deserialize_torch_tensor(msg), decode("fp16", msg))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_truncated_or_corrupted_payloads_raise_value_error(name: str) -> None:
    tensor = torch.randn(3, 700)
    msg = get_codec(name, **({"chunk_size": 256} if name in ("int8", "topk") else {})).compress(
        tensor, CompressionInfo.from_tensor(tensor)
    )
    rng = random.Random(0)
    for _ in range(150):  # fuzz: decode returns a finite tensor of the right shape or raises ValueError
        bad = type(msg)()
        bad.CopyFrom(msg)
        buffer = bytearray(msg.buffer)
        if rng.random() < 0.5:
            buffer = buffer[: rng.randrange(len(buffer))]
        else:
            for _ in range(rng.randint(1, 8)):
                buffer[rng.randrange(min(len(buffer), 64 if rng.random() < 0.5 else len(buffer)))] = rng.randrange(256)
        bad.buffer = bytes(buffer)
        try:
            decoded = decode(name, bad, expected_shape=(3, 700))
        except ValueError:
            continue
        assert decoded.shape == (3, 700) and bool(torch.isfinite(decoded).all())
    for mutate in (
        lambda m: setattr(m, "buffer", m.buffer[:-1]),
        lambda m: setattr(m, "buffer", m.buffer + b"\0"),
        lambda m: setattr(m, "buffer", b""),
        lambda m: setattr(m, "dtype", "int64"),
        lambda m: m.size.append(2),
    ):
        bad = type(msg)()
        bad.CopyFrom(msg)
        mutate(bad)
        with pytest.raises(ValueError):
            decode(name, bad)
    with pytest.raises(ValueError):
        decode(name, msg, expected_shape=(700, 3))


def test_invalid_topk_contents_raise_value_error() -> None:
    tensor = torch.randn(2, 512)
    msg = get_codec("topk", density=0.25, chunk_size=512).compress(tensor, CompressionInfo.from_tensor(tensor))
    header, scales_end = 20, 20 + 2 * 4
    corruptions = {
        "magic": lambda b: b"XXXX" + b[4:],
        "index out of range": lambda b: b[:scales_end] + (600).to_bytes(2, "little") + b[scales_end + 2 :],
        "duplicate index": lambda b: b[:scales_end] + b[scales_end + 2 : scales_end + 4] * 2 + b[scales_end + 4 :],
        "nan scale": lambda b: b[:header] + bytes.fromhex("0000c07f") + b[header + 4 :],
        "negative scale": lambda b: b[:header] + bytes.fromhex("0000803f")[:3] + b"\xbf" + b[header + 4 :],
    }
    for what, corrupt in corruptions.items():
        bad = type(msg)()
        bad.CopyFrom(msg)
        bad.buffer = corrupt(msg.buffer)
        with pytest.raises(ValueError):
            decode("topk", bad)
            pytest.fail(f"accepted a payload with a bad {what}")
    with pytest.raises(ValueError):
        decode("unknown", msg)
    with pytest.raises(ValueError):
        decode("int8", msg)  # a topk payload is not an int8 one


def test_non_finite_values_are_refused_both_ways() -> None:
    tensor = torch.tensor([1.0, float("nan")])
    for name in CODEC_NAMES:
        with pytest.raises(ValueError):
            get_codec(name).compress(tensor, CompressionInfo.from_tensor(tensor))
    msg = get_codec("none").compress(torch.ones(2), CompressionInfo.from_tensor(torch.ones(2)))
    msg.buffer = torch.tensor([1.0, float("inf")]).numpy().tobytes()
    with pytest.raises(ValueError):
        decode("none", msg)


def test_get_codec_rejects_unknown_names_and_options() -> None:
    with pytest.raises(ConfigError):
        get_codec("zip")
    with pytest.raises(ConfigError):
        get_codec("topk", density=0.0)
    with pytest.raises(ConfigError):
        get_codec("fp16", density=0.5)


def test_decode_all_checks_count_and_shapes() -> None:
    like = [torch.zeros(3), torch.zeros(2, 2)]
    msgs = compress_all(get_codec("none"), like)
    assert [t.shape for t in decode_all("none", msgs, like)] == [(3,), (2, 2)]
    with pytest.raises(ValueError):
        decode_all("none", msgs[:1], like)
    with pytest.raises(ValueError):
        decode_all("none", msgs[::-1], like)


def _deltas(rounds: int, seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    drift = [torch.randn(4096, generator=generator), torch.randn(10, 30, generator=generator)]
    return [[d + 2 * torch.randn(d.shape, generator=generator) for d in drift] for _ in range(rounds)]


@pytest.mark.parametrize(("name", "options"), [("topk", {"density": 1 / 64}), ("sparse", {"density": 0.02, "bits": 2})])
def test_error_feedback_sum_sent_tracks_sum_of_deltas(name: str, options: dict[str, float]) -> None:
    rounds = _deltas(300, seed=0)
    feedback = ErrorFeedback(get_codec(name, **options), like=rounds[0])
    total_delta = [torch.zeros_like(d, dtype=torch.float64) for d in rounds[0]]
    total_sent = [torch.zeros_like(d, dtype=torch.float64) for d in rounds[0]]
    relative_gap = []
    for delta in rounds:
        _, sent = feedback.prepare(delta)
        feedback.commit_(sent)
        for a, d in zip(total_delta, delta, strict=True):
            a += d
        for a, s in zip(total_sent, sent, strict=True):
            a += s
        gap = sum(float((a - b).norm() ** 2) for a, b in zip(total_delta, total_sent, strict=True)) ** 0.5
        residual = sum(float(e.norm() ** 2) for e in feedback.residual) ** 0.5
        assert gap == pytest.approx(residual, rel=1e-3)  # Σ sent = Σ Δ − e exactly (β = 1)
        relative_gap.append(gap / sum(float(a.norm() ** 2) for a in total_delta) ** 0.5)
    if name == "topk":  # its stated contraction bounds the residual
        max_delta = max(sum(float(d.norm() ** 2) for d in delta) ** 0.5 for delta in rounds)
        contraction = (1 - (64 / 4096) * (1 - 64 / 254**2)) ** 0.5
        assert residual <= contraction / (1 - contraction) * max_delta
    assert relative_gap[-1] < 0.5 * relative_gap[len(rounds) // 4]  # Σ sent converges to Σ Δ
    assert relative_gap[-1] < 0.1


def test_failed_exchange_leaves_error_feedback_bit_identical() -> None:
    rounds = _deltas(4, seed=1)
    feedback = ErrorFeedback(get_codec("topk", density=1 / 32), like=rounds[0], decay=0.9)
    twin = ErrorFeedback(get_codec("topk", density=1 / 32), like=rounds[0], decay=0.9)
    for ef in (feedback, twin):
        ef.commit_(ef.prepare(rounds[0])[1])
    before = [e.clone() for e in feedback.residual]
    msgs, sent = feedback.prepare(rounds[1])  # the exchange of this payload fails: no commit_
    assert payload_bytes(msgs) > 0 and any(bool(s.any()) for s in sent)
    assert all(torch.equal(a, b) for a, b in zip(feedback.residual, before, strict=True))
    for ef in (feedback, twin):  # the retry behaves as if the failed attempt never happened
        ef.commit_(ef.prepare(rounds[2])[1])
    assert all(torch.equal(a, b) for a, b in zip(feedback.residual, twin.residual, strict=True))
    with pytest.raises(RuntimeError):
        feedback.commit_(sent)  # nothing pending any more


def test_error_feedback_state_dict_round_trip() -> None:
    rounds = _deltas(2, seed=2)
    feedback = ErrorFeedback(get_codec("int8"), like=rounds[0])
    feedback.commit_(feedback.prepare(rounds[0])[1])
    restored = ErrorFeedback(get_codec("int8"), like=rounds[0])
    restored.load_state_dict(feedback.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(feedback.residual, restored.residual, strict=True))
    with pytest.raises(ValueError):
        restored.load_state_dict({"decay": 1.0, "residual": [torch.zeros(3)]})


def test_relative_encoding_beats_plain_fp16_for_parameters() -> None:
    generator = torch.Generator().manual_seed(3)
    reference = [torch.randn(1000, generator=generator) * 10, torch.randn(5, 5, generator=generator)]
    params = [r + 1e-3 * torch.randn(r.shape, generator=generator) for r in reference]
    restored = relative_decode(relative_encode(params, reference), reference)
    plain = decode_all("fp16", compress_all(get_codec("fp16"), params), params)
    for p, r, q, ref in zip(params, restored, plain, reference, strict=True):
        diff = p - ref
        assert bool(((r - p).abs() <= diff.abs() * 2**-11 + 2**-25 + 1e-6 * p.abs()).all())  # fp32 sum rounding
        assert float((r - p).abs().max()) < 0.05 * float((q - p).abs().max())
    with pytest.raises(ValueError):
        relative_decode(relative_encode(params, reference), reference[::-1])


def test_adaptive_choice_follows_the_link() -> None:
    raw_bytes, budget_s = 100_000_000, 10.0
    assert choose(raw_bytes, 1e9, budget_s).name == "fp16"  # fast link: 100 MB fits easily
    assert choose(raw_bytes, 1e9, budget_s, available=CODEC_NAMES).name == "none"
    assert choose(raw_bytes, 3e6, budget_s).name == "int8"  # 30 MB budget: fp16 (50 MB) does not fit
    slow = choose(raw_bytes, 1e6, budget_s)  # 10 MB budget for 100 MB
    assert slow.name == "topk"
    k = (4 * 4096 * 0.1 - 4) // 3
    assert slow.density == pytest.approx(k / 4096)
    sample_numel = 64 * 4096
    sent = payload_bytes(compress_all(slow.make(), [torch.randn(sample_numel)])) * raw_bytes / (4 * sample_numel)
    assert 0.99 * 1e7 <= sent <= 1e7
    crawl = choose(raw_bytes, 1e2, budget_s)
    assert crawl.name == "topk" and crawl.density == 1 / 4096  # at least one entry per chunk
    assert choose(raw_bytes, 1e6, budget_s, available=("fp16", "int8")).name == "int8"
