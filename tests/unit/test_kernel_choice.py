"""How a chunk's attention kernel is chosen (core/kernels/kernel_choice.py): by name, or by a picker
per call, never by a timing; what each call records of itself (sizes, strides, grad mode, its
gradient's layout); and the runner's table of measured kernels (runner/kernel_table.py) that a
picker looks calls up in. Stand-in kernels, on a CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sbpbench.config import ConfigError, point_specs
from sbpbench.core.attention import lower_right_attention
from sbpbench.core.kernels import kernel_choice
from sbpbench.core.kernels.chunk_kernels import ChunkCall, ChunkKernel, SplitKernel
from sbpbench.core.kernels.kernel_choice import LOWER_RIGHT, CallShape, check_chunk_attention, run_chunk
from sbpbench.measure.sdpa import RecordingSdpaBackends
from sbpbench.runner import kernel_table
from sbpbench.runner.kernel_table import TablePicker, device_class, shape_class, table_picker, write_table
from sbpbench.runner.point import kernel_names

CORE_KERNELS = Path(kernel_choice.__file__).parent


class StandIn(ChunkKernel):
    """The split's exact values under another name; counts its runs."""

    def __init__(self, name: str):
        self.name, self.runs = name, 0

    def run(self, call):
        self.runs += 1
        return SplitKernel().run(call)


def _call(num_queries=5, num_keys=12, seed=0, window=None) -> ChunkCall:
    torch.manual_seed(seed)
    query = torch.randn(1, 4, num_queries, 8, dtype=torch.float64)
    key, value = (torch.randn(1, 2, num_keys, 8, dtype=torch.float64) for _ in range(2))
    return ChunkCall(query, key, value, num_keys - num_queries, 0, None, window)


def _ran(setting, call=None) -> str:
    seen = []
    run_chunk(call or _call(), lower_right_attention, setting=setting, on_kernel=seen.append)
    return seen[0]


def test_the_core_never_times_a_kernel():
    """No clock in core/kernels: a step's kernel is a name or a lookup, measured elsewhere."""
    sources = "".join(path.read_text() for path in CORE_KERNELS.glob("*.py"))
    assert "perf_counter" not in sources and "elapsed_time" not in sources and "Event(" not in sources


def test_auto_is_the_lower_right_path():
    """auto is the fixed rule the estimator models: the reference, every call, on any device."""
    assert _ran("auto") == LOWER_RIGHT and _ran(LOWER_RIGHT) == LOWER_RIGHT


def test_a_named_kernel_runs_the_calls_it_supports_and_the_reference_the_rest():
    """split runs a chunk over its prefix; a window that cuts the prefix (no mask in the split) runs
    the reference."""
    assert _ran("split") == "split"
    assert _ran("split", _call(window=3)) == LOWER_RIGHT


def test_a_picker_is_asked_per_call(monkeypatch):
    """A picker names a kernel per call, by name or as a kernel object; a kernel this device lacks,
    or a call it cannot run, gives way to the reference."""
    fast = StandIn("fast")
    monkeypatch.setitem(kernel_choice.KERNELS, "fast", fast)
    short = _call(5, 12)
    assert _ran(lambda call: "fast" if call is short else LOWER_RIGHT, short) == "fast"
    assert _ran(lambda call: "fast" if call is short else LOWER_RIGHT, _call(5, 40)) == LOWER_RIGHT
    own = StandIn("own")
    assert _ran(lambda call: own) == "own" and own.runs == 1
    assert _ran(lambda call: "flex") == LOWER_RIGHT  # no CPU backward: unavailable here
    assert fast.runs == 1


def test_a_bad_setting_is_refused_before_any_work():
    """An unknown name, and a named kernel the device lacks, are ValueErrors; a picker is checked per call."""
    with pytest.raises(ValueError, match="unknown chunk_attention 'fastest'"):
        check_chunk_attention("fastest")
    with pytest.raises(ValueError, match="flex cannot run on cpu"):
        check_chunk_attention("flex", torch.device("cpu"))
    check_chunk_attention(lambda call: "flex", torch.device("cpu"))


