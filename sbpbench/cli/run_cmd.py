"""`sbp run`: measure peak memory and time of each method at one point, one process per method."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..core import DEFAULT_CHUNK_SIZE, DEFAULT_LOGITS_CHUNK_SIZE
from ..data import DEFAULT_PROMPT_LEN
from ..measure.units import gib
from ..records import ResultRow, check_writable
from ..runner import RunSpec, run_points
from ..runner.spec import DEFAULT_TIMEOUT_S
from .errors import user_errors
from .options import ChunkOpt, LogitsChunkOpt, SeedOpt
from .point_options import (
    AutoDeviceOpt,
    DefaultedBatchOpt,
    DefaultedDTypeOpt,
    DefaultedModelOpt,
    LoraAlphaOpt,
    LoraRankOpt,
    MemoryLimitOpt,
    MethodsOpt,
    MoreMethodsArg,
    NumLayersOpt,
    ObjectiveOpt,
    OutOpt,
    PromptLenOpt,
    ProtocolOpt,
    StepOpt,
    TimeoutOpt,
    parse_methods,
    point_specs,
)

DEFAULT_OUT = Path("results/runs.csv")


def _status(row: ResultRow) -> str:
    colour = {"ok": "green", "oom": "yellow"}.get(row.status, "red")
    return f"[{colour}]{row.status}[/]"


def _spread(row: ResultRow) -> str:
    if row.time_median_s is None:
        return "-"
    return f"{100 * (row.time_max_s - row.time_min_s) / row.time_median_s:.0f}%"


def _nvml(row: ResultRow) -> str:
    if row.nvml_peak_used_bytes is None or row.nvml_idle_used_bytes is None:
        return "-"
    return gib(row.nvml_peak_used_bytes - row.nvml_idle_used_bytes)


CAPTION = (
    "GiB = 2^30 B. peak: max allocated (CPU: resident tensors + tracked peak); resv: max reserved; "
    "nvml: device used minus idle; act: peak minus the resident baseline; time: median of the timed "
    "steps, spread (max-min)/median"
)


def results_table(rows: list[ResultRow], title: str) -> Table:
    table = Table(title=title, caption=CAPTION)
    headers = (
        "method",
        "status",
        "peak GiB",
        "resv GiB",
        "nvml GiB",
        "act GiB",
        "time s",
        "spread",
        "tok/s",
        "TFLOP/s",
    )
    for header in headers:
        table.add_column(header, justify="left" if header in ("method", "status") else "right", no_wrap=True)
    for row in rows:
        table.add_row(
            row.method,
            _status(row),
            gib(row.peak_allocated_bytes),
            gib(row.peak_reserved_bytes),
            _nvml(row),
            gib(row.activation_peak_bytes),
            "-" if row.time_median_s is None else f"{row.time_median_s:.3f}",
            _spread(row),
            "-" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}",
            "-" if row.tflops_per_s is None else f"{row.tflops_per_s:.3g}",
        )
    return table


def run(
    method: MethodsOpt = None,
    more_methods: MoreMethodsArg = None,
    model: DefaultedModelOpt = None,
    seq: Annotated[
        int | None,
        typer.Option("--seq", "-T", help="Tokens per row, prompt included (default: 9000 on cuda, 2048 on cpu)."),
    ] = None,
    batch: DefaultedBatchOpt = None,
    objective: ObjectiveOpt = "sft",
    prompt_len: PromptLenOpt = DEFAULT_PROMPT_LEN,
    lora_rank: LoraRankOpt = 0,
    lora_alpha: LoraAlphaOpt = 128,
    step: StepOpt = "bp",
    dtype: DefaultedDTypeOpt = None,
    chunk_size: ChunkOpt = DEFAULT_CHUNK_SIZE,
    logits_chunk_size: LogitsChunkOpt = DEFAULT_LOGITS_CHUNK_SIZE,
    device: AutoDeviceOpt = "auto",
    num_layers: NumLayersOpt = 0,
    protocol: ProtocolOpt = "steady",
    warmup: Annotated[int, typer.Option(min=0, help="Discarded steps before measuring.")] = 1,
    repeats: Annotated[int, typer.Option(min=0, help="Timed steps (median, min, max); 0: memory only.")] = 3,
    memory_limit: MemoryLimitOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    seed: SeedOpt = 0,
    out: OutOpt = DEFAULT_OUT,
) -> None:
    """Measure peak memory and step time of each method at one (model, T) point, one process per
    method, and add the rows to a results CSV. With no options: a real comparison on a GPU
    (Qwen/Qwen3-4B, T=9000, bf16), about a minute on a CPU (small/qwen3, T=2048, fp32)."""
    with user_errors():
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
            device=device,
            num_layers=num_layers,
            protocol=protocol,
            memory_limit=memory_limit,
            seed=seed,
            warmup=warmup,
            repeats=repeats,
            timeout_s=timeout,
        )
        check_writable(out)
        console = Console()
        rows = []
        with console.status(_measuring(specs[0])) as status:
            for row in run_points(specs, out):  # one environment capture for all points
                rows.append(row)
                if len(rows) < len(specs):
                    status.update(_measuring(specs[len(rows)]))
    first = rows[0]
    limit = f", limit {gib(first.memory_limit_bytes)} GiB" if first.memory_limit_bytes else ""
    lora = f", LoRA r{first.lora_rank}" if first.lora_rank else ""
    title = (
        f"{first.model} ({first.num_layers or '?'} layers{lora}), {first.objective}, step {first.step}, "
        f"{first.dtype}, B={first.batch_size}, T={first.seq_len}, "
        f"chunks {first.chunk_size}/{first.logits_chunk_size}, {first.protocol} protocol{limit}\n"
        f"{first.device_name} ({first.memory_source})"
    )
    console.print(results_table(rows, title))
    for row in rows:
        if row.error:
            console.print(f"{row.method}: {row.status}: {row.error}", highlight=False, soft_wrap=True)
    console.print(f"{len(rows)} row(s) written to {out}", highlight=False)
    if any(row.status in ("error", "timeout") for row in rows):
        raise typer.Exit(1)


def _measuring(spec: RunSpec) -> str:
    return f"measuring {spec.method} ({spec.model}, T={spec.seq_len}, {spec.device})"
