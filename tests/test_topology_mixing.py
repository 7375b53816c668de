"""Gossip graphs and mixing weights: symmetry, double stochasticity, mean preservation, pair equality."""

from __future__ import annotations

import collections
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks.sim.graphs import (  # noqa: E402
    check_symmetric,
    complete_graph,
    edges,
    mix_,
    mixing_matrix,
    mixing_weights,
    pair_average_,
    random_cycle_graph,
    random_matching,
)
from p2ptrain.errors import StateMismatchError  # noqa: E402
from p2ptrain.maths.mixing import consensus_distance, exact_average, metropolis_weight  # noqa: E402
from p2ptrain.maths.topology import draw_order_by_host  # noqa: E402

SEEDS = range(40)
SIZES = [1, 2, 3, 4, 5, 8, 9]


def _peer_states(n: int, seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randn(3, 4, generator=generator, dtype=torch.float64),
            torch.randn(5, generator=generator, dtype=torch.float64),
        ]
        for _ in range(n)
    ]


def _gossip_round(states: list[list[torch.Tensor]], neighbours: list[list[int]]) -> list[list[torch.Tensor]]:
    """One synchronous round: every peer mixes its own copy with its neighbours' pre-round values (fake exchange)."""
    before = [[t.clone() for t in state] for state in states]
    after = [[t.clone() for t in state] for state in states]
    for i, own in enumerate(after):
        mix_(own, [before[j] for j in neighbours[i]], mixing_weights(neighbours, i))
    return after


def test_complete_graph_lists_every_other_peer() -> None:
    assert complete_graph(1) == [[]]
    assert complete_graph(3) == [[1, 2], [0, 2], [0, 1]]


@pytest.mark.parametrize("n", SIZES)
def test_random_matching_is_a_matching(n: int) -> None:
    for seed in SEEDS:
        neighbours = random_matching(n, random.Random(seed))
        check_symmetric(neighbours)
        assert all(len(peers) <= 1 for peers in neighbours)
        alone = [i for i, peers in enumerate(neighbours) if not peers]
        assert len(alone) == n % 2
        assert len(edges(neighbours)) == n // 2


def test_random_matching_varies_with_the_seed() -> None:
    matchings = {tuple(edges(random_matching(8, random.Random(seed)))) for seed in SEEDS}
    assert len(matchings) > 10


@pytest.mark.parametrize("n", SIZES)
def test_random_cycle_graph_gives_two_distinct_partners(n: int) -> None:
    for seed in SEEDS:
        neighbours = random_cycle_graph(n, random.Random(seed))
        check_symmetric(neighbours)
        assert all(len(peers) == min(2, n - 1) for peers in neighbours)
        if n >= 3:  # a single Hamiltonian cycle: walking it visits every peer once
            visited, previous, current = [0], None, 0
            for _ in range(n - 1):
                step = next(j for j in neighbours[current] if j != previous)
                previous, current = current, step
                visited.append(current)
            assert sorted(visited) == list(range(n))


def test_check_symmetric_rejects_bad_graphs() -> None:
    for bad in ([[1], []], [[0]], [[1, 1], [0]], [[5], []]):
        with pytest.raises(ValueError):
            check_symmetric(bad)


def test_mixing_matrix_hand_computed_path() -> None:
    # path 0 - 1 - 2: degrees 1, 2, 1 → every edge weight 1/(1 + 2) = 1/3
    matrix = mixing_matrix([[1], [0, 2], [1]], 3)
    expected = torch.tensor([[2 / 3, 1 / 3, 0.0], [1 / 3, 1 / 3, 1 / 3], [0.0, 1 / 3, 2 / 3]], dtype=torch.float64)
    torch.testing.assert_close(matrix, expected)


def test_mixing_matrix_uniform_on_regular_graphs() -> None:
    assert metropolis_weight(1, 1) == 0.5
    assert metropolis_weight(2, 2) == pytest.approx(1 / 3)
    torch.testing.assert_close(mixing_matrix(complete_graph(4), 4), torch.full((4, 4), 0.25, dtype=torch.float64))
    cycle = random_cycle_graph(7, random.Random(0))
    matrix = mixing_matrix(cycle, 7)
    assert int((matrix > 0).sum()) == 7 * 3  # self + two partners per row
    torch.testing.assert_close(matrix[matrix > 0], torch.full((21,), 1 / 3, dtype=torch.float64))


@pytest.mark.parametrize("make_graph", [random_matching, random_cycle_graph])
def test_mixing_matrices_symmetric_and_doubly_stochastic(make_graph) -> None:  # type: ignore[no-untyped-def]
    graphs = [make_graph(n, random.Random(seed)) for n in SIZES for seed in SEEDS]
    graphs += [[[1, 2, 3], [0], [0], [0]], [[1], [0, 2], [1, 3], [2]]]  # a star and a path: irregular
    for neighbours in graphs:
        n = len(neighbours)
        matrix = mixing_matrix(neighbours, n)
        torch.testing.assert_close(matrix, matrix.T)
        torch.testing.assert_close(matrix.sum(dim=0), torch.ones(n, dtype=torch.float64))
        torch.testing.assert_close(matrix.sum(dim=1), torch.ones(n, dtype=torch.float64))
        assert bool((matrix >= 0).all())


@pytest.mark.parametrize("make_graph", [random_matching, random_cycle_graph, lambda n, rng: complete_graph(n)])
def test_gossip_round_preserves_the_swarm_mean(make_graph) -> None:  # type: ignore[no-untyped-def]
    for n in SIZES:
        for seed in SEEDS:
            states = _peer_states(n, seed)
            mixed = _gossip_round(states, make_graph(n, random.Random(seed)))
            for before, after in zip(exact_average(states), exact_average(mixed), strict=True):
                torch.testing.assert_close(after, before, rtol=0, atol=1e-12)


