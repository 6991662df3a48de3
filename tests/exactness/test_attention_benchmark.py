"""benchmarks/attention_kernels.py runs in its tiny mode on a CPU and writes the CSV it promises,
so the GPU command cannot rot between GPU sessions."""

from __future__ import annotations

import csv
import sys

import pytest
import torch

from sbpbench.core.kernels.chunk_kernels import ChunkKernel
from sbpbench.measure.flops import chunk_attention_flops

from ..conftest import load_script


@pytest.fixture(scope="module")
def bench():
    yield load_script("benchmarks/attention_kernels.py", "attention_kernels_benchmark")
    del sys.modules["attention_kernels_benchmark"]


def test_tiny_mode_writes_every_kernel_at_every_shape(bench, tmp_path):
    """Every kernel at every shape: the lower-right reference and the split timed (TFLOP/s > 0,
    agreeing to fp32 rounding), the GPU-only kernels a row each with the reason they cannot run."""
    out = tmp_path / "kernels.csv"
    assert bench.main(["--tiny", "--queries", "8,16", "--keys", "16,40", "--reps", "1", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    shapes = {(r["queries"], r["keys"]) for r in rows}
    assert shapes == {("8", "16"), ("8", "40"), ("16", "40")}  # keys include the chunk's own: (16, 16) is no chunk
    by_kernel = {}
    for row in rows:
        by_kernel.setdefault(row["kernel"], []).append(row)
    assert set(by_kernel) == {"lower-right", "split", "flex", "fa3", "fa4"}
    for row in by_kernel["lower-right"] + by_kernel["split"]:
        assert row["status"] == "ok" and float(row["forward_tflops"]) > 0 and float(row["backward_tflops"]) > 0
        assert float(row["max_relative_error"]) < 1e-5
    assert all(r["status"] == "unavailable" and r["reason"] for k in ("flex", "fa3", "fa4") for r in by_kernel[k])
    assert rows[0]["torch_version"] == torch.__version__ and rows[0]["git_commit"]


def test_a_failing_kernel_is_a_row_not_a_crash(bench):
    """An out-of-memory error and any other failure become rows with their status."""

    class Failing(ChunkKernel):
        def __init__(self, name, error):
            self.name, self.error = name, error

        def run(self, call):
            raise self.error

    kernels = {"oom": Failing("oom", torch.OutOfMemoryError("CUDA out of memory")), "bad": Failing("bad", ValueError())}
    shape = {"heads": 2, "kv_heads": 1, "head_dim": 8, "dtype_name": "fp32"}
    rows = bench.benchmark([(4, 12)], **shape, device=torch.device("cpu"), reps=1, kernels=kernels)
    assert [(r.kernel, r.status) for r in rows] == [("lower-right", "ok"), ("oom", "oom"), ("bad", "error")]


def test_without_a_gpu_only_the_tiny_mode_runs(bench):
    """StreamBP's shapes on a CPU would take hours: a usage error that says to pass --tiny."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", "unused.csv"])
    assert exit_info.value.code == 2


def test_chunk_flops_count_below_the_diagonal():
    """c queries over n keys: c (n - c) prefix pairs plus c (c + 1) / 2 diagonal ones, 4 x hd FLOPs
    per pair and head forward; backward 2.5x; a square chunk is measure/flops.py's causal count."""
    assert chunk_attention_flops(1, 1, 2, 5, 1) == 4 * (2 * 3 + 3)
    assert chunk_attention_flops(2, 3, 4, 10, 8, backward=True) == 2.5 * 4 * 2 * 3 * 8 * (4 * 6 + 10)
