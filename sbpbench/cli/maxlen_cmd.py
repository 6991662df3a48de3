"""`sbp maxlen`: the longest trainable sequence per method, by growth then bisection over probes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..core import DEFAULT_CHUNK_SIZE, DEFAULT_LOGITS_CHUNK_SIZE
from ..data import DEFAULT_PROMPT_LEN
from ..measure.units import gib, parse_bytes
from ..records import ResultRow, check_writable
from ..runner.maxlen import Resolution
from ..runner.search import MaxlenSpec, ProbeFailed, find_max_len
from ..runner.spec import DEFAULT_TIMEOUT_S, resolve_device
from .errors import user_errors
from .options import ChunkOpt, DType, LogitsChunkOpt, SeedOpt
from .paper import paper_max_len
from .point_options import (
    AutoDeviceOpt,
    DefaultedBatchOpt,
    DefaultedDTypeOpt,
    DefaultedModelOpt,
    LoraAlphaOpt,
    LoraRankOpt,
    MethodsOpt,
    MoreMethodsArg,
    NumLayersOpt,
    ObjectiveOpt,
    PromptLenOpt,
    ProtocolOpt,
    StepOpt,
    TimeoutOpt,
    parse_methods,
    point_specs,
)

# The budget, first probe and ceiling when none is given: the paper's 80 GB GPU; on a CPU a 1 GiB
# cap on tracked tensors keeps a search within minutes.
SEARCH_DEFAULTS = {
    "cuda": {"memory_limit": "80GiB", "start": 1024, "max_seq": 262_144},
    "cpu": {"memory_limit": "1GiB", "start": 512, "max_seq": 16_384},
}
DEFAULT_OUT = Path("results/maxlen.csv")
SIMULATED_OUT = Path("results/estimates.csv")
SIMULATED_DEVICE = "simulated GPU"  # what sbpbench.simulate writes as device_name


def maxlen(
    method: MethodsOpt = None,
    more_methods: MoreMethodsArg = None,
    model: DefaultedModelOpt = None,
    batch: DefaultedBatchOpt = None,
    objective: ObjectiveOpt = "sft",
    prompt_len: PromptLenOpt = DEFAULT_PROMPT_LEN,
    lora_rank: LoraRankOpt = 0,
    lora_alpha: LoraAlphaOpt = 128,
    step: StepOpt = "bp",
    dtype: DefaultedDTypeOpt = None,
    chunk_size: ChunkOpt = DEFAULT_CHUNK_SIZE,
    logits_chunk_size: LogitsChunkOpt = DEFAULT_LOGITS_CHUNK_SIZE,
    device: AutoDeviceOpt = "auto",
    num_layers: NumLayersOpt = 0,
    protocol: ProtocolOpt = "steady",
    memory_limit: Annotated[
        str | None,
        typer.Option(
            help="The memory budget, e.g. 80GiB (default: 80GiB on cuda, capping the process so an 80 GB card is "
            "emulated on a larger one; 1GiB of tracked tensors on cpu)."
        ),
    ] = None,
    resolution: Annotated[
        str, typer.Option(help="Stop when the bracket is this narrow: a percentage (1%) or tokens (256).")
    ] = "1%",
    start: Annotated[int | None, typer.Option(min=2, help="First probe length (default: 1024 cuda, 512 cpu).")] = None,
    max_seq: Annotated[
        int | None, typer.Option(min=2, help="Longest length tried (default: 262144 cuda, 16384 cpu).")
    ] = None,
    multiple_of: Annotated[int, typer.Option(min=1, help="Probe lengths are multiples of this.")] = 8,
    warmup: Annotated[int, typer.Option(min=0, help="Discarded steps before each probe's memory step.")] = 1,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    seed: SeedOpt = 0,
    resume: Annotated[bool, typer.Option(help="Reuse probes already in --out (same settings).")] = True,
    simulate: Annotated[
        bool,
        typer.Option(
            "--simulate",
            help="Probe with `sbp estimate` (the real step on fake tensors, modelling a GPU) instead of running: "
            "no GPU needed; rows are marked source=simulated.",
        ),
    ] = False,
    gpu_memory: Annotated[
        str | None, typer.Option(help="--simulate: the GPU's memory, e.g. 80GiB (default: --memory-limit, or 80GiB).")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="Results CSV (default: results/maxlen.csv; simulated: results/estimates.csv)."
        ),
    ] = None,
) -> None:
    """Find the longest sequence each method trains in a memory budget: doubling from --start
    until a probe runs out of memory, then bisection to --resolution. Each probe is one isolated
    `sbp run` point (memory only), kept in --out so an interrupted search resumes; the answer is
    a row of kind maxlen. Several methods give one table with the ratio to ckpt. With --simulate
    each probe is a prediction for a GPU of --gpu-memory instead (seconds each, on any machine)."""
    with user_errors():
        on_gpu = simulate or specs_on_cuda(device)
        search_defaults = SEARCH_DEFAULTS["cuda" if on_gpu else "cpu"]
        budget = gpu_memory or memory_limit or search_defaults["memory_limit"]
        if gpu_memory and not simulate:
            raise ValueError("--gpu-memory is the simulated GPU's size: add --simulate, or use --memory-limit")
        specs = point_specs(
            parse_methods([*(method or []), *(more_methods or [])]),
            model=model,
            seq=start or search_defaults["start"],
            batch=batch,
            objective=objective,
            prompt_len=prompt_len,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            step=step,
            dtype=dtype or (DType("bf16") if simulate else None),
            chunk_size=chunk_size,
            logits_chunk_size=logits_chunk_size,
            device="cpu" if simulate else device,  # fake CPU tensors stand in for the GPU's
            num_layers=num_layers,
            protocol=protocol,
            memory_limit=budget,
            seed=seed,
            warmup=warmup if on_gpu else 0,  # CPU memory is measured before any warm-up
            repeats=0,  # memory only
            timeout_s=timeout,
        )
        searches = [
            MaxlenSpec(
                base=spec,
                resolution=Resolution.parse(resolution),
                start=start or search_defaults["start"],
                ceiling=max_seq or search_defaults["max_seq"],
                multiple_of=multiple_of,
            )
            for spec in specs
        ]
        out = out or (SIMULATED_OUT if simulate else DEFAULT_OUT)
        check_writable(out)
        probing = _simulated_probe(parse_bytes(budget)) if simulate else {}
        console = Console()
        answers = []
        for search in searches:
            with console.status(f"{search.method}: searching") as status:

                def told(row: ResultRow, status=status, search=search) -> None:
                    status.update(f"{search.method}: T={row.seq_len} {row.status}; probing further")

                try:
                    answers.append(find_max_len(search, out, resume=resume, on_probe=told, **probing))
                except ProbeFailed as error:
                    console.print(f"[red]{escape(str(error))}[/]; probes so far are in {out}", highlight=False)
                    raise typer.Exit(1) from None
    console.print(maxlen_table(answers))
    console.print(f"{len(answers)} max-length row(s) written to {out}", highlight=False)


def _simulated_probe(gpu_memory_bytes: int) -> dict:
    """find_max_len's arguments for probes that are predictions (sbpbench.simulate)."""
    from ..simulate.depth import estimate_point_by_depth

    def measure(spec, env) -> ResultRow:
        return estimate_point_by_depth(spec, target="cuda", gpu_memory_bytes=gpu_memory_bytes)

    return {"measure": measure, "device_name": SIMULATED_DEVICE, "source": "simulated"}


