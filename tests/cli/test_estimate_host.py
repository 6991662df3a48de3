"""`sbp estimate --host-memory`: the host side of a placement against the given host, and the
result alone on stdout."""

from __future__ import annotations

from typer.testing import CliRunner

from sbpbench.cli import app

POINT = ["estimate", "--model", "tiny/qwen3", "--seq", "256", "--method", "streambp", "--checkpoints", "cpu"]


def test_a_placement_over_the_given_host_memory_says_how_much_it_needs():
    """Host buffers + process over --host-memory: a line with both numbers; progress stays off stdout."""
    result = CliRunner().invoke(app, [*POINT, "--host-memory", "4GiB"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "streambp: host needs 5.00 GiB (pinned checkpoints + process): over --host-memory 4.00 GiB" in result.stdout
    assert "[1/1] streambp: oom (" in result.stderr and "[1/1]" not in result.stdout


def test_the_host_need_is_printed_with_or_without_host_memory():
    """Under --host-memory the need is said to fit it; without the flag it is printed, unchecked."""
    fits = CliRunner().invoke(app, [*POINT, "--host-memory", "6GiB"], env={"COLUMNS": "200"})
    assert "fits --host-memory 6.00 GiB" in fits.stdout
    unchecked = CliRunner().invoke(app, POINT, env={"COLUMNS": "200"})
    assert "(pinned checkpoints + process); --host-memory checks it" in unchecked.stdout
