"""`sbp maxlen`: the longest trainable sequence per method, by growth then bisection over probes."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ..measure.host_memory import total_ram_bytes
from ..measure.units import parse_bytes
from ..records import ResultRow, check_writable
from ..runner.outcome import written_line
from ..settings import SEARCH_SETTINGS, default_of, ignored_knobs
from ..settings.table import NOT_ESTIMATED, not_estimated
from .errors import user_errors
from .flags import FLAGS
from .options import (
    BudgetOpt,
    ExactOpt,
    GpuMemoryOpt,
    GpusOpt,
    HostMemoryOpt,
    check_sizes,
    out_option,
    point_command,
    refuse_unestimated,
    run_fields_but,
    say_ignored,
    with_gpus,
)
from .outcomes import finish
from .progress import Progress
from .tables import maxlen_table, print_table

if TYPE_CHECKING:
    from ..config import MaxlenSpec
    from ..runner.searches import Probing

DEFAULT_OUT = Path("results/maxlen.csv")
SIMULATED_OUT = Path("results/estimates.csv")
MAXLEN_FIELDS = run_fields_but("repeats") + SEARCH_SETTINGS


def _search_default(name: str, device: str):
    return default_of(name, device, search=True)


ResumeOpt = Annotated[bool, typer.Option(help="Reuse probes already in --out (same settings).")]
SimulateOpt = Annotated[
    bool,
    typer.Option(
        "--simulate",
        help="Probe with `sbp estimate` (the real step on fake tensors, modelling a GPU) instead of running: "
        "no GPU needed; rows are marked source=simulated.",
    ),
]
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
        "sp": "Ranks sharing each sequence (default: 1; all --gpus P with --simulate).",
        "seq_len_ceiling": f"Longest length tried (default: {_search_default('seq_len_ceiling', 'cuda')} cuda, "
        f"{_search_default('seq_len_ceiling', 'cpu')} cpu; P times the cuda one with --simulate on --gpus "
        "sharing each sequence over P).",
        "memory_limit": f"The memory budget, e.g. 80GiB (default: {_search_default('memory_limit', 'cuda')} on cuda, "
        "capping the process so a smaller card is emulated on a larger one; "
        f"{_search_default('memory_limit', 'cpu')} of tracked tensors on cpu).",
    },
    aliases={"seq_len": ("--start",)},
)
def maxlen(
    settings: dict,
    methods: tuple[str, ...],
    resume: ResumeOpt = True,
    simulate: SimulateOpt = False,
    gpu_memory: GpuMemoryOpt = None,
    host_memory: HostMemoryOpt = None,
    exact: ExactOpt = False,
    gpus: GpusOpt = None,
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
    With --gpus P it predicts P GPUs sharing each sequence, as `sbp estimate --gpus P` does.

    A seed takes seconds to a minute of this machine's CPU; a probe is a new process. Without a
    seed a search at the defaults runs about 25 probes; --resolution 10% is a quicker look."""
    check_sizes({"--gpu-memory": gpu_memory, "--host-memory": host_memory})
    from ..runner.searches import run_searches

    with user_errors():
        probing = _probing(settings, simulate, gpu_memory, host_memory, exact, budget)
        settings, searches = _searches(settings, methods, simulate, gpu_memory, gpus)
        out = out or (SIMULATED_OUT if simulate else DEFAULT_OUT)
        check_writable(out)
    searches = _noticed(searches, settings, simulate, host_memory, probing)
    console = Console()
    with user_errors(), Progress(Console(stderr=True), len(searches)) as progress:
        outcome = run_searches(searches, out, probing=probing, resume=resume, steps=progress)
    if outcome.rows:
        print_table(console, maxlen_table(outcome.rows))
    _say_nothing_fits(console, outcome.rows, host_memory)
    if not (outcome.stopped or outcome.failed or outcome.interrupted):
        _say_past_context(console, searches[0].base.model, outcome.rows)
        console.print(written_line(outcome, out, "max-length answer(s)"), highlight=False, soft_wrap=True)
    finish(console, outcome)


def _searches(
    settings: dict, methods: tuple[str, ...], simulate: bool, gpu_memory: str | None, gpus: str | None
) -> tuple[dict, list[MaxlenSpec]]:
    """(settings, the searches): a simulated search on --gpus (options.with_gpus) gets a default
    ceiling P times one GPU's where P GPUs share each sequence (--max-seq's help says so); a measured
    one is checked against this machine, and refuses --gpus (its ranks are --nproc and --sp)."""
    from ..config.maxlen import search_specs
    from ..config.run import check_measurable

    if simulate:
        settings, methods = with_gpus(settings, methods, gpus)
        if settings.get("sp", 1) > 1 and "seq_len_ceiling" not in settings:
            settings = {**settings, "seq_len_ceiling": _search_default("seq_len_ceiling", "cuda") * settings["sp"]}
    elif gpus is not None:
        raise ValueError(
            f"--gpus {gpus} is how many GPUs --simulate predicts: add --simulate, or measure --nproc N --sp P"
        )
    searches = search_specs(settings, methods, simulate=simulate, gpu_memory=gpu_memory)
    if not simulate:
        check_measurable([search.base for search in searches])
    return settings, searches


