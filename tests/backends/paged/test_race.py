"""tgis.backends.paged.race: each contender's median time on a clock the test moves, one
unmeasured run first, and the fastest (a tie keeps the first)."""

from __future__ import annotations

import pytest

from tgis.backends.paged.race import race, winner


def test_each_contender_runs_once_unmeasured_then_its_median_counts() -> None:
    costs = {"a": [9.0, 2.0, 5.0, 3.0], "b": [1.0, 4.0, 4.0, 6.0]}
    now = [0.0]
    runs: list[str] = []

    def run(name: str) -> None:
        now[0] += costs[name][sum(1 for r in runs if r == name)]
        runs.append(name)

    times = race(("a", "b"), run, clock=lambda: now[0], repeats=3)
    assert runs == ["a"] * 4 + ["b"] * 4
    assert times == {"a": 3.0, "b": 4.0}  # medians of (2, 5, 3) and (4, 4, 6)
    assert winner(times) == "a"


def test_a_tie_keeps_the_first_and_nonsense_is_refused() -> None:
    assert winner({"triton": 1.0, "flash": 1.0}) == "triton"
    with pytest.raises(ValueError, match="at least one contender"):
        winner({})
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        race(("a",), lambda name: None, repeats=0)
