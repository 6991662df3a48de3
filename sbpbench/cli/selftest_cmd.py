"""`sbp selftest`: check this machine in one command (a GPU: about 8 minutes; a CPU: 2 or 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ..measure.environment import auto_device, capture_environment
from ..runner.selftest import (
    CPU_BUDGET_S,
    GPU_BUDGET_S,
    Selftest,
    find_tests_dir,
    output_dir,
    run_selftest,
    write_summary,
)


def selftest(
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Results directory: writes OUT/gpu/<device name>/ or OUT/cpu-selftest/.")
    ] = Path("results"),
    budget: Annotated[
        float | None,
        typer.Option(
            min=30, help=f"Seconds for the whole test (default: {GPU_BUDGET_S:g} on a GPU, {CPU_BUDGET_S:g} on a CPU)."
        ),
    ] = None,
) -> None:
    """Check this machine: on a GPU the gpu-marked tests, the default `sbp run`, two Qwen3-8B StreamBP
    points at 64k with offloaded and recomputed checkpoints, measured vs estimated peaks (Qwen3-4B,
    Qwen3-8B) and the longest Qwen3-8B StreamBP point the time allows; on a CPU a small check, run
    and estimate. Writes the rows, the raw log and summary.md (exit 1 if a step failed; one the
    budget left no time for is not a failure)."""
    # NVML, not torch.cuda: this process must hold no CUDA context while its points are measured
    kind = auto_device()
    env = capture_environment("cuda:0" if kind == "cuda" else "cpu")
    console = Console()
    if kind != "cuda":
        console.print("No CUDA GPU visible: running the CPU subset (sbp check, run, estimate; 2 to 3 minutes).")
    test = Selftest(
        kind, output_dir(out, kind, env.device_name), budget or (GPU_BUDGET_S if kind == "cuda" else CPU_BUDGET_S)
    )
    run_selftest(test, tests_dir=find_tests_dir(), echo=lambda line: console.print(line, highlight=False))
    summary = write_summary(test, env)
    console.print(f"summary: {summary}; rows and log beside it", highlight=False)
    if any(o.failed for o in test.outcomes):
        raise typer.Exit(1)
