"""Choosing a chunk's attention kernel (core/kernels/kernel_choice.py): measured once per shape class,
the fastest that agrees with the reference kept, cached (in memory, and on disk by the runner's
JsonChoiceCache), forced by name, recorded. Stand-in kernels with a fake clock, on a CPU."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from sbpbench.config import ConfigError, point_specs
from sbpbench.core.attention import lower_right_attention
from sbpbench.core.kernels import kernel_choice
from sbpbench.core.kernels.chunk_kernels import ChunkCall, ChunkKernel, SplitKernel
from sbpbench.core.kernels.kernel_choice import (
    CACHED,
    LOWER_RIGHT,
    KernelChooser,
    MemoryCache,
    run_chunk,
    shape_class,
)
from sbpbench.measure.kernel_cache import JsonChoiceCache
from sbpbench.measure.sdpa import RecordingSdpaBackends
from sbpbench.methods.streambp import current_hooks
from sbpbench.runner.point import kernel_names


class FakeClock:
    """Seconds advance only when a stand-in kernel (or the wrapped reference) runs."""

    def __init__(self):
        self.now = 0.0

    def timer(self, fn) -> float:
        start = self.now
        fn()
        return self.now - start


class StandIn(ChunkKernel):
    """A kernel that computes the split's exact result and costs `seconds` on the fake clock;
    `wrong` adds an error to its output, `fails` raises."""

    def __init__(self, name: str, clock: FakeClock, seconds: float, *, wrong: bool = False, fails: bool = False):
        self.name, self.clock, self.seconds, self.wrong, self.fails = name, clock, seconds, wrong, fails
        self.runs = 0

    def run(self, call):
        self.runs += 1
        self.clock.now += self.seconds
        if self.fails:
            raise RuntimeError("no kernel image for this device")
        out = SplitKernel().run(call)
        return out + 1e-3 if self.wrong else out


def _reference(clock: FakeClock, seconds: float):
    def reference(call, cuda_branch=None):
        clock.now += seconds
        return lower_right_attention(call, cuda_branch)

    return reference


def _call(num_queries=5, num_keys=12, seed=0) -> ChunkCall:
    torch.manual_seed(seed)
    query = torch.randn(1, 4, num_queries, 8, dtype=torch.float64)
    key, value = (torch.randn(1, 2, num_keys, 8, dtype=torch.float64) for _ in range(2))
    return ChunkCall(query, key, value, num_keys - num_queries, 0, None)


def _chooser(clock, *kernels, cache=None, on_cpu=False) -> KernelChooser:
    """on_cpu: auto measures on CPU tensors as it would on a GPU (its device check is the only difference)."""
    cache = cache if cache is not None else MemoryCache()
    devices = ("cpu",) if on_cpu else kernel_choice.AUTO_DEVICE_TYPES
    return KernelChooser({k.name: k for k in kernels}, cache, clock.timer, device_types=devices)


def test_the_fastest_is_kept_and_a_slower_one_never():
    """Reference 3 s, stand-ins 1 s and 5 s: the 1 s one. Without it, the reference, never the 5 s one."""
    clock = FakeClock()
    fast, slow = StandIn("fast", clock, 1.0), StandIn("slow", clock, 5.0)
    assert _chooser(clock, slow, fast).choose(_call(), _reference(clock, 3.0)) == "fast"
    assert _chooser(clock, slow).choose(_call(), _reference(clock, 3.0)) == LOWER_RIGHT


def test_a_kernel_that_disagrees_or_fails_is_never_chosen():
    """Faster but 1e-3 off the reference, or raising: warned about and skipped."""
    clock = FakeClock()
    wrong, broken = StandIn("wrong", clock, 0.1, wrong=True), StandIn("broken", clock, 0.1, fails=True)
    with pytest.warns(UserWarning) as caught:
        assert _chooser(clock, wrong, broken).choose(_call(), _reference(clock, 3.0)) == LOWER_RIGHT
    messages = " ".join(str(w.message) for w in caught)
    assert "wrong differs from lower-right" in messages and "broken failed" in messages


def test_no_memory_to_time_means_the_reference_and_nothing_cached():
    """An out-of-memory while timing (one more backward beside the chunk's activations) is not the
    step's failure: a warning, the reference runs, and the class is timed again next time."""
    clock = FakeClock()
    short = StandIn("short", clock, 1.0, fails=True)
    short.run = lambda call: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory"))
    chooser = _chooser(clock, short)
    with pytest.warns(UserWarning, match="no memory to time"):
        assert chooser.choose(_call(), _reference(clock, 3.0)) == LOWER_RIGHT
    assert chooser.cache.choices == {}


def test_a_forced_kernel_runs_though_slower_and_is_recorded():
    """chunk_attention="split" runs the split stand-in (5 s against the reference's 0) with no timing."""
    clock = FakeClock()
    split = StandIn("split", clock, 5.0)
    chooser = _chooser(clock, split)
    seen = set()
    run_chunk(_call(), _reference(clock, 0.0), setting="split", chooser=chooser, on_kernel=seen.add)
    assert (split.runs, seen, chooser.cache.choices) == (1, {"split"}, {})


def test_the_choice_is_cached_per_shape_class():
    """Timed once per class (queries and prefix to a power of two, heads, dtype, ...): a second call
    of the class runs no timing; another class is timed anew; the key names device and versions."""
    clock = FakeClock()
    fast = StandIn("fast", clock, 1.0)
    chooser = _chooser(clock, fast)
    reference = _reference(clock, 3.0)
    chooser.choose(_call(5, 12), reference)
    timed = fast.runs
    assert chooser.choose(_call(6, 13), reference) == "fast" and fast.runs == timed  # same class
    chooser.choose(_call(5, 40), reference)  # prefix 35: another class
    assert fast.runs > timed
    (key, *_) = chooser.cache.choices
    assert key.startswith(f"cpu | torch {torch.__version__} | cudnn ") and key.endswith(shape_class(_call(5, 12)))
    assert "| fast |" in key  # the candidates present: installing another is a new measurement
    assert shape_class(_call(5, 12)) == "B1 H4 KV2 hd8 float64 c<=8 prefix<=8 full"


def test_the_disk_cache_is_read_back_by_another_process(tmp_path):
    """A JsonChoiceCache written by one chooser answers a new one (a new worker) without timing."""
    clock, path = FakeClock(), tmp_path / "kernels.json"
    _chooser(clock, StandIn("fast", clock, 1.0), cache=JsonChoiceCache(path)).choose(_call(), _reference(clock, 3.0))
    again = StandIn("fast", clock, 1.0)
    assert _chooser(clock, again, cache=JsonChoiceCache(path)).choose(_call(), _reference(clock, 3.0)) == "fast"
    assert again.runs == 0 and list(json.loads(path.read_text()).values()) == ["fast"]


def test_a_corrupt_cache_file_is_ignored_with_a_warning(tmp_path):
    """Garbage in the cache file: a warning, no choice read, and the next choice rewrites it."""
    path = tmp_path / "kernels.json"
    path.write_text("{not json")
    cache = JsonChoiceCache(path)
    with pytest.warns(UserWarning, match="ignoring the attention-kernel cache"):
        assert cache.get("any") is None
    cache.put("key", "split")
    assert json.loads(path.read_text()) == {"key": "split"}
    path.write_text('["a list"]')
    with pytest.warns(UserWarning, match="not an object of kernel names"):
        assert JsonChoiceCache(path).get("key") is None


def test_the_cache_lives_under_the_users_cache_dir(monkeypatch, tmp_path):
    """$SBP_CACHE_DIR, else $XDG_CACHE_HOME/sbpbench, else ~/.cache/sbpbench."""
    from sbpbench.measure.kernel_cache import default_cache_path

    monkeypatch.delenv("SBP_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_path() == tmp_path / "sbpbench" / "attention-kernels.json"
    monkeypatch.setenv("SBP_CACHE_DIR", str(tmp_path / "own"))
    assert default_cache_path() == tmp_path / "own" / "attention-kernels.json"


def test_auto_off_a_gpu_keeps_the_reference_without_timing():
    """On a CPU auto is the lower-right path: no candidate runs, nothing is cached."""
    clock = FakeClock()
    fast = StandIn("fast", clock, 1.0)
    chooser = _chooser(clock, fast)
    seen = set()
    run_chunk(_call(), lower_right_attention, chooser=chooser, on_kernel=seen.add)
    assert (fast.runs, seen, chooser.cache.choices) == (0, {LOWER_RIGHT}, {})


def test_no_timing_where_forbidden_nor_under_a_narrowed_sdpa():
    """A measured step (mode CACHED) runs the reference for an uncached class and caches nothing;
    an sdpa_kernel block that narrows SDPA keeps auto on the reference."""
    clock = FakeClock()
    fast = StandIn("fast", clock, 1.0)
    chooser = _chooser(clock, fast, on_cpu=True)
    seen = set()
    run_chunk(_call(), _reference(clock, 3.0), mode=CACHED, chooser=chooser, on_kernel=seen.add)
    assert (fast.runs, seen, chooser.cache.choices) == (0, {LOWER_RIGHT}, {})
    seen = set()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        run_chunk(_call(), _reference(clock, 3.0), chooser=chooser, on_kernel=seen.add)
    assert (fast.runs, seen) == (0, {LOWER_RIGHT})


def test_a_rows_kernels_name_sdpas_and_the_chunk_kernels():
    """attention_kernel: SDPA's kernels and StreamBP's chunk kernels; lower-right shows as SDPA's own."""
    sdpa = RecordingSdpaBackends()
    sdpa.kernels = {"cudnn", "flash"}
    assert kernel_names(sdpa, {"split", LOWER_RIGHT}) == "cudnn+flash+split"
    sdpa.kernels = set()
    assert kernel_names(sdpa, set()) == ""


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"chunk_attention": "flex"}, "flex has no CPU kernel"),
        ({"chunk_attention": "split", "sdpa_backend": "math"}, "give one of the two"),
        ({"chunk_attention": "fastest"}, "unknown chunk_attention"),
    ],
)
def test_a_chunk_kernel_the_point_cannot_run_is_refused(values, words):
    """Before anything runs: a kernel with no CPU implementation, or one beside a forced SDPA kernel."""
    with pytest.raises(ConfigError, match=words):
        point_specs({"device": "cpu", "model": "tiny/qwen3", **values}, ["streambp"])