def _step_like_call(requires_grad: bool) -> tuple[ChunkCall, torch.Tensor]:
    """A call as a step makes it: q a transposed view (B, c, H, hd) -> (B, H, c, hd), K/V views of
    T-long (B, h_kv, T, hd) buffers."""
    batch, heads, kv_heads, head_dim, length, c, end = 1, 4, 2, 8, 64, 8, 24
    query = torch.randn(batch, c, heads, head_dim, dtype=torch.float64, requires_grad=requires_grad)
    buffers = [torch.randn(batch, kv_heads, length, head_dim, dtype=torch.float64) for _ in range(2)]
    key, value = (b[:, :, :end].requires_grad_(requires_grad) if requires_grad else b[:, :, :end] for b in buffers)
    return ChunkCall(query.transpose(1, 2), key, value, end - c, 0, None), query


def test_each_call_records_its_strides_grad_mode_and_its_gradients_layout():
    """on_call gets each call's sizes and strides as made (a transposed query, K/V views of a
    longer buffer), its grad mode, and, once its output's gradient arrives, that gradient's layout;
    make_call rebuilds tensors of exactly those strides."""
    seen = []
    with torch.no_grad():
        call, _ = _step_like_call(False)
        run_chunk(call, lower_right_attention, on_call=seen.append)
    call, _ = _step_like_call(True)
    out = run_chunk(call, lower_right_attention, on_call=seen.append)
    out.transpose(1, 2).contiguous().sum().backward()  # as stream_attention hands the output on
    no_grad, forward, backward = seen
    assert not no_grad.grad_enabled and forward.grad_enabled and forward.grad_out is None
    assert backward.build_key == forward.build_key and backward.grad_out is not None
    assert no_grad.query.stride == (8 * 4 * 8, 8, 4 * 8, 1) and no_grad.key.stride == (2 * 64 * 8, 64 * 8, 8, 1)
    assert forward.query.requires_grad and not no_grad.query.requires_grad
    made = backward.make_call()
    assert [t.stride() for t in (made.query, made.key, made.value)] == [
        backward.query.stride,
        backward.key.stride,
        backward.value.stride,
    ]
    assert made.query.requires_grad and not no_grad.make_call().query.requires_grad


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


def test_the_shape_class_names_what_a_choice_holds_for():
    """Batch, heads, key heads, head dim, dtype, queries and prefix to a power of two, window or not."""
    assert shape_class(_call(5, 12)) == "B1 H4 KV2 hd8 float64 c<=8 prefix<=8 full"
    assert shape_class(_call(6, 13)) == shape_class(_call(5, 12))
    assert shape_class(_call(5, 40, window=3)) == "B1 H4 KV2 hd8 float64 c<=8 prefix<=64 window"


def test_a_table_is_per_device_and_merged_on_write(tmp_path):
    """Each device's classes live under its device class (device, torch and cuDNN versions, the
    kernels that load): another device's table answers nothing; a write keeps the classes it does
    not name; a class the table lacks runs the reference."""
    path, here = tmp_path / "kernels.json", device_class(torch.device("cpu"))
    assert here.startswith(f"cpu | torch {torch.__version__} | cudnn ") and here.endswith("| split")
    assert table_picker(torch.device("cpu"), path) is None  # no file
    write_table(path, "another GPU | torch 0 | cudnn 0 | split", {shape_class(_call()): {"kernel": "split"}})
    assert table_picker(torch.device("cpu"), path) is None
    write_table(path, here, {shape_class(_call(5, 12)): {"kernel": "split"}})
    write_table(path, here, {shape_class(_call(5, 40)): {"kernel": LOWER_RIGHT}})
    picker = table_picker(torch.device("cpu"), path)
    assert picker(_call(5, 12)) == "split" and picker(_call(5, 40)) == LOWER_RIGHT
    assert picker(_call(3, 200)) == LOWER_RIGHT  # not in the table
    assert len(json.loads(path.read_text())["tables"]) == 2


def test_a_table_of_the_reference_only_or_of_unknown_kernels_picks_nothing(tmp_path):
    """Where a table names only the reference, or kernels this sbpbench does not know, no picker:
    auto keeps its own meaning."""
    path, here = tmp_path / "kernels.json", device_class(torch.device("cpu"))
    write_table(path, here, {shape_class(_call()): {"kernel": LOWER_RIGHT}, "other": {"kernel": "fa9"}})
    assert table_picker(torch.device("cpu"), path) is None
    assert TablePicker({shape_class(_call()): "split"}).names() == {"split"}


