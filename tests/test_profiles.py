"""The long profile: tests and cases marked ``long`` are skipped unless ``PIPECUT_FUZZ=long``."""

from __future__ import annotations

from pathlib import Path

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
    # In a subprocess, as a run collects them (an in-process pytester's teardown took 12 s in a worker
    # that had imported the suite's modules).
    pytester.makepyfile(test_marked=SOURCE)
    pytester.makeconftest("""
        import profiles

        def pytest_configure(config):
            config.addinivalue_line("markers", "long: the long profile's")

        def pytest_collection_modifyitems(items):
            profiles.skip_long(items)
    """)
    if long:
        monkeypatch.setenv("PIPECUT_FUZZ", "long")
    else:
        monkeypatch.delenv("PIPECUT_FUZZ", raising=False)
    monkeypatch.delenv(profiles.BUDGET_VARIABLE, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(Path(profiles.__file__).parent))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs", "-v")
    if long:
        result.assert_outcomes(passed=4)
        return
    result.assert_outcomes(passed=2, skipped=2)  # collected all the same: the report names them
    result.stdout.fnmatch_lines(["*test_long SKIPPED*", "*test_case?2? SKIPPED*",
                                 f"SKIPPED*{profiles.SKIP_REASON}*"])


def test_in_profile_keeps_the_default_cases_and_names_unknown_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = {"a": 1, "b": 2, "c": 3}
    monkeypatch.setattr(profiles, "LONG", False)
    assert profiles.in_profile(cases, ["b"]) == {"a": 1, "c": 3}
    monkeypatch.setattr(profiles, "LONG", True)
    assert profiles.in_profile(cases, ["b"]) == cases
    with pytest.raises(KeyError, match="'d'"):
        profiles.in_profile(cases, ["b", "d"])


def test_over_budget_names_the_slow_tests_slowest_first_and_the_budget_is_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert profiles.over_budget({"a": 1.0, "b": 61.0, "c": 90.0, "d": 60.0}, 60) == [("c", 90.0), ("b", 61.0)]
    monkeypatch.setattr(profiles, "LONG", False)
    monkeypatch.delenv(profiles.BUDGET_VARIABLE, raising=False)
    assert profiles.budget() is None
    monkeypatch.setenv(profiles.BUDGET_VARIABLE, "60")
    assert profiles.budget() == 60.0
    monkeypatch.setattr(profiles, "LONG", True)  # the long profile has none
    assert profiles.budget() is None
    monkeypatch.setattr(profiles, "LONG", False)
    for bad in ("sixty", "0", "-5"):
        monkeypatch.setenv(profiles.BUDGET_VARIABLE, bad)
        with pytest.raises(ValueError, match=repr(bad)):
            profiles.budget()


@pytest.mark.parametrize("budget", ["0.3", "30"])
def test_a_run_with_a_test_over_budget_fails_after_its_report(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, budget: str
) -> None:
    pytester.makepyfile(test_sleepy="""
        import time

        def test_quick():
            pass

        def test_sleepy():
            time.sleep(0.6)
    """)
    monkeypatch.setenv(profiles.BUDGET_VARIABLE, budget)
    monkeypatch.delenv("PIPECUT_FUZZ", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(Path(profiles.__file__).parent))
    result = pytester.runpytest_subprocess("-p", "profiles", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    if budget == "30":
        assert result.ret == 0
        assert "budget of a default-profile test" not in result.stdout.str()
    else:
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.stdout.fnmatch_lines(["*over the 0.3 s budget of a default-profile test*",
                                     "*s  test_sleepy.py::test_sleepy"])
        assert "test_quick" not in result.stdout.str().split("budget of a default-profile test")[1]