def test_only_streambp_reads_the_chunk_kernel():
    """bp's spec holds no chunk_attention (not in its key); streambp's defaults to auto."""
    bp, streambp = point_specs({"device": "cpu", "model": "tiny/qwen3"}, ["bp", "streambp"])
    assert bp.settings.chunk_attention is None and streambp.settings.chunk_attention == "auto"


def test_the_cuda_memory_step_never_times_and_records_the_chunk_kernels(monkeypatch):
    """The worker's CUDA measurement (against stand-ins for torch.cuda's counters): neither the
    warm-up nor the memory step may time a kernel, the memory step runs auto as the reference, and
    the row names the chunk kernel the memory step ran."""
    from sbpbench.records import ResultRow
    from sbpbench.runner import point

    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    for name in ("memory_allocated", "max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: 0)
    monkeypatch.setattr(point, "nvml_handle", lambda device: None)

    class Step:
        modes: list[str] = []

        def prepare(self):
            pass

        def run(self):
            hooks = current_hooks()
            self.modes.append(hooks.kernel_mode)
            run_chunk(
                _call(), lower_right_attention, setting="split", mode=hooks.kernel_mode, on_kernel=hooks.on_kernel
            )
            return torch.tensor(1.0)

    (spec,) = point_specs({"model": "tiny/qwen3", "repeats": 0, "warmup": 1}, ["streambp"])
    row, step = ResultRow(), Step()
    point._measure_cuda(spec, step, row, torch.device("cuda:0"), lambda name: None)
    assert step.modes == [kernel_choice.CACHED, kernel_choice.REFERENCE] and row.attention_kernel == "split"


def test_flex_refuses_fp64_on_a_gpu():
    """FlexAttention's GPU kernel accumulates in fp32: an fp64 call on CUDA (fake tensors) is refused
    before anything compiles; fp32 on CUDA and the CPU's fp64 eager path are not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sbpbench.core.kernels.chunk_kernels import FlexKernel

    with FakeTensorMode():
        query64 = torch.empty(1, 4, 5, 8, dtype=torch.float64, device="cuda")
        query32 = torch.empty(1, 4, 5, 8, dtype=torch.float32, device="cuda")
    assert "fp32" in FlexKernel().unsupported(ChunkCall(query64, query64, query64, 7, 0, None))
    assert FlexKernel().unsupported(ChunkCall(query32, query32, query32, 7, 0, None)) is None
    assert FlexKernel().unsupported(_call()) is None  # fp64 on the CPU


def _shifted_mask(call: ChunkCall) -> torch.Tensor:
    """Offset-causal attention with every query seeing one key too many (a mask off by one)."""
    query, key, value = call.query, call.key, call.value
    num_queries, num_keys = query.shape[2], key.shape[2]
    query_pos = torch.arange(num_keys - num_queries, num_keys)[:, None]
    sees = torch.arange(num_keys)[None, :] <= query_pos + 1
    repeats = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=sees, scale=call.scale)


def test_bf16_agreement_catches_a_mask_one_key_off():
    """In bf16 a kernel whose mask lets each query see one key too many is within the old flat bound
    (4 roundings, 1.6%, over the whole tensor) but beyond 4x the reference's own error against fp32;
    the split, whose math is the reference's, passes."""
    from sbpbench.core.kernels.kernel_choice import Judge, _forward_backward, agreement_tolerance, relative_error

    torch.manual_seed(0)
    query = torch.randn(1, 4, 512, 64, dtype=torch.bfloat16)
    key, value = (torch.randn(1, 2, 16384, 64, dtype=torch.bfloat16) for _ in range(2))
    call = ChunkCall(query, key, value, 16384 - 512, 0, None)
    grad_out = torch.randn(1, 4, 512, 64, dtype=torch.bfloat16)
    expected = _forward_backward(lower_right_attention, call, grad_out)
    wide = call.with_tensors(*(t.float() for t in (query, key, value)))
    judge = Judge(expected, _forward_backward(lower_right_attention, wide, grad_out.float()))
    shifted = _forward_backward(_shifted_mask, call, grad_out)
    assert max(relative_error(s, e) for s, e in zip(shifted, expected)) < agreement_tolerance(torch.bfloat16)
    assert judge.error(shifted) is not None
    assert judge.error(_forward_backward(SplitKernel().run, call, grad_out)) is None


def test_an_out_of_memory_while_timing_is_remembered():
    """A class that ran out of memory while being measured runs the reference from then on, untried."""
    clock = FakeClock()
    short = StandIn("short", clock, 1.0)
    short.run = lambda call: (short.__dict__.__setitem__("runs", short.runs + 1), _oom())[1]
    chooser = _chooser(clock, short)
    with pytest.warns(UserWarning, match="no memory to time"):
        assert chooser.choose(_call(), _reference(clock, 3.0)) == LOWER_RIGHT
    assert chooser.choose(_call(), _reference(clock, 3.0)) == LOWER_RIGHT and short.runs == 1


def _oom():
    raise torch.OutOfMemoryError("CUDA out of memory")


def test_the_estimator_refuses_a_forced_chunk_kernel():
    """Fake tensors model the lower-right path (auto's choice there): a forced kernel is refused, not
    silently estimated as another."""
    from sbpbench.simulate import estimate

    values = {"device": "cpu", "model": "tiny/qwen3", "seq_len": 16, "chunk_attention": "split"}
    (spec,) = point_specs(values, ["streambp"])
    with pytest.raises(ConfigError, match="models the lower-right kernel only"):
        estimate(spec)
