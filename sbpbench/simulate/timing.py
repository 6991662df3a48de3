"""How long one training step takes on a GPU, phase by phase: the planner's time model (plan.py).

A step's work, counted from the model's shapes (measure/flops.py's conventions: 2 FLOPs per
multiply-add, causal attention below the diagonal only), divided by a rate per kind of work:
- matmul: the weights' matmuls. StreamBP runs every layer's forward twice (the checkpoint pass and
  the chunk forward of the backward), recomputes the K/V projections of all positions once per
  layer, adds one forward per rebuilt layer (recompute:K), and the gradients of inputs and of
  trainable weights (a LoRA step skips the frozen weights'); the head's lm_head forward and
  gradients; bp and ckpt (for fitting measured rows) their forward, ckpt's recompute, backward;
- attention forward, attention backward: FlashAttention's (B, H, T, T) work, the backward counted
  as FlashAttention's benchmarks count it, 2.5 forwards (it recomputes QK^T; flash_attn's
  benchmark_flash_attention.py `flops`), so the published rates apply as they stand;
- per chunk (StreamBP's overhead for a smaller chunk): each layer chunk adds its fp32 weight-gradient
  sum (core/grad_accum.py: read the chunk's bf16 gradient, read and write the fp32 sum, 10 B per
  bf16 trainable parameter, plus the 2 B the gradient is written with) at HBM bandwidth, and its
  kernel launches where they exceed the chunk's GPU time (the host queues kernels ahead of the
  GPU; a chunk shorter than its launches leaves the GPU waiting);
- host copies (cpu placements): the checkpoint store's copies (`depth.store_counts`) at PCIe
  bandwidth, each overlapping the compute it runs beside (a copy out the next layer's forward, a
  copy back the current layer's backward): only what exceeds that compute is added, plus the
  first copy back, which nothing overlaps;
- stream placements (`stream_copies_s`): the rebuilt layers' forwards (core/placements/rebuild_schedule.py) as
  work, and the chunk copies of each phase beyond the compute of that phase (they run one chunk ahead
  beside it): a layer's forward reads and writes one layer input, its backward reads two and dZ and
  writes dX, the head and the embedding's backward copy theirs beside no compute counted here. One
  side stream carries both directions, so the copy rate is for both together;
- first-step pinning: registering the host copies' pages with CUDA (cudaHostRegister), once per
  buffer: reported apart from the step, since a pinned-buffer pool pays it once per process;
- P ranks sharing each sequence (Ulysses, `ranks`): one rank's share of the work, its T_loc =
  ceil(T / P) positions through the weights and H / P heads of attention over all T, in chunks of
  T_loc; plus its collectives (sequence_parallel.collective_bytes) at the interconnect rate, not
  overlapped with compute (the all-to-alls sit inside each chunk's attention; FSDP2's gathers
  are issued when a layer begins): an upper bound on their cost.

Rates come from measured GPU rows of the same device when the results hold any (`fitted_rates`),
else the defaults below, from published figures. A ranking and a forecast, not a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..core import Placement
from ..core.internal import schedule
from ..measure.flops import attention_layer_windows, matmul_parameters, mean_attended_keys
from ..records import decode_row, read_rows

# Defaults, NVIDIA H100 SXM5 80 GB, bf16 (a device without measured rows is priced as one):
# - matmul: the highest bf16 matmul rate measured on an H100 SXM, 794.5 TFLOP/s of its 989 dense peak
#   (stas00/ml-engineering, compute/accelerator "Maximum Achievable Matmul FLOPS comparison table",
#   torch 2.7, cu12.6);
# - attention: PyTorch's SDPA runs FlashAttention-2 on an H100; the FlashAttention-3 paper (Shah et
#   al. 2024, arXiv 2407.08608, figures 5 and 6) measures FlashAttention-2 at head dim 128, 16k
#   tokens, at 335 TFLOP/s forward with a causal mask and 322 TFLOP/s backward;
# - HBM3: 3.35 TB/s (H100 SXM5 datasheet); PCIe 5.0 x16: 64 GB/s each way (H100 datasheet:
#   128 GB/s, both directions), an assumption until a GPU row measures it: page-locked copies on a
#   Gen5 x16 link commonly reach 50-55 GB/s, and the stream placements' one side stream carries
#   both directions in turn;
# - a kernel launch from PyTorch eager: 5 us, an assumption of the order NVIDIA's and PyTorch's CUDA
#   graphs posts give for the host's cost per launched kernel ("a few microseconds"); it matters only
#   where a chunk's kernels run shorter than their launches;
# - page-locking host memory (cudaHostRegister of fresh pages, faulted in and pinned): HOST_REGISTER_BYTES_S;
# - GPU to GPU within a node: NVLink 4 on an H100 SXM, "900 gigabytes per second (GB/s) bidirectional per
#   GPU" (NVIDIA's H100 product page), 450 GB/s each way; a rank of an all-to-all sends and receives at once,
#   so its bytes sent go at 450 GB/s. NCCL reaches less in practice (its all-to-all bus bandwidth on 8 H100s
#   is commonly quoted near 350 GB/s); `sbp plan --interconnect` replaces the rate.
INTERCONNECT_BYTES_S = 450e9
DEFAULT_RATES_NOTE = "H100 SXM figures: 794.5 TFLOP/s matmul, FlashAttention-2 335/322 TFLOP/s"


# Page-locking "is itself expensive (~1-2 GB/s)" (openvm-org/stark-backend#384); 5-19 s for the 18 GiB of a
# Qwen3-8B cpu step at 64k (1.0-3.9 GB/s measured on an H100 host). Replaced by the measured rate where
# GPU rows record their first step's page-locking (host_register_s, core/host_pool.py).
HOST_REGISTER_BYTES_S = 2e9


@dataclass(frozen=True)
class Rates:
    matmul_flop_s: float = 794.5e12
    attention_forward_flop_s: float = 335e12
    attention_backward_flop_s: float = 322e12  # FlashAttention's convention: 2.5 forwards of FLOPs
    memory_bytes_s: float = 3.35e12
    host_copy_bytes_s: float = 64e9
    launch_s: float = 5e-6
    pinning_bytes_s: float = HOST_REGISTER_BYTES_S
    interconnect_bytes_s: float = INTERCONNECT_BYTES_S  # GPU to GPU, each way (ranks sharing a sequence)
    # where each rate not assumed came from: (rate, "fitted to 4 rows of NVIDIA H100 80GB HBM3"); the
    # others are the defaults above, assumed from published figures
    fitted: tuple[tuple[str, str], ...] = ()

    @property
    def measured(self) -> tuple[str, ...]:
        """The rates fitted to measured rows."""
        return tuple(name for name, _ in self.fitted)

    def describe(self) -> str:
        """One line: every rate, grouped by where it came from: fitted to measured rows, or assumed."""
        origins = dict(self.fitted)
        groups: dict[str, list[str]] = {}
        for name, label, unit, scale in _SHOWN:
            origin = origins.get(name, f"assumed ({DEFAULT_RATES_NOTE})")
            groups.setdefault(origin, []).append(f"{label} {getattr(self, name) / scale:.3g} {unit}")
        return "; ".join(f"{', '.join(rates)}: {origin}" for origin, rates in groups.items())


_SHOWN = (  # (rate, label, unit, scale)
    ("matmul_flop_s", "matmul", "TFLOP/s", 1e12),
    ("attention_forward_flop_s", "attention forward", "TFLOP/s", 1e12),
    ("attention_backward_flop_s", "attention backward", "TFLOP/s", 1e12),
    ("host_copy_bytes_s", "host copies", "GB/s", 1e9),
    ("pinning_bytes_s", "page-locking", "GB/s", 1e9),
)
COMPUTE_RATES = ("matmul_flop_s", "attention_forward_flop_s", "attention_backward_flop_s")
# Kernels a StreamBP chunk launches per layer: the aten ops its fake step dispatches for one chunk of
# a Qwen3 layer (checkpoint pass, K/V, forward, backward, gradient sums; counted with instants.py:
# 489, and 792 with LoRA on its 7 linears); a head chunk about 60.
LAUNCHES_PER_CHUNK_LAYER = 490
LAUNCHES_PER_LORA_LINEAR = 43
LAUNCHES_PER_HEAD_CHUNK = 60
FLASH_BACKWARD_FORWARDS = 2.5


@dataclass(frozen=True)
class Work:
    """One step's work by kind, and what its time per chunk needs."""

    matmul_flops: float
    attention_forward_flops: float
    attention_backward_flops: float
    layer_forward_flops: float  # one layer's forward (matmuls and attention), for the copies' overlap
    chunk_layers: int  # layer chunks run in the backward (chunks x layers)
    head_chunks: int
    sum_bytes: float  # HBM traffic of the fp32 gradient sums
    launches: float


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step by phase, at the given rates."""

    matmul_s: float
    attention_forward_s: float
    attention_backward_s: float
    chunks_s: float  # gradient sums and launches beyond the chunks' GPU time
    host_copies_s: float  # copies beyond the compute they overlap
    first_step_pinning_s: float  # once per buffer, not in total_s
    communication_s: float = 0.0  # collectives between ranks sharing a sequence, not overlapped

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.attention_forward_s + self.attention_backward_s + self.chunks_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.host_copies_s + self.communication_s


def _layer_shapes(model: torch.nn.Module):
    """(decoder layers, lm_head) of a (meta, maybe LoRA) causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers, base.lm_head