def test_a_corrupt_table_is_ignored_with_a_warning(tmp_path):
    """Garbage, or another format, in the table file: a warning, no table; the next write replaces it."""
    path = tmp_path / "kernels.json"
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the attention-kernel table"):
        assert table_picker(torch.device("cpu"), path) is None
    path.write_text('{"format": 0, "tables": {}}')
    with pytest.warns(UserWarning, match="not a format-1 table"):
        assert kernel_table.read_tables(path) == {}
    with pytest.warns(UserWarning):
        write_table(path, "d", {"c": {"kernel": "split"}})
    assert kernel_table.read_tables(path) == {"d": {"c": {"kernel": "split"}}}


def test_the_table_lives_under_the_users_cache_dir(monkeypatch, tmp_path):
    """$SBP_CACHE_DIR, else $XDG_CACHE_HOME/sbpbench, else ~/.cache/sbpbench."""
    monkeypatch.delenv("SBP_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_table.default_table_path() == tmp_path / "sbpbench" / "attention-kernels.json"
    monkeypatch.setenv("SBP_CACHE_DIR", str(tmp_path / "own"))
    assert kernel_table.default_table_path() == tmp_path / "own" / "attention-kernels.json"


def test_the_warm_runs_each_distinct_call_once_as_the_step_made_it(monkeypatch):
    """warm_chunk_kernels: one run per distinct call shape the picker sends to a kernel (none for
    the reference), on tensors of the recorded strides, in the recorded grad mode, with a backward
    where the call's output got a gradient."""
    seen, runs = [], []

    class Recording(ChunkKernel):
        name = "split"

        def run(self, call):
            runs.append((CallShape.of(call).build_key, torch.is_grad_enabled()))
            return SplitKernel().run(call)

    with torch.no_grad():
        run_chunk(_step_like_call(False)[0], lower_right_attention, on_call=seen.append)
    call, _ = _step_like_call(True)
    run_chunk(call, lower_right_attention, on_call=seen.append).sum().backward()
    monkeypatch.setitem(kernel_choice.KERNELS, "split", Recording())
    assert kernel_table.warm_chunk_kernels(seen + seen, lambda call: "split") == 2
    assert runs == [(seen[0].build_key, False), (seen[2].build_key, True)]
    assert kernel_table.warm_chunk_kernels(seen, lambda call: LOWER_RIGHT) == 0


def test_the_cuda_memory_step_runs_autos_own_kernel_and_the_warm_up_the_timed_ones(monkeypatch):
    """The worker's CUDA measurement (against stand-ins for torch.cuda's counters): the warm-up
    steps run inside the timed steps' kernels (a table's, where there is one), the memory step
    outside them, and the row names the chunk kernel the memory step ran."""
    from contextlib import contextmanager

    from sbpbench.methods.streambp import current_hooks
    from sbpbench.records import ResultRow
    from sbpbench.runner import point

    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    for name in ("memory_allocated", "max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: 0)
    monkeypatch.setattr(point, "nvml_handle", lambda device: None)
    inside = [False]

    @contextmanager
    def kernels():
        inside[0] = True
        yield
        inside[0] = False

    class Step:
        steps: list[bool] = []

        def prepare(self):
            pass

        def run(self):
            self.steps.append(inside[0])
            run_chunk(_call(), lower_right_attention, setting="split", on_kernel=current_hooks().on_kernel)
            return torch.tensor(1.0)

    (spec,) = point_specs({"model": "tiny/qwen3", "repeats": 0, "warmup": 1}, ["streambp"])
    row, step = ResultRow(), Step()
    point._measure_cuda(spec, step, row, torch.device("cuda:0"), lambda name: None, step_kernels=kernels)
    assert step.steps == [True, False] and row.attention_kernel == "split"


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


def test_the_estimator_refuses_a_forced_chunk_kernel():
    """Fake tensors model the lower-right path (auto's): a forced kernel is refused, not silently
    estimated as another."""
    from sbpbench.simulate import estimate

    values = {"device": "cpu", "model": "tiny/qwen3", "seq_len": 16, "chunk_attention": "split"}
    (spec,) = point_specs(values, ["streambp"])
    with pytest.raises(ConfigError, match="models the lower-right kernel only"):
        estimate(spec)
