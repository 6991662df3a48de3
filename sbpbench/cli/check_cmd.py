"""`sbp check`: compare each method's loss and gradients with standard BP on one model."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..core import DEFAULT_LOGITS_CHUNK_SIZE
from ..data import DEFAULT_PROMPT_LEN, OBJECTIVES
from ..methods import METHODS, MethodSettings
from ..runner import ExactnessSpec, check_exactness
from .errors import user_errors
from .options import BatchOpt, ChunkOpt, DeviceOpt, DType, LogitsChunkOpt, Method, ModelOpt, SeedOpt


def check(
    model: ModelOpt = "Qwen/Qwen3-0.6B",
    seq: Annotated[int, typer.Option("--seq", "-T", min=2, help="Sequence length T.")] = 300,
    batch: BatchOpt = 2,
    objective: Annotated[str, typer.Option(help=f"Training objective: {', '.join(OBJECTIVES)}.")] = "sft",
    prompt_len: Annotated[int, typer.Option(min=1, help="grpo/dpo: prompt tokens (at most half of --seq).")] = (
        DEFAULT_PROMPT_LEN
    ),
    lora_rank: Annotated[int, typer.Option(min=0, help="Check with LoRA adapters of this rank (0: none).")] = 0,
    dtype: Annotated[
        DType, typer.Option(help="fp64 (tolerance 1e-10), fp32 (1e-5) or bf16 (reported only).")
    ] = DType.fp64,
    method: Annotated[
        list[Method] | None, typer.Option("--method", help="Methods to compare with bp; repeatable (default: all).")
    ] = None,
    chunk_size: ChunkOpt = 128,
    logits_chunk_size: LogitsChunkOpt = DEFAULT_LOGITS_CHUNK_SIZE,
    num_layers: Annotated[
        int, typer.Option("--num-layers", min=0, help="Keep only the first N decoder layers; 0 keeps all.")
    ] = 2,
    device: DeviceOpt = "cpu",
    seed: SeedOpt = 0,
) -> None:
    """Check that every method gives standard BP's loss and gradients (exit 1 if one does not)."""
    methods = tuple(m.value for m in method) if method else tuple(name for name in METHODS if name != "bp")
    with user_errors():
        spec = ExactnessSpec(
            model=model,
            seq_len=seq,
            batch_size=batch,
            objective=objective,
            prompt_len=prompt_len,
            lora_rank=lora_rank,
            dtype=dtype.value,
            methods=methods,
            settings=MethodSettings(chunk_size=chunk_size, logits_chunk_size=logits_chunk_size),
            num_layers=num_layers or None,
            device=device,
            seed=seed,
        )
        results = check_exactness(spec)
    layers = f"{num_layers} layers" if num_layers else "all layers"
    layers += f", LoRA r{lora_rank}" if lora_rank else ""
    table = Table(
        title=f"{model} ({layers}), {objective}, {dtype.value}, B={batch}, T={seq}, chunk {chunk_size}/{logits_chunk_size}: vs bp"
    )
    for column in ("method", "result", "loss err", "grad err", "tolerance", "worst gradient"):
        table.add_column(column, no_wrap=column != "worst gradient", overflow="fold")
    for result in results:
        worst = result.worst
        table.add_row(
            result.method,
            "[green]exact[/]" if result.ok else "[red]DIFFERS[/]",
            f"{result.loss.rel_error:.2e}",
            f"{worst.rel_error:.2e}",
            str(worst.tolerance) if worst.tolerance is not None else "reported",
            worst.name,
        )
    console = Console()
    console.print(table)
    failed = [d for r in results for d in r.failures()]
    for diff in failed:
        console.print(f"[red]{diff.describe()}[/]", highlight=False)
    if failed:
        raise typer.Exit(1)