def test_mix_equals_the_mixing_matrix_product() -> None:
    neighbours = [[1, 2, 3], [0], [0, 3], [0, 2]]
    states = _peer_states(4, seed=7)
    mixed = _gossip_round(states, neighbours)
    matrix = mixing_matrix(neighbours, 4)
    stacked = torch.stack([state[0] for state in states])  # (peers, 3, 4)
    expected = torch.einsum("ij,jab->iab", matrix, stacked)
    for i in range(4):
        torch.testing.assert_close(mixed[i][0], expected[i], rtol=0, atol=1e-12)


def test_complete_graph_round_is_exact_averaging() -> None:
    states = _peer_states(5, seed=3)
    mixed = _gossip_round(states, complete_graph(5))
    for state in mixed:
        for tensor, mean in zip(state, exact_average(states), strict=True):
            torch.testing.assert_close(tensor, mean, rtol=0, atol=1e-12)


def test_a_pair_ends_bit_identical() -> None:
    generator = torch.Generator().manual_seed(0)
    a = [torch.randn(17, generator=generator), torch.randn(2, 3, generator=generator)]
    b = [torch.randn(17, generator=generator), torch.randn(2, 3, generator=generator)]
    expected = [(x + y) / 2 for x, y in zip(a, b, strict=True)]
    # each end applies mix_ with weight 1/2 to its own copy, as two peers would
    a_end, b_end = [t.clone() for t in a], [t.clone() for t in b]
    mix_(a_end, [b], [0.5])
    mix_(b_end, [a], [0.5])
    for x, y, mean in zip(a_end, b_end, expected, strict=True):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, mean)
    pair_average_(a, b)
    for x, y, mean in zip(a, b, expected, strict=True):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, mean)


def test_mixing_an_empty_list_is_the_identity() -> None:
    own = [torch.randn(4), torch.randn(2, 2)]
    before = [t.clone() for t in own]
    mix_(own, [], [])
    assert all(torch.equal(x, y) for x, y in zip(own, before, strict=True))


def test_bad_neighbour_leaves_own_untouched() -> None:
    own = [torch.randn(4), torch.randn(2, 2)]
    before = [t.clone() for t in own]
    good, bad = [torch.zeros(4), torch.zeros(2, 2)], [torch.zeros(4), torch.zeros(3)]
    with pytest.raises(StateMismatchError):
        mix_(own, [good, bad], [0.25, 0.25])
    with pytest.raises(StateMismatchError):
        mix_(own, [good[:1]], [0.5])
    with pytest.raises(ValueError):
        mix_(own, [good], [0.5, 0.5])
    with pytest.raises(ValueError):
        mix_(own, [good, good], [0.75, 0.75])
    assert all(torch.equal(x, y) for x, y in zip(own, before, strict=True))


def test_consensus_distance_hand_computed() -> None:
    a = [torch.tensor([3.0]), torch.tensor([4.0])]  # ‖a‖ = 5
    b = [torch.tensor([3.0]), torch.tensor([3.0])]  # ‖a − b‖ = 1
    assert consensus_distance(a, b) == pytest.approx(0.2)
    assert consensus_distance(a, a) == 0.0
    zero = [torch.zeros(1), torch.zeros(1)]
    assert consensus_distance(zero, zero) == 0.0
    assert consensus_distance(zero, b) == float("inf")


def test_repeated_gossip_reaches_consensus() -> None:
    states = _peer_states(8, seed=1)
    mean = exact_average(states)
    rng = random.Random(1)
    start = max(consensus_distance(mean, state) for state in states)
    for _ in range(30):
        states = _gossip_round(states, random_cycle_graph(8, rng))
    assert max(consensus_distance(mean, state) for state in states) < 1e-3 * start


def test_a_draw_takes_every_candidate_once_in_random_order() -> None:
    candidates = ["a", "b", "c", "d", "e", "b"]
    for seed in SEEDS:
        assert sorted(draw_order_by_host(candidates, {}, random.Random(seed))) == ["a", "b", "c", "d", "e"]
    assert draw_order_by_host([], {}, random.Random(0)) == []
    assert draw_order_by_host(candidates, {}, random.Random(5)) == draw_order_by_host(candidates, {}, random.Random(5))
    assert len({draw_order_by_host(candidates, {}, random.Random(s))[0] for s in range(40)}) == 5


def test_a_hosts_identities_count_as_one_in_a_draw() -> None:
    """20 identities of one machine that never answer, beside 3 honest peers: drawn first 20 times in 23 when each
    identity counted, and the honest peers' rounds froze; a host's identities count as one. Peers of no known host
    (None: loopback, a circuit, not connected) are hosts of their own."""
    sybils = [f"sybil{i:02d}" for i in range(20)]
    hosts: dict[str, str | None] = {**{s: "203.0.113.7" for s in sybils}, "honest1": None, "honest2": "198.51.100.2"}
    firsts: collections.Counter[bool] = collections.Counter()
    for seed in range(2000):
        order = draw_order_by_host([*sybils, "honest0", "honest1", "honest2"], hosts, random.Random(seed))
        assert sorted(order) == sorted([*sybils, "honest0", "honest1", "honest2"])
        assert sum(p.startswith("sybil") for p in order[:4]) == 1  # one of the host's among the first 4
        firsts[order[0].startswith("sybil")] += 1
    assert 400 <= firsts[True] <= 600  # 1 in 4
