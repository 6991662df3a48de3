"""`sbp run`: measure peak memory and time of each method at one point, one process per method."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

from ..core import DEFAULT_CHUNK_SIZE, DEFAULT_LOGITS_CHUNK_SIZE
from ..data import DEFAULT_PROMPT_LEN, OBJECTIVES
from ..measure.units import gib, parse_bytes
from ..methods import METHODS, MethodSettings
from ..records import ResultRow, check_writable
from ..runner import PROTOCOLS, RunSpec, run_points
from ..runner.spec import DEFAULT_TIMEOUT_S
from .errors import user_errors
from .options import ChunkOpt, DType, LogitsChunkOpt, SeedOpt

# With no options: a real comparison on a GPU (the paper's Table 2 point), a one-minute one on a CPU.
DEFAULTS = {
    "cuda": {"model": "Qwen/Qwen3-4B", "seq": 9000, "dtype": "bf16"},
    "cpu": {"model": "small/qwen3", "seq": 2048, "dtype": "fp32"},
}
DEFAULT_OUT = Path("results/runs.csv")
DEFAULT_BATCH = {"sft": 1, "grpo": 8, "dpo": 2}  # the paper's: one sequence, a group of 8, one pair


def parse_methods(values: list[str]) -> tuple[str, ...]:
    """`--method bp ckpt`, `--method bp --method ckpt` and `--method bp,ckpt` all mean the same."""
    names = [name for value in values for name in value.replace(",", " ").split()]
    for name in names:
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return tuple(dict.fromkeys(names)) or tuple(METHODS)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


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
    method: Annotated[
        list[str] | None,
        typer.Option("--method", help=f"Methods: {', '.join(METHODS)}; several allowed (default: all)."),
    ] = None,
    more_methods: Annotated[
        list[str] | None,
        typer.Argument(metavar="[METHOD]...", help="More methods after --method: `--method bp ckpt streambp`."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="Registry name (`sbp models`) or a local checkpoint directory "
            "(default: Qwen/Qwen3-4B on cuda, small/qwen3 on cpu).",
        ),
    ] = None,
    seq: Annotated[
        int | None,
        typer.Option("--seq", "-T", help="Tokens per row, prompt included (default: 9000 on cuda, 2048 on cpu)."),
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option("--batch", "-B", min=1, help="Rows per batch (default: sft 1, grpo 8 = a group, dpo 2 = a pair)."),
    ] = None,
    objective: Annotated[str, typer.Option(help=f"Training objective: {', '.join(OBJECTIVES)}.")] = "sft",
    prompt_len: Annotated[
        int, typer.Option(min=1, help="grpo/dpo: prompt tokens within --seq (at most half of it).")
    ] = DEFAULT_PROMPT_LEN,
    lora_rank: Annotated[
        int, typer.Option(min=0, help="LoRA rank on all linear layers (peft); 0: full fine-tuning.")
    ] = 0,
    lora_alpha: Annotated[int, typer.Option(min=1, help="LoRA alpha.")] = 128,
    step: Annotated[
        str, typer.Option(help="bp: forward + backward (the paper's Figure 3); train: + AdamW (its Table 3).")
    ] = "bp",
    dtype: Annotated[DType | None, typer.Option(help="Model dtype (default: bf16 on cuda, fp32 on cpu).")] = None,
    chunk_size: ChunkOpt = DEFAULT_CHUNK_SIZE,
    logits_chunk_size: LogitsChunkOpt = DEFAULT_LOGITS_CHUNK_SIZE,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")] = "auto",
    num_layers: Annotated[
        int, typer.Option("--num-layers", min=0, help="Keep only the first N decoder layers; 0 keeps all.")
    ] = 0,
    protocol: Annotated[
        str,
        typer.Option(help="steady: gradient buffers resident before the step (the paper's); first: allocated in it."),
    ] = "steady",
    warmup: Annotated[int, typer.Option(min=0, help="Discarded steps before measuring.")] = 1,
    repeats: Annotated[int, typer.Option(help="Timed steps (median, min, max).")] = 3,
    memory_limit: Annotated[
        str | None,
        typer.Option(help="Cap memory, e.g. 80GiB: CUDA per-process limit; CPU limit on tracked tensors."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds per point before it is recorded as timeout.")] = (
        DEFAULT_TIMEOUT_S
    ),
    seed: SeedOpt = 0,
    out: Annotated[Path, typer.Option("--out", "-o", help="Results CSV (rows upserted by point).")] = DEFAULT_OUT,
) -> None:
    """Measure peak memory and step time of each method at one (model, T) point, one process per
    method, and add the rows to a results CSV. With no options: a real comparison on a GPU
    (Qwen/Qwen3-4B, T=9000, bf16), about a minute on a CPU (small/qwen3, T=2048, fp32)."""
    with user_errors():
        methods = parse_methods([*(method or []), *(more_methods or [])])
        device = resolve_device(device)
        defaults = DEFAULTS["cuda" if device.startswith("cuda") else "cpu"]
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}; choose from {', '.join(OBJECTIVES)}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")
        specs = [
            RunSpec(
                model=model or defaults["model"],
                method=name,
                seq_len=seq if seq is not None else defaults["seq"],
                batch_size=batch or DEFAULT_BATCH[objective],
                objective=objective,
                prompt_len=prompt_len,
                lora_rank=lora_rank,
                lora_alpha=lora_alpha,
                step=step,
                dtype=dtype.value if dtype else defaults["dtype"],
                device=device,
                settings=MethodSettings(chunk_size=chunk_size, logits_chunk_size=logits_chunk_size),
                num_layers=num_layers or None,
                protocol=protocol,
                warmup=warmup,
                repeats=repeats,
                memory_limit_bytes=parse_bytes(memory_limit) if memory_limit else None,
                seed=seed,
                timeout_s=timeout,
            )
            for name in methods
        ]
        _check_model(specs[0].model)
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


def _check_model(name: str) -> None:
    """Fail in the parent, before any process starts, on a model that cannot be built."""
    from ..models import load_config

    load_config(name)