def _noticed(
    searches: list[MaxlenSpec], settings: dict, simulate: bool, host_memory: str | None, probing: Probing
) -> list[MaxlenSpec]:
    """The notices before work: knobs a method ignores; a simulated host of this machine's RAM (as
    `sbp plan` says it: it decides probes on ranks sharing a sequence); measured searches lose a
    seed the estimator cannot make."""
    say_ignored(ignored_knobs([search.method for search in searches], settings))
    if simulate and not host_memory:
        ram = f"{probing.host_memory_bytes / 2**30:.1f} GiB"
        print(f"notice: --host-memory not given: predicting for this machine's RAM, {ram}", file=sys.stderr, flush=True)
    return searches if simulate else without_unmodelled_seeds(searches)


def _say_nothing_fits(console: Console, answers: list[ResultRow], host_memory: str | None) -> None:
    """Under the table, each search whose shortest probe did not fit: why, and the flag where it is the host."""
    for row in answers:
        if row.status == "oom" and row.error:
            hint = "; --host-memory SIZE gives the GPU machine's" if "host:" in row.error and not host_memory else ""
            console.print(escape(f"{row.method}: {row.error}{hint}"), highlight=False, soft_wrap=True)


def without_unmodelled_seeds(searches: list[MaxlenSpec]) -> list[MaxlenSpec]:
    """The searches, each given a setting the estimator does not model (runner/simulated_search.py
    `unmodelled`, what `sbp estimate` refuses) now without its seed, which would predict another
    point than its probes measure; one notice line on stderr per such setting, naming its flag."""
    from ..runner.simulated_search import unmodelled

    found: dict[str, list[str]] = {}
    kept = []
    for search in searches:
        setting = unmodelled(search.base) if search.seed_from_estimate else None
        if setting is not None:
            found.setdefault(setting[0], []).append(search.method)
            search = replace(search, seed_from_estimate=False)
        kept.append(search)
    for name, methods in found.items():
        print(
            f"notice: {FLAGS[name]} is not modelled by the estimator ({not_estimated(name)}): no seed for "
            f"{', '.join(methods)}; the search grows from T={searches[0].start:,}",
            file=sys.stderr,
            flush=True,
        )
    return kept


def _probing(settings: dict, simulate: bool, gpu_memory, host_memory, exact: bool, budget: str | None) -> Probing:
    """How the probes run, from the options; a combination that does not apply is a one-line error."""
    from ..measure.units import parse_seconds
    from ..runner.searches import Probing

    if budget is not None and simulate:
        raise ValueError("--budget stops measured probes: drop it with --simulate (a prediction takes seconds)")
    for given, what in ((gpu_memory, "--gpu-memory is the simulated GPU's size: add --simulate, or use --memory-limit"),
                        (host_memory, "--host-memory is the simulated host's size: add --simulate"),
                        (exact, "--exact is how --simulate predicts a probe: add --simulate")):  # fmt: skip
        if given and not simulate:
            raise ValueError(what)
    if simulate and gpu_memory and settings.get("memory_limit") is not None:
        raise ValueError(
            "--memory-limit and --gpu-memory both give the simulated GPU's size: give one of them (--gpu-memory)"
        )
    if simulate and settings.get("device") is not None:
        raise ValueError("--device does not apply to --simulate (its probes predict a GPU on this CPU): drop it")
    if simulate and settings.get("weights"):
        raise ValueError("--weights does not apply to --simulate (fake tensors hold no values); drop it")
    if simulate and "seed_from_estimate" in settings:
        raise ValueError(
            "--no-seed and --seed-from-estimate are for measured searches (a --simulate search's probes are "
            "the estimate); drop it"
        )
    if simulate:  # the budget (--memory-limit) is the simulated GPU's size, as --gpu-memory is
        refuse_unestimated(settings, tuple(name for name in NOT_ESTIMATED if name != "memory_limit"))
    return Probing(
        simulate=simulate,
        exact=exact,
        host_memory_bytes=parse_bytes(host_memory, what="--host-memory") if host_memory else total_ram_bytes(),
        budget_s=parse_seconds(budget) if budget is not None else None,
        budget=budget or "",
    )


def _say_past_context(console: Console, model: str, answers: list[ResultRow]) -> None:
    from ..models import load_config

    past = past_context_line(model, answers, getattr(load_config(model), "max_position_embeddings", None))
    if past:
        console.print(past, style="yellow", highlight=False, soft_wrap=True)


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
