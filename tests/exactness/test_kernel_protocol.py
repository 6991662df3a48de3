"""The measuring protocol around StreamBP's chunk-kernel choice (runner/point.py, core/kernels/kernel_choice.py):
no timed step measures a kernel or pays a first build of one, a memory step runs one fixed kernel
whatever ran before, and the row names every kernel it used. A whole tiny point on the CPU, with
stand-in candidates that measure on CPU tensors as auto does on a GPU, and a fake clock."""

from __future__ import annotations

import pytest

from sbpbench.config import point_specs
from sbpbench.core import attention as attention_module
from sbpbench.core.kernels.chunk_kernels import ChunkKernel, SplitKernel
from sbpbench.core.kernels.kernel_choice import DEFAULT_CHOOSER, LOWER_RIGHT, KernelChooser, MemoryCache
from sbpbench.methods import MethodSettings
from sbpbench.methods.exactness import compare_methods
from sbpbench.methods.streambp import step_hooks
from sbpbench.runner import point

from ..conftest import observing_kernels, padded_batch, tiny_model
from ..unit.test_kernel_choice import FakeClock, StandIn, _chooser
from ..unit.test_kernel_choice import _reference as timed_reference_of


class Candidate(ChunkKernel):
    """The split's exact values at 1 s a run on the fake clock, plus `build_s` the first time it
    sees a shape (a cuDNN graph, a compiled specialisation); `builds` lists those shapes."""

    def __init__(self, name: str, clock: FakeClock, build_s: float = 0.5):
        self.name, self.clock, self.build_s = name, clock, build_s
        self.builds: list[tuple] = []

    def run(self, call):
        shape = (tuple(call.query.shape), tuple(call.key.shape))
        if shape not in self.builds:
            self.builds.append(shape)
            self.clock.now += self.build_s
        self.clock.now += 1.0
        return SplitKernel().run(call)


def _reference(clock: FakeClock):
    from sbpbench.core.attention import lower_right_attention

    def reference(call, cuda_branch=None):
        clock.now += 3.0
        return lower_right_attention(call, cuda_branch)

    return reference


@pytest.fixture
def stand_in(monkeypatch):
    """A chooser that measures on the CPU (the GPU's path) with one fast candidate, "fast"."""
    from sbpbench.core import attention

    clock = FakeClock()
    fast = Candidate("fast", clock)
    chooser = KernelChooser({"fast": fast}, MemoryCache(), clock.timer, device_types=("cpu",))
    monkeypatch.setattr(attention, "lower_right_attention", _reference(clock))
    with step_hooks(chooser=chooser):
        yield chooser, fast


def _spec(**values):
    base = {"device": "cpu", "model": "tiny/qwen3", "seq_len": 48, "chunk_size": 16, "logits_chunk_size": 16}
    (spec,) = point_specs({**base, **values}, ["streambp"])
    return spec


def test_no_timed_step_measures_or_builds_a_kernel(stand_in, monkeypatch):
    """With no warm-up (the long-context protocol), the chooser measures between the memory step
    and the timed steps, recorded as tuning_s; inside the timed steps it times nothing and the
    candidate builds no new shape; the timed steps ran the candidate and the row says so."""
    chooser, fast = stand_in
    inside: list[tuple[int, int]] = []
    timed = point.time_steps

    def watched(run, **kwargs):
        before = (chooser.timings, len(fast.builds))
        result = timed(run, **kwargs)
        inside.append((chooser.timings - before[0], len(fast.builds) - before[1]))
        return result

    monkeypatch.setattr(point, "time_steps", watched)
    row = point.measure_point(_spec(warmup=0, repeats=2))
    assert row.status == "ok", row.error
    assert inside == [(0, 0)]
    assert chooser.timings > 0 and row.tuning_s is not None and row.tuning_s >= 0
    assert row.timed_attention_kernel == "fast"
    assert "fast" not in row.attention_kernel  # the memory step ran auto as the reference


def test_the_tuning_pass_builds_every_shape_the_step_runs(stand_in):
    """Each distinct chunk shape of the step is built once in the tuning pass: two chunks with a
    prefix (T = 48 in chunks of 16) are two shapes."""
    _, fast = stand_in
    row = point.measure_point(_spec(warmup=0, repeats=1))
    assert row.status == "ok", row.error
    assert sorted(key[2] for _, key in fast.builds) == [32, 48]


