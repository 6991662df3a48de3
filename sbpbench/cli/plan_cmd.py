"""`sbp plan`: the fastest StreamBP checkpoint placement and chunk size that fit a GPU and a host."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..config import point_specs
from ..measure.host_memory import total_ram_bytes
from ..measure.units import parse_bytes
from ..simulate.plan import ACHIEVED_FLOP_S, PCIE_BYTES_S, describe, plan
from .errors import user_errors
from .options import point_command, run_fields_but

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
    """Pick where StreamBP keeps its checkpoints (--checkpoints) and its layer chunk size for one
    point: candidates in order of predicted step time (FLOPs, one more forward per recomputed
    layer, PCIe copies beyond the compute they overlap) go through the memory estimator (`sbp
    estimate`) until one fits both the GPU and the host. Predictions, not measurements."""
    with user_errors():
        gpu_bytes = parse_bytes(gpu_memory)
        host_bytes = parse_bytes(host_memory) if host_memory else total_ram_bytes()
        fixed = {"device": "cpu", "warmup": 0, "repeats": 0}
        (spec,) = point_specs({**settings, **fixed}, ["streambp"], defaults_for="cuda")
    console = Console()
    with console.status(f"planning {spec.model}, T={spec.seq_len}"):
        chosen, tried = plan(spec, gpu_memory_bytes=gpu_bytes, host_memory_bytes=host_bytes)
    table = Table(title=f"{spec.model}, T={spec.seq_len}, B={spec.batch_size}: candidates estimated (simulated)")
    for column in ("checkpoints", "chunk", "logits chunk", "status", "GPU GiB", "host GiB", "pred. time s"):
        table.add_column(column)
    for outcome in tried:
        d = describe(outcome)
        table.add_row(
            d["checkpoints"], str(d["chunk_size"]), str(d["logits_chunk_size"]), d["status"],
            f"{d['device_bytes'] / GIB:.2f}", f"{d['host_bytes'] / GIB:.2f}", f"{d['predicted_time_s']:.1f}",
        )  # fmt: skip
    console.print(table)
    console.print(
        f"GiB = 2^30 B; GPU: peak allocated + margin of {gpu_bytes / GIB:.1f} GiB; host: pinned checkpoints + process "
        f"of {host_bytes / GIB:.1f} GiB; time at {ACHIEVED_FLOP_S / 1e12:.0f} TFLOP/s and {PCIE_BYTES_S / 1e9:.0f} GB/s",
        highlight=False,
    )
    if chosen is None:
        console.print("[red]nothing fits[/]: a shorter --seq, LoRA, or more host memory", highlight=False)
        raise typer.Exit(1)
    d = describe(chosen)
    console.print(
        f"plan: --checkpoints {d['checkpoints']} --chunk-size {d['chunk_size']} --logits-chunk-size "
        f"{d['logits_chunk_size']}  (predicted {d['predicted_time_s']:.1f} s per step)",
        highlight=False,
    )
