"""The verified reduce-scatter (sync/scatter_allreduce.py, maths/chunk_check.py): the check's arithmetic by hand
(an honest chunk's sketches sum to zero, a lie does not, and what a cancelled lie can be at most), malformed claims;
then real P2P nodes: an honest group gets the exact mean at an ideal all-reduce's bytes, and a lying owner, a lying
sketch or a dead member sends the round to the all-to-all, where the honest members still get the exact mean and
the liar is banned."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import types
from typing import Any

import pytest
import torch
from swarm_utils import run_swarm, shutdown, start_p2ps, tiny_config

from p2ptrain.errors import ConfigError
from p2ptrain.maths import chunk_check
from p2ptrain.maths.centered_clip import RobustMean, centered_clip_rows_
from p2ptrain.maths.mixing import exact_average
from p2ptrain.net.exchange import serve_exchanges
from p2ptrain.sync.config import SyncConfig
from p2ptrain.sync.scatter_allreduce import FALLBACK, ChunkMean, ScatterAllReduce, View, chunks_of
from p2ptrain.tensor_layout import distance, norm

RUN, FINGERPRINT = "scatter-allreduce-test", "fp-1"
SHAPES = [(16, 8), (8,)]  # 136 values: chunks of 34 for 4 members


def deltas(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator) for s in SHAPES]


# ---- the check's arithmetic --------------------------------------------------------------------------------------


def test_chunks_cover_the_flat_values_in_equal_zero_padded_parts():
    sent = [torch.arange(10.0).view(2, 5), torch.arange(3.0)]
    chunks = chunks_of(sent, ["a", "b", "c", "d"])
    assert [c.numel() for c in chunks.values()] == [4, 4, 4, 4]
    assert torch.equal(torch.cat(list(chunks.values()))[:13], torch.cat([t.reshape(-1) for t in sent]))
    assert not torch.cat(list(chunks.values()))[13:].any()
    view = View.of(list(chunks), chunks, {o: ChunkMean(0.0, (o,), (1.0,), ("0" * 64,)) for o in chunks})
    assert all(torch.equal(a, b) for a, b in zip(view.mean(sent), sent, strict=True))  # the padding is dropped


def chunk_inputs(members: int = 6, length: int = 500, outlier: float = 30.0) -> torch.Tensor:
    """Rows of one chunk: honest noise around a common direction, and one far input (CenteredClip clips it)."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(members, length, generator=generator) + torch.randn(length, generator=generator)
    rows[-1] *= outlier
    return rows


def reduced(rows: torch.Tensor) -> tuple[torch.Tensor, float]:
    result = centered_clip_rows_(rows.clone(), [rows[0]], 2.0, chunk_check.MAX_ITERATIONS, chunk_check.CONVERGED)
    return result.mean[0], result.radius


def claims(rows: torch.Tensor, mean: torch.Tensor, radius: float, seed: bytes = b"s") -> dict[str, list[float]]:
    layout = chunk_check.sketch_layout(seed, rows.shape[1])
    return {f"m{i}": chunk_check.sketch(chunk_check.residual(row, mean, radius), layout) for i, row in enumerate(rows)}


def test_an_honest_chunk_mean_passes_and_a_shifted_one_fails():
    rows = chunk_inputs()
    mean, radius = reduced(rows)
    lengths = rows.norm(dim=1).tolist()
    clipped = [float((row - mean).norm()) > radius for row in rows]
    assert clipped[-1] and not any(clipped[:-1])  # the check covers a mean CenteredClip had to iterate for
    assert chunk_check.judge_sketches(claims(rows, mean, radius), radius, lengths) is None
    shift = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(9))
    lie = mean + shift * (0.2 * radius / float(shift.norm()))  # a fifth of τ
    why = chunk_check.judge_sketches(claims(rows, lie, radius), radius, lengths)
    assert why is not None and "not their CenteredClip" in why


@pytest.mark.parametrize("shift_in_radii, caught", [(0.01, False), (2.0, True), (20.0, True)])
def test_an_owner_cancelling_its_lie_with_its_own_claim_gets_away_with_a_few_hundredths_of_tau_at_most(
        shift_in_radii: float, caught: bool):
    """The owner holds every input of its chunk, so it can compute the others' sketches and claim the one that
    cancels them; its claim is then as long as m × the lie, and a claim may be CLAIM_SLACK × τ long at most."""
    rows = chunk_inputs(members=6)
    mean, radius = reduced(rows)
    shift = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(5))
    lie = mean + shift * (shift_in_radii * radius / float(shift.norm()))
    honest = claims(rows[1:], lie, radius)
    honest["owner"] = [-math.fsum(column) for column in zip(*honest.values(), strict=True)]
    why = chunk_check.judge_sketches(honest, radius, rows.norm(dim=1).tolist())
    assert (why is not None) == caught, why
    if caught:
        assert "owner's residual sketch" in why  # type: ignore[operator]


