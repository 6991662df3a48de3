"""Predict a point's peak memory by running its real step (methods/step.py, the one the
measured worker runs) on fake tensors, and report it as a results row (source "simulated").

target "cpu" reproduces the CPU tracker measurement (measure_point on device cpu) to the byte:
same baseline (weights, resident gradients, batch, optimizer state), same live-tensor count.
target "cuda" predicts torch.cuda.max_memory_allocated of the same point on a GPU:
- every block rounded up to 512 B, as the caching allocator does;
- attention through the CUDA kernels' own ops, chosen as CUDA's dispatcher chooses, plus the
  memory those kernels allocate internally (cuda_attention.py);
- StreamBP's attention takes its CUDA branch (SteeredHooks.cuda_branch);
- AdamW's multi-tensor (foreach) implementation, PyTorch's default for CUDA parameters.
What a GPU needs beyond the allocated peak is the margin, reported separately (MARGIN_NOTE).

With spec.nproc > 1 the prediction is one rank's under FSDP2 FULL_SHARD (sharded.py): the same
step on the rank's batch, with sharded resident terms and FSDP2's gathered copies added.

Host memory is counted apart (StepHooks.on_store, SteeredHooks.shapes_only): the checkpoint copies a placement
keeps on the host (`host_pinned_bytes`, their peak) plus HOST_PROCESS_BYTES for the process
itself; a point fits when both the device and the host side fit.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import lru_cache

from ..config import RunSpec
from ..measure.environment import capture_environment
from ..measure.flops import training_flops
from ..measure.host_memory import available_ram_bytes
from ..measure.tensor_tracker import counting_fsdp_resizes
from ..methods import MethodFn, MethodSettings, MethodUnsupported
from ..methods.phase_labels import PhaseLabels
from ..methods.step import storage_bytes
from ..methods.streambp import step_hooks
from ..records import ResultRow, one_line
from ..settings import ConfigError
from ..workload.rows import spec_fields
from .cuda_attention import CudaAttention, hidden_buffers, streambp_cuda_branch
from .fake_mode import build_fake_step
from .memory_counter import CUDA_ALLOCATOR_ROUNDING, SimulatedMemory
from .sequence_parallel import fake_ranks, local_bounds
from .sharded import check_sharded_spec, per_rank, sharded_terms

TARGETS = ("cuda", "cpu")
GIB = 2**30

# The margin: device memory a run needs beyond max_memory_allocated. Stated from what is known
# about CUDA and the caching allocator, not fitted to the paper's numbers.
# - The CUDA context (driver state, loaded kernel images, cuBLAS/cuBLASLt/cuDNN handles), outside
#   the allocator: commonly 0.3-0.7 GiB for PyTorch 2.x with CUDA 12's lazy module loading on
#   A100/H100. We take 0.75 GiB, which also covers the small allocations the count does not see
#   (cuBLAS workspaces, the attention kernels' RNG state). `sbp run` on a GPU records the context
#   (cuda_context_bytes), so this constant can be checked against real runs.
# - Fragmentation: the caching allocator reserves more than it hands out (large blocks rounded to
#   2 MiB, split blocks a larger request cannot reuse): we allow 5% of the activation peak. The
#   weights, gradients and optimizer moments are allocated once, in blocks of their own size, and
#   are not charged.
CUDA_CONTEXT_BYTES = 3 * GIB // 4
FRAGMENTATION_FRACTION = 0.05
MARGIN_NOTE = "CUDA context 0.75 GiB + 5% of the activation peak for allocator fragmentation"
# The host side of a GPU run besides the pinned checkpoints: the Python process with torch, the CUDA
# runtime and its libraries (cuBLAS, cuDNN) mapped, typically 3-5 GiB of RSS; the model is built on
# the GPU (models/build.py initialises on the target device), so its weights never sit on the host.
HOST_PROCESS_BYTES = 5 * GIB


# The estimate's own host memory: its batch is real (fake_mode.py), and the step's Python reads
# it, so it grows with the tokens. Measured RSS of `sbp estimate --model tiny/qwen3`: 43 B per token
# for one method (T = 1e7 to 3e7), 97 B for three; the fake steps of up to UNRUN_CACHED + 1
# methods hold their batches at once (`_unrun`'s cache and the one being built).
ESTIMATE_HOST_BYTES_PER_TOKEN = 48
UNRUN_CACHED = 4
HOST_HEADROOM_FRACTION = 0.8  # of the memory available now: the rest for the process and the OS


def check_estimate_host_memory(specs: list[RunSpec], available_bytes: int | None = None) -> None:
    """ValueError (one line) when the estimate of `specs` (one point, a spec per method) would need
    more host memory for its real batches than `available_bytes` (default: what this machine has
    available now) allows, with the bound and what to do."""
    if not specs:
        return
    if available_bytes is None:
        available_bytes = available_ram_bytes()
    spec, held = specs[0], min(len(specs), UNRUN_CACHED + 1)
    per_token = ESTIMATE_HOST_BYTES_PER_TOKEN * held * spec.batch_size
    need, allowed = per_token * spec.seq_len, int(HOST_HEADROOM_FRACTION * available_bytes)
    if need > allowed:
        raise ValueError(
            f"--seq {spec.seq_len} would need about {need / GIB:.1f} GiB of this machine's memory for the "
            f"estimate's real token batches ({ESTIMATE_HOST_BYTES_PER_TOKEN} B per token, B={spec.batch_size}, "
            f"{held} method(s) at once) but {allowed / GIB:.1f} GiB is usable; give --seq {allowed // per_token} "
            "or less" + (", or fewer methods" if held > 1 else "")
        )


@dataclass(frozen=True, kw_only=True)
class Estimate:
    target: str
    weights_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int | None
    baseline_bytes: int  # allocated before the step (rounded as the target's allocator rounds)
    activation_peak_bytes: int  # the step's peak above the baseline
    peak_phase: str
    attention_kernel: str  # cuda: the SDPA kernels used, e.g. "flash" or "efficient"; cpu: ""
    margin_bytes: int  # cuda: context + fragmentation; cpu: 0
    num_layers: int
    num_params: int
    trainable_params: int
    num_tokens: int
    model_flops: float
    host_pinned_bytes: int = 0  # peak of the checkpoint copies in host memory
    transfer_bytes: int = 0  # checkpoint bytes moved host <-> device in the step

    @property
    def host_peak_bytes(self) -> int:
        return HOST_PROCESS_BYTES + self.host_pinned_bytes

    @property
    def peak_allocated_bytes(self) -> int:
        return self.baseline_bytes + self.activation_peak_bytes

    def fits(self, memory_bytes: int) -> bool:
        return self.peak_allocated_bytes + self.margin_bytes <= memory_bytes


def margin_bytes(activation_peak_bytes: int) -> int:
    return CUDA_CONTEXT_BYTES + round(FRAGMENTATION_FRACTION * activation_peak_bytes)


@contextmanager
def _cuda_attention():
    """Attention as on a GPU for the duration of the block; yields the CudaAttention in use."""
    with streambp_cuda_branch(), CudaAttention() as attention:
        yield attention


def estimate(spec: RunSpec, *, target: str = "cuda", method: MethodFn | None = None) -> Estimate:
    """Run the point's step under fake tensors and count its memory; see the module docstring.

    method: a stand-in for the registered spec.method with the same signature (e.g.
    paper_baseline.PAPER_METHODS["ckpt"]), followed by the optimizer step as TrainingStep.run does."""
    return simulate(spec, target=target, method=method)[0]


@dataclass(frozen=True)
class StepMemory:
    """What only running the step tells: its activation peak (one GPU), where, the kernels, the host copies."""

    activation_peak_bytes: int
    peak_phase: str
    attention_kernel: str
    host_pinned_bytes: int
    transfer_bytes: int
    phase_peaks: dict[str, int] = field(default_factory=dict)  # the activation peak within each phase label


def simulate(
    spec: RunSpec, *, target: str = "cuda", method: MethodFn | None = None, counter_type=SimulatedMemory
) -> tuple[Estimate, SimulatedMemory]:
    """estimate(), and the counter it ran (counter_type: SimulatedMemory or a subclass that records
    more, length.py), for callers that read more of the step than its peak."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
    check_sharded_spec(spec)
    if spec.settings.chunk_attention not in (None, "auto", "lower-right"):  # auto is lower-right on fake tensors
        raise ConfigError(
            "chunk_attention", f"{spec.settings.chunk_attention}: the estimator models the lower-right kernel only"
        )
    with ranks_of(spec):  # the fake process group a sequence-parallel rank's step runs in
        return _simulate(spec, target, method, counter_type)


