"""The planner behind `sbp plan`: the fastest checkpoint placement and chunk sizes that fit a GPU and
a host, from the memory estimator (estimate.py, depth.py) and a time model from the FLOP count.

Time model (a ranking, not a measurement; its constants are assumptions stated here):
- StreamBP executes about 4 forwards' worth of matmuls per step: the checkpoint pass, the chunked
  forward with grad and the backward (2x), so 4/3 of the model FLOPs (measure/flops.py, whose count
  is 3 forwards: PaLM's 6N per token plus attention);
- recompute:K adds one more forward of the layers it rebuilds: (L - ceil(L/K)) of L layers;
- the device computes ACHIEVED_FLOP_S (an H100 in bf16 at about 40% of its 989 TFLOP/s dense peak,
  what attention-bound long-context steps reach);
- cpu moves every kept input out and back over PCIe at PCIE_BYTES_S (Gen5 x16 in practice): each
  copy out overlaps the next layer's forward, each copy back the current layer's backward; only
  what a copy takes beyond the compute it overlaps is added, plus the first copy back, which
  nothing overlaps. spill adds its rebuilt inputs' copies out (overlapping the rebuild) and back,
  and a second copy back of each rebuilt segment's kept input;
- the first step of a process also page-locks a host buffer per layer input the host holds at
  HOST_REGISTER_BYTES_S (core/host_pool.py); later steps reuse them, so candidates rank by the
  steady step and `first_step=True` adds it.
Candidates run in order of predicted time through the estimator; the first that fits is the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from transformers import AutoModelForCausalLM

from ..config import DTYPES, RunSpec
from ..core.placement import Placement
from ..measure.flops import training_flops
from ..models import apply_lora, load_config
from ..records import ResultRow
from .depth import estimate_point_by_depth
from .estimate import host_peak_bytes

ACHIEVED_FLOP_S = 400e12
PCIE_BYTES_S = 25e9
# cudaHostRegister of fresh pages (faulted in and pinned): page-locking "is itself expensive (~1-2
# GB/s)" (openvm-org/stark-backend#384); 5-19 s for the 18 GiB of a Qwen3-8B cpu step at 64k (1.0-3.9
# GB/s, the reading in issue 26). An assumption until a GPU row's host_register_s measures it.
HOST_REGISTER_BYTES_S = 2e9
RECOMPUTE_EVERY = (2, 3, 4, 6, 9, 12)  # K candidates
CHUNK_SIZES = (500, 1000, 2000)  # layer chunks tried, the paper's 500 first (fewer chunks: fewer kernel launches)


@dataclass(frozen=True)
class Candidate:
    placement: Placement
    chunk_size: int
    predicted_time_s: float


@dataclass
class PlanOutcome:
    candidate: Candidate
    row: ResultRow  # the estimator's row (status ok / oom / error)


def predicted_time_s(
    spec: RunSpec,
    placement: Placement,
    *,
    num_layers: int,
    model_flops: float,
    layer_bytes: int,
    first_step: bool = False,
) -> float:
    """The time model above for one step (the process's first with first_step: host buffers are
    registered then). layer_bytes: one layer input X_l (B x T x d x s)."""
    if first_step:
        register_s = placement.host_inputs(num_layers) * layer_bytes / HOST_REGISTER_BYTES_S
        return register_s + predicted_time_s(
            spec, placement, num_layers=num_layers, model_flops=model_flops, layer_bytes=layer_bytes
        )
    forward = model_flops / 3  # one forward of the whole model, attention included
    layer_forward_s = forward / num_layers / ACHIEVED_FLOP_S
    every = placement.recompute_every
    kept = math.ceil(num_layers / every)
    compute = (4 * forward + forward * (num_layers - kept) / num_layers) / ACHIEVED_FLOP_S
    if not placement.offload:
        return compute
    spilled = refetched = 0
    if placement.spill:  # segment [s, top]: X_{s+1} .. X_{top-2} spilled; X_s dropped, back twice, if top > s + 1
        heights = [min(every, num_layers - s) - 1 for s in range(0, num_layers, every)]  # top - s
        spilled = sum(max(0, h - 2) for h in heights)
        refetched = sum(h >= 2 for h in heights)
    copy_s = layer_bytes / PCIE_BYTES_S
    exposed_out = (kept + spilled) * max(0.0, copy_s - layer_forward_s)
    exposed_back = (kept + spilled + refetched - 1) * max(0.0, copy_s - 3 * layer_forward_s) + copy_s
    return compute + exposed_out + exposed_back


def candidates(spec: RunSpec, *, num_layers: int, model_flops: float, layer_bytes: int) -> list[Candidate]:
    """Every placement x chunk size, fastest predicted first (ties: the larger chunk, fewer launches)."""
    placements = [Placement(), Placement(offload=True)]
    for k in RECOMPUTE_EVERY:
        if k < num_layers:
            placements += [Placement(recompute_every=k), Placement(offload=True, recompute_every=k)]
            if k > 3:  # below 4 a segment has nothing to spill
                placements.append(Placement(offload=True, recompute_every=k, spill=True))
    found = [
        Candidate(
            p, c, predicted_time_s(spec, p, num_layers=num_layers, model_flops=model_flops, layer_bytes=layer_bytes)
        )
        for p in placements
        for c in CHUNK_SIZES
        if c <= spec.seq_len or c == CHUNK_SIZES[0]
    ]
    return sorted(found, key=lambda c: (c.predicted_time_s, -c.chunk_size))


def plan(
    spec: RunSpec, *, gpu_memory_bytes: int, host_memory_bytes: int, max_estimates: int = 12
) -> tuple[PlanOutcome | None, list[PlanOutcome]]:
    """(the fastest fitting candidate or None, every candidate estimated on the way). spec: a
    streambp point; its placement and chunk size are what the planner chooses."""
    model = _meta_model(spec)
    num_layers = model.config.num_hidden_layers
    layer_bytes = spec.batch_size * spec.seq_len * model.config.hidden_size * DTYPES[spec.dtype].itemsize
    flops = training_flops(model, batch_size=spec.batch_size, seq_len=spec.seq_len)
    tried: list[PlanOutcome] = []
    for candidate in candidates(spec, num_layers=num_layers, model_flops=flops, layer_bytes=layer_bytes):
        if len(tried) >= max_estimates:
            break
        if _dominated(candidate, tried):
            continue
        settings = replace(spec.settings, checkpoints=candidate.placement.name, chunk_size=candidate.chunk_size)
        row = estimate_point_by_depth(
            replace(spec, settings=settings),
            target="cuda",
            gpu_memory_bytes=gpu_memory_bytes,
            host_memory_bytes=host_memory_bytes,
        )
        outcome = PlanOutcome(candidate, row)
        tried.append(outcome)
        if row.status == "ok":
            return outcome, tried
    return None, tried


def _meta_model(spec: RunSpec) -> torch.nn.Module:
    """The point's model (depth, LoRA) on the meta device: shapes for the FLOP count, no memory."""
    overrides = {"num_hidden_layers": spec.num_layers} if spec.num_layers else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(spec.model, **overrides), dtype=DTYPES[spec.dtype])
    return apply_lora(model, rank=spec.lora_rank, alpha=spec.lora_alpha) if spec.lora_rank else model


