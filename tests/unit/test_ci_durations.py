""".ci/durations.py, the 3 s rule in CI: it reads pytest's --durations lines and finds the calls over
the limit, with an allowance that grows with the machine's load."""

from __future__ import annotations

from ..conftest import load_script


def _durations():
    return load_script(".ci/durations.py", "ci_durations")


def test_calls_over_the_limit_are_found_and_setup_is_not_counted():
    """A call over the limit is reported, one under it and a slow setup are not; the allowance is 2
    on a quiet machine and 1.5 x the load per core on a busy one."""
    durations = _durations()
    log = (
        "7.10s call     tests/unit/test_a.py::test_slow\n"
        "12.00s setup    tests/unit/test_a.py::test_fixture\n"
        "5.90s call     tests/unit/test_b.py::test_fine\n"
        "1 passed in 9.00s\n"
    )
    assert durations.over_limit(log, 6.0) == [(7.1, "tests/unit/test_a.py::test_slow")]
    assert durations.allowance(0.5, 2) == 2.0 and durations.allowance(6.0, 2) == 4.5


def test_the_allowance_takes_the_busiest_minute_the_fast_tier_saw():
    """The load comes from the samples .ci/run took during the fast tier, their highest 1-minute
    value, not the load when the tier ended; no samples, no value."""
    durations = _durations()
    samples = "1.20 1.00 0.90 2/300 10\n5.60 2.00 1.00 4/301 11\n3.00 2.50 1.10 3/302 12\n"
    assert durations.peak_load(samples) == 5.6
    assert durations.peak_load("") is None
