"""`sbp plan`: the fastest StreamBP checkpoint placement and chunk size that fit a GPU and a host."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..measure.host_memory import total_ram_bytes
from ..measure.units import parse_bytes
from .errors import user_errors
from .options import (
    DEFAULT_GPU_MEMORY,
    PREDICTED_POINT,
    GpuMemoryOpt,
    HostMemoryOpt,
    point_command,
    predicted_gpu_point_helps,
    run_fields_but,
)
from .outcomes import fail_if
from .progress import Progress
from .tables import print_table

if TYPE_CHECKING:
    from ..config import RunSpec
    from ..simulate.plan import PlanOutcome
    from ..simulate.timing import Rates

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
    "weights",
    "sdpa_backend",  # the estimator models torch's own kernel choice
    "chunk_attention",  # and StreamBP's lower-right chunk path
)

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp plan --model Qwen/Qwen3-8B --seq 131072",
    "sbp plan --model Qwen/Qwen3-8B --seq 1048576 --lora-rank 64",
)


@point_command(
    PLAN_FIELDS,
    helps=predicted_gpu_point_helps(),
)
def plan_command(
    settings: dict,
    methods: tuple[str, ...],
    gpu_memory: GpuMemoryOpt = None,
    host_memory: HostMemoryOpt = None,
    gpu: Annotated[
        str,
        typer.Option(metavar="NAME", help="The GPU whose measured rows give the rates: its device name contains this."),
    ] = "H100",
    results: Annotated[
        Path, typer.Option(metavar="CSV|DIR", help="Results CSV or folder with those measured rows.")
    ] = Path("results"),
) -> None:
    """Pick StreamBP's checkpoint placement and chunk size for a GPU.

    Candidate --checkpoints placements and layer chunk sizes, in order of predicted step time
    (matmul and attention rates, chunk overheads, PCIe copies beyond the compute they overlap),
    are ruled out by bounds or estimated (`sbp estimate`, from short fake runs) until one fits
    both the GPU and the host. The rates come from measured rows of --gpu in --results when there
    are any, else published H100 figures. Predictions, not measurements."""
    from ..config import point_specs
    from ..simulate.plan import describe, meta_model, plan
    from ..simulate.timing import fitted_rates

    with user_errors():
        gpu_bytes = parse_bytes(gpu_memory or DEFAULT_GPU_MEMORY)
        host_bytes = parse_bytes(host_memory) if host_memory else total_ram_bytes()
        (spec,) = point_specs({**settings, **PREDICTED_POINT}, ["streambp"], defaults_for="cuda")
        rates = fitted_rates(results, gpu, meta_model)
    console = Console()
    with Progress(console, None) as progress:
        progress.start(f"planning {spec.model}, T={spec.seq_len}")
        chosen, tried = plan(
            spec, gpu_memory_bytes=gpu_bytes, host_memory_bytes=host_bytes, rates=rates, note=progress.note
        )
    print_table(console, plan_table(spec, tried, gpu_bytes, host_bytes, rates))
    for outcome in tried:
        if outcome.bound:
            console.print(f"{outcome.candidate.placement.name}: {outcome.bound}", highlight=False, soft_wrap=True)
    if chosen is None:
        console.print("[red]nothing fits[/]: a shorter --seq, LoRA, or more host memory", highlight=False)
    fail_if(chosen is None)
    d = describe(chosen, spec.batch_size * spec.seq_len)
    console.print(
        f"plan: --checkpoints {d['checkpoints']} --chunk-size {d['chunk_size']} --logits-chunk-size "
        f"{d['logits_chunk_size']}  (predicted {d['predicted_time_s']:.1f} s per step, "
        f"{d['tokens_per_s']:,.0f} tokens/s)",
        highlight=False,
    )


def plan_table(spec: RunSpec, tried: list[PlanOutcome], gpu_bytes: int, host_bytes: int, rates: Rates) -> Table:
    """The candidates decided, in order (simulate/plan.py PlanOutcome), with the rates their times use."""
    from ..simulate.plan import describe

    caption = (
        f"GiB = 2^30 B. GPU: peak allocated + margin, of {gpu_bytes / GIB:.1f} GiB (bound: ruled out without "
        f"a simulation, below); host: pinned checkpoints + process, of {host_bytes / GIB:.1f} GiB. step s: "
        f"predicted step time; pin s: the first step's page-locking of the host copies, once per process. "
        f"Rates: {rates.describe()}"
    )
    title = f"{spec.model}, T={spec.seq_len}, B={spec.batch_size}: candidates (simulated)"
    table = Table(title=title, caption=caption)
    for column in ("checkpoints", "chunk", "logits", "status", "GPU GiB", "host GiB", "step s", "tokens/s", "pin s"):
        table.add_column(column, justify="left" if column in ("checkpoints", "status") else "right", no_wrap=True)
    for outcome in tried:
        d = describe(outcome, spec.batch_size * spec.seq_len)
        device = "bound" if d["device_bytes"] is None else f"{d['device_bytes'] / GIB:.2f}"
        chunk = "any" if outcome.any_chunk else str(d["chunk_size"])
        table.add_row(
            d["checkpoints"], chunk, str(d["logits_chunk_size"]), d["status"], device,
            f"{d['host_bytes'] / GIB:.2f}", f"{d['predicted_time_s']:.1f}", f"{d['tokens_per_s']:,.0f}",
            f"{d['first_step_pinning_s']:.1f}",
        )  # fmt: skip
    return table
