"""One measured point, inside the worker process: build, warm up, measure memory, time.

Protocol (recorded in every row):
  1. build the model (random weights, seeded) and the batch on the device;
  2. on a GPU: `warmup` steps, discarded (kernels load, cuBLAS workspaces and allocator caches
     fill), then one memory step with the peaks reset just before it (torch.cuda peak stats, an
     NVML sampler, the peak RSS); a memory-only point defaults to no warm-up (config/run.py
     `point_specs`; why its peak is the same: `_measure_cuda`);
     on the CPU: the memory step first (the live-tensor tracker counts tensors, which no lazy
     setup creates there, and a step over --memory-limit stops before any warm-up is spent),
     then the warm-up, which also keeps the tracker's first-run costs out of the timed steps;
  3. `repeats` timed steps, synchronised, with nothing else running (no tracker, no sampler);
     none for a memory-only point (repeats 0: a max-length probe). A streambp step times its
     phases meanwhile (CUDA events, or the CPU's clock; core/phases.py): the row's phase_*_s
     columns are those of the timed step whose time is time_median_s (the lower middle of an even
     count: one rule for both), read after the timed steps.
The worker runs spec.threads intra-op threads (default: OMP_NUM_THREADS, else the physical cores it
may use); the row records them and the load average as the point started.
A memory limit above the device's capacity (the paper's 80 GiB on an H100; 100TB on the CPU, whose
cap is on the tracked bytes, against the machine's RAM) runs at the capacity; the row records the cap
that applied (memory_limit_effective_bytes) and the parent says so (runner/isolated.py).
Every step runs under the forced SDPA kernel, if any (spec.sdpa_backend, measure/sdpa.py); the
memory step records the kernels that ran (attention_kernel): SDPA's, and StreamBP's chunk kernels
(core/kernels/kernel_choice.py) other than the lower-right SDPA path, e.g. "cudnn+split". No step
ever times a kernel. StreamBP's auto is the lower-right path in the memory step, the kernel the
estimator models, so a peak never depends on what was measured before. Its warm-up and timed
steps ask this device's table of measured kernels, where one exists (runner/kernel_table.py:
written by benchmarks/attention_kernels.py): the kernel the table names for each call's shape
class. Before the timed steps, an untimed pass (its seconds in tuning_s) runs each such kernel once
on every distinct call shape the memory step made, strides, grad mode and gradient layout as the
step makes them (cuDNN graphs, compiles); timed_attention_kernel names the chunk kernels the timed
steps ran.
Gradients before each step follow the protocol: steady = resident and zeroed in place, first =
None. An out-of-memory error anywhere is the point's result (status oom), not a crash.
An offloading StreamBP point on CUDA page-locks its host buffers in its first step (the warm-up, or
the memory step without one) and reuses them after (core/host_pool.py): host_register_s records that
first step's registration, which no timed step pays.
A step that runs past a few seconds prints "layer i of L" lines to stderr (measure/progress.py;
StreamBP steps only: bp and ckpt are transformers' own backward, with no per-layer callback).
With a timeline folder (`sbp run --timeline`; runner/timelines.py) the memory step is also recorded
as a memory timeline, the tracker's on the CPU (measure/timeline/tracked.py), PyTorch's memory
history on a GPU (measure/timeline/cuda.py), marked with the step's phases and kinds
(methods/memory_marks.py); an OOM step keeps what it recorded.
With spec.nproc > 1 this process is one rank (runner/ranks.py): the model is sharded with FSDP2,
the batch is the rank's own, and on the CPU the tracker also counts FSDP2's in-place resizes of
the gathered parameters' storages; the parent merges the ranks' rows.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from ..config import RunSpec
from ..core.internal import AUTO, LOWER_RIGHT
from ..measure.cuda_memory import NvmlPeakSampler, nvml_handle, start_cuda
from ..measure.flops import training_flops
from ..measure.host_memory import peak_rss_bytes, reset_peak_rss, total_ram_bytes
from ..measure.memory_cap import memory_cap
from ..measure.progress import StepProgress
from ..measure.sdpa import RecordingSdpaBackends, forcing_sdpa_backend, is_no_kernel_error
from ..measure.tensor_tracker import LiveTensorTracker, TrackedOutOfMemoryError, counting_fsdp_resizes
from ..measure.threads import available_cpus, load_average_1m, set_intra_op_threads
from ..measure.timeline.cuda import CUDA_MEMORY, CudaMemoryCalls, CudaTimeline
from ..measure.timeline.cuda import ROUNDING as CUDA_ROUNDING
from ..measure.timeline.tracked import TrackedTimeline
from ..measure.timing import TimingStats, time_steps
from ..methods import MethodUnsupported
from ..methods.step import TrainingStep, storage_bytes
from ..methods.streambp import reporting_progress, step_hooks, timing_phases
from ..records import ResultRow, one_line
from ..records.schema import phase_column
from ..workload.build import build_model_and_batch, training_step
from ..workload.rows import spec_fields
from ..workload.timeline import resident_kinds
from . import ranks, timelines
from .allocator import allocator_setting
from .kernel_table import TablePicker, table_picker, warm_chunk_kernels
from .traces import trace_step  # sbp run --trace: one step more, profiled, outside the times

_HOST_OOM_MESSAGES = ("can't allocate memory", "out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, TrackedOutOfMemoryError, MemoryError)):
        return True
    # autograd may re-raise an error from inside backward as a plain RuntimeError
    message = str(error)
    return TrackedOutOfMemoryError.__name__ in message or any(m in message for m in _HOST_OOM_MESSAGES)


def failure_outcome(spec: RunSpec, error: BaseException) -> tuple[str, str]:
    """(status, error) of a step that raised: oom, error, or unsupported where the forced SDPA kernel
    cannot run the point's attention on this device (e.g. flash in fp32)."""
    if spec.sdpa_backend != "auto" and is_no_kernel_error(error):
        return (
            "unsupported",
            f"--sdpa-backend {spec.sdpa_backend} cannot run this attention on {spec.device}: {one_line(error)}",
        )
    return ("oom" if is_out_of_memory(error) else "error"), one_line(error)


