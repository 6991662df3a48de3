"""The planner behind `sbp plan`: the fastest checkpoint placement and chunk size that fit a GPU and
a host, from the time model (timing.py) and the memory estimator (estimate.py, length.py, depth.py).

Candidates are every placement x chunk size, fastest predicted first, decided in that order; the
first that fits is the plan. The stream placement comes as stream:N with the most host buffers the
host holds (more buffers, fewer rebuilt layers: faster; the device holds the same). What cannot fit
is ruled out without a simulation where it can be:
- for every chunk size of a placement: the host the checkpoint store would fill (its own count of
  the layer inputs it holds there, `depth.store_counts`, the bytes the estimator reports), or the
  device's resident bytes plus what is certainly live at the top layer's backward: the layer inputs
  the store holds there, the gradient dZ (on the device but under stream), the layer's K/V buffers
  and their fp32 sums, and one attention call's gradients of all T keys (`_Bounds.layer_bytes`);
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
from ..core.internal import every_input_buffers, kv_heads_per_call
from ..methods.step import storage_bytes
from ..models import apply_lora, load_config
from ..records import ResultRow
from .depth import StoreCounts, estimate_point_by_depth, layer_input_bytes, store_counts
from .estimate import (
    HOST_PROCESS_BYTES,
    granularity_bytes,
    host_peak_bytes,
    margin_bytes,
    ranks_per_node,
    unrun_step,
)
from .length import Note
from .sequence_parallel import collective_bytes
from .timing import Rates, StepTime, rebuilt_layers, step_time, stream_copies_s, work

RECOMPUTE_EVERY = (2, 3, 4, 6, 9, 12)  # K candidates
CHUNK_SIZES = (500, 1000, 2000, 4096)  # layer chunks tried (the paper's 500 the smallest; 4096 the rule's largest)
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


def placements(num_layers: int, stream_buffers: int = 2) -> list[Placement]:
    """Every placement tried; stream_buffers: the N of stream:N (`stream` where it keeps every input)."""
    found = [Placement(), Placement(offload=True)]
    for k in RECOMPUTE_EVERY:
        if k < num_layers:
            found += [Placement(recompute_every=k), Placement(offload=True, recompute_every=k)]
            if k > 3:  # below 4 a segment has nothing to spill
                found.append(Placement(offload=True, recompute_every=k, spill=True))
    every = every_input_buffers(num_layers)
    found.append(Placement(stream=True, host_buffers=None if stream_buffers >= every else stream_buffers))
    return found


def stream_buffers(spec: RunSpec, host_memory_bytes: int | None) -> int:
    """The most host buffers of one layer input a stream placement can have on this host (at least 2:
    the fewest it runs with, then refused by the host bound where they do not fit)."""
    if host_memory_bytes is None:
        return 2
    per_rank = host_memory_bytes // ranks_per_node(spec)  # each rank of the node its own buffers
    return max(2, (per_rank - HOST_PROCESS_BYTES) // layer_input_bytes(spec))


def candidates(
    spec: RunSpec, model: torch.nn.Module, rates: Rates, host_memory_bytes: int | None = None
) -> list[Candidate]:
    """Every placement x chunk size, fastest predicted first (ties: the larger chunk)."""
    num_layers = model.config.num_hidden_layers
    layer_input = layer_input_bytes(spec)
    trains = not spec.lora_rank  # the embedding trains: layer 0 writes dX_0
    found = []
    for placement in placements(num_layers, stream_buffers(spec, host_memory_bytes)):
        counts = store_counts(placement, num_layers, embedding_trains=trains)
        kept = -(-num_layers // placement.recompute_every)  # copied out in the checkpoint pass when offloaded
        sent = sent_bytes(spec, model, rebuilt_layers(placement, num_layers))
        for chunk in CHUNK_SIZES:
            if chunk > -(-spec.seq_len // spec.sp) and chunk != CHUNK_SIZES[0]:
                continue
            step = work(
                model,
                method="streambp",
                batch_size=spec.batch_size,
                seq_len=spec.seq_len,
                placement=placement,
                chunk_size=chunk,
                logits_chunk_size=spec.settings.logits_chunk_size,
                ranks=spec.sp,
            )
            copies_out = kept if placement.offload else 0
            streamed = 0.0
            if placement.stream:
                copies_out, streamed = 0, stream_copies_s(
                    step, rates, placement=placement, num_layers=num_layers, layer_input_bytes=layer_input,
                    embedding_trains=trains, sequence_parallel=spec.sp > 1,
                )  # fmt: skip
            time = step_time(
                step,
                rates,
                layer_input_bytes=layer_input,
                copies_out=copies_out,
                copies_back=0 if placement.stream else counts.transfers - copies_out,
                pinned_bytes=counts.max_host_inputs * layer_input,
                streamed_s=streamed,
                sent_bytes=sent,
            )
            found.append(Candidate(placement, chunk, time, counts))
    return sorted(found, key=lambda c: (c.predicted_time_s, -c.chunk_size))


def sent_bytes(spec: RunSpec, model: torch.nn.Module, rebuilt: int) -> float:
    """What one rank sends per step to the ranks sharing its sequence (none on one GPU); model: meta_model(spec)."""
    return collective_bytes(spec, model, rebuilt_layers=rebuilt).total if spec.sp > 1 else 0.0


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
    found = candidates(spec, meta_model(spec), rates, host_memory_bytes)
    num_layers = spec.num_layers or load_config(spec.model).num_hidden_layers
    bounds = _Bounds(spec, gpu_memory_bytes, host_memory_bytes, num_layers)
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
            placement_bound = bounds.refuses(candidate)
            twin = None if placement_bound else _spill_twin(candidate, found)
            if twin is not None and (twin.placement, twin.chunk_size) not in decided and not bounds.refuses(twin):
                decided[twin.placement, twin.chunk_size] = estimate(twin)  # holds less: it bounds this one
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


def ruled_out_by(spec: RunSpec, decided: list[PlanOutcome], gpu_memory_bytes: int) -> set[str]:
    """What would have to grow for a decided candidate to fit: "GPU", "host" or both. A candidate the
    host ruled out counts for the GPU where the GPU alone rules it out too (its bound with an
    unbounded host, or its estimate's peak + margin), so more host memory is advised only where it
    would help."""
    num_layers = spec.num_layers or load_config(spec.model).num_hidden_layers
    unbounded_host = _Bounds(spec, gpu_memory_bytes, 2**62, num_layers)
    found = set()
    for outcome in decided:
        row = outcome.row
        if not (outcome.bound or row.error).startswith("host"):
            found.add("GPU")
        elif outcome.bound:
            found.add("GPU" if unbounded_host.refuses(outcome.candidate) else "host")
        else:
            peak = row.peak_allocated_bytes
            found.add("host" if peak is not None and peak + (row.margin_bytes or 0) <= gpu_memory_bytes else "GPU")
    return found


def family(placement: Placement) -> str:
    """The placement's kind, its numbers as letters: "cpu+recompute:K+spill", "stream:N"."""
    if placement.stream:
        return "stream:N"
    return placement.name.replace(f"recompute:{placement.recompute_every}", "recompute:K")


def summary(
    chosen: PlanOutcome | None, decided: list[PlanOutcome], found: list[Candidate]
) -> list[PlanOutcome | Candidate]:
    """Per placement family, in order of predicted time: the plan where it is of the family, else the
    family's fastest decided candidate (why it was not the plan), else its fastest candidate (slower
    than the plan, never decided)."""
    rows: dict[str, PlanOutcome | Candidate] = {}
    for candidate in found:
        name = family(candidate.placement)
        mine = [o for o in decided if o.candidate == candidate]
        if chosen is not None and chosen.candidate == candidate:
            rows[name] = chosen
        elif name not in rows or (isinstance(rows[name], Candidate) and mine):
            rows[name] = mine[0] if mine else rows.get(name, candidate)
    return sorted(rows.values(), key=lambda r: _candidate(r).predicted_time_s)


def _candidate(row: PlanOutcome | Candidate) -> Candidate:
    return row.candidate if isinstance(row, PlanOutcome) else row


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
        self.layer_bytes = _layer_backward_bytes(spec)

    def refuses(self, candidate: Candidate) -> str:
        """Why no chunk size of the candidate's placement fits, from the store's counts and what the
        top layer's backward certainly holds (module docstring)."""
        counts = candidate.counts
        ranks = ranks_per_node(self.spec)
        host = ranks * (HOST_PROCESS_BYTES + counts.max_host_inputs * self.layer_input)
        if host > self.host:
            inputs = f"{counts.max_host_inputs} layer inputs" + (f" x {ranks} ranks" if ranks > 1 else "")
            return f"host: needs {host / GIB:.1f} GiB ({inputs}), of {self.host / GIB:.1f}"
        held = counts.max_device_inputs * self.device_input  # at some instant
        top = counts.top_device_inputs * self.device_input + self.layer_bytes
        top += 0 if candidate.placement.stream else self.device_input  # dZ
        device = max(self.baseline + extra + margin_bytes(extra) for extra in (held, top))
        if device > self.gpu:
            inputs = max(counts.max_device_inputs, counts.top_device_inputs)
            return f"GPU: needs over {device / GIB:.1f} GiB ({inputs} layer inputs), of {self.gpu / GIB:.1f}"
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
        spec = self.spec
        row = ResultRow(model=spec.model, method="streambp", seq_len=spec.seq_len, source="simulated")
        row.nproc, row.sp = spec.nproc, spec.sp  # the host side is per node where ranks share the sequence
        row.checkpoints, row.chunk_size = candidate.placement.name, candidate.chunk_size
        row.logits_chunk_size = self.spec.settings.logits_chunk_size
        row.status, row.error = "oom", why
        row.host_pinned_peak_bytes = candidate.counts.max_host_inputs * self.layer_input
        return row


def _layer_backward_bytes(spec: RunSpec) -> int:
    """What any placement's top layer backward certainly holds (a lower bound of its peak). One GPU,
    at its first chunk's attention backward: the
    K/V buffers (model dtype) and their fp32 gradient sums over all T positions, and one attention
    call's gradients of its T keys (core/attention.py ATTENTION_BACKWARD_BYTES) unless a sliding
    window bounds the keys. Each allocator block rounded up to 512 B (whole T: negligible)."""
    config = load_config(spec.model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    itemsize, tokens = spec.torch_dtype.itemsize, spec.batch_size * spec.seq_len
    if spec.sp > 1:  # a rank's K/V heads (each up to once per rank) over T padded, and dZ's query share (B, T_loc, d)
        padded = spec.batch_size * -(-spec.seq_len // spec.sp) * spec.sp
        heads_here = max(kv_heads, spec.sp) // spec.sp
        return 2 * heads_here * head_dim * (itemsize + max(itemsize, 4)) * padded + layer_input_bytes(spec)
    buffers = 2 * kv_heads * head_dim * (itemsize + max(itemsize, 4)) * tokens
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None)
    if sliding or any(kind != "full_attention" for kind in layer_types):
        return buffers
    group = kv_heads_per_call(spec.batch_size, heads, kv_heads, head_dim, itemsize, spec.seq_len)
    return buffers + group * tokens * 2 * head_dim * itemsize * (1 + heads // kv_heads)


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
