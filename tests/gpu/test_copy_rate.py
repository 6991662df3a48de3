"""measure/copy_rate.py, the host copy rate `sbp selftest` sets beside the planner's assumption: the
CSV it writes on a CPU (plain buffers), the stores' kind of buffer through stand-ins of the runtime,
and on a CUDA GPU page-locked copies of both kinds at a bus's rate."""

from __future__ import annotations

import pytest
import torch

from sbpbench.measure.copy_rate import (
    DEVICE_TO_HOST,
    HOST_REGISTER,
    HOST_TO_DEVICE,
    PAGE_BYTES,
    PAGEABLE,
    PIN_MEMORY,
    main,
    measure_copy_rates,
    read_csv,
)


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
        assert row["host_buffer"] == PAGEABLE


def test_the_stores_kind_of_buffer_is_page_locked_in_place_by_whole_pages():
    """The cudaHostRegister kind (the stores' pool's, core/host_pool.py), through stand-ins of the
    runtime: one registration of whole pages from a page boundary, unregistered after its copies;
    its rows say so beside the other kind's."""
    calls = []
    register = lambda address, nbytes: calls.append(("register", address, nbytes)) or 0
    unregister = lambda address: calls.append(("unregister", address)) or 0
    num_bytes = 3 * PAGE_BYTES + 5
    rates = measure_copy_rates(
        torch.device("cpu"), num_bytes, repeats=1, kinds=(PAGEABLE, HOST_REGISTER), page_lock=(register, unregister)
    )
    assert [(r.host_buffer, r.direction) for r in rates] == [
        (PAGEABLE, HOST_TO_DEVICE), (PAGEABLE, DEVICE_TO_HOST), (HOST_REGISTER, HOST_TO_DEVICE), (HOST_REGISTER, DEVICE_TO_HOST),
    ]  # fmt: skip
    (registered, address, nbytes), unregistered = calls
    assert registered == "register" and address % PAGE_BYTES == 0 and nbytes == 4 * PAGE_BYTES
    assert unregistered == ("unregister", address)
    assert all(r.pinned == (r.host_buffer == HOST_REGISTER) and r.num_bytes == num_bytes for r in rates)


@pytest.mark.gpu
def test_cuda_copies_are_page_locked_and_run_at_a_bus_rate(tmp_path):
    """On CUDA: both directions from both kinds of page-locked buffer, each above 1 GB/s, far below
    any PCIe or NVLink-C2C link's rate: a copy that did not happen would read as far faster, a
    stalled one slower."""
    out = tmp_path / "copy-rate.csv"
    assert main(["--out", str(out), "--bytes", str(256 * 2**20), "--repeats", "3"]) == 0
    rows = read_csv(out)
    assert {r["host_buffer"] for r in rows} == {PIN_MEMORY, HOST_REGISTER} and len(rows) == 4
    assert all(r["pinned"] == "True" and float(r["gb_per_s"]) > 1.0 for r in rows), rows
