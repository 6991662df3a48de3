"""The worker's memory numbers hang together and OOM is a result; on a CUDA GPU (gpu-marked), and the
same path on the CPU.

Every point here is measured in a worker process of its own (runner/isolated.py: a fresh
interpreter on a GPU), as `sbp run` measures it: in the pytest process the caching allocator keeps
the blocks of earlier tests, and the per-process cap is only checked when it asks the driver for
more, so a capped point could reuse cached blocks and come back ok instead of oom. Before each CUDA
worker the device must be free (device_free.py: a test before this one that kept its cache fails
it by name, instead of an OOM or a wrong NVML figure). One worker per method serves both the
memory-source and the ordering test (a module fixture). The CUDA cases are skipped without a GPU
(conftest.py); the CPU cases run the same isolated path.

On CUDA the worker also records its memory step's timeline (`sbp run --timeline`: PyTorch's memory
history, measure/timeline/cuda.py). Its replay must hold the backward's allocations and reach the
allocator's own peak (max_memory_allocated).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from sbpbench.config import RunSpec
from sbpbench.measure.timeline.data import Timeline, load_timeline
from sbpbench.methods import MethodSettings
from sbpbench.records import ResultRow
from sbpbench.runner import run_isolated

from ..device_free import assert_device_free

MIB = 2**20
DEVICES = [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)]
# cuda: Qwen3-0.6B at T = 8192 in bf16 (weights + grads 2.2 GiB), capped at 4 GiB bp runs out of
# memory; cpu: tiny/qwen3 at T = 1024 (bp's activations about 27 MB), capped at 8 MB
POINTS = {
    "cuda": ({"model": "Qwen/Qwen3-0.6B", "seq_len": 8192, "dtype": "bf16", "device": "cuda"}, 2048, 4 * 2**30),
    "cpu": ({"model": "tiny/qwen3", "seq_len": 1024, "dtype": "fp32", "device": "cpu", "warmup": 0}, 128, 8 * MIB),
}


def _spec(device: str, method: str, **values) -> RunSpec:
    base, chunk, _ = POINTS[device]
    settings = MethodSettings(
        chunk_size=chunk, chunk_attention=SETTINGS["chunk_attention"] if method == "streambp" else None
    )
    return RunSpec(method=method, settings=settings, **{"repeats": 1, **base, **values})


# StreamBP's chunk kernel in the workers: the lower-right reference, which reads no table of measured
# kernels (runner/kernel_table.py) and compiles nothing
SETTINGS = {"chunk_attention": "lower-right"}
# the timeline's activation peak (above the baseline) against the allocator's: the replay rounds
# each request to 512 B where the allocator counts whole blocks
TIMELINE_PEAK_TOLERANCE = 0.02


def _measure(device: str, method: str, timeline_dir: Path | None = None, **values) -> ResultRow:
    if device == "cuda":
        assert_device_free()
    return run_isolated(_spec(device, method, **values), timeline_dir=timeline_dir)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """measured(device, method): the row of one isolated point (warm-up, memory step, one timed
    step), measured once per module; on CUDA with its memory step's timeline."""
    rows: dict[tuple[str, str], ResultRow] = {}
    folder = tmp_path_factory.mktemp("timelines")

    def row(device: str, method: str) -> ResultRow:
        if (device, method) not in rows:
            rows[device, method] = _measure(device, method, timeline_dir=folder if device == "cuda" else None)
        return rows[device, method]

    return row


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["bp", pytest.param("streambp", marks=pytest.mark.quick)])
def test_cuda_memory_sources_agree(measured, method):
    """allocated <= reserved, and NVML's device peak minus idle is the reserved peak plus the CUDA
    context, within 256 MiB or 5% (the allocator's memory is all NVML sees of this process besides
    its context)."""
    row = measured("cuda", method)
    assert row.status == "ok", row.error
    assert row.memory_source == "torch.cuda"
    assert row.baseline_bytes >= row.weights_bytes + row.grads_bytes
    assert row.peak_allocated_bytes <= row.peak_reserved_bytes
    nvml = row.nvml_peak_used_bytes - row.nvml_idle_used_bytes
    expected = row.peak_reserved_bytes + row.cuda_context_bytes
    print(f"{method}: nvml {nvml / MIB:.0f} MiB, reserved + context {expected / MIB:.0f} MiB")
    assert abs(nvml - expected) <= max(256 * MIB, 0.05 * expected)
    assert row.time_median_s > 0 and row.tflops_per_s > 0


