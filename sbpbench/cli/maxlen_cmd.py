"""`sbp maxlen`: the longest trainable sequence per method, by growth then bisection over probes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ..measure.host_memory import total_ram_bytes
from ..measure.units import parse_bytes
from ..records import ResultRow, check_writable
from ..settings import SEARCH_SETTINGS, default_of
from .errors import user_errors
from .options import (
    BUDGET_EXIT,
    BudgetOpt,
    ExactOpt,
    GpuMemoryOpt,
    HostMemoryOpt,
    out_option,
    point_command,
    run_fields_but,
)
from .progress import Progress
from .run_cmd import point_line
from .tables import maxlen_table, print_table, seq_bound

DEFAULT_OUT = Path("results/maxlen.csv")
SIMULATED_OUT = Path("results/estimates.csv")
MAXLEN_FIELDS = run_fields_but("repeats") + SEARCH_SETTINGS


def _search_default(name: str, device: str):
    return default_of(name, device, search=True)


MaxlenOutOpt = out_option("results/maxlen.csv; --simulate: results/estimates.csv")

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp maxlen --model Qwen/Qwen3-8B --memory-limit 80GiB --budget 9m  # Fig. 3",
    "sbp maxlen --device cpu --model tiny/qwen3 --memory-limit 10MB",
    "sbp maxlen --simulate --model Qwen/Qwen3-8B --checkpoints cpu  # no GPU",
)


@point_command(
    MAXLEN_FIELDS,
    helps={
        "seq_len": f"First probe length without a seed (default: {_search_default('seq_len', 'cuda')} cuda, "
        f"{_search_default('seq_len', 'cpu')} cpu).",
        "warmup": "Discarded steps before each probe's memory step (default: 0; its peak needs none).",
        "memory_limit": f"The memory budget, e.g. 80GiB (default: {_search_default('memory_limit', 'cuda')} on cuda, "
        "capping the process so a smaller card is emulated on a larger one; "
        f"{_search_default('memory_limit', 'cpu')} of tracked tensors on cpu).",
    },
    aliases={"seq_len": ("--start",)},
)
def maxlen(
    settings: dict,
    methods: tuple[str, ...],
    resume: Annotated[bool, typer.Option(help="Reuse probes already in --out (same settings).")] = True,
    simulate: Annotated[
        bool,
        typer.Option(
            "--simulate",
            help="Probe with `sbp estimate` (the real step on fake tensors, modelling a GPU) instead of running: "
            "no GPU needed; rows are marked source=simulated.",
        ),
    ] = False,
    gpu_memory: GpuMemoryOpt = None,
    host_memory: HostMemoryOpt = None,
    exact: ExactOpt = False,
    out: MaxlenOutOpt = None,
    budget: BudgetOpt = None,
) -> None:
    """Find the longest sequence each method trains in a memory budget.

    Each probe is one isolated `sbp run` point (memory only), kept in --out so an interrupted
    search resumes; the answer is a row of kind maxlen. The search starts at `sbp estimate`'s
    predicted max T for the same point (seconds of fake-tensor runs on this machine's CPU,
    for bp, ckpt, ckpt-offload and streambp), probes it and one --resolution step above, and
    widens by doubling steps only where a probe disagrees: two probes when the prediction is right,
    the true answer when it is not. Without a seed (--no-seed, or another method) the search
    doubles T from --seq until a probe runs out of memory, then bisects. Several methods give one
    table with the ratio to ckpt.

    With --simulate each probe is a prediction for a GPU of --gpu-memory instead (never seeded),
    extrapolated from short fake runs (simulate/length.py): the search first probes lengths that
    share those runs (multiples of the layer chunk), then bisects what is left to --resolution.

    A seed takes seconds to a minute of this machine's CPU; a probe is a new process. Without a
    seed a search at the defaults runs about 25 probes; --resolution 10% is a quicker look."""
    from ..config import MaxlenSpec, point_specs
    from ..config.device import device_kind, resolve_device
    from ..config.maxlen import SEARCH_DEFAULTS
    from ..config.run import check_measurable
    from ..measure.environment import capture_environment
    from ..measure.units import parse_seconds
    from ..runner.budget import Budget, BudgetSpent, within
    from ..runner.isolated import run_isolated
    from ..runner.maxlen import ProbeFailed, find_max_len
    from .simulated_search import estimate_seed, simulated_max_len, simulated_probing

    with user_errors():
        if budget is not None and simulate:
            raise ValueError("--budget stops measured probes: drop it with --simulate (a prediction takes seconds)")
        seconds = parse_seconds(budget) if budget is not None else None
        if gpu_memory and not simulate:
            raise ValueError("--gpu-memory is the simulated GPU's size: add --simulate, or use --memory-limit")
        if host_memory and not simulate:
            raise ValueError("--host-memory is the simulated host's size: add --simulate")
        if exact and not simulate:
            raise ValueError("--exact is how --simulate predicts a probe: add --simulate")
        if simulate and settings.get("weights"):
            raise ValueError("--weights does not apply to --simulate (fake tensors hold no values); drop it")
        if simulate and "seed_from_estimate" in settings:
            raise ValueError(
                "--no-seed and --seed-from-estimate are for measured searches (a --simulate search's probes are "
                "the estimate); drop it"
            )
        host_bytes = parse_bytes(host_memory) if host_memory else total_ram_bytes()
        kind = "cuda" if simulate else device_kind(resolve_device(settings.get("device", "auto")))
        search = {name: settings.pop(name) for name in SEARCH_SETTINGS if name in settings}
        defaults = {**SEARCH_DEFAULTS[kind], "repeats": 0}  # probes measure memory only
        if gpu_memory:
            settings["memory_limit"] = gpu_memory
        if simulate:
            settings["device"] = "cpu"  # fake CPU tensors stand in for the GPU's
        ceiling = search.get("seq_len_ceiling", defaults.pop("seq_len_ceiling"))
        specs = point_specs(settings, methods, defaults=defaults, defaults_for=kind)
        if not simulate:
            check_measurable(specs)
        searches = [
            MaxlenSpec(
                base=spec,
                seq_len_ceiling=ceiling,
                **{k: v for k, v in search.items() if k != "seq_len_ceiling"},
            )
            for spec in specs
        ]
        out = out or (SIMULATED_OUT if simulate else DEFAULT_OUT)
        check_writable(out)
        console = Console()
        answers = []
        stopped = ""  # why the budget stopped the searches
        with Progress(console, len(searches)) as progress:
            if simulate:
                probing = simulated_probing(
                    target="cuda",
                    memory_bytes=specs[0].memory_limit,
                    host_memory_bytes=host_bytes,
                    exact=exact,
                    note=progress.note,
                )
            else:
                env = capture_environment(specs[0].device)
                clock = Budget(seconds) if seconds is not None else None
                probing = {"env": env, "measure": within(run_isolated, clock) if clock else run_isolated}
                # the seed's prediction is for this device: its capacity caps --memory-limit as a probe's does
                probing["seed"] = estimate_seed(
                    capacity_bytes=env.device_total_memory_bytes, budget=clock, note=progress.note
                )
            for search_spec in searches:
                progress.start(f"{search_spec.method}: searching")

                def told(row: ResultRow, search_spec=search_spec) -> None:
                    progress.note(f"{search_spec.method}: probe {point_line(row)}")

                try:
                    if simulate:
                        answer = simulated_max_len(
                            search_spec, out, probing=probing, exact=exact, resume=resume, on_probe=told
                        )
                    else:
                        answer = find_max_len(search_spec, out, resume=resume, on_probe=told, **probing)
                except ProbeFailed as error:
                    console.print(f"[red]{escape(str(error))}[/]; probes so far are in {out}", highlight=False)
                    raise typer.Exit(1) from None
                except BudgetSpent as spent:  # the answers so far, then why it stopped
                    stopped = (
                        f"--budget {budget} spent in {search_spec.method}'s search ({spent}): "
                        f"{len(searches) - len(answers)} of {len(searches)} search(es) left; probes so far are in "
                        f"{out}; run the same command to resume"
                    )
                    break
                answers.append(answer)
                progress.advance(f"{search_spec.method}: max T {seq_bound(answer)} ({answer.num_probes} probes)")
    if stopped:
        if answers:
            print_table(console, maxlen_table(answers))
        console.print(stopped, style="yellow", highlight=False, soft_wrap=True)
        raise typer.Exit(BUDGET_EXIT)
    print_table(console, maxlen_table(answers))
    from ..models import load_config

    context = getattr(load_config(specs[0].model), "max_position_embeddings", None)
    past = past_context_line(specs[0].model, answers, context)
    if past:
        console.print(past, style="yellow", highlight=False, soft_wrap=True)
    console.print(f"{len(answers)} max-length row(s) written to {out}", highlight=False, soft_wrap=True)


def past_context_line(model: str, answers: list[ResultRow], context: int | None) -> str | None:
    """One line naming the methods whose max T lies past the model's trained context (a search's
    ceiling usually does: memory, not the context, is what it measures), or None."""
    if not isinstance(context, int):
        return None
    past = [a.method for a in answers if a.max_seq_len is not None and a.max_seq_len > context]
    if not past:
        return None
    return (
        f"max T past {model}'s context of {context:,} tokens (max_position_embeddings) for {', '.join(past)}: "
        "memory allows it, but the model was never trained that long"
    )
