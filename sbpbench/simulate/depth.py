"""Predicting a deep model from two shallow ones, for long sequences where a full-depth fake run
takes minutes.

When every decoder layer has the same shape and attention type, each memory term of a step is
affine in the depth L: weights, gradients and optimizer moments per layer, plus per layer what
stays alive at the peak (bp: its saved activations; ckpt and streambp: its input checkpoint),
while the peak itself happens in a phase that does not depend on L (the head, or the top layer's
backward). So the full-depth value is v(2) + (L - 2) * (v(3) - v(2)); with recompute:K, along depths of one
remainder mod K (`probe_depths`). tests/estimator/test_simulate_depth.py checks this against full-depth runs
to the byte; models whose layers differ (Gemma 3's sliding
and global layers) are always run at full depth.

Each shallow model is itself predicted at T from shorter sequences (length.py) unless `exact`:
depth outermost, since its affine law holds at any fixed T, length innermost, since its fit needs
the step's instants, which only a run at one depth has. `exact` runs the full step: the point's
own depth and length, nothing extrapolated.

For StreamBP on one GPU the slope is known, so the deeper model need not run (`_lifted`). Under a
stream placement no layer input is on the device, so the device's peak is the shallow model's
(`_lifted_streamed`); its host buffers and copies follow from the schedule (`stream_transfers`).
Otherwise, when
the depth is a multiple of K, every segment below the top one is the top one's twin but for what
it keeps, and adds to the device only its kept input (one layer input, B x T x d; nothing when
offloaded), to what is live at every instant from the top segment up (its backward, the head, the
forward of its layers), and to the host and the copies what the checkpoint store counts for it
(`store_counts`, the store itself run on one-element tensors). So the full model's peak is the low
model's plus that, when the low model's peak is at such an instant (else both depths run); its
resident bytes are counted on the full model's fake step, built but not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import partial

import torch

from ..config import RunSpec
from ..core import Placement
from ..core.internal import CheckpointStore, schedule
from ..methods import MethodFn
from ..models import load_config
from ..records import ResultRow
from .estimate import Estimate, StepMemory, assemble_unrun, estimate_point, granularity_bytes, judge, margin_bytes
from .length import Note, predict, predict_by_phase

AFFINE_COLUMNS = (
    "num_params",
    "trainable_params",
    "weights_bytes",
    "grads_bytes",
    "optimizer_state_bytes",
    "baseline_bytes",
    "peak_allocated_bytes",
    "activation_peak_bytes",
    "model_flops",
    "host_pinned_peak_bytes",
    "transfer_bytes",
)
MIN_DEPTH = 6  # below this a full-depth run costs about as much as the two shallow ones
LIFTED_METHODS = ("streambp",)  # whose per-segment slope is known (`lifted`)


def uniform_layers(model: str) -> bool:
    """Every decoder layer the same: one attention type (no sliding/global mix)."""
    config = load_config(model)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and len(set(layer_types)) > 1:
        return False
    return not getattr(config, "sliding_window_pattern", None)


def probe_depths(depth: int, recompute_every: int = 1) -> tuple[int, int] | None:
    """The two shallow depths whose estimates give the full one, or None to run at full depth.

    Without recompute the terms are affine in L (2 and 3 layers). With recompute:K the device holds
    ceil(L/K) kept inputs and the top segments' rebuilt ones, so the terms are affine along depths
    of the same remainder mod K: the first with two segments, and one more segment."""
    k = recompute_every
    low = max(2, k + 1)
    low += (depth - low) % k  # low = depth (mod k)
    high = low + k
    return (low, high) if high < depth and depth >= MIN_DEPTH else None


def estimate_point_by_depth(
    spec: RunSpec,
    *,
    target: str = "cuda",
    gpu_memory_bytes: int | None = None,
    host_memory_bytes: int | None = None,
    method: MethodFn | None = None,
    exact: bool = False,
    note: Note | None = None,
) -> ResultRow:
    """estimate_point's row, from two shallower models when that is exact (see above), each
    predicted from shorter sequences (length.py) unless `exact`. note: progress lines."""
    estimator = None if exact else partial(predict, note=note)
    depth = spec.num_layers or load_config(spec.model).num_hidden_layers
    every = spec.settings.checkpoints.recompute_every if spec.settings.checkpoints else 1
    depths = None if exact else probe_depths(depth, every)
    if depths is None or not uniform_layers(spec.model):
        return estimate_point(
            spec,
            target=target,
            gpu_memory_bytes=gpu_memory_bytes,
            host_memory_bytes=host_memory_bytes,
            method=method,
            estimator=estimator,
        )
    low, high = depths
    # one GPU, or ranks sharing the sequence (whose FSDP2 terms at the peak are one layer's and the root's)
    if not exact and spec.method in LIFTED_METHODS and (spec.nproc == 1 or spec.sp > 1):
        lift = _lifted_streamed if Placement.parse(spec.settings.checkpoints or "gpu").stream else _lifted
        lifted = lift(spec, low, target=target, method=method, note=note)
        if lifted is not None:
            return estimate_point(
                spec,
                target=target,
                gpu_memory_bytes=gpu_memory_bytes,
                host_memory_bytes=host_memory_bytes,
                estimator=lambda *_, **__: lifted,
            )
    shallow = estimate_point(replace(spec, num_layers=low), target=target, method=method, estimator=estimator)
    row = estimate_point(replace(spec, num_layers=high), target=target, method=method, estimator=estimator)
    failed = [r for r in (shallow, row) if r.status in ("error", "unsupported")]
    if failed:  # the method cannot run, or its step failed: that row, with the point's own depth
        failed[0].num_layers = depth
        return failed[0]
    steps = (depth - low) // (high - low)  # whole segments: depth = low (mod high - low)
    for column in AFFINE_COLUMNS:
        a, b = getattr(shallow, column), getattr(row, column)
        if a is not None and b is not None:
            setattr(row, column, type(b)(a + steps * (b - a)))
    row.num_layers = depth  # as spec_fields records the full model, so the row keys as the full run's
    row.margin_bytes = margin_bytes(row.activation_peak_bytes)
    # a layer counted from the top of the `high`-layer model is the same layer from the top of the full one
    row.peak_phase = re.sub(r"layer (\d+)", lambda m: f"layer {int(m.group(1)) + depth - high}", row.peak_phase)
    return judge(row, gpu_memory_bytes, host_memory_bytes)


@dataclass(frozen=True)
class StoreCounts:
    """What a CheckpointStore holds and moves in one step, in layer inputs."""

    max_host_inputs: int
    transfers: int  # copies host <-> device
    top_device_inputs: int  # on the device during the top layer's backward
    max_device_inputs: int


def store_counts(placement: Placement, num_layers: int, *, embedding_trains: bool = True) -> StoreCounts:
    """The checkpoint store (core/placements/placement.py) of `placement` put, got and released as
    stream_backward does, on one-element CPU tensors: its own counters, in layer inputs. A stream
    placement's, from its schedule: its buffers, and the copies of the whole step (`stream_transfers`)."""
    if placement.stream:
        buffers = placement.buffers(num_layers)
        transfers = stream_transfers(num_layers, buffers, embedding_trains=embedding_trains)
        return StoreCounts(buffers, transfers, 0, 0)
    store = CheckpointStore(placement, num_layers)
    store.rebuild_into = _copy_one
    one = torch.zeros(1, 1, 1, dtype=torch.uint8)  # (B, T, d) of one element
    for index in range(num_layers):
        store.put(index, one.clone())
    top = 0
    for index in reversed(range(num_layers)):
        store.get(index, one.device)
        top = top or store.device_inputs
        store.release(index)
    store.close()
    return StoreCounts(store.max_host_bytes, store.transfer_bytes, top, store.max_device_inputs)