def work(
    model: torch.nn.Module,
    *,
    method: str,
    batch_size: int,
    seq_len: int,
    placement: Placement | None = None,
    chunk_size: int | None = None,
    logits_chunk_size: int | None = None,
    ranks: int = 1,
) -> Work:
    """The work of one SFT step of `method` (bp, ckpt, streambp) on `model` (meta, LoRA applied).
    ranks: P ranks sharing each sequence (streambp): one rank's work (module docstring)."""
    layers, head = _layer_shapes(model)
    config = model.config
    local = math.ceil(seq_len / ranks)  # positions per rank
    tokens = batch_size * local
    num_layers = len(layers)
    layer = matmul_parameters(layers[0])
    layer_trainable = matmul_parameters(layers[0], trainable_only=True)
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_weights = 2 * config.hidden_size * kv * head_dim
    attention = [  # each rank: H / P heads over every position
        4 * heads * head_dim * mean_attended_keys(seq_len, w) * batch_size * seq_len / ranks
        for w in attention_layer_windows(config)
    ]
    head_weights = head.weight.numel()
    head_trainable = head_weights if head.weight.requires_grad else 0
    forward = 2 * layer * num_layers * tokens
    gradients = (2 * layer + 2 * layer_trainable) * num_layers * tokens
    head_flops = (4 * head_weights + 2 * head_trainable) * tokens
    if method in ("bp", "ckpt"):
        recompute = forward if method == "ckpt" else 0.0
        return Work(
            matmul_flops=forward + gradients + head_flops + recompute,
            attention_forward_flops=sum(attention) * (2 if method == "ckpt" else 1),
            attention_backward_flops=FLASH_BACKWARD_FORWARDS * sum(attention),
            layer_forward_flops=(forward + sum(attention)) / num_layers,
            chunk_layers=0,
            head_chunks=0,
            sum_bytes=0.0,
            launches=0.0,
        )
    if method != "streambp":
        raise ValueError(f"no time model for method {method!r}; it has bp, ckpt and streambp")
    placement = placement or Placement()
    rebuilt = rebuilt_layers(placement, num_layers)
    chunk_layers = math.ceil(local / chunk_size) * num_layers
    head_chunks = math.ceil(local / logits_chunk_size)
    bf16_trainable = sum(p.numel() for p in layers[0].parameters() if p.requires_grad and p.dtype == torch.bfloat16)
    lora_linears = sum(1 for name, _ in layers[0].named_modules() if name.endswith("lora_A"))
    return Work(
        matmul_flops=2 * forward
        + 2 * kv_weights * num_layers * tokens
        + gradients
        + head_flops
        + forward * rebuilt / num_layers,
        attention_forward_flops=2 * sum(attention) + sum(attention) / num_layers * rebuilt,
        attention_backward_flops=FLASH_BACKWARD_FORWARDS * sum(attention),
        layer_forward_flops=(forward + sum(attention)) / num_layers,
        chunk_layers=chunk_layers,
        head_chunks=head_chunks,
        sum_bytes=12.0
        * (bf16_trainable * chunk_layers + head_trainable * head_chunks * (head.weight.dtype == torch.bfloat16)),
        launches=chunk_layers * (LAUNCHES_PER_CHUNK_LAYER + LAUNCHES_PER_LORA_LINEAR * lora_linears)
        + head_chunks * LAUNCHES_PER_HEAD_CHUNK,
    )


