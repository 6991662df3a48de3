"""`sbp plan`: the fastest StreamBP checkpoint placement and chunk size that fit a GPU and a host."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..measure.host_memory import total_ram_bytes
from ..measure.units import parse_bytes
from .errors import user_errors
from .options import point_command, run_fields_but
from .tables import print_table

if TYPE_CHECKING:
    from ..config import RunSpec
    from ..simulate.plan import PlanOutcome

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
)

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp plan --model Qwen/Qwen3-8B --seq 131072",
    "sbp plan --model Qwen/Qwen3-8B --seq 1048576 --lora-rank 64",
)


@point_command(
    PLAN_FIELDS,
    helps={
        "model": "Registry name (`sbp models`), a Hub id ORG/NAME or a local checkpoint directory (its config only; "
        "default: Qwen/Qwen3-4B).",
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
) -> None:
    """Pick StreamBP's checkpoint placement and chunk size for a GPU.

    Candidate --checkpoints placements and layer chunk sizes, in order of predicted step time
    (FLOPs, one more forward per recomputed layer, PCIe copies beyond the compute they overlap),
    go through the memory estimator (`sbp estimate`) until one fits both the GPU and the host.
    Predictions, not measurements."""
    from ..config import point_specs
    from ..simulate.plan import describe, plan

    with user_errors():
        gpu_bytes = parse_bytes(gpu_memory)
        host_bytes = parse_bytes(host_memory) if host_memory else total_ram_bytes()
        fixed = {"device": "cpu", "warmup": 0, "repeats": 0}
        (spec,) = point_specs({**settings, **fixed}, ["streambp"], defaults_for="cuda")
    console = Console()
    with console.status(f"planning {spec.model}, T={spec.seq_len}"):
        chosen, tried = plan(spec, gpu_memory_bytes=gpu_bytes, host_memory_bytes=host_bytes)
    print_table(console, plan_table(spec, tried, gpu_bytes, host_bytes))
    if chosen is None:
        console.print("[red]nothing fits[/]: a shorter --seq, LoRA, or more host memory", highlight=False)
        raise typer.Exit(1)
    d = describe(chosen)
    console.print(
        f"plan: --checkpoints {d['checkpoints']} --chunk-size {d['chunk_size']} --logits-chunk-size "
        f"{d['logits_chunk_size']}  (predicted {d['predicted_time_s']:.1f} s per step)",
        highlight=False,
    )


def plan_table(spec: RunSpec, tried: list[PlanOutcome], gpu_bytes: int, host_bytes: int) -> Table:
    """The candidates estimated, in the order tried (simulate/plan.py PlanOutcome)."""
    from ..simulate.plan import ACHIEVED_FLOP_S, PCIE_BYTES_S, describe

    caption = (
        f"GiB = 2^30 B. GPU: peak allocated + margin, of {gpu_bytes / GIB:.1f} GiB; host: pinned checkpoints + "
        f"process, of {host_bytes / GIB:.1f} GiB; time: predicted at {ACHIEVED_FLOP_S / 1e12:.0f} TFLOP/s and "
        f"{PCIE_BYTES_S / 1e9:.0f} GB/s"
    )
    title = f"{spec.model}, T={spec.seq_len}, B={spec.batch_size}: candidates estimated (simulated)"
    table = Table(title=title, caption=caption)
    for column in ("checkpoints", "chunk", "logits", "status", "GPU GiB", "host GiB", "time s"):
        table.add_column(column, justify="left" if column in ("checkpoints", "status") else "right", no_wrap=True)
    for outcome in tried:
        d = describe(outcome)
        table.add_row(
            d["checkpoints"], str(d["chunk_size"]), str(d["logits_chunk_size"]), d["status"],
            f"{d['device_bytes'] / GIB:.2f}", f"{d['host_bytes'] / GIB:.2f}", f"{d['predicted_time_s']:.1f}",
        )  # fmt: skip
    return table