@pytest.mark.parametrize("robust", [True, False])
def test_an_owner_reports_lengths_a_member_can_check_at_the_base_presets_chunk_size(robust: bool):
    """A member checks that the owner reduced its chunk by hash and by length (within 1e-4). The base preset's
    chunk of 4 holds 6.4M values: in fp32 the Gram diagonal was 3.8e-4 and `Tensor.norm` 1.3e-4 off the exact
    length, so every member found one owner "misreporting" its input every round and fell back to the all-to-all
    (4.5 S sent a round where 1.5 S is ideal). Both sides now accumulate in fp64."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 6_359_296, generator=generator).mul_(1e-4).add_(1e-4)
    config = SyncConfig(robust=robust)
    owner = types.SimpleNamespace(config=config)
    result = ScatterAllReduce._chunk_mean(owner, rows.clone()) if not robust else \
        centered_clip_rows_(rows.clone(), [rows[0]], config.clip_multiplier, chunk_check.MAX_ITERATIONS,
                            chunk_check.CONVERGED)
    for length, row in zip(result.lengths, rows, strict=True):
        exact = math.sqrt(float(row.double().pow(2).sum()))
        assert math.isclose(length, exact, rel_tol=1e-9) and math.isclose(norm([row]), exact, rel_tol=1e-9)


def test_a_radius_beyond_what_centered_clip_could_have_is_refused():
    assert chunk_check.radius_problem(2.0, [1.0, 1.0, 1.2], 2.0) is None
    assert chunk_check.radius_problem(100.0, [1.0, 1.0, 1.2], 2.0) is not None  # nothing would be clipped
    assert chunk_check.radius_problem(float("nan"), [1.0], 2.0) is not None


def test_a_members_sketch_matches_only_the_residual_of_its_own_input():
    rows = chunk_inputs()
    mean, radius = reduced(rows)
    exact = claims(rows, mean, radius)
    lengths = rows.norm(dim=1).tolist()
    assert chunk_check.sketch_matches(exact["m0"], exact["m0"], radius, lengths)
    assert not chunk_check.sketch_matches([v * 1.1 for v in exact["m0"]], exact["m0"], radius, lengths)
    assert chunk_check.sketch_layout(b"a", 64)[0].tolist() != chunk_check.sketch_layout(b"b", 64)[0].tolist()


@pytest.mark.parametrize("value", [
    None, [], {"radius": 1.0}, {"radius": -1.0, "members": ["a"], "lengths": [1.0], "hashes": ["0" * 64]},
    {"radius": 1.0, "members": ["b", "a"], "lengths": [1.0, 1.0], "hashes": ["0" * 64] * 2},  # not sorted
    {"radius": 1.0, "members": ["a", "a"], "lengths": [1.0, 1.0], "hashes": ["0" * 64] * 2},  # twice
    {"radius": 1.0, "members": ["a"], "lengths": [float("inf")], "hashes": ["0" * 64]},
    {"radius": 1.0, "members": ["a"], "lengths": [1.0], "hashes": ["xyz"]},
    {"radius": True, "members": ["a"], "lengths": [1.0], "hashes": ["0" * 64]},
    {"radius": 1.0, "members": ["a"] * 40, "lengths": [1.0] * 40, "hashes": ["0" * 64] * 40},
])
def test_malformed_chunk_claims_are_refused(value: Any):
    assert ChunkMean.parse(value) is None
    assert not chunk_check.is_sketch([1.0] * (chunk_check.SKETCH_BUCKETS - 1))
    assert not chunk_check.is_sketch([float("nan")] * chunk_check.SKETCH_BUCKETS)


def test_scatter_sends_the_codecs_whose_values_it_can_cut_into_chunks():
    assert SyncConfig(mode="diloco", allreduce_transport="scatter", grad_codec="fp16").allreduce_transport == "scatter"
    with pytest.raises(ConfigError, match="scatter"):
        SyncConfig(mode="diloco", allreduce_transport="scatter", grad_codec="sparse")


# ---- real P2P nodes ----------------------------------------------------------------------------------------------


def with_transports(count: int, scenario: Any, serving: int | None = None) -> None:
    """`count` transports on real P2P nodes; only the first `serving` answer exchanges (the rest are dead)."""
    async def main() -> None:
        p2ps = await start_p2ps(count)
        try:
            config = SyncConfig(mode="diloco", exchange_safety_factor=1.0, state_download_timeout_s=5.0)
            transports = [ScatterAllReduce(p, RUN, FINGERPRINT, deltas(0), config, "allreduce.diloco", None)
                          for p in p2ps]
            for t in transports[:serving]:
                await serve_exchanges(t.p2p, t.driver)
            await scenario(transports)
        finally:
            await shutdown(p2ps)

    asyncio.run(asyncio.wait_for(main(), timeout=120))


async def run_round(transports: list[ScatterAllReduce], round_: int, patience_s: float = 3.0) -> list[Any]:
    ids = [t.own_id for t in transports]
    return await asyncio.gather(*(t.gather(deltas(i + 10 * round_), [p for p in ids if p != t.own_id], round_,
                                           patience_s) for i, t in enumerate(transports)))


def assert_exact_mean(results: list[Any], round_: int, members: list[int]) -> None:
    mean = exact_average([deltas(i + 10 * round_) for i in members])
    for result in results:
        assert result.group_size == len(members) and not result.discarded
        assert distance(result.delta, mean) <= 1e-6 * norm(mean)
        assert all(torch.equal(a, b) for a, b in zip(result.delta, results[0].delta, strict=True))


@pytest.mark.network
def test_an_honest_group_gets_the_exact_mean_at_an_ideal_all_reduces_bytes():
    async def scenario(transports: list[ScatterAllReduce]) -> None:
        values = sum(math.prod(s) for s in SHAPES)
        ideal = 2 * 4 * values * (len(transports) - 1) / len(transports)
        for round_ in range(2):
            results = await run_round(transports, round_)
            assert_exact_mean(results, round_, list(range(4)))
            # the chunks' zero padding and the two digest stages' one-value tokens are the excess
            assert all(ideal <= r.bytes_sent <= 1.1 * ideal for r in results), [r.bytes_sent for r in results]
            assert all(t.previous is not None and len(t.previous.hashes) == 4 for t in transports)

    with_transports(4, scenario)


def lie_about_the_mean(transport: ScatterAllReduce) -> None:
    """Make `transport`, as an owner, return its chunk's mean moved by 3 × its radius."""
    plain = transport._chunk_mean

    def chunk_mean(self: ScatterAllReduce, rows: torch.Tensor) -> RobustMean:
        honest = plain(rows)
        moved = honest.mean[0] + 3 * honest.radius / math.sqrt(honest.mean[0].numel())
        return dataclasses.replace(honest, mean=[moved])

    transport._chunk_mean = types.MethodType(chunk_mean, transport)  # type: ignore[method-assign]


