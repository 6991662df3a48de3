"""`sbp plan`: the fastest StreamBP checkpoint placement and chunk size that fit a GPU and a host."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..measure.host_memory import total_ram_bytes
from ..measure.units import parse_bytes
from ..settings import SETTINGS
from ..settings.table import has_flag
from .errors import user_errors
from .flags import flags_of
from .options import (
    DEFAULT_GPU_MEMORY,
    PREDICTED_POINT,
    RUN_FIELDS,
    GpuMemoryOpt,
    GpusOpt,
    InterconnectOpt,
    interconnect_bytes_s,
    point_command,
    predicted_gpu_point_helps,
    with_gpus,
)
from .outcomes import fail_if
from .progress import Progress
from .tables import print_table, shared_by

if TYPE_CHECKING:
    from ..config import RunSpec
    from ..simulate.plan import PlanOutcome
    from ..simulate.timing import Rates

GIB = 2**30
# what the planner decides itself: StreamBP on one GPU, its chunk size and checkpoint placement
PLANNED = ("method", "nproc", "chunk_size", "checkpoints")
# the rest of a point and StreamBP's other knobs; one the estimator does not model is refused, as by
# `sbp estimate` (the settings table's `estimator`)
PLAN_FIELDS = tuple(
    name
    for name in RUN_FIELDS
    if name not in PLANNED and (not SETTINGS[name].read_by or "streambp" in SETTINGS[name].read_by)
)

# The host default is this machine's RAM: right where one plans on the GPU's own host, wrong from a
# laptop; a notice names it either way, since it decides the stream placement's buffers and time.
PlanHostMemoryOpt = Annotated[
    str | None,
    typer.Option(
        metavar="SIZE",
        help="The GPU machine's host memory, for the checkpoints kept there, e.g. 120GiB (default: this "
        "machine's RAM, said in a notice; give it when planning for another machine).",
    ),
]

RatesGpuOpt = Annotated[
    str, typer.Option(metavar="NAME", help="The GPU whose measured rows give the rates: its device name contains this.")
]
RatesResultsOpt = Annotated[
    Path, typer.Option(metavar="CSV|DIR", help="Results CSV or folder with those measured rows.")
]
AllCandidatesOpt = Annotated[bool, typer.Option("--all", help="Also list every candidate decided, with its reason.")]

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp plan --model Qwen/Qwen3-8B --seq 131072",
    "sbp plan --model Qwen/Qwen3-8B --seq 1048576 --lora-rank 64",
    "sbp plan --gpus 8 --model Qwen/Qwen3-8B --seq 8388608 --host-memory 1TiB",
)


@point_command(PLAN_FIELDS, helps=predicted_gpu_point_helps(), predicted=True)
def plan_command(
    settings: dict,
    methods: tuple[str, ...],
    gpu_memory: GpuMemoryOpt = None,
    host_memory: PlanHostMemoryOpt = None,
    gpus: GpusOpt = None,
    interconnect: InterconnectOpt = None,
    gpu: RatesGpuOpt = "H100",
    results: RatesResultsOpt = Path("results"),
    all_candidates: AllCandidatesOpt = False,
) -> None:
    """Pick StreamBP's checkpoint placement and chunk size for a GPU.

    Candidate --checkpoints placements and layer chunk sizes, in order of predicted step time
    (matmul and attention rates, chunk overheads, PCIe copies beyond the compute they overlap; with
    --gpus a GPU's share and its collectives at --interconnect), are ruled out by bounds or estimated
    (`sbp estimate`, from short fake runs) until one fits both the GPU and the host. The rates come
    from measured rows of --gpu in --results when there are any, else assumed from published H100
    figures. Prints the fastest candidate of each kind of placement and why it is or is not the plan,
    then the `sbp run` command that measures the plan. --gpus P plans for P GPUs of one node sharing
    each sequence (--sp of them, default all). Predictions, not measurements."""
    from ..config import point_specs
    from ..simulate import check_estimate_host_memory
    from ..simulate.plan import candidates, meta_model, plan, ruled_out_by, summary

    with user_errors():
        gpu_bytes = parse_bytes(gpu_memory or DEFAULT_GPU_MEMORY)
        host_bytes = parse_bytes(host_memory) if host_memory else total_ram_bytes()
        settings = _on_gpus(settings, gpus)
        (spec,) = point_specs({**settings, **PREDICTED_POINT}, ["streambp"], defaults_for="cuda")
        check_estimate_host_memory([spec])  # its estimates' real batches fit this machine
        rates = plan_rates(results, gpu, interconnect)
    console = Console()
    print_notices(console, host_memory, host_bytes, results, gpu, rates)
    with Progress(Console(stderr=True), None) as progress:
        progress.start(f"planning {spec.model}, T={spec.seq_len}")
        chosen, tried = plan(
            spec, gpu_memory_bytes=gpu_bytes, host_memory_bytes=host_bytes, rates=rates, note=progress.note
        )
    found = candidates(spec, meta_model(spec), rates, host_bytes)
    if all_candidates:
        print_every_candidate(console, spec, tried, gpu_bytes, host_bytes, rates)
    print_table(console, summary_table(spec, summary(chosen, tried, found), chosen, gpu_bytes, host_bytes, rates))
    if chosen is None:
        console.print(f"[red]nothing fits[/]: {advice(ruled_out_by(spec, tried, gpu_bytes))}", highlight=False)
    fail_if(chosen is None)
    print_choice(console, spec, chosen, gpu_bytes, host_bytes)
    print_shared(console, spec, chosen, rates)
    console.print(run_command(settings, spec, chosen), highlight=False, soft_wrap=True)


def _on_gpus(settings: dict, gpus: str | None) -> dict:
    """The settings on --gpus (options.with_gpus); GPUs that share no sequence are refused in one line."""
    settings, _ = with_gpus(settings, (), gpus)
    if settings.get("nproc", 1) > 1 and settings["sp"] == 1:
        raise ValueError(
            "--gpus plans GPUs sharing each sequence: give --sp 2 or more, or leave --gpus out to plan one GPU"
        )
    return settings


def plan_rates(results: Path, gpu: str, interconnect: str | None) -> Rates:
    """The time model's rates: fitted to --results' rows of --gpu where there are any, the
    interconnect's from --interconnect where given."""
    from dataclasses import replace

    from ..simulate.plan import meta_model
    from ..simulate.timing import fitted_rates

    given = interconnect_bytes_s(interconnect)  # a bad rate is refused before the rows are read
    rates = fitted_rates(results, gpu, meta_model)
    return rates if given is None else replace(rates, interconnect_bytes_s=given)


def print_shared(console: Console, spec: RunSpec, chosen: PlanOutcome, rates: Rates) -> None:
    """With --gpus: what the plan's numbers are per, and its step time's communication."""
    from ..simulate.plan import meta_model, sent_bytes
    from ..simulate.timing import INTERCONNECT_BYTES_S, rebuilt_layers

    if spec.sp == 1:
        return
    time, model = chosen.candidate.time, meta_model(spec)
    sent = sent_bytes(spec, model, rebuilt_layers(chosen.candidate.placement, model.config.num_hidden_layers))
    assumed = (
        "assumed: NVLink 4 of an H100 SXM" if rates.interconnect_bytes_s == INTERCONNECT_BYTES_S else "--interconnect"
    )
    console.print(
        f"per GPU {shared_by(spec)}; host memory per node of {spec.nproc} ranks. The step's "
        f"{seconds_and_hours(time.total_s)}: {seconds_and_hours(time.compute_s)} of compute, "
        f"{seconds_and_hours(time.host_copies_s)} of host copies beyond it and {seconds_and_hours(time.communication_s)} "
        f"for the {sent / GIB:,.0f} GiB each GPU sends at {rates.interconnect_bytes_s / 1e9:,.0f} GB/s each way ({assumed})",
        highlight=False,
    )


def print_notices(console: Console, host_memory: str | None, host_bytes: int, results: Path, gpu: str, rates: Rates):
    """What the plan assumed that the command line did not say: the host memory, and rates assumed
    where --results or --gpu gave no measured rows."""
    found = []
    if not host_memory:
        found.append(f"--host-memory not given: planning for this machine's RAM, {host_bytes / GIB:.1f} GiB")
    if not rates.fitted:
        why = "no such file or folder" if not results.exists() else f"no measured rows of --gpu {gpu} there"
        found.append(f"--results {results}: {why}; the rates are assumed (published H100 figures)")
    for line in found:
        console.print(f"[yellow]notice:[/] {line}", highlight=False)


def advice(constraints: set[str]) -> str:
    """What would make a candidate fit, from what ruled them out (simulate/plan.py `ruled_out_by`)."""
    more = [f"more {kind} memory (--{kind.lower()}-memory)" for kind in ("GPU", "host") if kind in constraints]
    return "a shorter --seq, LoRA (--lora-rank), or " + (" or ".join(more) or "more GPU memory (--gpu-memory)")


def run_command(settings: dict, spec: RunSpec, chosen: PlanOutcome) -> str:
    """The `sbp run` line that measures the plan's point on a GPU: every option given to `sbp plan`,
    then the plan's method, placement and chunk sizes (a shell quotes nothing else)."""
    from ..simulate.plan import describe

    d = describe(chosen, step_tokens(spec))
    ranks = {"nproc": spec.nproc, "sp": spec.sp} if spec.sp > 1 else {}
    point = dict(
        settings, model=spec.model, seq_len=spec.seq_len, device="cuda", **ranks, method="streambp",
        checkpoints=d["checkpoints"], chunk_size=d["chunk_size"], logits_chunk_size=d["logits_chunk_size"],
    )  # fmt: skip
    return shlex.join(["sbp", "run", *(word for name, value in point.items() for word in _option_words(name, value))])


def _option_words(name: str, value) -> list[str]:
    """A setting as `sbp run` takes it: its flag and value, a bool's --name or --no-name, a knob
    without a flag as --set NAME=VALUE."""
    if not has_flag(name):
        text = str(value).lower() if isinstance(value, bool) else str(value)
        return ["--set", f"{name}={text}"]
    flag, *negative = flags_of(name)[0].split("/")
    if SETTINGS[name].kind is bool:
        return [flag if value else negative[0]]
    return [flag, str(value)]


def seconds_and_hours(seconds: float) -> str:
    """Seconds, with minutes or hours beside them where those read better: "3,357 s (56 min)"."""
    text = f"{seconds:,.0f} s"
    if seconds >= 3600:
        return f"{text} ({seconds / 3600:.1f} h)"
    return f"{text} ({seconds / 60:.0f} min)" if seconds >= 120 else text


def print_every_candidate(
    console: Console, spec: RunSpec, tried: list[PlanOutcome], gpu_bytes: int, host_bytes: int, rates: Rates
) -> None:
    """--all: every candidate decided, and each bound with the chunk sizes it covers."""
    print_table(console, plan_table(spec, tried, gpu_bytes, host_bytes, rates))
    for outcome in tried:
        if outcome.bound:
            chunk = "any chunk" if outcome.any_chunk else f"chunk {outcome.candidate.chunk_size}"
            console.print(f"{outcome.candidate.placement.name}, {chunk}: {outcome.bound}", highlight=False)


def print_choice(console: Console, spec: RunSpec, chosen: PlanOutcome, gpu_bytes: int, host_bytes: int) -> None:
    """The plan's flags, its predicted time and page-locking, and why it won."""
    from ..simulate.depth import layer_input_bytes
    from ..simulate.plan import describe

    d = describe(chosen, step_tokens(spec))
    pinned = chosen.candidate.counts.max_host_inputs * layer_input_bytes(spec)
    pinning_s = seconds_and_hours(d["first_step_pinning_s"])
    each = " per GPU" if spec.sp > 1 else ""
    pinning = f"; the first step pins {pinned / GIB:.0f} GiB of host memory{each} ({pinning_s})"
    console.print(
        f"plan: {d['checkpoints']}, chunk {d['chunk_size']}: predicted {seconds_and_hours(d['predicted_time_s'])} per step "
        f"({d['tokens_per_s']:,.0f} tokens/s{over_groups(spec)})" + (pinning if pinned else ""),
        highlight=False,
    )
    console.print(
        f"why: the fastest candidate that fits {gpu_bytes / GIB:.0f} GiB of GPU and {host_bytes / GIB:.0f} GiB of "
        "host; each faster one above needs more. Measure it:",
        highlight=False,
    )


def summary_table(
    spec: RunSpec, rows: list, chosen: PlanOutcome | None, gpu_bytes: int, host_bytes: int, rates: Rates
) -> Table:
    """Per kind of placement its fastest candidate (simulate/plan.py `summary`): the plan, why a faster
    one is not, or that it is slower."""
    from ..simulate.depth import layer_input_bytes
    from ..simulate.estimate import HOST_PROCESS_BYTES, ranks_per_node
    from ..simulate.plan import Candidate, describe

    tokens = step_tokens(spec)
    title = (
        f"{spec.model}, T={spec.seq_len:,}, B={spec.batch_size}{on_gpus(spec)}: fastest of each placement (simulated)"
    )
    caption = (
        f"GiB = 2^30 B. GPU: peak allocated + margin, of {gpu_bytes / GIB:.1f} GiB (> x: ruled out without a "
        f"simulation; -: not simulated, slower or the host too small); host: pinned buffers + process, of {host_bytes / GIB:.1f} GiB. step s: predicted time of "
        f"a step. Rates: {rates.describe()}"
    )
    table = Table(title=title, caption=caption)
    for column in ("placement", "chunk", "step s", "GPU GiB", "host GiB", "outcome"):
        table.add_column(column, justify="left" if column in ("placement", "outcome") else "right", no_wrap=True)
    layer_input = layer_input_bytes(spec)
    for row in rows:
        if isinstance(row, Candidate):
            host = ranks_per_node(spec) * (HOST_PROCESS_BYTES + row.counts.max_host_inputs * layer_input)
            table.add_row(
                row.placement.name,
                str(row.chunk_size),
                f"{row.predicted_time_s:,.0f}",
                "-",
                f"{host / GIB:.1f}",
                "slower",
            )
            continue
        d = describe(row, tokens)
        if row.bound:
            kind = "host" if row.bound.startswith("host") else "GPU"
            device = row.bound.split("over ")[1].split(" GiB")[0] if kind == "GPU" else ""
            device, outcome = (f"> {device}" if device else "-"), f"{kind} too small"
        else:
            device = f"{d['device_bytes'] / GIB:.1f}"
            outcome = "the plan" if row is chosen else "fits" if d["status"] == "ok" else _too_small(row)
        table.add_row(
            d["checkpoints"], "any" if row.any_chunk else str(d["chunk_size"]), f"{d['predicted_time_s']:,.0f}",
            device, f"{d['host_bytes'] / GIB:.1f}", outcome,
        )  # fmt: skip
    return table


def step_tokens(spec: RunSpec) -> int:
    """The tokens one step trains on every GPU of the plan: B x T per group of --sp GPUs sharing it."""
    return spec.batch_size * spec.seq_len * (spec.nproc // spec.sp)


def over_groups(spec: RunSpec) -> str:
    """What a plan's tokens/s counts where several groups share their own sequences ("" for one)."""
    groups = spec.nproc // spec.sp
    return f" over the {groups} groups" if groups > 1 and spec.sp > 1 else ""


def on_gpus(spec: RunSpec) -> str:
    """A title's note where GPUs share each sequence: its GPU figures are per GPU, its host per node."""
    if spec.sp == 1:
        return ""
    sharing = "sharing it" if spec.nproc == spec.sp else f"in groups of {spec.sp} sharing each row"
    return f" on {spec.nproc} GPUs {sharing} (GPU: per GPU; host: per node)"


def _too_small(outcome: PlanOutcome) -> str:
    return "host too small" if outcome.row.error.startswith("host") else "GPU too small"


def plan_table(spec: RunSpec, tried: list[PlanOutcome], gpu_bytes: int, host_bytes: int, rates: Rates) -> Table:
    """The candidates decided, in order (simulate/plan.py PlanOutcome), with the rates their times use."""
    from ..simulate.plan import describe

    caption = (
        f"GiB = 2^30 B. GPU: peak allocated + margin, of {gpu_bytes / GIB:.1f} GiB (bound: ruled out without "
        f"a simulation, below); host: pinned checkpoints + process, of {host_bytes / GIB:.1f} GiB. step s: "
        f"predicted step time; pin s: the first step's page-locking of the host copies, once per process. "
        f"Rates: {rates.describe()}"
    )
    title = f"{spec.model}, T={spec.seq_len}, B={spec.batch_size}{on_gpus(spec)}: candidates (simulated)"
    table = Table(title=title, caption=caption)
    for column in ("checkpoints", "chunk", "logits", "status", "GPU GiB", "host GiB", "step s", "tokens/s", "pin s"):
        table.add_column(column, justify="left" if column in ("checkpoints", "status") else "right", no_wrap=True)
    for outcome in tried:
        d = describe(outcome, step_tokens(spec))
        device = "bound" if d["device_bytes"] is None else f"{d['device_bytes'] / GIB:.2f}"
        chunk = "any" if outcome.any_chunk else str(d["chunk_size"])
        table.add_row(
            d["checkpoints"], chunk, str(d["logits_chunk_size"]), d["status"], device,
            f"{d['host_bytes'] / GIB:.2f}", f"{d['predicted_time_s']:.1f}", f"{d['tokens_per_s']:,.0f}",
            f"{d['first_step_pinning_s']:.1f}",
        )  # fmt: skip
    return table