def stream_transfers(
    num_layers: int,
    num_buffers: int,
    *,
    embedding_trains: bool = True,
    head_reads: int = 1,
    sequence_parallel: bool = False,
) -> int:
    """Layer inputs' worth of host <-> device copies in one step of a stream placement (core/
    stream_store.py), every chunk of the head counted (head_reads: 2 for an objective of sequence
    sums, which reads Z_L twice). X_0 is computed on the device, so layer 0 reads nothing.
    pass:      each layer writes its output; each but layer 0 reads its input
    head:      Z_L read, dZ_L written
    layer l:   X_l read twice (K/V capture, chunks) but for l = 0; dZ read; dX written (layer 0: if
               the embedding trains, which then reads dX_0 back whole)
    rebuilds:  each forward reads its input (unless X_0) and writes its output
    sequence_parallel (core/parallel/sequence_layer.py): a forward reads its input twice (keys/values
    to head space first, then the chunks); a backward reads X_l once more (the keys/values' backward)
    and reads dX back and writes it again (the norm's share added)."""
    plan = schedule(num_layers, num_buffers)
    reads = 2 if sequence_parallel else 1  # of a forward's input
    passing = num_layers + reads * (num_layers - 1)
    backward = 7 if sequence_parallel else 4  # X_l reads, dZ read, dX written (and read and written again)
    layers = backward * (num_layers - 1) + 1 + embedding_trains * (3 if sequence_parallel else 1)
    rebuilds = (reads + 1) * plan.rebuilt - reads * plan.rebuilt_from_embedding
    return passing + head_reads + 1 + layers + rebuilds + embedding_trains


def _copy_one(index: int, source, sink) -> None:
    """A rebuild on one-element layer inputs (B, T, d) = (1, 1, 1)."""
    (chunk,) = source.chunks([(0, 1)])
    sink.write(0, 1, chunk)


