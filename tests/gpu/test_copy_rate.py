"""measure/copy_rate.py, the host copy rate `sbp selftest` sets beside the planner's assumption: the
CSV it writes on a CPU (plain buffers), and on a CUDA GPU page-locked copies at a bus's rate."""

from __future__ import annotations

import pytest

from sbpbench.measure.copy_rate import DEVICE_TO_HOST, HOST_TO_DEVICE, main, read_csv


def test_both_directions_are_rows_of_the_csv(tmp_path):
    """On a CPU: one row each way, timed (median within min and max), the rate the bytes over the
    median, with the device and the commit."""
    out = tmp_path / "copy-rate.csv"
    assert main(["--out", str(out), "--bytes", str(2**20), "--repeats", "3", "--device", "cpu"]) == 0
    rows = read_csv(out)
    assert [r["direction"] for r in rows] == [HOST_TO_DEVICE, DEVICE_TO_HOST]
    for row in rows:
        low, median, high = (float(row[k]) for k in ("seconds_min", "seconds_p50", "seconds_max"))
        assert 0 < low <= median <= high
        assert float(row["gb_per_s"]) == pytest.approx(2**20 / median / 1e9)
        assert row["pinned"] == "False" and row["device"] == "cpu" and row["git_commit"]


@pytest.mark.gpu
def test_cuda_copies_are_page_locked_and_run_at_a_bus_rate(tmp_path):
    """On CUDA: both directions from a page-locked buffer, each above 1 GB/s, far below any PCIe or
    NVLink-C2C link's rate: a copy that did not happen would read as far faster, a stalled one slower."""
    out = tmp_path / "copy-rate.csv"
    assert main(["--out", str(out), "--bytes", str(256 * 2**20), "--repeats", "3"]) == 0
    rows = read_csv(out)
    assert all(r["pinned"] == "True" and float(r["gb_per_s"]) > 1.0 for r in rows), rows