def test_a_memory_only_probe_runs_the_reference_whatever_is_cached(stand_in):
    """A probe (repeats 0) after a point that cached "fast" for every class still runs the lower-right
    path, as the estimator models: its peak does not depend on what ran before. Nothing is tuned."""
    chooser, fast = stand_in
    point.measure_point(_spec(warmup=0, repeats=1))
    assert set(chooser.cache.choices.values()) == {"fast"}
    runs_before = chooser.timings, len(fast.builds)
    probe = point.measure_point(_spec(warmup=0, repeats=0))
    assert probe.status == "ok", probe.error
    assert "fast" not in probe.attention_kernel and probe.tuning_s is None and probe.timed_attention_kernel == ""
    assert (chooser.timings, len(fast.builds)) == runs_before


def test_the_memory_step_is_the_same_with_or_without_a_cache(stand_in):
    """The memory step's peak with every class cached as "fast" equals the peak with none cached."""
    chooser, _ = stand_in
    fresh = point.measure_point(_spec(warmup=0, repeats=0))
    point.measure_point(_spec(warmup=0, repeats=1))
    assert chooser.cache.choices
    cached = point.measure_point(_spec(warmup=0, repeats=0))
    assert cached.peak_allocated_bytes == fresh.peak_allocated_bytes and cached.loss == fresh.loss


def test_auto_off_the_chooser_devices_tunes_nothing():
    """On a CPU (auto is the reference there) the pass finds nothing to measure: the timed steps ran
    the lower-right path and the row says so."""
    row = point.measure_point(_spec(warmup=0, repeats=1))
    assert row.status == "ok", row.error
    assert row.timed_attention_kernel == LOWER_RIGHT and DEFAULT_CHOOSER.timings == 0


def test_forced_flex_is_warmed_before_the_timed_steps(monkeypatch):
    """A forced kernel is not measured but is still run once per shape before the timed steps (a
    first compile never lands in a timed step)."""
    clock = FakeClock()
    flex = Candidate("flex", clock)
    chooser = KernelChooser({"flex": flex}, MemoryCache(), clock.timer, device_types=("cpu",))
    monkeypatch.setattr("sbpbench.config.run.check_chunk_attention", lambda *args: None)  # flex on a CPU
    inside = []
    timed = point.time_steps

    def watched(run, **kwargs):
        before = len(flex.builds)
        result = timed(run, **kwargs)
        inside.append(len(flex.builds) - before)
        return result

    monkeypatch.setattr(point, "time_steps", watched)
    with step_hooks(chooser=chooser):
        row = point.measure_point(_spec(warmup=0, repeats=1, chunk_attention="flex"))
    assert row.status == "ok", row.error
    assert inside == [0] and len(flex.builds) == 2 and chooser.timings == 0
    assert row.timed_attention_kernel == "flex"


def test_auto_through_a_whole_model_is_exact_and_recorded(monkeypatch):
    """stream_backward with auto: each shape class timed once, the fast stand-in (the split's values)
    kept and run, bp's gradients to 1e-10, and the step's kernels name it."""
    clock = FakeClock()
    fast, slow = StandIn("fast", clock, 1.0), StandIn("slow", clock, 5.0)
    chooser = _chooser(clock, fast, slow, on_cpu=True)
    timed_reference = timed_reference_of(clock, 3.0)
    monkeypatch.setattr(attention_module, "lower_right_attention", timed_reference)
    model = tiny_model("tiny/qwen3")
    batch = padded_batch(model, batch_size=2, seq_len=23, lengths=[23, 17])
    settings = MethodSettings(chunk_size=5, logits_chunk_size=7, chunk_attention="auto")
    with step_hooks(chooser=chooser), observing_kernels() as seen:
        (result,) = compare_methods(model, batch, ["streambp"], settings)
    assert result.ok, "\n".join(d.describe() for d in result.failures())
    assert seen == {"fast"} and set(chooser.cache.choices.values()) == {"fast"}
    classes = len(chooser.cache.choices)
    assert classes >= 2 and slow.runs == classes * (1 + chooser.reps)  # checked, warmed up, timed: once per class