def layer_input_bytes(spec: RunSpec) -> int:
    """One layer input X_l of the point (of one rank: T_loc = ceil(T / P) positions where P ranks
    share the sequence): B x T x d in the model dtype."""
    positions = -(-spec.seq_len // spec.sp)
    return spec.batch_size * positions * load_config(spec.model).hidden_size * spec.torch_dtype.itemsize


def _lifted(spec: RunSpec, low: int, *, target: str, method: MethodFn | None, note: Note | None) -> Estimate | None:
    """The full model's Estimate from the `low`-layer model's and the known slope (module
    docstring); None where the slope does not apply: a top segment shorter than the others (a
    full segment below it would hold more rebuilt inputs), or the low model's peak below its top
    segment."""
    if spec.step == "train" and spec.protocol == "first":  # moments made in the step, per layer: measure the slope
        return None
    placement = spec.settings.checkpoints
    depth = spec.num_layers or load_config(spec.model).num_hidden_layers
    shallow, phases = predict_by_phase(replace(spec, num_layers=low), target=target, method=method, note=note)
    layer_input = layer_input_bytes(spec)
    counts, full = store_counts(placement, low), store_counts(placement, depth)
    if (shallow.host_pinned_bytes, shallow.transfer_bytes) != (
        counts.max_host_inputs * layer_input,
        counts.transfers * layer_input,
    ):
        return None
    every = placement.recompute_every
    kept = 0 if placement.offload else (depth - low) // every  # more kept inputs on the device
    granularity = granularity_bytes(target)
    more = kept * -(-layer_input // granularity) * granularity
    if depth % every:
        return None
    peak, phase = shallow.activation_peak_bytes + more, shallow.peak_phase
    if not _from_top_segment(phase, low - every):
        if spec.sp == 1:  # one GPU: both depths run instead (estimate_point_by_depth)
            return None
        peak, phase = _peak_by_phase(phases, low - every, more)
    memory = StepMemory(
        activation_peak_bytes=peak,
        # a layer counted from the top of the shallow model is the same layer from the top of the full one
        peak_phase=re.sub(r"layer (\d+)", lambda m: f"layer {int(m.group(1)) + depth - low}", phase),
        attention_kernel=shallow.attention_kernel,
        host_pinned_bytes=full.max_host_inputs * layer_input,
        transfer_bytes=full.transfers * layer_input,
    )
    return assemble_unrun(spec, memory, target)


def _lifted_streamed(
    spec: RunSpec, low: int, *, target: str, method: MethodFn | None, note: Note | None
) -> Estimate | None:
    """A stream placement's full model from the `low`-layer model's: the same device peak (nothing
    of a layer input is on the device between its layer's phases, and every layer but the first
    runs the same ops), the host buffers of the full model's schedule, and the copies the full
    schedule adds to the shallow one's (`stream_transfers`). None for the first step's moments."""
    if spec.step == "train" and spec.protocol == "first":
        return None
    placement = Placement.parse(spec.settings.checkpoints)
    depth = spec.num_layers or load_config(spec.model).num_hidden_layers
    # every stream:N with N >= low runs the same shallow step as stream: one sample run for all of them
    same = replace(placement, host_buffers=None) if placement.buffers(low) == low else placement
    shallow_spec = replace(spec.with_settings(checkpoints=same), num_layers=low)
    shallow = predict(shallow_spec, target=target, method=method, note=note)
    layer_input = layer_input_bytes(spec)
    if shallow.host_pinned_bytes != placement.buffers(low) * layer_input:
        return None
    trains, shared = not spec.lora_rank, spec.sp > 1
    more = stream_transfers(
        depth, placement.buffers(depth), embedding_trains=trains, sequence_parallel=shared
    ) - stream_transfers(low, placement.buffers(low), embedding_trains=trains, sequence_parallel=shared)
    memory = StepMemory(
        activation_peak_bytes=shallow.activation_peak_bytes,
        peak_phase=re.sub(r"layer (\d+)", lambda m: f"layer {int(m.group(1)) + depth - low}", shallow.peak_phase),
        attention_kernel=shallow.attention_kernel,
        host_pinned_bytes=placement.buffers(depth) * layer_input,
        transfer_bytes=shallow.transfer_bytes + more * layer_input,
    )
    return assemble_unrun(spec, memory, target)


def _peak_by_phase(phases: dict[str, int], top_segment: int, more: int) -> tuple[int, str]:
    """The full model's activation peak and its phase from the shallow model's peak per phase
    (`phases`, length.predict_by_phase): the
    phases where every kept input below the top segment is live gain `more` (the full model's kept
    inputs beyond the shallow one's); the others (the bottom layers, the embedding, the optimizer)
    hold what the shallow model's do, and a layer between holds less than the top one. Where ranks
    share the sequence, FSDP2's unsharded root gradients can put the shallow peak in the embedding's
    backward while the full model's is in its head."""
    found = [(value + more * _from_top_segment(label, top_segment), label) for label, value in phases.items()]
    return max(found, key=lambda pair: pair[0])  # the first phase to reach it, as a run reports its peak's


def _from_top_segment(phase: str, top_segment: int) -> bool:
    """Whether every kept input below the top segment is live at this phase: the head, and the
    forward and backward of the top segment's layers."""
    match = re.fullmatch(r"(?:forward|backward) layer (\d+)", phase)
    return phase.startswith("head") or (match is not None and int(match.group(1)) >= top_segment)
