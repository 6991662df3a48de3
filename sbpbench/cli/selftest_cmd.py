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
    "sbp selftest --dry-run            # the GPU plan, priced, on any machine",
    "sbp selftest --pack selftest.tgz --budget 5m --out /tmp/selftest",
)
DEVICES = ("auto", "cuda", "cpu")

OutOpt = Annotated[
    Path,
    typer.Option(
        "--out", "-o", metavar="DIR", help="Results directory: writes OUT/gpu/<device name>/ or OUT/cpu-selftest/."
    ),
]
SelftestBudgetOpt = Annotated[
    str | None,
    typer.Option(
        "--budget",
        metavar="DURATION",
        help=f"Time for the whole test, at least {MIN_BUDGET_S:g} s, e.g. 5m or 300 (default: "
        f"{BUDGET_S['cuda']:g} s on a GPU, {BUDGET_S['cpu']:g} s on a CPU).",
    ),
]
SelftestDeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        metavar="DEVICE",
        help="auto (a GPU if one is visible), cuda, or cpu: the CPU subset (default: auto).",
        show_default=False,
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Run nothing: print the plan, each step's predicted seconds and the work counted for it, "
        "beside the budget (the GPU plan unless --device cpu; one GPU where none is visible).",
    ),
]
PackOpt = Annotated[
    Path | None,
    typer.Option(
        "--pack",
        metavar="FILE",
        help="After the run, also write one .tar.gz of the rows, the raw log, the kernel table and "
        "summary.md (no compile cache, no memory snapshot).",
    ),
]


def selftest(
    out: OutOpt = Path("results"),
    budget: SelftestBudgetOpt = None,
    device: SelftestDeviceOpt = "auto",
    dry_run: DryRunOpt = False,
    pack: PackOpt = None,
) -> None:
    """Check this machine in one command: tests, kernels, runs.

    On a GPU, in order of value: the quick gpu-marked tests; the attention kernels measured on a
    Qwen3-8B step's calls, into this GPU's kernel table; Qwen3-4B T=9000 ckpt and streambp with
    phases, StreamBP's kernels from that table; Qwen3-8B StreamBP at 262,144 tokens streamed through
    host memory (3 layers), and at 65,536 with its checkpoints on the host; the host copy rate each
    way. With 2 GPUs or more it also checks and runs StreamBP sharing each sequence over 2 GPUs.
    sbp estimate predicts each point's peak beside them. On a CPU a small check, run and estimate.
    Writes the rows, the raw log, the kernel table and summary.md, which names each failure with its
    message (exit 1 if a step failed; one the budget left no time for is not a failure)."""
    from ..measure.environment import auto_device, capture_environment, visible_gpu_count
    from ..runner import selftest as st

    seconds = _budget_s(budget)
    found = auto_device()  # NVML, not torch.cuda: this process holds no CUDA context while points run
    kind = _kind(device, found, dry_run, pack)
    gpus = visible_gpu_count() if found == "cuda" else 0
    if dry_run:
        named = capture_environment("cuda:0").device_name if found == "cuda" else None
        print(st.dry_run_text(out, kind, seconds or BUDGET_S[kind], max(1, gpus), named))
        return
    env = capture_environment("cuda:0" if kind == "cuda" else "cpu")
    console = Console()
    if kind != "cuda":
        console.print("No CUDA GPU visible: running the CPU subset (sbp check, run, estimate; about 40 CPU-seconds).")
    folder = st.output_dir(out, kind, env.device_name)
    test = st.Selftest(kind, folder, seconds or BUDGET_S[kind], env.device_name, num_gpus=gpus if kind == "cuda" else 0)
    st.run_selftest(test, repository=st.find_repository(), echo=lambda line: console.print(line, highlight=False))
    summary = st.write_summary(test, env)
    console.print(f"summary: {summary}; rows and log beside it", highlight=False)
    if pack is not None:
        members = st.pack_files(test, pack)
        console.print(f"packed {len(members)} files into {pack}: {', '.join(members)}", highlight=False)
    fail_if(any(o.failed for o in test.outcomes))


def _kind(device: str, found: str, dry_run: bool, pack: Path | None) -> str:
    """The plan to run or print: cuda or cpu; a one-line error for a device not here or two asks at once."""
    with user_errors():
        if device not in DEVICES:
            raise ValueError(f"--device {device}: choose from {', '.join(DEVICES)}")
        if dry_run and pack is not None:
            raise ValueError("--dry-run runs nothing to pack: give one of --dry-run and --pack")
        if dry_run:
            return "cpu" if device == "cpu" else "cuda"  # a GPU's plan is priced on any machine
        if device == "cuda" and found != "cuda":
            raise ValueError("--device cuda: no CUDA GPU is visible here; run --device cpu, or --dry-run for the plan")
    return found if device == "auto" else device


def _budget_s(budget: str | None) -> float | None:
    """--budget in seconds (None: not given); a one-line error under MIN_BUDGET_S."""
    from ..measure.units import parse_seconds

    with user_errors():
        seconds = parse_seconds(budget) if budget is not None else None
        if seconds is not None and seconds < MIN_BUDGET_S:
            raise ValueError(f"--budget {budget} is under {MIN_BUDGET_S:g} s: too short to start one step; give more")
    return seconds
