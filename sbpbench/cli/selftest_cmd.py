"""`sbp selftest`: check every CUDA path of this machine in one command (8 minutes on a GPU, under one on an idle CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from .errors import user_errors
from .outcomes import fail_if

# runner/selftest.py GPU_BUDGET_S and CPU_BUDGET_S, named here so that help imports no torch;
# tests/cli/test_cli_startup.py checks they agree
BUDGET_S = {"cuda": 480.0, "cpu": 480.0}
MIN_BUDGET_S = 30.0  # runner/budget.py MIN_START_S: less starts no step

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp selftest       # into results/gpu/<device>/ or results/cpu-selftest/",
    "sbp selftest --budget 5m --out /tmp/selftest",
)


def selftest(
    out: Annotated[
        Path,
        typer.Option(
            "--out", "-o", metavar="DIR", help="Results directory: writes OUT/gpu/<device name>/ or OUT/cpu-selftest/."
        ),
    ] = Path("results"),
    budget: Annotated[
        str | None,
        typer.Option(
            metavar="DURATION",
            help=f"Time for the whole test, at least {MIN_BUDGET_S:g} s, e.g. 5m or 300 (default: "
            f"{BUDGET_S['cuda']:g} s on a GPU, {BUDGET_S['cpu']:g} s on a CPU).",
        ),
    ] = None,
) -> None:
    """Check this machine in one command: tests, kernels, runs.

    On a GPU, in order of value: the quick gpu-marked tests; the attention kernels at 16k-256k
    keys; Qwen3-4B T=9000 ckpt and streambp with phases and memory timelines; Qwen3-8B StreamBP at
    262,144 tokens streamed through host memory (3 layers), and at 65,536 with its checkpoints on
    the GPU; the host copy rate each way. With 2 GPUs or more it also checks and runs StreamBP
    sharing each sequence over 2 GPUs. sbp estimate predicts each point's peak beside them. On a
    CPU a small check, run and estimate. Writes the rows, the raw log, the kernel choices and
    summary.md, which names each failure with its message (exit 1 if a step failed; one the
    budget left no time for is not a failure)."""
    from ..measure.environment import auto_device, capture_environment, visible_gpu_count
    from ..runner.selftest import Selftest, find_repository, output_dir, run_selftest, write_summary

    seconds = _budget_s(budget)
    # NVML, not torch.cuda: this process must hold no CUDA context while its points are measured
    kind = auto_device()
    env = capture_environment("cuda:0" if kind == "cuda" else "cpu")
    console = Console()
    if kind != "cuda":
        console.print("No CUDA GPU visible: running the CPU subset (sbp check, run, estimate; about 40 CPU-seconds).")
    folder = output_dir(out, kind, env.device_name)
    test = Selftest(kind, folder, seconds or BUDGET_S[kind], env.device_name, num_gpus=visible_gpu_count())
    run_selftest(test, repository=find_repository(), echo=lambda line: console.print(line, highlight=False))
    summary = write_summary(test, env)
    console.print(f"summary: {summary}; rows and log beside it", highlight=False)
    fail_if(any(o.failed for o in test.outcomes))


def _budget_s(budget: str | None) -> float | None:
    """--budget in seconds (None: not given); a one-line error under MIN_BUDGET_S."""
    from ..measure.units import parse_seconds

    with user_errors():
        seconds = parse_seconds(budget) if budget is not None else None
        if seconds is not None and seconds < MIN_BUDGET_S:
            raise ValueError(f"--budget {budget} is under {MIN_BUDGET_S:g} s: too short to start one step; give more")
    return seconds
