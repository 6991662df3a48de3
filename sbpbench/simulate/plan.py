"""The planner behind `sbp plan`: the fastest checkpoint placement and chunk size that fit a GPU and
a host, from the time model (timing.py) and the memory estimator (estimate.py, length.py, depth.py).

Candidates are every placement x chunk size, fastest predicted first, decided in that order; the
first that fits is the plan. What cannot fit is ruled out without a simulation where it can be:
- for every chunk size of a placement: the host the checkpoint store would fill (its own count of
  the layer inputs it holds there, `depth.store_counts`, the bytes the estimator reports), or the
  device's resident bytes plus the layer inputs the store holds there at once;
- a chunk size larger than one of the same placement that ran out of device memory (a larger chunk
  needs at least as much);
- from an estimate of another placement at the same chunk size whose peak is in the top layer's
  backward (`_Bounds.by_estimates`): a cpu+recompute:K candidate has its spill twin, which holds
  fewer layer inputs on the device at every instant, estimated first for that.
The rest are estimated (estimate_point_by_depth, extrapolated from short runs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import AutoModelForCausalLM

from ..config import DTYPES, RunSpec
from ..core import Placement
from ..methods.step import storage_bytes
from ..models import apply_lora, load_config
from ..records import ResultRow
from .depth import StoreCounts, estimate_point_by_depth, layer_input_bytes, store_counts
from .estimate import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION_FRACTION,
    HOST_PROCESS_BYTES,
    granularity_bytes,
    host_peak_bytes,
    margin_bytes,
    unrun_step,
)
from .length import Note
from .timing import Rates, StepTime, step_time, work

RECOMPUTE_EVERY = (2, 3, 4, 6, 9, 12)  # K candidates
CHUNK_SIZES = (500, 1000, 2000)  # layer chunks tried (the paper's 500 the smallest)
GIB = 2**30


@dataclass(frozen=True)
class Candidate:
    placement: Placement
    chunk_size: int
    time: StepTime
    counts: StoreCounts

    @property
    def predicted_time_s(self) -> float:
        return self.time.total_s


@dataclass
class PlanOutcome:
    candidate: Candidate
    row: ResultRow  # the estimator's row (status ok / oom / error), or a bound's (status oom, no peak)
    bound: str = ""  # why it was dropped without a simulation
    any_chunk: bool = False  # the bound holds for every chunk size of its placement


def meta_model(point: RunSpec | ResultRow) -> torch.nn.Module:
    """A point's model (a spec's, or a results row's: depth, dtype, LoRA) on the meta device: shapes
    for the work, no memory."""
    overrides = {"num_hidden_layers": point.num_layers} if point.num_layers else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(point.model, **overrides), dtype=DTYPES[point.dtype])
    return apply_lora(model, rank=point.lora_rank, alpha=point.lora_alpha) if point.lora_rank else model


def placements(num_layers: int) -> list[Placement]:
    found = [Placement(), Placement(offload=True)]
    for k in RECOMPUTE_EVERY:
        if k < num_layers:
            found += [Placement(recompute_every=k), Placement(offload=True, recompute_every=k)]
            if k > 3:  # below 4 a segment has nothing to spill
                found.append(Placement(offload=True, recompute_every=k, spill=True))
    return found


def candidates(spec: RunSpec, model: torch.nn.Module, rates: Rates) -> list[Candidate]:
    """Every placement x chunk size, fastest predicted first (ties: the larger chunk)."""
    num_layers = model.config.num_hidden_layers
    layer_input = layer_input_bytes(spec)
    found = []
    for placement in placements(num_layers):
        counts = store_counts(placement, num_layers)
        kept = -(-num_layers // placement.recompute_every)  # copied out in the checkpoint pass when offloaded
        for chunk in CHUNK_SIZES:
            if chunk > spec.seq_len and chunk != CHUNK_SIZES[0]:
                continue
            step = work(
                model,
                method="streambp",
                batch_size=spec.batch_size,
                seq_len=spec.seq_len,
                placement=placement,
                chunk_size=chunk,
                logits_chunk_size=spec.settings.logits_chunk_size,
            )
            copies_out = kept if placement.offload else 0
            time = step_time(
                step,
                rates,
                layer_input_bytes=layer_input,
                copies_out=copies_out,
                copies_back=counts.transfers - copies_out,
                pinned_bytes=counts.max_host_inputs * layer_input,
            )
            found.append(Candidate(placement, chunk, time, counts))
    return sorted(found, key=lambda c: (c.predicted_time_s, -c.chunk_size))


def plan(
    spec: RunSpec,
    *,
    gpu_memory_bytes: int,
    host_memory_bytes: int,
    rates: Rates | None = None,
    note: Note | None = None,
    max_estimates: int = 12,
) -> tuple[PlanOutcome | None, list[PlanOutcome]]:
    """(the fastest candidate that fits, or None; every candidate decided on the way, by a bound or
    an estimate). spec: a streambp point; its placement and chunk size are what the planner picks."""
    rates = rates or Rates()
    model = meta_model(spec)
    found = candidates(spec, model, rates)
    bounds = _Bounds(spec, gpu_memory_bytes, host_memory_bytes, model.config.num_hidden_layers)
    decided: dict[tuple[Placement, int], PlanOutcome] = {}

    def estimate(candidate: Candidate) -> PlanOutcome:
        if note:
            note(f"{candidate.placement.name} --chunk-size {candidate.chunk_size}: estimating")
        row = estimate_point_by_depth(
            spec.with_settings(checkpoints=candidate.placement, chunk_size=candidate.chunk_size),
            target="cuda",
            gpu_memory_bytes=gpu_memory_bytes,
            host_memory_bytes=host_memory_bytes,
            note=note,
        )
        if note:
            note(f"{candidate.placement.name} --chunk-size {candidate.chunk_size}: {row.status} {row.error}".rstrip())
        return PlanOutcome(candidate, row)

    for candidate in found:
        key = (candidate.placement, candidate.chunk_size)
        if key not in decided and not _dominated(candidate, decided.values()):
            twin = _spill_twin(candidate, found)
            if twin is not None and (twin.placement, twin.chunk_size) not in decided and not bounds.refuses(twin):
                decided[twin.placement, twin.chunk_size] = estimate(twin)  # holds less: it bounds this one
            placement_bound = bounds.refuses(candidate)
            why = placement_bound or bounds.by_estimates(candidate, decided.values())
            if why:
                decided[key] = PlanOutcome(candidate, bounds.row(candidate, why), why, bool(placement_bound))
            elif sum(not o.bound for o in decided.values()) >= max_estimates:
                break
            else:
                decided[key] = estimate(candidate)
        if key in decided and decided[key].row.status == "ok":  # the fastest left: those before it did not fit
            return decided[key], list(decided.values())
    return None, list(decided.values())


def _spill_of(placement: Placement) -> Placement | None:
    """cpu+recompute:K+spill for cpu+recompute:K (K >= 4, with something to spill), else None: it
    holds no more layer inputs on the device at any instant (at most two)."""
    if not placement.offload or placement.spill or placement.recompute_every < 4:
        return None
    return replace(placement, spill=True)


def _spill_twin(candidate: Candidate, found: list[Candidate]) -> Candidate | None:
    """The candidate's spill twin (`_spill_of`, same chunk), estimated first: where it does not fit
    neither does the candidate, and where it fits, its top layer's peak bounds the candidate's
    (`_Bounds.by_estimates`)."""
    spill = _spill_of(candidate.placement)
    return next((c for c in found if c.placement == spill and c.chunk_size == candidate.chunk_size), None)


def _dominated(candidate: Candidate, decided) -> bool:
    """Cannot fit: its placement was ruled out by a bound that holds for any chunk size, or a chunk no
    larger of the same placement ran out of device memory (a larger one needs at least as much)."""
    for outcome in decided:
        done = outcome.candidate
        if done.placement != candidate.placement or outcome.row.status != "oom":
            continue
        if outcome.any_chunk:
            return True
        if not outcome.row.error.startswith("host") and done.chunk_size <= candidate.chunk_size:
            return True
    return False


class _Bounds:
    """What rules a candidate out without simulating it (module docstring)."""

    def __init__(self, spec: RunSpec, gpu_memory_bytes: int, host_memory_bytes: int, num_layers: int):
        self.spec, self.gpu, self.host = spec, gpu_memory_bytes, host_memory_bytes
        self.top_layer = f"backward layer {num_layers - 1}"
        step = unrun_step(spec, "cuda")
        granularity = granularity_bytes("cuda")
        self.baseline = storage_bytes(step.resident_tensors(), granularity)
        self.layer_input = layer_input_bytes(spec)
        self.device_input = -(-self.layer_input // granularity) * granularity

    def refuses(self, candidate: Candidate) -> str:
        """Why no chunk size of the candidate's placement fits, from the store's counts alone."""
        host = HOST_PROCESS_BYTES + candidate.counts.max_host_inputs * self.layer_input
        if host > self.host:
            return f"host: needs {host / GIB:.2f} GiB (pinned checkpoints + process) of {self.host / GIB:.2f} GiB"
        inputs = candidate.counts.max_device_inputs * self.device_input
        device = self.baseline + inputs + CUDA_CONTEXT_BYTES + round(FRAGMENTATION_FRACTION * inputs)
        if device > self.gpu:
            return (
                f"needs over {device / GIB:.2f} GiB: resident {self.baseline / GIB:.2f} GiB and "
                f"{candidate.counts.max_device_inputs} layer inputs at once, of {self.gpu / GIB:.2f} GiB"
            )
        return ""

    def by_estimates(self, candidate: Candidate, decided) -> str:
        """Why the candidate does not fit, from an estimate of its chunk size whose peak is in the top
        layer's backward: there every placement runs the same ops and holds the same besides its
        layer inputs on the device (the store's count then, `top_device_inputs`), so the candidate's
        value at that instant is the estimate's with the difference in layer inputs; a lower bound
        of its peak. A spill twin that does not fit bounds it too (it holds no more at any instant)."""
        for outcome in decided:
            done, row = outcome.candidate, outcome.row
            if done.chunk_size != candidate.chunk_size or outcome.bound or row.peak_allocated_bytes is None:
                continue
            if (
                done.placement == _spill_of(candidate.placement)
                and row.status == "oom"
                and not row.error.startswith("host")
            ):
                return f"its spill twin ({done.placement.name}) does not fit: {row.error}"
            if row.peak_phase != self.top_layer:
                continue
            more = (candidate.counts.top_device_inputs - done.counts.top_device_inputs) * self.device_input
            peak = row.peak_allocated_bytes + more
            need = peak + margin_bytes(peak - self.baseline)
            if need > self.gpu:
                return (
                    f"needs over {need / GIB:.2f} GiB: {done.placement.name}'s top layer (estimated) with "
                    f"{candidate.counts.top_device_inputs} layer inputs on the device, of {self.gpu / GIB:.2f} GiB"
                )
        return ""

    def row(self, candidate: Candidate, why: str) -> ResultRow:
        row = ResultRow(model=self.spec.model, method="streambp", seq_len=self.spec.seq_len, source="simulated")
        row.checkpoints, row.chunk_size = candidate.placement.name, candidate.chunk_size
        row.logits_chunk_size = self.spec.settings.logits_chunk_size
        row.status, row.error = "oom", why
        row.host_pinned_peak_bytes = candidate.counts.max_host_inputs * self.layer_input
        return row


def describe(outcome: PlanOutcome, tokens: int) -> dict:
    """The numbers `sbp plan` prints for one decided candidate (tokens: B x T, for tokens/s)."""
    row = outcome.row
    time = outcome.candidate.time
    return {
        "checkpoints": outcome.candidate.placement.name,
        "chunk_size": outcome.candidate.chunk_size,
        "logits_chunk_size": row.logits_chunk_size,
        "status": row.status,
        "device_bytes": None if outcome.bound else (row.peak_allocated_bytes or 0) + (row.margin_bytes or 0),
        "host_bytes": host_peak_bytes(row),
        "predicted_time_s": time.total_s,
        "tokens_per_s": tokens / time.total_s,
        "first_step_pinning_s": time.first_step_pinning_s,
        "error": row.error,
    }