def rebuilt_layers(placement: Placement, num_layers: int) -> int:
    """Layer forwards a step runs beyond the checkpoint pass's: recompute:K rebuilds all but the kept
    ceil(L/K); a stream placement what its schedule rebuilds."""
    if placement.stream:
        return schedule(num_layers, placement.buffers(num_layers)).rebuilt
    return num_layers - math.ceil(num_layers / placement.recompute_every)


def stream_copies_s(
    step: Work,
    rates: Rates,
    *,
    placement: Placement,
    num_layers: int,
    layer_input_bytes: int,
    embedding_trains: bool,
    sequence_parallel: bool = False,
) -> float:
    """Seconds of a stream placement's chunk copies beyond the compute they run beside (module
    docstring), per phase: a layer forward (the checkpoint pass's, a rebuild's) beside one layer
    forward of compute, a layer backward beside three. sequence_parallel: a rank's copies
    (depth.stream_transfers: a forward reads its input twice, a backward moves seven layer inputs)."""
    copy = layer_input_bytes / rates.host_copy_bytes_s
    forward = step.layer_forward_flops / rates.matmul_flop_s
    plan = schedule(num_layers, placement.buffers(num_layers))
    from_host = plan.rebuilt - plan.rebuilt_from_embedding
    reads, moved = (2, 7) if sequence_parallel else (1, 4)  # a forward's reads of its input, a backward's copies
    forwards = (num_layers - 1 + from_host) * max(0.0, (reads + 1) * copy - forward)  # read X_l, write X_{l+1}
    forwards += (1 + plan.rebuilt_from_embedding) * max(0.0, copy - forward)  # from X_0: write only
    first = 1 + embedding_trains * (3 if sequence_parallel else 1)  # layer 0: dZ in, dX out (and in, out)
    backwards = (num_layers - 1) * max(0.0, moved * copy - 3 * forward) + max(0.0, first * copy - 3 * forward)
    return forwards + backwards + (2 + embedding_trains) * copy  # head: Z_L in, dZ_L out; dX_0 in


