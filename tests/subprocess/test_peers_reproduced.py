"""The committed CPU peers comparison (issue 16) is what this code measures: CI re-measures the peak
of every method at the comparison's T = 1024 point with the live-tensor tracker (deterministic on a
CPU) and compares it to the byte with results/cpu/peers_cpu.csv, whose rows feed the committed
figures (plots/cpu/peers/), README.md's results table and benchmarks/peers_cpu_2026-11-23.md. A
change that moves a method's memory fails here until the comparison is re-run and re-committed.

In-process (runner.point.measure_point, memory only) rather than `sbp sweep`: the same measurement
without a worker process per method, so the tier stays within its CI budget.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from sbpbench.config.experiment import load_experiment
from sbpbench.runner.point import measure_point

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = ROOT / "experiments" / "peers_cpu.toml"
RESULTS = ROOT / "results" / "cpu" / "peers_cpu.csv"
SEQ = 1024


def _committed() -> pd.DataFrame:
    rows = pd.read_csv(RESULTS)
    return rows[(rows["kind"] == "point") & (rows["seq_len"] == SEQ)].set_index("method")


def _specs():
    specs = [spec for spec in load_experiment(EXPERIMENT, device="cpu").grid if spec.seq_len == SEQ]
    return {spec.method: spec for spec in specs}


SPECS = _specs()
# official runs only as an external worker in its own virtualenv (runner/official.py), never in this
# process, and liger needs CUDA: both are checked by tests/exactness/test_peers.py instead.
IN_PROCESS = sorted(set(SPECS) - {"official", "liger"})


def test_every_method_of_the_comparison_has_a_committed_row():
    committed = _committed()
    assert set(SPECS) == set(committed.index), "re-run: sbp sweep experiments/peers_cpu.toml"
    assert committed.loc["liger", "status"] == "unsupported"  # Triton: CUDA only
    ok = committed[committed["status"] == "ok"]
    peaks = ok["activation_peak_bytes"]
    # What those tables show: StreamBP holds the least; the chunked head removes the logits.
    assert peaks.idxmin() == "streambp"
    assert peaks["ckpt-chunked-ce"] < peaks["ckpt"] < peaks["bp"]


@pytest.mark.slow
@pytest.mark.parametrize("method", IN_PROCESS)
def test_committed_peak_is_reproduced_to_the_byte(method):
    committed = _committed().loc[method]
    row = measure_point(dataclasses.replace(SPECS[method], repeats=0))
    assert row.status == committed["status"], row.error
    if row.status != "ok":
        return
    assert row.peak_allocated_bytes == committed["peak_allocated_bytes"]
    assert row.activation_peak_bytes == committed["activation_peak_bytes"]
