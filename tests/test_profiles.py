"""The long profile: tests and cases marked ``long`` are skipped unless ``PIPECUT_FUZZ=long``."""

from __future__ import annotations

import pytest

import profiles

pytest_plugins = ["pytester"]

SOURCE = """
import pytest

@pytest.mark.long
def test_long():
    pass

def test_default():
    pass

@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.long)])
def test_case(n):
    pass
"""


@pytest.mark.parametrize("long", [False, True])
def test_long_items_are_skipped_outside_the_long_profile(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                         long: bool) -> None:
    items = pytester.getitems(SOURCE)
    monkeypatch.setattr(profiles, "LONG", long)
    profiles.skip_long(items)
    skipped = [item.name for item in items if item.get_closest_marker("skip") is not None]
    assert skipped == ([] if long else ["test_long", "test_case[2]"])
    assert all(m.kwargs["reason"] == profiles.SKIP_REASON for item in items for m in item.iter_markers("skip"))


def test_in_profile_keeps_the_default_cases_and_names_unknown_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = {"a": 1, "b": 2, "c": 3}
    monkeypatch.setattr(profiles, "LONG", False)
    assert profiles.in_profile(cases, ["b"]) == {"a": 1, "c": 3}
    monkeypatch.setattr(profiles, "LONG", True)
    assert profiles.in_profile(cases, ["b"]) == cases
    with pytest.raises(KeyError, match="'d'"):
        profiles.in_profile(cases, ["b", "d"])