def specs_on_cuda(device: str) -> bool:
    return resolve_device(device).startswith("cuda")


def _bound(row: ResultRow) -> str:
    if row.max_seq_len is None:
        return f"< {row.oom_seq_len:,}"
    return f"{row.max_seq_len:,}" if row.oom_seq_len is not None else f">= {row.max_seq_len:,} (ceiling)"


def maxlen_table(rows: list[ResultRow]) -> Table:
    """Max T per method, the ratio to ckpt, and the paper's number where it has one."""
    first = rows[0]
    lora = f", LoRA r{first.lora_rank}" if first.lora_rank else ""
    budget = first.device_total_memory_bytes if first.source == "simulated" else first.memory_limit_bytes
    title = (
        f"max sequence length: {first.model} ({first.num_layers or '?'} layers{lora}), {first.objective}, "
        f"step {first.step}, {first.dtype}, B={first.batch_size}, {first.protocol} protocol, "
        f"budget {gib(budget)} GiB\n{first.device_name} ({first.source}, {first.memory_source})"
    )
    caption = "probes: lengths the search used, cached ones included. peak: max allocated at max T."
    if first.source == "simulated":
        caption += (
            " Simulated: a prediction, not a measurement. Our bp/ckpt free the logits after the loss; the paper's"
            " script keeps them through the backward (sbpbench/simulate/paper_baseline.py), so ours reach longer."
        )
    if first.objective != "sft":
        caption += " grpo/dpo: the paper's number is the completion length; ours minus prompt_len is in brackets."
    table = Table(title=title, caption=caption)
    for header in ("method", "max T", "first OOM", "x ckpt", "paper", "probes", "peak GiB"):
        table.add_column(header, justify="left" if header == "method" else "right", no_wrap=True)
    ckpt = next((r.max_seq_len for r in rows if r.method == "ckpt" and r.max_seq_len), None)
    for row in rows:
        ratio = f"{row.max_seq_len / ckpt:.2f}" if ckpt and row.max_seq_len else "-"
        if ratio != "-" and row.oom_seq_len is None:
            ratio = f">= {ratio}"  # the search stopped at its ceiling
        shown = _bound(row)
        if row.objective != "sft" and row.max_seq_len is not None and row.prompt_len:
            shown += f" [{row.max_seq_len - row.prompt_len:,}]"
        paper = paper_max_len(row)
        table.add_row(
            row.method,
            shown,
            "-" if row.oom_seq_len is None else f"{row.oom_seq_len:,}",
            ratio,
            "-" if paper is None else paper,
            f"{row.num_probes}",
            gib(row.peak_allocated_bytes),
        )
    return table
