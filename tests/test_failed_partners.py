"""Gossip partners whose exchanges failed sit out 1, 2, 4 ... rounds, up to a cap; an exchange that ends well (either
side opened it) forgets their failures, and a partner gone from the live set is forgotten once its rounds are over."""

from __future__ import annotations

from p2ptrain.sync.failed_partners import MAX_SKIPPED_ROUNDS, FailedPartners


def rounds_drawn(partners: FailedPartners, rounds: range, fails: bool = True) -> list[int]:
    drawn = []
    for round_ in rounds:
        if partners.drawable(["x"], round_):
            drawn.append(round_)
            if fails:
                partners.failed_("x", round_)
    return drawn


def test_a_dead_partner_is_drawn_ever_more_rarely_up_to_the_cap() -> None:
    drawn = rounds_drawn(FailedPartners(), range(40))
    gaps = [later - earlier for earlier, later in zip(drawn, drawn[1:], strict=False)]
    assert gaps[:3] == [2, 3, 5]  # skips 1, 2, then 4 rounds
    assert set(gaps[3:]) == {MAX_SKIPPED_ROUNDS + 1}


def test_an_exchange_that_ends_well_forgets_the_failures() -> None:
    partners = FailedPartners()
    for round_ in (0, 2, 5):
        partners.failed_("x", round_)
    partners.reached_("x")  # it opened an exchange with us, or ours went through
    assert partners.drawable(["x", "y"], 6) == ["x", "y"]
    partners.failed_("x", 6)
    assert partners.drawable(["x"], 7) == [] and partners.drawable(["x"], 8) == ["x"]  # one round again, not four


def test_the_table_holds_only_partners_that_failed_lately() -> None:
    partners = FailedPartners()
    for i in range(100):
        partners.failed_(f"gone{i}", 0)
    assert partners.drawable(["here"], 1) == ["here"] and len(partners.failed) == 100  # still sitting out
    assert partners.drawable(["here"], 2) == ["here"] and partners.failed == {}