def build_step(spec: RunSpec, row: ResultRow, device: torch.device, rank: ranks.Rank | None = None) -> TrainingStep:
    """The point's step on `device` (FSDP2-sharded on one of several ranks), and the row columns
    that building it fixes."""
    if rank is None:
        model, batch = build_model_and_batch(spec)
        step = training_step(spec, model, batch)
    else:
        step, model = ranks.build_sharded_step(spec, device, rank)
        batch = step.batch
    row.num_layers = model.config.num_hidden_layers
    row.num_params = sum(p.numel() for p in model.parameters())
    row.trainable_params = sum(p.numel() for p in step.trainable)
    row.num_tokens = batch.num_tokens
    row.model_flops = training_flops(model, batch_size=spec.batch_size, seq_len=spec.seq_len)
    row.weights_bytes = storage_bytes(model.parameters())  # this rank's shards under FSDP2
    row.grads_bytes = step.grads_bytes
    return step


def start_cuda_point(spec: RunSpec, row: ResultRow, device: torch.device) -> None:
    """Before anything else touches the GPU: NVML's idle reading, the CUDA context, the memory cap
    (set_per_process_memory_fraction of the device's total, the cap clamped to it) and the
    allocator setting the worker runs with."""
    startup = start_cuda(device)
    row.nvml_idle_used_bytes, row.cuda_context_bytes = startup.idle_used_bytes, startup.context_bytes
    row.cuda_alloc_conf = allocator_setting()
    total = torch.cuda.get_device_properties(device).total_memory
    row.memory_limit_effective_bytes = memory_cap(spec.memory_limit, total)
    if row.memory_limit_effective_bytes is not None and row.memory_limit_effective_bytes < total:
        torch.cuda.set_per_process_memory_fraction(row.memory_limit_effective_bytes / total, device)