def _simulate(spec: RunSpec, target: str, method: MethodFn | None, counter_type) -> tuple[Estimate, SimulatedMemory]:
    cuda, shared = target == "cuda", spec.sp > 1
    fake = build_fake_step(spec, foreach_optimizer=cuda)
    step = fake.step
    baseline = storage_bytes(step.resident_tensors(), granularity_bytes(target))
    counter = counter_type(granularity_bytes(target), hidden=hidden_buffers if cuda else None)
    if shared and hasattr(counter, "sequence_bounds"):
        counter.sequence_bounds = local_bounds(spec)
    phases = PhaseLabels(counter, chunked_head=spec.method == "streambp", at_norm=shared)
    with ExitStack() as stack:
        if shared:
            stack.enter_context(counting_fsdp_resizes(counter))  # FSDP2's gathered parameters
        attention = stack.enter_context(_cuda_attention()) if cuda else None
        stack.enter_context(phases.attached(step.model, step.optimizer))
        # On a GPU the host copies are another memory; on the CPU they are in the same one, as the
        # tracker counts them: fake copies, so the counter sees them.
        stores = []  # StreamBP's checkpoint stores, or the offloaded checkpoints' (methods/offload.py)
        stack.enter_context(step_hooks(on_store=stores.append, shapes_only=cuda))
        stack.enter_context(counter.attached(step))
        stack.enter_context(fake.mode)
        stack.enter_context(counter)
        if method is None:
            step.run()
        else:
            method(step.model, step.batch, step.settings)
            if step.optimizer is not None:
                step.optimizer.step()
    memory = StepMemory(
        activation_peak_bytes=counter.peak_bytes,
        peak_phase=counter.peak_phase,
        attention_kernel=attention.kernel_names() if attention is not None else "",
        host_pinned_bytes=max((s.max_host_bytes for s in stores), default=0),
        transfer_bytes=sum(s.transfer_bytes for s in stores),
        phase_peaks=dict(counter.phase_peaks),
    )
    return assemble(spec, step, memory, target, baseline=baseline), counter