def step_time(
    step: Work,
    rates: Rates,
    *,
    layer_input_bytes: int = 0,
    copies_out: int = 0,
    copies_back: int = 0,
    pinned_bytes: int = 0,
    streamed_s: float = 0.0,
    sent_bytes: float = 0.0,
) -> StepTime:
    """Seconds by phase; copies_out / copies_back: the store's copies of layer inputs (each
    layer_input_bytes) in the checkpoint pass and in the backward (depth.store_counts); streamed_s:
    a stream placement's copies beyond their compute (`stream_copies_s`); sent_bytes: what a rank
    sends to the ranks sharing its sequence (sequence_parallel.collective_bytes)."""
    matmul = step.matmul_flops / rates.matmul_flop_s
    forward = step.attention_forward_flops / rates.attention_forward_flop_s
    backward = step.attention_backward_flops / rates.attention_backward_flop_s
    gpu = matmul + forward + backward
    chunks = step.sum_bytes / rates.memory_bytes_s
    if step.chunk_layers:
        gpu_per_chunk = gpu / step.chunk_layers
        launch_per_chunk = step.launches * rates.launch_s / step.chunk_layers
        chunks += step.chunk_layers * max(0.0, launch_per_chunk - gpu_per_chunk)
    copy = layer_input_bytes / rates.host_copy_bytes_s
    layer_forward = step.layer_forward_flops / rates.matmul_flop_s
    copies = 0.0
    if copies_out + copies_back:
        copies = copies_out * max(0.0, copy - layer_forward) + max(0, copies_back - 1) * max(
            0.0, copy - 3 * layer_forward
        )
        copies += copy  # the first copy back overlaps nothing
    return StepTime(
        matmul, forward, backward, chunks, copies + streamed_s, pinned_bytes / rates.pinning_bytes_s,
        sent_bytes / rates.interconnect_bytes_s,
    )  # fmt: skip