Kernels = Callable[[], AbstractContextManager]  # the warm-up and timed steps' chunk kernels, around them


def _measure_cpu(
    spec: RunSpec,
    step: TrainingStep,
    row: ResultRow,
    prepare: Callable[[str], None],
    timeline_dir: Path | None = None,
    step_kernels: Kernels = nullcontext,
) -> Callable[[], None]:
    prepare("memory step")
    resident = storage_bytes(step.resident_tensors())
    cap = row.memory_limit_effective_bytes = memory_cap(spec.memory_limit, total_ram_bytes())
    if cap is not None and resident > cap:
        raise TrackedOutOfMemoryError(f"weights, gradients and batch take {resident:,} B, over the limit of {cap:,} B")
    limit = None if cap is None else cap - resident
    row.baseline_bytes = resident
    recorder = TrackedTimeline(resident_kinds(step), limit_bytes=limit) if timeline_dir else None
    assert recorder is None or recorder.baseline_bytes == resident, "the resident kinds are the baseline"
    tracker = recorder or LiveTensorTracker(limit_bytes=limit)
    marks = timelines.marked(recorder, step) if recorder else nullcontext()
    reset_peak_rss()
    stores, kernels, chunk_kernels = [], RecordingSdpaBackends(), set()
    error = None
    try:
        resizes = counting_fsdp_resizes(tracker) if spec.nproc > 1 else nullcontext()
        with (
            marks,
            tracker,
            resizes,
            kernels,
            step_hooks(on_store=stores.append, on_kernel=chunk_kernels.add),
        ):
            row.loss = float(step.run())
    except BaseException as failed:
        error = failed
        raise
    finally:  # an OOM row still says how far the step got
        row.attention_kernel = kernel_names(kernels, chunk_kernels)
        _record_stores(row, stores)
        row.cpu_peak_rss_bytes = peak_rss_bytes()
        row.peak_allocated_bytes = resident + tracker.peak_bytes
        row.activation_peak_bytes = tracker.peak_bytes
        if recorder is not None:  # what ran, up to an OOM
            timelines.save_cpu(recorder, spec, row, timeline_dir, timelines.status_of(error, is_out_of_memory))
    with step_kernels():
        for i in range(1, spec.warmup + 1):
            prepare(f"warm-up {i} of {spec.warmup}")
            step.run()
    return lambda: None


def kernel_names(sdpa: RecordingSdpaBackends, chunk_kernels: set[str]) -> str:
    """The attention kernels a step ran, sorted and '+'-joined: SDPA's (flash, cudnn, ...) and
    StreamBP's chunk kernels (split, flex, fa3, fa4); its lower-right path shows as SDPA's kernel."""
    return "+".join(sorted(set(filter(None, sdpa.names().split("+"))) | (chunk_kernels - {LOWER_RIGHT})))


def _record_stores(row: ResultRow, stores) -> None:
    """A streambp step's checkpoint store: host copies (pinned on CUDA) at their peak, bytes moved."""
    if stores:
        row.host_pinned_peak_bytes = max(s.max_host_bytes for s in stores)
        row.transfer_bytes = sum(s.transfer_bytes for s in stores)


