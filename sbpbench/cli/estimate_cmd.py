"""`sbp estimate`: predict a GPU's peak memory for each method by running its step on fake tensors."""

from __future__ import annotations

import functools
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ..measure.units import parse_bytes
from ..records import check_writable, upsert_rows
from ..settings import default_of, ignored_knobs
from .errors import user_errors
from .options import (
    DEFAULT_GPU_MEMORY,
    PREDICTED_POINT,
    RUN_FIELDS,
    ExactOpt,
    GpuMemoryOpt,
    GpusOpt,
    check_sizes,
    out_option,
    point_command,
    predicted_gpu_point_helps,
    say_ignored,
    with_gpus,
)
from .outcomes import fail_if
from .progress import Progress
from .tables import estimate_table, print_table, shared_by

GIB = 2**30
# The host side is checked only when given: this machine's RAM says nothing of the GPU machine's.
HostMemoryOpt = Annotated[
    str | None,
    typer.Option(
        metavar="SIZE",
        help="The GPU machine's host memory, e.g. 120GiB: a placement whose host buffers + process need more "
        "does not fit (default: not checked; the need is printed).",
    ),
]

# a prediction is for a GPU: the GPU defaults (Qwen/Qwen3-4B, T=9000, bf16) unless told, but the dtype
# is the target's (fp32 for --target cpu, as `sbp run --device cpu`). Every point setting parses; one
# the estimator does not model is refused (the settings table's `estimator`)
ESTIMATE_FIELDS = RUN_FIELDS

EstimateOutOpt = out_option("none, the table is only printed")
TargetOpt = Annotated[
    str,
    typer.Option(
        metavar="[cuda|cpu]", help="cuda: predict a GPU run; cpu: reproduce what `sbp run --device cpu` measures."
    ),
]

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp estimate --model Qwen/Qwen3-8B --seq 20000     # each method's peak",
    "sbp estimate --model Qwen/Qwen3-4B --gpu-memory 24GiB --method all",
    "sbp estimate --model tiny/qwen3 --target cpu    # what sbp run measures",
)


def _helps() -> dict[str, str]:
    helps = predicted_gpu_point_helps()
    cuda, cpu = default_of("dtype", "cuda"), default_of("dtype", "cpu")
    return helps | {"dtype": f"Model dtype (default: {cuda}; {cpu} with --target cpu)."}


@point_command(ESTIMATE_FIELDS, helps=_helps(), predicted=True)
def estimate(
    settings: dict,
    methods: tuple[str, ...],
    gpu_memory: GpuMemoryOpt = None,
    host_memory: HostMemoryOpt = None,
    target: TargetOpt = "cuda",
    exact: ExactOpt = False,
    gpus: GpusOpt = None,
    out: EstimateOutOpt = None,
) -> None:
    """Predict each method's peak GPU memory, without a GPU.

    The step `sbp run` measures runs on fake tensors (no memory behind them), with CUDA's
    attention kernels and allocator rounding modelled. Prints the breakdown, the phase of the
    peak and whether it fits --gpu-memory. Unless --exact, the step runs on a shallow model and at
    short lengths and is extrapolated to the full depth (sbpbench/simulate/depth.py) and length
    (length.py), equal to the full run to the byte in tests."""
    check_sizes({"--gpu-memory": gpu_memory, "--host-memory": host_memory})
    from ..config import point_specs
    from ..simulate import MARGIN_NOTE, TARGETS, check_estimate_host_memory, depth

    with user_errors():
        if target not in TARGETS:
            raise ValueError(f"unknown --target {target!r}; choose from {', '.join(TARGETS)}")
        gpu_memory_bytes = parse_bytes(gpu_memory or DEFAULT_GPU_MEMORY)
        settings, methods = with_gpus(settings, methods, gpus)
        target_dtype = {"dtype": default_of("dtype", target)}  # the device's own, unless --dtype
        specs = point_specs({**settings, **PREDICTED_POINT}, methods, defaults=target_dtype, defaults_for="cuda")
        check_estimate_host_memory(specs)  # its real batches fit this machine
        if out is not None:
            check_writable(out)
    say_ignored(ignored_knobs([spec.method for spec in specs], settings))
    console = Console()
    host_memory_bytes = parse_bytes(host_memory) if host_memory else None  # read by check_sizes
    estimate_one = functools.partial(
        depth.estimate_point_by_depth, target=target, gpu_memory_bytes=gpu_memory_bytes,
        host_memory_bytes=host_memory_bytes, exact=exact,
    )  # fmt: skip
    rows = _estimate_each(specs, estimate_one, out)
    print_table(console, estimate_table(rows, gpu_memory_bytes, MARGIN_NOTE))
    _say_failures(console, rows)
    print_host_side(console, rows, host_memory_bytes)
    print_collectives(console, specs, rows)
    _say_written(console, rows, out)
    fail_if(any(row.status == "error" for row in rows))


