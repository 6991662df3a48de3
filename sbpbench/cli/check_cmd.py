"""`sbp check`: compare each method's loss and gradients with standard BP on one model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..settings import EXACTNESS_DEFAULTS
from .errors import user_errors
from .options import ExactnessOutOpt, point_command, run_fields_but
from .outcomes import fail_if
from .tables import print_table

if TYPE_CHECKING:
    from ..config import RunSpec

# bp is the reference; lora_alpha is 2 x rank (with seeded non-zero B); nothing is timed (nor an SDPA kernel forced)
UNTIMED = ("warmup", "repeats", "memory_limit", "timeout_s", "threads", "sdpa_backend")
CHECK_FIELDS = run_fields_but("lora_alpha", "step", "protocol", *UNTIMED)

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp check          # every method against bp: Qwen3-0.6B's shape, fp64",
    "sbp check --model tiny/gemma3 --seq 64 --chunk-size 7 --objective dpo",
    "sbp check --model ./my-checkpoint --dtype fp32 --out results/exactness.csv",
)


@point_command(
    CHECK_FIELDS,
    helps={  # the defaults named are its own point's (EXACTNESS_DEFAULTS)
        "method": "Methods to compare with bp; several allowed (default: all).",
        "model": "Registry name (`sbp models`), a Hub id ORG/NAME or a local checkpoint directory (default: "
        f"{EXACTNESS_DEFAULTS['model']}).",
        "seq_len": f"Sequence length T (default: {EXACTNESS_DEFAULTS['seq_len']}).",
        "batch_size": f"Rows per batch (default: {EXACTNESS_DEFAULTS['batch_size']}).",
        "lora_rank": "Check with LoRA adapters of this rank (default: 0, none).",
        "dtype": "fp64 (tolerance 1e-10), fp32 (against an fp64 step: within a small factor of bp's own "
        f"fp32 error) or bf16 (against an fp64 step: within a few times bp's own bf16 error) (default: {EXACTNESS_DEFAULTS['dtype']}).",
        "chunk_size": f"StreamBP positions per layer chunk (default: {EXACTNESS_DEFAULTS['chunk_size']}).",
        "num_layers": f"Keep only the first N decoder layers (default: {EXACTNESS_DEFAULTS['num_layers']}).",
        "device": f"cpu, cuda or cuda:N (default: {EXACTNESS_DEFAULTS['device']}).",
        "nproc": "Run the compared methods on N ranks (FSDP2, every rank on the one batch), bp in one process, "
        "judged as --dtype says (default: 1).",
    },
)
def check(settings: dict, methods: tuple[str, ...], out: ExactnessOutOpt = None) -> None:
    """Check that every method gives standard BP's loss and gradients.

    Exit 1 if one does not, printing where and how much it differs."""
    from ..config import exactness_specs
    from ..runner import ExactnessSpec, check_exactness

    console = Console()
    with user_errors():
        specs = exactness_specs(settings, methods, defaults=EXACTNESS_DEFAULTS)
        refuse_nothing_compared(specs, settings)
        if any(s.method == "streambp" for s in specs):  # the architecture's verdict first: seconds, not the check
            console.print(escape(architecture_line(specs[0])), highlight=False, soft_wrap=True)
        checked = check_exactness(ExactnessSpec(tuple(specs), out=out))
    results = checked.results
    print_table(console, exactness_table(specs, results))
    if specs[0].dtype == "fp32":  # every row against an fp64 step, bp's own row included
        for line in error_ratios(results):
            console.print(line, highlight=False)
    if checked.not_saved is not None:
        with user_errors():  # a failed write says where the rows are
            raise checked.not_saved
    if out is not None:
        # one line, never folded: a long path stays pasteable
        console.print(
            f"{checked.appended} comparison(s) appended to {escape(str(out))}", highlight=False, soft_wrap=True
        )
    failed = [d for r in results for d in r.failures()]
    for diff in failed:
        console.print(f"[red]{diff.describe()}[/]", highlight=False)
    fail_if(bool(failed))


def architecture_line(spec: RunSpec) -> str:
    """Whether StreamBP streams the spec's architecture (models.admission), for its model as built."""
    from ..models import admission, load_config

    overrides = {"num_hidden_layers": spec.num_layers} if spec.num_layers else {}
    return admission(load_config(spec.model, **overrides))


