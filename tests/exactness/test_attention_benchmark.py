"""benchmarks/attention_kernels.py runs in its tiny mode on a CPU and writes the CSV and the table
it promises, so the GPU command cannot rot between GPU sessions; its judge of agreement
(runner/kernel_bench.py) catches a mask one key off in bf16."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch

from sbpbench.core.attention import lower_right_attention
from sbpbench.core.kernels.chunk_kernels import ChunkCall, ChunkKernel, SplitKernel
from sbpbench.measure.flops import chunk_attention_flops
from sbpbench.runner.kernel_bench import Judge, agreement_tolerance, forward_backward, relative_error

from ..conftest import load_script


@pytest.fixture(scope="module")
def bench():
    yield load_script("benchmarks/attention_kernels.py", "attention_kernels_benchmark")
    del sys.modules["attention_kernels_benchmark"]


def test_tiny_mode_writes_every_kernel_on_every_class_of_the_step(bench, tmp_path):
    """The tiny step's two shape classes (T = 48 in chunks of 16: prefixes 16 and 32), every kernel
    on each: the reference and the split timed in both grad modes (TFLOP/s > 0, within fp32's
    agreement, their build seconds), the GPU-only kernels a row each with the reason; the table
    holds each class's kernel among those that ran, with steady and build seconds beside."""
    out, table = tmp_path / "kernels.csv", tmp_path / "table.json"
    assert bench.main(["--tiny", "--reps", "1", "--out", str(out), "--table", str(table)]) == 0
    rows = list(csv.DictReader(out.open()))
    classes = {r["shape_class"] for r in rows}
    assert classes == {f"B1 H4 KV2 hd16 float32 c<=16 prefix<={p} full" for p in (16, 32)}
    by_kernel = {}
    for row in rows:
        by_kernel.setdefault(row["kernel"], []).append(row)
    assert set(by_kernel) == {"lower-right", "split", "flex", "fa3", "fa4"}
    for row in by_kernel["lower-right"] + by_kernel["split"]:
        assert row["status"] == "ok" and float(row["forward_tflops"]) > 0 and float(row["train_tflops"]) > 0
        assert (
            float(row["error_ratio"]) <= 1 and float(row["build_s"]) >= 0 and int(row["shapes"]) == 1
        )  # one chunk each
    assert [int(r["keys"]) for r in by_kernel["split"]] == [32, 48]  # each class's largest call
    assert all(r["status"] == "unavailable" and r["reason"] for k in ("flex", "fa3", "fa4") for r in by_kernel[k])
    assert rows[0]["torch_version"] == torch.__version__ and rows[0]["git_commit"]
    (entries,) = json.loads(table.read_text())["tables"].values()
    assert set(entries) == classes
    for name, entry in entries.items():
        chosen = [r["kernel"] for r in rows if r["shape_class"] == name and r["chosen"] == "True"]
        assert chosen == [entry["kernel"]] and set(entry["steady_s"]) == set(entry["build_s"]) == {
            "lower-right",
            "split",
        }


def test_without_a_table_option_a_cpu_run_writes_no_table(bench, tmp_path, monkeypatch):
    """On a CPU the table is written only where --table says: the user's cache stays as it was."""
    monkeypatch.setenv("SBP_CACHE_DIR", str(tmp_path / "cache"))
    assert bench.main(["--tiny", "--reps", "1", "--out", str(tmp_path / "k.csv")]) == 0
    assert not (tmp_path / "cache").exists()


def test_a_failing_or_wrong_kernel_is_a_row_and_never_the_tables(bench):
    """An out-of-memory error, any other failure and a kernel whose values are off become rows with
    their status; the table's kernel is one that agrees."""

    class Failing(ChunkKernel):
        def __init__(self, name, error):
            self.name, self.error = name, error

        def run(self, call):
            raise self.error

    class Off(ChunkKernel):
        name = "off"

        def run(self, call):
            return SplitKernel().run(call) * 1.01

    kernels = {"oom": Failing("oom", torch.OutOfMemoryError("CUDA out of memory")), "bad": Failing("bad", ValueError())}
    kernels["off"] = Off()
    args = bench.parse(["--tiny", "--reps", "1"])
    rows, table = bench.benchmark(args, torch.device("cpu"), kernels=kernels)
    first = rows[0].shape_class
    assert [(r.kernel, r.status) for r in rows if r.shape_class == first] == [
        ("lower-right", "ok"), ("oom", "oom"), ("bad", "error"), ("off", "wrong"),
    ]  # fmt: skip
    assert {e["kernel"] for e in table.values()} == {"lower-right"}


def _shifted_mask(call: ChunkCall) -> torch.Tensor:
    """Offset-causal attention with every query seeing one key too many (a mask off by one)."""
    query, key, value = call.query, call.key, call.value
    num_queries, num_keys = query.shape[2], key.shape[2]
    query_pos = torch.arange(num_keys - num_queries, num_keys)[:, None]
    sees = torch.arange(num_keys)[None, :] <= query_pos + 1
    repeats = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=sees, scale=call.scale)


@pytest.mark.slow  # bf16 attention of 512 queries by several kernels on the CPU: 18 s on 2 busy cores
def test_bf16_agreement_catches_a_mask_one_key_off():
    """In bf16 a kernel whose mask lets each query see one key too many is within a flat bound
    (4 roundings, 1.6%, over the whole tensor) but beyond 4x the reference's own error against fp32;
    the split, whose math is the reference's, passes."""
    torch.manual_seed(0)
    query = torch.randn(1, 4, 512, 64, dtype=torch.bfloat16)
    key, value = (torch.randn(1, 2, 16384, 64, dtype=torch.bfloat16) for _ in range(2))
    call = ChunkCall(query, key, value, 16384 - 512, 0, None)
    grad_out = torch.randn(1, 4, 512, 64, dtype=torch.bfloat16)
    expected = forward_backward(lower_right_attention, call, grad_out)
    wide = call.with_tensors(*(t.float() for t in (query, key, value)))
    judge = Judge(expected, forward_backward(lower_right_attention, wide, grad_out.float()))
    shifted = forward_backward(_shifted_mask, call, grad_out)
    assert max(relative_error(s, e) for s, e in zip(shifted, expected)) < agreement_tolerance(torch.bfloat16)
    assert judge.error(shifted) > 1
    assert judge.error(forward_backward(SplitKernel().run, call, grad_out)) <= 1


def test_without_a_gpu_only_the_tiny_mode_runs(bench):
    """StreamBP's long-sequence calls on a CPU would take hours: a usage error that says to pass --tiny."""
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
