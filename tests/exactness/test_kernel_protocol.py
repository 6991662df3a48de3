"""The measuring protocol around StreamBP's chunk kernels (runner/point.py, runner/kernel_table.py):
auto is the lower-right path without a table and what the table says with one (a table written by
the attention benchmark on the CPU); the memory step runs one fixed kernel whatever the table says;
and no timed step builds a kernel, shown by a stand-in that counts its builds by (sizes, strides,
dtype, grad mode, gradient layout), which catches a warm-up on contiguous tensors. A whole tiny
point on the CPU."""

from __future__ import annotations

import sys

import pytest
import torch

from sbpbench.config import point_specs
from sbpbench.core.kernels import kernel_choice
from sbpbench.core.kernels.chunk_kernels import ChunkKernel, SplitKernel
from sbpbench.core.kernels.kernel_choice import LOWER_RIGHT, CallShape, TensorLayout
from sbpbench.methods import MethodSettings
from sbpbench.methods.exactness import compare_methods
from sbpbench.runner import kernel_bench, point
from sbpbench.runner.kernel_table import TablePicker, default_table_path, device_class, read_tables, write_table

from ..conftest import load_script, observing_kernels, padded_batch, tiny_model


class Counting(ChunkKernel):
    """The split's exact values; a build the first time it meets a forward's (layouts, dtype, grad
    mode) or a backward's (layouts, gradient layout), as cuDNN keys its graphs and dynamo its guards."""

    name = "split"

    def __init__(self):
        self.builds: list[tuple] = []

    def _meet(self, key: tuple) -> None:
        if key not in self.builds:
            self.builds.append(key)

    def run(self, call):
        key = CallShape.of(call).build_key
        self._meet(("forward", key))
        out = SplitKernel().run(call)
        if out.requires_grad:
            out.register_hook(lambda grad: self._meet(("backward", key, TensorLayout.of(grad))))
        return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of the test's own: the worker's table is read from there."""
    monkeypatch.setenv("SBP_CACHE_DIR", str(tmp_path))
    return tmp_path


def _spec(**values):
    base = {"device": "cpu", "model": "tiny/qwen3", "seq_len": 48, "chunk_size": 16, "logits_chunk_size": 16}
    (spec,) = point_specs({**base, **values}, ["streambp"])
    return spec


def _split_everywhere(path) -> None:
    """A table naming split for every class the point's step makes (T = 48 in chunks of 16)."""
    classes = [f"B1 H4 KV2 hd16 float32 c<=16 prefix<={p} full" for p in (16, 32)]
    write_table(path, device_class(torch.device("cpu")), {c: {"kernel": "split"} for c in classes})


def test_auto_without_a_table_is_the_lower_right_path(cache):
    """No table for this device: the timed steps run the reference, nothing is warmed."""
    row = point.measure_point(_spec(warmup=0, repeats=1))
    assert row.status == "ok", row.error
    assert row.timed_attention_kernel == LOWER_RIGHT and row.tuning_s is None


class _Clock:
    """Seconds advance only when a stand-in runs: the reference 3 s a call, the split 1 s."""

    def __init__(self):
        self.now = 0.0

    def timer(self, fn) -> float:
        start = self.now
        fn()
        return self.now - start


def test_auto_with_the_benchmarks_table_is_what_the_table_says(cache, monkeypatch):
    """The attention benchmark, run on the CPU with a clock on which the split is the faster, writes
    split for each class of the step into the cache's table; a point with auto then runs split in
    its timed steps (after a warm pass) and the reference in its memory step. Edited to name the
    reference for one class, the table gives that class the reference."""
    clock = _Clock()

    class Timed(ChunkKernel):
        name = "split"

        def run(self, call):
            clock.now += 1.0
            return SplitKernel().run(call)

    reference = kernel_bench.lower_right_attention

    def slow_reference(call, cuda_branch=None):
        clock.now += 3.0
        return reference(call, cuda_branch)

    monkeypatch.setattr(kernel_bench, "lower_right_attention", slow_reference)
    bench = load_script("benchmarks/attention_kernels.py", "attention_kernels_protocol")
    try:
        argv = ["--tiny", "--reps", "1", "--out", str(cache / "b.csv"), "--table", str(default_table_path())]
        assert bench.main(argv, kernels={"split": Timed()}, timer=clock.timer) == 0
    finally:
        del sys.modules["attention_kernels_protocol"]
    monkeypatch.setattr(kernel_bench, "lower_right_attention", reference)
    (table,) = read_tables(default_table_path()).values()
    assert {e["kernel"] for e in table.values()} == {"split"} and len(table) == 2
    assert all(e["steady_s"]["split"] < e["steady_s"][LOWER_RIGHT] and e["shapes"] >= 1 for e in table.values())
    row = point.measure_point(_spec(warmup=0, repeats=1))
    assert row.status == "ok", row.error
    assert row.timed_attention_kernel == "split" and row.tuning_s is not None
    assert "split" not in row.attention_kernel  # the memory step ran auto's own kernel
    first = min(table)
    write_table(default_table_path(), device_class(torch.device("cpu")), {first: {"kernel": LOWER_RIGHT}})
    row = point.measure_point(_spec(warmup=0, repeats=1))
    assert row.timed_attention_kernel == f"{LOWER_RIGHT}+split"