def timeline_problems(timeline: Timeline) -> list[str]:
    """What a measured CUDA timeline misses: the backward's allocations above the baseline, or the
    allocator's peak (allocator_peak_bytes, max_memory_allocated) within TIMELINE_PEAK_TOLERANCE of
    the activation peak plus a MiB."""
    problems = []
    samples = timeline.samples
    backward = [b for b, p in zip(samples["bytes"], samples["phase"]) if "backward" in timeline.phases[p]]
    if not backward or max(backward) <= timeline.baseline_bytes:
        problems.append(f"no allocation above the baseline in a backward phase (phases: {timeline.phases[:8]} ...)")
    if timeline.allocator_peak_bytes is None:
        problems.append("no allocator peak recorded")
    else:
        ours = timeline.peak.bytes - timeline.baseline_bytes
        allocator = timeline.allocator_peak_bytes - timeline.baseline_bytes
        if abs(ours - allocator) > TIMELINE_PEAK_TOLERANCE * allocator + MIB:
            problems.append(
                f"peak above the baseline {ours / MIB:.1f} MiB in the timeline, {allocator / MIB:.1f} MiB by "
                f"max_memory_allocated (at {timeline.peak.phase})"
            )
    return problems


@pytest.mark.gpu
@pytest.mark.quick
def test_cuda_timeline_holds_the_backward(measured):
    """The streambp worker's memory timeline on CUDA (PyTorch's memory history, replayed): ok, with
    allocations above the baseline in backward phases, and its peak that of max_memory_allocated
    within 2% of the activation peak."""
    row = measured("cuda", "streambp")
    assert row.status == "ok", row.error
    assert row.timeline_file, "no timeline recorded"
    timeline = load_timeline(row.timeline_file)
    assert (timeline.memory_source, timeline.status) == ("torch.cuda", "ok")
    print(f"timeline peak {timeline.peak.bytes / MIB:.0f} MiB at {timeline.peak.phase}; notes: {timeline.notes}")
    problems = timeline_problems(timeline)
    assert not problems, "; ".join(problems)


def _stand_in_timeline(phases, samples, peak, allocator_peak, baseline=100 * MIB) -> Timeline:
    return SimpleNamespace(
        phases=phases,
        samples={"bytes": [b for b, _ in samples], "phase": [p for _, p in samples]},
        baseline_bytes=baseline,
        peak=SimpleNamespace(bytes=peak, phase="chunk backward, layer 0"),
        allocator_peak_bytes=allocator_peak,
    )


def test_the_timeline_check_fails_without_the_backward_or_its_peak():
    """timeline_problems on stand-in timelines: a good one passes; one whose backward never rises above
    the baseline (its allocations lost) fails, and so does one whose peak is 10% under
    max_memory_allocated's."""
    phases = ["checkpoint pass, layer 0", "chunk backward, layer 0"]
    good = _stand_in_timeline(phases, [(150 * MIB, 0), (200 * MIB, 1)], 200 * MIB, 200 * MIB + 1000)
    assert timeline_problems(good) == []
    no_backward = _stand_in_timeline(phases, [(200 * MIB, 0), (100 * MIB, 1)], 200 * MIB, 200 * MIB)
    assert "backward phase" in timeline_problems(no_backward)[0]
    low_peak = _stand_in_timeline(phases, [(150 * MIB, 0), (190 * MIB, 1)], 190 * MIB, 200 * MIB)
    assert "max_memory_allocated" in timeline_problems(low_peak)[0]


@pytest.mark.parametrize("device", DEVICES)
def test_activation_peaks_are_ordered(measured, device):
    """bp keeps more activations than ckpt, ckpt more than streambp, each measured in its own process."""
    peaks = {m: measured(device, m).activation_peak_bytes for m in ("bp", "ckpt", "streambp")}
    print({m: f"{p / MIB:.1f} MiB" for m, p in peaks.items()})
    assert peaks["bp"] > peaks["ckpt"] > peaks["streambp"]


@pytest.mark.parametrize("device", DEVICES)
def test_memory_limit_gives_an_oom_row(device):
    """Capped (cuda: 4 GiB, weights and gradients take 2.2; cpu: 8 MB of tracked tensors), bp is an
    oom row, not a crash, and streambp under the same cap on the CPU fits; the cap is recorded as
    applied."""
    cap = POINTS[device][2]
    row = _measure(device, "bp", memory_limit=cap)
    assert row.status == "oom" and "OutOfMemoryError" in row.error, row.error
    assert row.memory_limit_bytes == row.memory_limit_effective_bytes == cap
    if device == "cpu":
        assert _measure(device, "streambp", memory_limit=cap, repeats=0).status == "ok"


def test_gpu_tests_measure_memory_in_their_own_process():
    """No gpu-marked test module measures a point with measure_point, in the pytest process, whose
    allocator cache the earlier tests filled: they go through run_isolated (or sbp's commands)."""
    for path in sorted(Path(__file__).parents[1].rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        source = path.read_text()
        if "pytest.mark.gpu" not in source:
            continue
        calls = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", "")) == "measure_point"
        ]
        assert not calls, f"{path.name} lines {calls}: measure in a worker process (runner.run_isolated)"