def _measure_cuda(
    spec: RunSpec,
    step: TrainingStep,
    row: ResultRow,
    device: torch.device,
    prepare: Callable[[str], None],
    timeline_dir: Path | None = None,
    memory_calls: CudaMemoryCalls = CUDA_MEMORY,
    step_kernels: Kernels = nullcontext,
) -> Callable[[], None]:
    """Warm-up, then the memory step. A memory-only probe needs no warm-up for its peak:
    max_memory_allocated counts live tensors, and what a first step creates lazily and keeps
    (cuBLAS/cuBLASLt workspaces, allocated through the caching allocator on the first matmul)
    is then allocated early inside the measured step and still counted at its peak, instead of
    sitting in the baseline; the peak is the same, activation_peak_bytes (peak - baseline) grows
    by the workspaces (a few MiB to tens of MiB) and peak_reserved_bytes may differ (no cached
    segments to reuse). The warm-up matters for timing, which a probe does not do.
    timeline_dir: record PyTorch's memory history of the memory step into a timeline there
    (runner/timelines.py); memory_calls: torch.cuda.memory as the recorder calls it (tests: a stand-in);
    step_kernels: around the warm-up steps, the chunk kernels the timed steps will run."""

    def synchronize() -> None:
        torch.cuda.synchronize(device)

    with step_kernels():
        for i in range(1, spec.warmup + 1):
            prepare(f"warm-up {i} of {spec.warmup}")
            step.run()
    prepare("memory step")
    synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    row.baseline_bytes = torch.cuda.memory_allocated(device)
    reset_peak_rss()
    sampler = NvmlPeakSampler(nvml_handle(device))
    recorder = CudaTimeline(device, resident_kinds(step, CUDA_ROUNDING), calls=memory_calls) if timeline_dir else None
    history = nullcontext() if recorder is None else recorder
    marks = nullcontext() if recorder is None else timelines.marked(recorder, step)
    stores, kernels, chunk_kernels = [], RecordingSdpaBackends(), set()
    error = None
    try:
        with (
            sampler,
            history,
            marks,
            kernels,
            step_hooks(on_store=stores.append, on_kernel=chunk_kernels.add),
        ):
            row.loss = float(step.run())
            synchronize()
    except BaseException as failed:
        error = failed
        raise
    finally:  # an OOM row still says how far the step got
        row.attention_kernel = kernel_names(kernels, chunk_kernels)
        _record_stores(row, stores)
        row.peak_allocated_bytes = torch.cuda.max_memory_allocated(device)
        row.peak_reserved_bytes = torch.cuda.max_memory_reserved(device)
        row.activation_peak_bytes = row.peak_allocated_bytes - row.baseline_bytes
        row.nvml_peak_used_bytes = sampler.peak_bytes
        row.cpu_peak_rss_bytes = peak_rss_bytes()
        if recorder is not None:  # what ran, up to an OOM; the raw snapshot beside it
            timelines.save_cuda(recorder, spec, row, timeline_dir, timelines.status_of(error, is_out_of_memory))
    return synchronize


def measure_point(spec: RunSpec, timeline_dir: str | Path | None = None) -> ResultRow:
    """Measure one point in this process. Never raises for a failed step: the row says what happened.
    timeline_dir: also record the memory step's timeline into this folder (runner/timelines.py)."""
    stores = []  # each step's checkpoint store (streambp), the first step's first
    with step_hooks(on_store=stores.append):
        row = _measure(spec, Path(timeline_dir) if timeline_dir else None)
    if stores and stores[0].pins_host_memory:
        row.host_register_s = stores[0].host_register_s
    return row


