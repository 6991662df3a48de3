"""`sbp plan`: the fastest StreamBP checkpoint placement and chunk size that fit a GPU and a host."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..config import point_specs
from ..measure.host_memory import total_ram_bytes
from ..measure.units import parse_bytes
from .errors import user_errors
from .options import point_command, run_fields_but
from .progress import Progress
from .tables import print_table

GIB = 2**30
# the planner chooses method settings for streambp itself; nothing is measured (no threads)
PLAN_FIELDS = run_fields_but(
    "method",
    "chunk_size",
    "checkpoints",
    "device",
    "warmup",
    "repeats",
    "memory_limit",
    "timeout_s",
    "threads",
    "nproc",
    "mlp_tile_size",
    "offload_checkpoints",
)


@point_command(
    PLAN_FIELDS,
    helps={
        "model": "Registry name (`sbp models`) or a local checkpoint directory (default: Qwen/Qwen3-4B).",
        "seq_len": "Tokens per row, prompt included (default: 9000).",
        "dtype": "Model dtype (default: bf16).",
    },
)
def plan_command(
    settings: dict,
    methods: tuple[str, ...],
    gpu_memory: Annotated[str, typer.Option(help="The GPU's memory, e.g. 80GiB.")] = "80GiB",
    host_memory: Annotated[
        str | None, typer.Option(help="Host memory the step may use, e.g. 100GiB (default: this machine's RAM).")
    ] = None,
    gpu: Annotated[
        str,
        typer.Option(help="The GPU whose measured rows give the time model's rates (its device name contains this)."),
    ] = "H100",
    results: Annotated[Path, typer.Option(help="Results CSV or folder whose measured rows give the rates.")] = Path(
        "results"
    ),
) -> None:
    """Pick where StreamBP keeps its checkpoints (--checkpoints) and its layer chunk size for one
    point: candidates in order of predicted step time (timing.py: matmul and attention rates, chunk
    overheads, PCIe copies beyond the compute they overlap) are ruled out by bounds or estimated
    (`sbp estimate`, extrapolated from short runs) until one fits both the GPU and the host.
    The rates are fitted to measured rows of --gpu under --results when there are any, else
    published H100 figures. Predictions, not measurements."""
    from ..simulate.plan import describe, meta_model, plan
    from ..simulate.timing import Rates, fitted_rates

    with user_errors():
        gpu_bytes = parse_bytes(gpu_memory)
        host_bytes = parse_bytes(host_memory) if host_memory else total_ram_bytes()
        fixed = {"device": "cpu", "warmup": 0, "repeats": 0}
        (spec,) = point_specs({**settings, **fixed}, ["streambp"], defaults_for="cuda")
        rates = fitted_rates(results, gpu, meta_model) if results.exists() else Rates()
    console = Console()
    with Progress(console, None) as progress:
        progress.start(f"planning {spec.model}, T={spec.seq_len}")
        chosen, tried = plan(
            spec, gpu_memory_bytes=gpu_bytes, host_memory_bytes=host_bytes, rates=rates, note=progress.note
        )
    tokens = spec.batch_size * spec.seq_len
    table = Table(title=f"{spec.model}, T={spec.seq_len}, B={spec.batch_size}: candidates decided (simulated)")
    for column in ("checkpoints", "chunk", "status", "GPU GiB", "host GiB", "step s", "tokens/s", "pin s"):
        table.add_column(column, justify="left" if column in ("checkpoints", "status") else "right")
    for outcome in tried:
        d = describe(outcome, tokens)
        gpu_cell = "bound" if d["device_bytes"] is None else f"{d['device_bytes'] / GIB:.2f}"
        table.add_row(
            d["checkpoints"], str(d["chunk_size"]), d["status"], gpu_cell, f"{d['host_bytes'] / GIB:.2f}",
            f"{d['predicted_time_s']:.1f}", f"{d['tokens_per_s']:,.0f}", f"{d['first_step_pinning_s']:.1f}",
        )  # fmt: skip
    print_table(console, table)
    console.print(
        f"GiB = 2^30 B; GPU: peak allocated + margin of {gpu_bytes / GIB:.1f} GiB (bound: ruled out without a "
        f"simulation, see the line above it); host: pinned checkpoints + process of {host_bytes / GIB:.1f} GiB; "
        f"step s: predicted step time; pin s: first step's page-locking of the host copies, once per buffer",
        highlight=False,
    )
    console.print(f"rates: {rates.describe()}", highlight=False, soft_wrap=True)
    for outcome in tried:
        if outcome.bound:
            console.print(f"{outcome.candidate.placement.name}: {outcome.bound}", highlight=False, soft_wrap=True)
    if chosen is None:
        console.print("[red]nothing fits[/]: a shorter --seq, LoRA, or more host memory", highlight=False)
        raise typer.Exit(1)
    d = describe(chosen, tokens)
    console.print(
        f"plan: --checkpoints {d['checkpoints']} --chunk-size {d['chunk_size']} --logits-chunk-size "
        f"{d['logits_chunk_size']}  (predicted {d['predicted_time_s']:.1f} s per step, {d['tokens_per_s']:,.0f} tokens/s)",
        highlight=False,
    )