def lie_about_a_sketch(transport: ScatterAllReduce) -> None:
    """Make `transport` claim twice the sketch of its residuals."""
    plain = View.sketch

    def sketch(view: View, owner: str, input_: torch.Tensor) -> list[float]:
        values = plain(view, owner, input_)
        return [2 * v for v in values] if view is transport._lying_view else values

    plain_means = transport._means

    async def means(self: ScatterAllReduce, *args: Any) -> Any:
        view, problem = await plain_means(*args)
        if view is not None:
            self._lying_view = view  # type: ignore[attr-defined]
            view.sketch = types.MethodType(sketch, view)  # type: ignore[method-assign]
        return view, problem

    transport._means = types.MethodType(means, transport)  # type: ignore[method-assign]


@pytest.mark.network
@pytest.mark.parametrize("lie", [lie_about_the_mean, lie_about_a_sketch])
def test_a_liar_sends_the_round_to_the_all_to_all_and_is_banned(lie: Any):
    """Its own Δ is honest, so the fallback's mean is the exact mean of all four; with every input in hand, each
    honest member recomputes what it was told, finds the liar out and bans it: the next round is three members'."""
    async def scenario(transports: list[ScatterAllReduce]) -> None:
        liar = transports[2]
        lie(liar)
        results = await run_round(transports, 0)
        honest = [r for t, r in zip(transports, results, strict=True) if t is not liar]
        assert_exact_mean(honest, 0, [0, 1, 2, 3])
        offence = "false_mean" if lie is lie_about_the_mean else "false_sketch"
        for t in transports:
            if t is not liar:
                assert t.reputation.is_banned(liar.own_id), t.reputation.offences()
                assert offence in t.reputation.offences()[liar.own_id]
        honest_transports = [t for t in transports if t is not liar]
        ids = [t.own_id for t in transports]
        results = await asyncio.gather(*(t.gather(deltas(ids.index(t.own_id) + 10), ids, 1, 3.0)
                                         for t in honest_transports))
        assert_exact_mean(list(results), 1, [0, 1, 3])

    with_transports(4, scenario)