def granularity_bytes(target: str) -> int:
    return CUDA_ALLOCATOR_ROUNDING if target == "cuda" else 1


@lru_cache(maxsize=4)
def _unrun(spec: RunSpec, cuda: bool):
    with ranks_of(spec):
        return build_fake_step(spec, foreach_optimizer=cuda).step


def ranks_of(spec: RunSpec):
    """The fake process group of a point whose ranks share each sequence (sequence_parallel.py); else nothing."""
    return fake_ranks(spec.nproc) if spec.sp > 1 else nullcontext()


def unrun_step(spec: RunSpec, target: str):
    """The point's fake step, built and not run: what is resident before it. Its method settings
    do not change that, so one is built per point whatever the placement or chunk sizes."""
    return _unrun(replace(spec, settings=MethodSettings(), auto_settings=()), target == "cuda")


def assemble_unrun(spec: RunSpec, memory: StepMemory, target: str) -> Estimate:
    """The Estimate of a point whose `memory` comes from elsewhere (an extrapolation), its resident
    bytes counted on `unrun_step`."""
    step = unrun_step(spec, target)
    return assemble(
        spec, step, memory, target, baseline=storage_bytes(step.resident_tensors(), granularity_bytes(target))
    )


def assemble(spec: RunSpec, step, memory: StepMemory, target: str, *, baseline: int) -> Estimate:
    """The Estimate of the point from its fake `step` (run or not) and `memory` from running it
    (baseline: the resident bytes before the step); per rank under FSDP2 (sharded.py)."""
    granularity = granularity_bytes(target)
    model = step.model
    result = Estimate(
        target=target,
        weights_bytes=storage_bytes(model.parameters()),
        grads_bytes=step.grads_bytes,
        optimizer_state_bytes=step.optimizer_state_bytes,
        baseline_bytes=baseline,
        activation_peak_bytes=memory.activation_peak_bytes,
        peak_phase=memory.peak_phase,
        attention_kernel=memory.attention_kernel,
        margin_bytes=0,
        num_layers=model.config.num_hidden_layers,
        num_params=sum(p.numel() for p in model.parameters()),
        trainable_params=sum(p.numel() for p in step.trainable),
        num_tokens=step.batch.num_tokens,
        model_flops=training_flops(model, batch_size=spec.batch_size, seq_len=spec.seq_len),
        host_pinned_bytes=memory.host_pinned_bytes,
        transfer_bytes=memory.transfer_bytes,
    )
    if spec.nproc > 1 and spec.sp == 1:  # data-parallel: FSDP2's terms added to the one-GPU step's
        result = per_rank(result, sharded_terms(step, spec.nproc, granularity))
    return replace(result, margin_bytes=margin_bytes(result.activation_peak_bytes) if target == "cuda" else 0)