def _dominated(candidate: Candidate, tried: list[PlanOutcome]) -> bool:
    """Skip what cannot fit: the same placement with a smaller chunk already ran out of device
    memory (a larger chunk needs at least as much), or the host was already too small for a
    placement that keeps at least as many inputs there."""
    for outcome in tried:
        if outcome.row.status != "oom":
            continue
        done = outcome.candidate
        host_short = outcome.row.error.startswith("host")
        offloads = done.placement.offload and candidate.placement.offload
        layers = outcome.row.num_layers
        if host_short and offloads and candidate.placement.host_inputs(layers) >= done.placement.host_inputs(layers):
            return True
        if not host_short and done.placement == candidate.placement and candidate.chunk_size >= done.chunk_size:
            return True
    return False


def describe(outcome: PlanOutcome) -> dict:
    """The numbers `sbp plan` prints for one estimated candidate."""
    row = outcome.row
    return {
        "checkpoints": outcome.candidate.placement.name,
        "chunk_size": outcome.candidate.chunk_size,
        "logits_chunk_size": row.logits_chunk_size,
        "status": row.status,
        "device_bytes": (row.peak_allocated_bytes or 0) + (row.margin_bytes or 0),
        "host_bytes": host_peak_bytes(row),
        "predicted_time_s": outcome.candidate.predicted_time_s,
        "error": row.error,
    }