@pytest.mark.network
def test_a_member_whose_outer_gradient_is_far_is_clipped_in_every_chunk_and_penalised_by_every_honest_owner():
    async def scenario(transports: list[ScatterAllReduce]) -> None:
        ids = [t.own_id for t in transports]
        values = [deltas(i) for i in range(3)] + [[-1000 * t for t in deltas(3)]]
        results = await asyncio.gather(*(t.gather(v, [p for p in ids if p != t.own_id], 0, 3.0)
                                         for t, v in zip(transports, values, strict=True)))
        honest_mean = exact_average(values[:3])
        for t, result in zip(transports[:3], results[:3], strict=True):
            # banned as its first far chunk is reduced, the attacker is out of the rest of the round: every honest
            # member takes the honest members' mean (before, CenteredClip's, within τ/3 of it; the plain mean would be
            # ~2,900 away)
            assert result.group_size == 3 and not result.discarded  # checked: a far input is no lie
            assert distance(result.delta, honest_mean) < 1e-5 * norm(honest_mean)
            assert torch.equal(result.delta[0], results[0].delta[0])
            # ~500 τ away: a ban at once, at every honest member (a clip of a few τ costs 1 of the ban score)
            assert t.reputation.offences()[ids[3]] == {"clipped_far": 1}
            assert t.reputation.is_banned(ids[3])

    with_transports(4, scenario)


@pytest.mark.network
def test_a_pair_swaps_whole_outer_gradients_and_each_computes_the_mean_itself():
    async def scenario(transports: list[ScatterAllReduce]) -> None:
        results = await run_round(transports, 0)
        assert_exact_mean(results, 0, [0, 1])
        assert all(r.bytes_sent >= 4 * sum(math.prod(s) for s in SHAPES) for r in results)  # S each, not S/2
        assert all(t.driver.current is not None and t.driver.current.round % t.STAGES >= FALLBACK for t in transports)

    with_transports(2, scenario)


@pytest.mark.network
def test_a_member_that_never_answers_costs_one_fallback_and_the_others_get_their_mean():
    async def scenario(transports: list[ScatterAllReduce]) -> None:
        ids = [t.own_id for t in transports]
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(t.gather(deltas(i), [p for p in ids if p != t.own_id], 0, 2.0)
                                         for i, t in enumerate(transports[:3])))
        assert_exact_mean(list(results), 0, [0, 1, 2])
        assert asyncio.get_running_loop().time() - started < 10.0

    with_transports(4, scenario, serving=3)


@pytest.mark.network
def test_members_whose_views_of_the_group_differ_fall_back_together_and_stay_in_step():
    """One member still sees a peer that left (netns testnet): it cuts 5 chunks, the others 4, so its chunks are
    refused; it answered, though, so every member's fallback has all four, and all apply the same mean."""
    async def scenario(transports: list[ScatterAllReduce]) -> None:
        ids = [t.own_id for t in transports]
        live, gone = ids[:4], ids[4]
        views = [[p for p in live if p != me] + ([gone] if i == 0 else []) for i, me in enumerate(live)]
        results = await asyncio.gather(*(t.gather(deltas(i), view, 0, 2.0)
                                         for i, (t, view) in enumerate(zip(transports, views, strict=False))))
        assert_exact_mean(list(results), 0, [0, 1, 2, 3])

    with_transports(5, scenario, serving=4)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_diloco_swarm_on_the_scatter_transport_trains_in_step():
    config_ = tiny_config("scatter-diloco-swarm", run={"rounds": 6}, sync={"allreduce_transport": "scatter"})
    threads, histories = run_swarm(config_, peers=4)
    final = [t.params_after_round[5] for t in threads]
    for history in histories:
        print([round(m.val_loss, 3) for m in history], [m.peers_averaged for m in history],
              [m.bytes_sent for m in history])
        assert history[-1].val_loss < history[0].val_loss - 0.5
        assert sum(m.peers_averaged == 4 for m in history) >= 4
    assert all(distance(p, final[0]) <= 1e-6 * norm(final[0]) for p in final[1:])


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_factored_swarm_mixes_its_outer_gradients_by_reduce_scatter_in_groups_of_three():
    config_ = tiny_config("scatter-factored-swarm", run={"rounds": 5},
                          sync={"mode": "factored", "allreduce_transport": "scatter", "mix2_group_size": 3})
    threads, histories = run_swarm(config_, peers=3)
    for history in histories:
        print([round(m.val_loss, 3) for m in history], [m.peers_averaged for m in history])
        assert history[-1].val_loss < history[0].val_loss - 0.5
    # Mix2's group of three: every member reduces one chunk (a scatter of 2 or 1 would not show it)
    mix2 = [t.peer.sync.mix2.averager.exchange for t in threads]  # type: ignore[attr-defined]
    assert all(isinstance(t, ScatterAllReduce) and t.previous is not None and len(t.previous.hashes) == 3
               for t in mix2), [None if t.previous is None else len(t.previous.hashes) for t in mix2]