def estimate_point(
    spec: RunSpec,
    *,
    target: str = "cuda",
    gpu_memory_bytes: int | None = None,
    host_memory_bytes: int | None = None,
    method: MethodFn | None = None,
    estimator: Callable[..., Estimate] | None = None,
) -> ResultRow:
    """A results row for the point: status ok, or oom when peak + margin exceeds gpu_memory_bytes
    or the host side exceeds host_memory_bytes, or error (the row says why). Provenance is this
    machine's software, not a GPU's. method: as in `estimate`. estimator: what gives the Estimate
    (default `estimate`, the full fake run; length.predict extrapolates from shorter ones)."""
    row = ResultRow(**spec_fields(spec))
    row.source, row.memory_source = "simulated", "fake-tensor"
    row.device = target
    row.device_name = "simulated GPU" if target == "cuda" else "simulated CPU"
    row.device_total_memory_bytes = gpu_memory_bytes
    env = capture_environment("cpu")
    for name in ("host", "torch_version", "transformers_version", "sbpbench_version", "python_version"):
        setattr(row, name, getattr(env, name))
    row.git_commit, row.git_dirty = env.git_commit, env.git_dirty
    row.timestamp_utc = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        result = (estimator or estimate)(spec, target=target, method=method)
    except MethodUnsupported as error:
        row.status, row.error = "unsupported", one_line(error)
        return row
    except Exception as error:
        row.status, row.error = "error", one_line(error)
        return row
    for name in (
        "weights_bytes",
        "grads_bytes",
        "optimizer_state_bytes",
        "baseline_bytes",
        "activation_peak_bytes",
        "peak_allocated_bytes",
        "peak_phase",
        "attention_kernel",
        "margin_bytes",
        "num_layers",
        "num_params",
        "trainable_params",
        "num_tokens",
        "model_flops",
        "transfer_bytes",
    ):
        setattr(row, name, getattr(result, name))
    row.host_pinned_peak_bytes = result.host_pinned_bytes
    return judge(row, gpu_memory_bytes, host_memory_bytes)


def host_peak_bytes(row: ResultRow) -> int:
    """The host side of a simulated row: the process and the pinned checkpoint copies, of each rank
    on the node where ranks share each sequence (P GPUs of one node: `ranks_per_node`)."""
    return ranks_per_node(row) * (HOST_PROCESS_BYTES + (row.host_pinned_peak_bytes or 0))


def ranks_per_node(point) -> int:
    """Processes on the GPU machine whose host buffers add up: nproc where ranks share each sequence
    (a spec's or a row's; every rank holds as much), else 1 (one GPU; data-parallel rows stay per rank)."""
    return point.nproc if (point.sp or 1) > 1 else 1


def judge(row: ResultRow, gpu_memory_bytes: int | None, host_memory_bytes: int | None) -> ResultRow:
    """status ok or oom from the row's device peak + margin and its host peak; error and
    unsupported rows stay."""
    if row.status in ("error", "unsupported"):
        return row
    row.status, row.error = "ok", ""
    row.device_total_memory_bytes = gpu_memory_bytes
    need = row.peak_allocated_bytes + row.margin_bytes
    if gpu_memory_bytes is not None and need > gpu_memory_bytes:
        row.status = "oom"
        row.error = f"needs {need / GIB:.2f} GiB (peak + margin) of {gpu_memory_bytes / GIB:.2f} GiB"
    elif host_memory_bytes is not None and host_peak_bytes(row) > host_memory_bytes:
        row.status = "oom"
        row.error = (
            f"host: needs {host_peak_bytes(row) / GIB:.2f} GiB (pinned checkpoints + process) "
            f"of {host_memory_bytes / GIB:.2f} GiB"
        )
    return row
