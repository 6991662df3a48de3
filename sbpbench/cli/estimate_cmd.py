"""`sbp estimate`: predict a GPU's peak memory for each method by running its step on fake tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..core import DEFAULT_CHUNK_SIZE, DEFAULT_LOGITS_CHUNK_SIZE
from ..data import DEFAULT_PROMPT_LEN
from ..measure.units import gib, parse_bytes
from ..records import ResultRow, check_writable, upsert_rows
from ..simulate import MARGIN_NOTE, TARGETS
from ..simulate.depth import estimate_point_by_depth
from .errors import user_errors
from .options import ChunkOpt, DType, LogitsChunkOpt, SeedOpt
from .point_options import (
    DEFAULTS,
    DefaultedBatchOpt,
    LoraAlphaOpt,
    LoraRankOpt,
    MethodsOpt,
    MoreMethodsArg,
    NumLayersOpt,
    ObjectiveOpt,
    PromptLenOpt,
    ProtocolOpt,
    StepOpt,
    parse_methods,
    point_specs,
)

GPU_DEFAULTS = DEFAULTS["cuda"]  # a prediction is for a GPU: Qwen/Qwen3-4B, T=9000, bf16 unless told
DEFAULT_DTYPE = DType(GPU_DEFAULTS["dtype"])


def _fits(row: ResultRow) -> str:
    if row.status == "error":
        return "[red]error[/]"
    return "[green]yes[/]" if row.status == "ok" else "[yellow]no[/]"


def estimate_table(rows: list[ResultRow], gpu_memory_bytes: int) -> Table:
    first = rows[0]
    lora = f", LoRA r{first.lora_rank}" if first.lora_rank else ""
    title = (
        f"predicted peak memory: {first.model} ({first.num_layers or '?'} layers{lora}), {first.objective}, "
        f"step {first.step}, {first.dtype}, B={first.batch_size}, T={first.seq_len}, "
        f"chunks {first.chunk_size}/{first.logits_chunk_size}, {first.protocol} protocol\n"
        f"{first.device_name} ({first.device}), fake tensors"
    )
    caption = (
        "GiB = 2^30 B. peak: predicted max_memory_allocated = weights + grads + optimizer + batch + activations "
        "(act: the step's peak above them, in the phase shown). "
        f"margin, not in peak: {MARGIN_NOTE}. fits: peak + margin <= the GPU memory."
    )
    table = Table(title=title, caption=caption)
    fits = f"fits {gib(gpu_memory_bytes)} GiB"
    headers = ("method", "peak GiB", "weights", "grads", "optim", "act GiB", "peak phase", "attention", "margin", fits)
    for header in headers:
        table.add_column(
            header, justify="left" if header in ("method", "peak phase", "attention") else "right", no_wrap=True
        )
    for row in rows:
        table.add_row(
            row.method,
            gib(row.peak_allocated_bytes),
            gib(row.weights_bytes),
            gib(row.grads_bytes),
            gib(row.optimizer_state_bytes),
            gib(row.activation_peak_bytes),
            escape(row.peak_phase or "-"),
            row.attention_kernel or "-",
            gib(row.margin_bytes),
            _fits(row),
        )
    return table


def estimate(
    method: MethodsOpt = None,
    more_methods: MoreMethodsArg = None,
    model: Annotated[
        str, typer.Option("--model", "-m", help="Registry name (`sbp models`) or a local checkpoint directory.")
    ] = GPU_DEFAULTS["model"],
    seq: Annotated[int, typer.Option("--seq", "-T", min=2, help="Tokens per row, prompt included.")] = GPU_DEFAULTS[
        "seq"
    ],
    batch: DefaultedBatchOpt = None,
    objective: ObjectiveOpt = "sft",
    prompt_len: PromptLenOpt = DEFAULT_PROMPT_LEN,
    lora_rank: LoraRankOpt = 0,
    lora_alpha: LoraAlphaOpt = 128,
    step: StepOpt = "bp",
    dtype: Annotated[DType, typer.Option(help="Model dtype.")] = DEFAULT_DTYPE,
    chunk_size: ChunkOpt = DEFAULT_CHUNK_SIZE,
    logits_chunk_size: LogitsChunkOpt = DEFAULT_LOGITS_CHUNK_SIZE,
    num_layers: NumLayersOpt = 0,
    protocol: ProtocolOpt = "steady",
    gpu_memory: Annotated[
        str, typer.Option(help="GPU memory to check the prediction against, e.g. 80GiB, 24GB.")
    ] = "80GiB",
    target: Annotated[
        str,
        typer.Option(help="cuda: predict a GPU run; cpu: reproduce what `sbp run --device cpu` measures."),
    ] = "cuda",
    seed: SeedOpt = 0,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Results CSV to add the rows to (upserted by point).")
    ] = None,
) -> None:
    """Predict each method's peak GPU memory at one (model, T) point without a GPU: the step
    `sbp run` measures runs on fake tensors (no memory behind them), with CUDA's attention kernels
    and allocator rounding modelled. Prints the breakdown, the phase of the peak and whether it
    fits --gpu-memory. A model whose layers are all alike runs at depths 2 and 3 and is extrapolated
    to its full depth, exactly (sbpbench/simulate/depth.py): Qwen3-8B at T=20k takes about 30 s for
    all three methods on a 2-core CPU."""
    with user_errors():
        if target not in TARGETS:
            raise ValueError(f"unknown --target {target!r}; choose from {', '.join(TARGETS)}")
        gpu_memory_bytes = parse_bytes(gpu_memory)
        specs = point_specs(
            parse_methods([*(method or []), *(more_methods or [])]),
            model=model,
            seq=seq,
            batch=batch,
            objective=objective,
            prompt_len=prompt_len,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            step=step,
            dtype=dtype,
            chunk_size=chunk_size,
            logits_chunk_size=logits_chunk_size,
            device="cpu",  # fake CPU tensors: fake CUDA tensors abort a CPU-only torch build
            num_layers=num_layers,
            protocol=protocol,
            memory_limit=None,
            seed=seed,
            warmup=0,
            repeats=0,
        )
        if out is not None:
            check_writable(out)
    console = Console()
    rows = []
    for spec in specs:
        with console.status(f"simulating {spec.method} ({spec.model}, T={spec.seq_len})"):
            row = estimate_point_by_depth(spec, target=target, gpu_memory_bytes=gpu_memory_bytes)
        rows.append(row)
        if out is not None:
            upsert_rows(out, [row])
    console.print(estimate_table(rows, gpu_memory_bytes))
    for row in rows:
        if row.status == "error":
            console.print(f"{row.method}: error: {escape(row.error)}", highlight=False, soft_wrap=True)
    if out is not None:
        console.print(f"{len(rows)} row(s) written to {out}", highlight=False)
    if any(row.status == "error" for row in rows):
        raise typer.Exit(1)
