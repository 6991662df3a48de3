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