def _estimate_each(specs: list, estimate_one, out) -> list:
    """Each spec's estimate row, progress on stderr (stdout: the result alone), each row upserted into out."""
    rows = []
    with Progress(Console(stderr=True), len(specs)) as progress:
        for spec in specs:
            progress.start(f"simulating {spec.method} ({spec.model}, T={spec.seq_len})")
            note = lambda line, method=spec.method: progress.note(f"{method}: {line}")
            row = estimate_one(spec, note=note)
            progress.advance(f"{spec.method}: {row.status}")
            rows.append(row)
            if out is not None:
                with user_errors():  # a failed write says where the rows are
                    upsert_rows(out, [row])
    return rows


def print_host_side(console: Console, rows: list, host_memory_bytes: int | None) -> None:
    """Each placement's host side: what its buffers and the process need, against --host-memory."""
    from ..simulate.estimate import host_peak_bytes, ranks_per_node

    for row in rows:
        if not row.host_pinned_peak_bytes or row.status in ("error", "unsupported"):
            continue
        ranks = ranks_per_node(row)
        each = f" of each of {ranks} ranks on the node" if ranks > 1 else ""
        need = f"{row.method}: host needs {host_peak_bytes(row) / GIB:.2f} GiB (pinned checkpoints + process{each})"
        if host_memory_bytes is None:
            console.print(f"{need}; --host-memory checks it", highlight=False)
        elif row.error.startswith("host"):
            console.print(f"[red]{need}: over --host-memory {host_memory_bytes / GIB:.2f} GiB[/]", highlight=False)
        else:
            console.print(f"{need}: fits --host-memory {host_memory_bytes / GIB:.2f} GiB", highlight=False)


def print_collectives(console: Console, specs: list, rows: list) -> None:
    """Where GPUs share each sequence: what the numbers are per, and what a GPU sends per step."""
    from ..simulate.plan import meta_model
    from ..simulate.sequence_parallel import collective_bytes
    from ..simulate.timing import rebuilt_layers

    for spec, row in zip(specs, rows):
        if spec.sp == 1 or row.status in ("error", "unsupported"):
            continue
        if spec.method != "streambp":  # the bytes are counted for StreamBP's collectives
            console.print(f"{row.method}: memory per GPU {shared_by(spec)}", highlight=False)
            continue
        rebuilt = rebuilt_layers(spec.settings.checkpoints, row.num_layers)
        sent = collective_bytes(spec, meta_model(spec), rebuilt_layers=rebuilt)
        console.print(
            f"{row.method}: memory per GPU {shared_by(spec)}; each GPU sends {sent.total / GIB:.1f} "
            f"GiB per step: {sent.all_to_all / GIB:.1f} in all-to-alls, {sent.fsdp / GIB:.1f} in FSDP2's gathers and "
            "reduce-scatters (predicted from the shapes)",
            highlight=False,
        )


def _say_failures(console: Console, rows: list) -> None:
    """Why a method has no estimate: an error, or unsupported (it cannot run here, so it is not modelled)."""
    for row in rows:
        if row.status in ("error", "unsupported"):
            console.print(f"{row.method}: {row.status}: {escape(row.error)}", highlight=False, soft_wrap=True)


def _say_written(console: Console, rows: list, out) -> None:
    if out is not None:
        console.print(f"{len(rows)} row(s) written to {out}", highlight=False)
