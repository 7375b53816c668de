"""Gossip partners whose exchanges failed sit out 1, 2, 4 ... rounds, up to a cap (a far higher one for a partner that
never completed an exchange with us); an exchange that ends well (either side opened it) forgets their failures,
and a partner gone from the live set is forgotten once its rounds are over."""

from __future__ import annotations

from p2ptrain.sync.failed_partners import MAX_SKIPPED_ROUNDS, MAX_STRANGER_SKIPPED_ROUNDS, FailedPartners


def rounds_drawn(partners: FailedPartners, rounds: range, fails: bool = True) -> list[int]:
    drawn = []
    for round_ in rounds:
        if partners.drawable(["x"], round_):
            drawn.append(round_)
            if fails:
                partners.failed_("x", round_)
    return drawn


def gaps(drawn: list[int]) -> list[int]:
    return [later - earlier for earlier, later in zip(drawn, drawn[1:], strict=False)]


def test_a_dead_partner_we_mixed_with_is_drawn_ever_more_rarely_up_to_the_cap() -> None:
    partners = FailedPartners()
    partners.reached_("x")
    drawn = gaps(rounds_drawn(partners, range(40)))
    assert drawn[:3] == [2, 3, 5]  # skips 1, 2, then 4 rounds
    assert set(drawn[3:]) == {MAX_SKIPPED_ROUNDS + 1}


def test_a_partner_that_never_completed_an_exchange_is_skipped_ever_longer_and_its_deadline_never_grows() -> None:
    """An identity that takes our offers and never answers: 9 deadlines in 200 rounds, where a partner we mixed with
    before (cut off since) costs 41; and each a set-up floor: its time-outs bound no link."""
    stranger = FailedPartners()
    drawn = rounds_drawn(stranger, range(200))
    assert gaps(drawn) == [2, 3, 5, 9, 17, 33, MAX_STRANGER_SKIPPED_ROUNDS + 1, MAX_STRANGER_SKIPPED_ROUNDS + 1]
    assert not stranger.slow_if_timed_out("x")
    known = FailedPartners()
    known.reached_("x")
    assert not known.slow_if_timed_out("x")  # its first time-out in a row: it may be gone
    assert len(drawn) == 9 and len(rounds_drawn(known, range(200))) == 41
    assert known.slow_if_timed_out("x")


def test_partners_remembered_as_known_are_bounded() -> None:
    partners = FailedPartners(max_known=3)
    for name in "abcd":
        partners.reached_(name)
    assert list(partners.known) == ["b", "c", "d"]


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