def refuse_nothing_compared(specs: list[RunSpec], settings: dict) -> None:
    """bp alone is compared with nothing in fp64 (it is the reference) nor on ranks (it runs in one
    process): one line before any model is built. In fp32 and bf16 bp alone is judged against fp64."""
    ranked = (settings.get("nproc") or 1) > 1 or (settings.get("sp") or 1) > 1
    if len(specs) == 1 and (ranked or specs[0].dtype == "fp64"):
        what = "runs in one process as the reference" if ranked else "is the fp64 reference"
        raise ValueError(f"--method bp {what}, compared with nothing: name another method too, or leave --method out")


def exactness_table(specs: list[RunSpec], results: list) -> Table:
    """A row per method: its loss and worst gradient error against the reference (bp, or an
    fp64 step when the check is fp32); results: check_exactness's, in spec order. Long tensor
    names fold, never cut."""
    run = specs[0]
    streamed = next((s for s in specs if s.settings.chunk_size is not None), None)
    layers = f"{run.num_layers} layers" if run.num_layers else "all layers"
    layers += f", LoRA r{run.lora_rank}" if run.lora_rank else ""
    chunks = f", chunk {streamed.settings.chunk_size}/{streamed.settings.logits_chunk_size}" if streamed else ""
    judged = run.dtype in ("fp32", "bf16")  # against an fp64 step, by bp's own error
    ranked = specs[-1] if specs[-1].nproc > 1 else None  # the compared methods on ranks, bp in one process
    where = f"on {ranked.nproc} ranks{f', {ranked.sp} per sequence' if ranked.sp > 1 else ''}, " if ranked else ""
    table = Table(
        title=f"{run.model} ({layers}), {run.objective}, {run.dtype}, B={run.batch_size}, T={run.seq_len}{chunks}: "
        f"{where}vs {results[0].reference}" + (" in one process" if ranked else "")
    )
    columns = ("method", "result", "loss err", "grad err", "tolerance", "worst gradient")
    columns += (f"worst vs bp {run.dtype}",) if judged else ()
    for column in columns:
        table.add_column(column, no_wrap=True)
    for result in results:
        worst = result.worst
        if result.loss is None:
            table.add_row(result.method, "[yellow]unsupported[/]", "", "", "", result.unsupported)
            continue
        cells = [
            result.method,
            ("[green]exact[/]" if result.ok else "[red]DIFFERS[/]")
            if result.method != "bp" or not judged
            else ("[green]reference ok[/]" if result.ok else "[red]REFERENCE?[/]"),
            f"{result.loss.rel_error:.2e}",
            f"{worst.rel_error:.2e}",
            f"{worst.tolerance:.2g}" if worst.tolerance is not None else "reported",
            fold_at_dots(worst.name),
        ]
        if judged:
            cells.append("" if result.versus_baseline is None else f"{result.versus_baseline:.2e}")
        table.add_row(*cells)
    from ..runner.exactness import float32_note

    table.caption = float32_note(run, results) or None
    return table


NAME_WIDTH = 24  # a tensor name's lines in the table: the widest table fits 80 columns without folding a word


def fold_at_dots(name: str, width: int = NAME_WIDTH) -> str:
    """A dotted tensor name on lines of at most `width` characters, broken after a dot (never inside
    a word, so a terminal of 80 columns shows it whole): model.layers.1.self_attn. / k_norm.weight."""
    lines = [""]
    for part in name.split("."):
        piece = part if not lines[-1] else "." + part
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines[-1] += "."
            lines.append(part)
        else:
            lines[-1] += piece
    return "\n".join(lines)


def error_ratios(results) -> list[str]:
    """fp32: per method, its error over bp's on each tensor (both against fp64): the spread that
    FP32_ERROR_FACTOR must cover, and the tensor where it is largest."""
    baseline = {d.name: d for d in results[0].grads}
    lines = []
    for result in results[1:]:
        if result.loss is None:  # unsupported here
            continue
        ratios = sorted(
            (d.rel_error / baseline[d.name].rel_error, d.name) for d in result.grads if baseline[d.name].rel_error > 0
        )
        if ratios:
            median = ratios[len(ratios) // 2][0]
            top, name = ratios[-1]
            lines.append(
                f"{result.method}: error / bp's error over {len(ratios)} tensors: median {median:.2f}, max {top:.2f} "
                f"({name}: {baseline[name].rel_error:.2e} for bp)"
            )
    return lines