@pytest.mark.parametrize("warm", ["as recorded", "contiguous"])
def test_no_timed_step_builds_a_kernel_the_table_names(cache, monkeypatch, warm):
    """With a table naming split (a stand-in that counts its builds) and no warm-up step, every
    build lands in the warm pass and none in the timed steps. Warming on contiguous tensors instead
    of the step's own strides leaves builds to the timed steps: the count sees the difference."""
    counting = Counting()
    monkeypatch.setitem(kernel_choice.KERNELS, "split", counting)
    _split_everywhere(default_table_path())
    if warm == "contiguous":
        made = CallShape.make_call

        def contiguous(shape, generator=None):
            call = made(shape, generator)
            tensors = [
                t.detach().contiguous().requires_grad_(t.requires_grad) for t in (call.query, call.key, call.value)
            ]
            return call.with_tensors(*tensors)

        monkeypatch.setattr(CallShape, "make_call", contiguous)
    inside = _builds_per_timed_run(monkeypatch, counting)
    row = point.measure_point(_spec(warmup=0, repeats=2))
    assert row.status == "ok", row.error
    assert row.timed_attention_kernel == "split" and row.tuning_s >= 0
    forwards = {key for kind, key, *_ in counting.builds if kind == "forward"}
    assert {key[5] for key in forwards} == {False, True}  # both grad modes were met
    if warm == "as recorded":
        assert inside == [0], "a timed step built a kernel the warm pass should have"
    else:
        assert inside[0] > 0, "contiguous warm tensors should leave builds to the timed step"


def _builds_per_timed_run(monkeypatch, counting) -> list[int]:
    """The kernel builds `counting` sees inside each of point.time_steps' calls, filled as they run."""
    inside = []
    timed = point.time_steps

    def watched(run, **kwargs):
        before = len(counting.builds)
        result = timed(run, **kwargs)
        inside.append(len(counting.builds) - before)
        return result

    monkeypatch.setattr(point, "time_steps", watched)
    return inside


def test_a_forced_kernel_builds_in_the_memory_step_not_in_a_timed_one(cache, monkeypatch):
    """chunk_attention=split: the memory step runs it on the step's own calls, so the timed steps
    build nothing, with no warm pass."""
    counting = Counting()
    monkeypatch.setitem(kernel_choice.KERNELS, "split", counting)
    inside = _builds_per_timed_run(monkeypatch, counting)
    row = point.measure_point(_spec(warmup=0, repeats=1, chunk_attention="split"))
    assert row.status == "ok", row.error
    assert inside == [0] and counting.builds and row.tuning_s is None and "split" in row.attention_kernel


def test_the_memory_step_is_the_same_with_or_without_a_table(cache):
    """A memory-only probe's peak and loss with a table naming split equal those without one; the
    probe warms nothing."""
    fresh = point.measure_point(_spec(warmup=0, repeats=0))
    _split_everywhere(default_table_path())
    probe = point.measure_point(_spec(warmup=0, repeats=0))
    assert probe.status == "ok", probe.error
    assert (probe.peak_allocated_bytes, probe.loss) == (fresh.peak_allocated_bytes, fresh.loss)
    assert "split" not in probe.attention_kernel and probe.tuning_s is None and probe.timed_attention_kernel == ""


def test_a_narrowed_sdpa_keeps_auto_on_its_own_kernel(cache):
    """--sdpa-backend asks for one SDPA kernel everywhere: the table is not read."""
    _split_everywhere(default_table_path())
    row = point.measure_point(_spec(warmup=0, repeats=1, sdpa_backend="math"))
    assert row.status == "ok", row.error
    assert row.timed_attention_kernel == LOWER_RIGHT and row.tuning_s is None


def test_a_table_picker_through_a_whole_model_is_exact_and_recorded():
    """stream_backward with a table's picker as chunk_attention: split on one class, the reference
    on the rest; bp's gradients to 1e-10, and the step's kernels name both."""
    model = tiny_model("tiny/qwen3")
    batch = padded_batch(model, batch_size=2, seq_len=23, lengths=[23, 17])
    picker = TablePicker({"B2 H4 KV2 hd16 float64 c<=8 prefix<=8 full": "split"})
    settings = MethodSettings(chunk_size=5, logits_chunk_size=7, chunk_attention=picker)
    with observing_kernels() as seen:
        (result,) = compare_methods(model, batch, ["streambp"], settings)
    assert result.ok, "\n".join(d.describe() for d in result.failures())
    assert seen == {"split", LOWER_RIGHT}