def fitted_rates(results: str | Path, device: str, model_of) -> Rates:
    """Rates from the measured GPU rows under `results` (a CSV or a folder of them) whose device_name
    contains `device`: the three compute rates by least squares of the step times of bp, ckpt and
    streambp rows (any placement) on each row's work, when the rows separate them (three or
    more, of full rank), else one factor on all three defaults (the rows' time over the defaults');
    the page-locking rate from the rows that record their first step's (host_register_s). The
    other rates stay defaults. model_of(row) -> the row's model on the meta device (LoRA applied)."""
    rows = [row for row in _measured_rows(results) if device.lower() in row.device_name.lower()]
    rates = Rates()
    if not rows:
        return rates
    pinned = [row for row in rows if row.host_register_s and row.host_pinned_peak_bytes]
    if pinned:
        seconds = sum(row.host_register_s for row in pinned)
        rates = replace(rates, pinning_bytes_s=sum(row.host_pinned_peak_bytes for row in pinned) / seconds)
    # Every placement: a recompute placement's extra forward is work the fit sees; an offloaded one's
    # host copies hide behind the compute they run beside (a Qwen3-8B layer input at 64k copies in
    # 8 ms at PCIe rate, a layer's forward takes hundreds), so its time is compute too.
    timed = [row for row in rows if row.method in ("bp", "ckpt", "streambp")]
    fitted = (("pinning_bytes_s", _fitted_to(pinned)),) if pinned else ()
    if not timed:
        return replace(rates, fitted=fitted)
    columns, times = [], []
    for row in timed:
        step = work(
            model_of(row),
            method=row.method,
            batch_size=row.batch_size,
            seq_len=row.seq_len,
            chunk_size=row.chunk_size,
            logits_chunk_size=row.logits_chunk_size,
            placement=Placement.parse(row.checkpoints) if row.checkpoints else None,
        )
        columns.append([step.matmul_flops, step.attention_forward_flops, step.attention_backward_flops])
        times.append(row.time_median_s - step_time(step, rates).chunks_s)
    design, target = np.array(columns), np.array(times)
    if len(timed) >= 3 and np.linalg.matrix_rank(design) == 3:
        seconds_per_flop, *_ = np.linalg.lstsq(design, target, rcond=None)
        if (seconds_per_flop > 0).all():
            values = {name: float(1 / s) for name, s in zip(COMPUTE_RATES, seconds_per_flop)}
            fitted += tuple((name, _fitted_to(timed)) for name in COMPUTE_RATES)
            return replace(rates, **values, fitted=fitted)
    factor = float(target.sum() / (design @ np.array([1 / getattr(rates, name) for name in COMPUTE_RATES])).sum())
    values = {name: getattr(rates, name) / factor for name in COMPUTE_RATES}
    scaled = _fitted_to(timed) + ", one factor on the assumed"
    return replace(rates, **values, fitted=fitted + tuple((name, scaled) for name in COMPUTE_RATES))


def _fitted_to(rows) -> str:
    """Where a rate fitted to `rows` came from: "fitted to 4 rows of NVIDIA H100 80GB HBM3"."""
    devices = sorted({row.device_name for row in rows})
    return f"fitted to {len(rows)} row{'s' if len(rows) > 1 else ''} of {', '.join(devices)}"


def _measured_rows(results: str | Path):
    """The ok, timed point rows of one process measured on a GPU, from a CSV or a folder of them."""
    results = Path(results)
    files = sorted(results.rglob("*.csv")) if results.is_dir() else [results] if results.exists() else []
    for path in files:
        try:
            rows = read_rows(path)
        except ValueError:  # not a results CSV
            continue
        for values in rows:
            row = decode_row(values)
            if (
                (row.source, row.kind, row.status) == ("measured", "point", "ok")
                and row.device.startswith("cuda")
                and row.time_median_s
                and (row.nproc or 1) == 1
            ):
                yield row