def _measure(spec: RunSpec, timeline_dir: Path | None) -> ResultRow:
    row = ResultRow(**spec_fields(spec))
    row.load_avg_1m = load_average_1m()  # before this point adds its own threads to it
    row.num_threads = set_intra_op_threads(spec.threads)
    row.num_cpus = len(available_cpus())  # with nproc x num_threads above it, the times are of shared cores
    device = torch.device(spec.device)
    rank = ranks.rank_from_env() if spec.nproc > 1 else None
    try:
        if rank is not None:
            device = ranks.rank_device(spec, rank)
            row.device = str(device)
        if device.type == "cuda":
            # before a rank joins: join's set_device makes the CUDA context (CUDA 12's cudaSetDevice does,
            # on any GPU but the current one), which NVML's idle reading must not hold
            start_cuda_point(spec, row, device)
        if rank is not None:
            ranks.join(spec, rank)
        step = build_step(spec, row, device, rank)
        row.optimizer_state_bytes = step.optimizer_state_bytes
        progress = StepProgress(
            f"{spec.method} {spec.model} T={spec.seq_len}",
            synchronize=(lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else lambda: None,
        )

        def prepare(name: str) -> None:  # before each step: gradients per protocol, the progress clock and label
            step.prepare()
            progress.restart(name)

        picker = measured_kernels(spec, device)

        def step_kernels() -> AbstractContextManager:  # the warm-up and timed steps': the table's where it has one
            return nullcontext() if picker is None else step.using(chunk_attention=picker)

        calls = {}  # the chunk calls' shapes, in order of first appearance
        with reporting_progress(progress), forcing_sdpa_backend(spec.sdpa_backend):
            with step_hooks(on_chunk_call=lambda shape: calls.setdefault(shape)):
                if device.type == "cuda":
                    synchronize = _measure_cuda(
                        spec, step, row, device, prepare, timeline_dir, step_kernels=step_kernels
                    )
                else:
                    synchronize = _measure_cpu(spec, step, row, prepare, timeline_dir, step_kernels=step_kernels)
            timing, timers = None, []
            if spec.repeats:
                timed = (f"timed step {i} of {spec.repeats}" for i in range(1, spec.repeats + 1))
                timed_kernels = set()
                with step_kernels():
                    if picker is not None and calls:
                        progress.restart("attention kernels")
                        row.tuning_s = warm_kernels(calls, picker, synchronize)
                    with (
                        timing_phases() as timers,
                        step_hooks(on_kernel=timed_kernels.add),
                    ):  # streambp: a PhaseTimer each
                        timing = time_steps(
                            step.run,
                            repeats=spec.repeats,
                            synchronize=synchronize,
                            before_each=lambda: prepare(next(timed)),
                        )
                    row.timed_attention_kernel = "+".join(sorted(timed_kernels))
                    trace_step(spec, row, device.type, prepare, step.run, synchronize)
        row.optimizer_state_bytes = step.optimizer_state_bytes
    except MethodUnsupported as error:  # the method cannot run here: a result, with the reason
        row.status, row.error = "unsupported", one_line(error)
        return row
    except Exception as error:
        traceback.print_exc()
        row.status, row.error = failure_outcome(spec, error)
        return row
    row.status = "ok"
    if timing is None:
        return row
    row.time_median_s, row.time_min_s, row.time_max_s = timing.median_s, timing.min_s, timing.max_s
    row.tokens_per_s = spec.batch_size * spec.seq_len / timing.median_s
    row.tflops_per_s = row.model_flops / timing.median_s / 1e12
    record_phases(row, timing, timers)
    return row


def measured_kernels(spec: RunSpec, device: torch.device) -> TablePicker | None:
    """Where the point's StreamBP runs auto with SDPA's kernels all allowed: the picker of this
    device's table of measured chunk kernels, if there is one (runner/kernel_table.py)."""
    if spec.settings.chunk_attention != AUTO or spec.sdpa_backend != "auto":
        return None
    return table_picker(device)


def warm_kernels(calls, picker: TablePicker, synchronize: Callable[[], None]) -> float:
    """Seconds of the untimed pass that runs the kernel the table picks for each distinct chunk
    call the point's first steps made, as they made it (kernel_table.py `warm_chunk_kernels`):
    a cuDNN graph per shape and a compile per grad mode happen here, never in a timed step."""
    synchronize()
    start = time.perf_counter()
    warm_chunk_kernels(list(calls), picker)
    synchronize()
    return time.perf_counter() - start


def record_phases(row: ResultRow, timing: TimingStats, timers) -> None:
    """The phase columns of a streambp point: those of the timed step whose time is the median
    (time_median_s: the lower middle of an even count), its own phases (a median per phase would
    not add up to one step). Read after the timed steps, so its one synchronize lies outside them."""
    if not timers or len(timers) != len(timing.times_s):
        return
    phases = timers[timing.times_s.index(timing.median_s)].resolve()
    for name, seconds in phases.seconds.items():
        setattr(row, phase_column(name), seconds)
    row.phase_other_s = phases.other_s
