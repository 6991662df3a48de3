"""One measured point, inside the worker process: build, warm up, measure memory, time.

Protocol (recorded in every row):
  1. build the model (random weights, seeded) and the batch on the device;
  2. on a GPU: `warmup` steps, discarded (kernels load, cuBLAS workspaces and allocator caches
     fill), then one memory step with the peaks reset just before it (torch.cuda peak stats, an
     NVML sampler, the peak RSS);
     on the CPU: the memory step first (the live-tensor tracker counts tensors, which no lazy
     setup creates there, and a step over --memory-limit stops before any warm-up is spent),
     then the warm-up, which also keeps the tracker's first-run costs out of the timed steps;
  3. `repeats` timed steps, synchronised, with nothing else running (no tracker, no sampler);
     none for a memory-only point (repeats 0: a max-length probe).
Gradients before each step follow the protocol: steady = resident and zeroed in place, first =
None. An out-of-memory error anywhere is the point's result (status oom), not a crash.
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Callable
from functools import cache

import torch

from ..core.attention import ATTENTION_NAME
from ..data import prompt_length
from ..measure.cuda_memory import NvmlPeakSampler, nvml_handle, start_cuda
from ..measure.flops import training_flops
from ..measure.host_memory import peak_rss_bytes, reset_peak_rss
from ..measure.tensor_tracker import LiveTensorTracker, TrackedOutOfMemoryError
from ..measure.timing import time_steps
from ..methods import make_optimizer, run_step
from ..methods.training import init_optimizer_state, optimizer_state_bytes, optimizer_state_tensors
from ..records import ResultRow
from .spec import RunSpec, build_model_and_batch

_HOST_OOM_MESSAGES = ("can't allocate memory", "out of memory")


@cache
def _full_depth(model: str) -> int | None:
    from ..models import load_config

    try:
        return load_config(model).num_hidden_layers
    except (OSError, ValueError):  # a model that cannot be built: its row says why elsewhere
        return None


def spec_fields(spec: RunSpec) -> dict:
    """The row columns a spec fixes before anything runs. num_layers is the depth that will be
    built (a full model's from its config), so a row keyed before running equals the measured one."""
    return {
        "model": spec.model,
        "num_layers": spec.num_layers or _full_depth(spec.model),
        "method": spec.method,
        "objective": spec.objective,
        "step": spec.step,
        "lora_rank": spec.lora_rank,
        "lora_alpha": spec.lora_alpha if spec.lora_rank else None,
        "prompt_len": prompt_length(spec.seq_len, spec.prompt_len) if spec.objective != "sft" else None,
        "seq_len": spec.seq_len,
        "batch_size": spec.batch_size,
        "dtype": spec.dtype,
        "device": spec.device,
        "protocol": spec.protocol,
        "chunk_size": spec.settings.chunk_size,
        "logits_chunk_size": spec.settings.logits_chunk_size,
        "fp32_grad_accumulation": spec.settings.fp32_grad_accumulation,
        "attn_implementation": ATTENTION_NAME if spec.method == "streambp" else "sdpa",
        "memory_limit_bytes": spec.memory_limit_bytes,
        "seed": spec.seed,
        "warmup_steps": spec.warmup,
        "repeats": spec.repeats,
        "memory_source": "torch.cuda" if spec.device.startswith("cuda") else "tensor-tracker",
    }


def spec_key(spec: RunSpec, *, device_name: str, source: str = "measured", kind: str = "point") -> tuple[str, ...]:
    """The results-CSV key of the row this spec will give on a device called device_name (a
    maxlen answer row: kind maxlen, no seq_len)."""
    from ..records import row_key

    values = {**spec_fields(spec), "kind": kind, "source": source, "device_name": device_name}
    if kind == "maxlen":
        values["seq_len"] = None
    return row_key(values)


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, TrackedOutOfMemoryError, MemoryError)):
        return True
    # autograd may re-raise an error from inside backward as a plain RuntimeError
    message = str(error)
    return TrackedOutOfMemoryError.__name__ in message or any(m in message for m in _HOST_OOM_MESSAGES)


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:500]


def storage_bytes(tensors, granularity_bytes: int = 1) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped), each rounded up to
    granularity_bytes. Keyed by storage identity, which also holds for fake tensors (whose
    storages all report data_ptr 0)."""
    sizes = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(-(-n // granularity_bytes) * granularity_bytes for n in sizes.values())


def resident_tensors(model, batch, optimizer) -> list[torch.Tensor]:
    """What is allocated before a step: weights, gradients (present under the steady protocol),
    the batch's tensors and the optimizer's state. Shared with the simulated step."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [t for t in vars(batch).values() if isinstance(t, torch.Tensor)]
    if optimizer is not None:
        tensors += optimizer_state_tensors(optimizer)
    return tensors


class _Step:
    """The model, batch, optimizer and gradient protocol of one point."""

    def __init__(self, spec: RunSpec, row: ResultRow):
        self.spec = spec
        model, self.batch = build_model_and_batch(spec, lora_alpha=spec.lora_alpha)
        self.model = model.train()
        config = self.model.config
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.model) if spec.step == "train" else None
        row.num_layers = config.num_hidden_layers
        row.num_params = sum(p.numel() for p in self.model.parameters())
        row.trainable_params = sum(p.numel() for p in self.trainable)
        row.num_tokens = self.batch.num_tokens
        row.model_flops = training_flops(self.model, batch_size=spec.batch_size, seq_len=spec.seq_len)
        row.weights_bytes = storage_bytes(self.model.parameters())
        row.grads_bytes = sum(p.numel() * p.element_size() for p in self.trainable)
        if spec.protocol == "steady":
            for p in self.trainable:
                p.grad = torch.zeros_like(p)
            if self.optimizer is not None:
                init_optimizer_state(self.optimizer)

    def prepare(self) -> None:
        """Before each step, outside any measured region."""
        for p in self.trainable:
            if self.spec.protocol == "steady":
                p.grad.zero_()
            else:
                p.grad = None
        if self.optimizer is not None and self.spec.protocol == "first":
            self.optimizer.state.clear()  # the moments are allocated inside the step
        gc.collect()  # reference cycles must not carry one step's tensors into the next

    def resident_bytes(self) -> int:
        return storage_bytes(resident_tensors(self.model, self.batch, self.optimizer))

    def run(self) -> torch.Tensor:
        return run_step(self.spec.method, self.model, self.batch, self.spec.settings, self.optimizer)

    def record_optimizer(self, row: ResultRow) -> None:
        if self.optimizer is not None:
            row.optimizer_state_bytes = optimizer_state_bytes(self.optimizer)


def _measure_cpu(step: _Step, row: ResultRow) -> Callable[[], None]:
    spec = step.spec
    step.prepare()
    resident = step.resident_bytes()
    if spec.memory_limit_bytes is not None and resident > spec.memory_limit_bytes:
        raise TrackedOutOfMemoryError(
            f"weights, gradients and batch take {resident:,} B, over the limit of {spec.memory_limit_bytes:,} B"
        )
    limit = None if spec.memory_limit_bytes is None else spec.memory_limit_bytes - resident
    row.baseline_bytes = resident
    tracker = LiveTensorTracker(limit_bytes=limit)
    reset_peak_rss()
    try:
        with tracker:
            row.loss = float(step.run())
    finally:  # an OOM row still says how far the step got
        row.cpu_peak_rss_bytes = peak_rss_bytes()
        row.peak_allocated_bytes = resident + tracker.peak_bytes
        row.activation_peak_bytes = tracker.peak_bytes
    for _ in range(spec.warmup):
        step.prepare()
        step.run()
    return lambda: None


def _measure_cuda(step: _Step, row: ResultRow, device: torch.device) -> Callable[[], None]:
    def synchronize() -> None:
        torch.cuda.synchronize(device)

    for _ in range(step.spec.warmup):
        step.prepare()
        step.run()
    step.prepare()
    synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    row.baseline_bytes = torch.cuda.memory_allocated(device)
    reset_peak_rss()
    sampler = NvmlPeakSampler(nvml_handle(device))
    try:
        with sampler:
            row.loss = float(step.run())
            synchronize()
    finally:  # an OOM row still says how far the step got
        row.peak_allocated_bytes = torch.cuda.max_memory_allocated(device)
        row.peak_reserved_bytes = torch.cuda.max_memory_reserved(device)
        row.activation_peak_bytes = row.peak_allocated_bytes - row.baseline_bytes
        row.nvml_peak_used_bytes = sampler.peak_bytes
        row.cpu_peak_rss_bytes = peak_rss_bytes()
    return synchronize


def measure_point(spec: RunSpec) -> ResultRow:
    """Measure one point in this process. Never raises for a failed step: the row says what happened."""
    row = ResultRow(**spec_fields(spec))
    device = torch.device(spec.device)
    try:
        if device.type == "cuda":
            startup = start_cuda(device)
            row.nvml_idle_used_bytes, row.cuda_context_bytes = startup.idle_used_bytes, startup.context_bytes
            if spec.memory_limit_bytes is not None:
                total = torch.cuda.get_device_properties(device).total_memory
                if spec.memory_limit_bytes > total:
                    raise ValueError(f"--memory-limit {spec.memory_limit_bytes:,} B exceeds the GPU's {total:,} B")
                torch.cuda.set_per_process_memory_fraction(spec.memory_limit_bytes / total, device)
        step = _Step(spec, row)
        step.record_optimizer(row)
        if device.type == "cuda":
            synchronize = _measure_cuda(step, row, device)
        else:
            synchronize = _measure_cpu(step, row)
        timing = None
        if spec.repeats:
            timing = time_steps(step.run, repeats=spec.repeats, synchronize=synchronize, before_each=step.prepare)
        step.record_optimizer(row)
    except Exception as error:  # noqa: BLE001 (any failure is the point's outcome, classified; the traceback goes to the worker's stderr)
        traceback.print_exc()
        row.status = "oom" if is_out_of_memory(error) else "error"
        row.error = one_line(error)
        return row
    row.status = "ok"
    if timing is None:
        return row
    row.time_median_s, row.time_min_s, row.time_max_s = timing.median_s, timing.min_s, timing.max_s
    row.tokens_per_s = spec.batch_size * spec.seq_len / timing.median_s
    row.tflops_per_s = row.model_flops / timing.median_s / 1e12
    return row
