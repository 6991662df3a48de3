"""The tables commands print: measured points, predictions, max-length answers. Shared by the
commands that print the same kind of row (`sbp run`/`sweep`, `sbp maxlen`/`sweep`).

A table of result rows keeps only the columns some row has a value for (a CPU run has no
reserved or NVML memory), and its caption explains exactly those columns and the terms of its
title. `print_table` makes any table fit the console, 80 columns included."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..measure.units import gib
from ..records import ResultRow
from ..records.select import LOADED_MARK, MAXLEN_TABLE, is_loaded, load_note, paper_rows
from ..runner.outcome import seq_bound


def print_table(console: Console, table: Table) -> None:
    """Print a table that fits the console: as built; else without its outer border; else
    transposed (a row per column, a column per row: three methods fit 80 columns); else one block
    of "header  value" lines per row. Nothing is cut. The title and caption go above and below,
    wrapped at the console's width (inside a narrow table they would wrap at its width)."""
    chosen = next(
        (t for t in (table, _compact(table), _transposed(table)) if _width(console, t) <= console.width),
        _records(table),
    )
    title, caption = chosen.title, chosen.caption
    chosen.title = chosen.caption = None
    if title:
        console.print(title, style="table.title", highlight=False)
    console.print(chosen)
    if caption:
        console.print(caption, style="table.caption", highlight=False)


def _width(console: Console, table: Table) -> int:
    """The width a table takes unsqueezed (a measure is otherwise capped at the console's width)."""
    return console.measure(table, options=console.options.update_width(10_000)).maximum


def _cells(table: Table) -> list[list]:
    return [list(column.cells) for column in table.columns]


def _like(table: Table, **options) -> Table:
    return Table(title=table.title, caption=table.caption, **options)


# a line under the header only, no outer border: 4 columns narrower than rich's default box
_COMPACT = {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False}


def _compact(table: Table) -> Table:
    compact = _like(table, **_COMPACT)
    for column in table.columns:
        compact.add_column(column.header, justify=column.justify, no_wrap=column.no_wrap)
    for values in zip(*_cells(table), strict=True):
        compact.add_row(*values)
    return compact


def _transposed(table: Table) -> Table:
    """Columns become rows: the first column's values (a method, a model) head the new columns;
    compact, so three methods' longest values (a peak phase) fit 80 columns."""
    columns = _cells(table)
    flipped = _like(table, **_COMPACT)
    flipped.add_column(table.columns[0].header, justify="left", no_wrap=True)
    for name in columns[0]:
        flipped.add_column(name, justify="right", no_wrap=True)
    for column, cells in zip(table.columns[1:], columns[1:], strict=True):
        flipped.add_row(column.header, *cells)
    return flipped


def _records(table: Table) -> Table:
    """One block per row, "header  value" per line: fits any width (a long value folds)."""
    records = _like(table, show_header=False, show_lines=True)
    records.add_column("column", justify="left", no_wrap=True)
    records.add_column("value", justify="left", overflow="fold")
    headers = [str(column.header) for column in table.columns]
    for values in zip(*_cells(table), strict=True):
        lines = [str(v) for v in values]  # a value of several lines keeps the next header beside its own line
        records.add_row(
            "\n".join(h + "\n" * v.count("\n") for h, v in zip(headers, lines, strict=True)), "\n".join(lines)
        )
    return records


@dataclass(frozen=True)
class Column:
    """A column of result rows: its header, its cell, what it means (for the caption; "" for a
    self-explanatory one such as the method)."""

    header: str
    cell: Callable[[ResultRow], str]
    meaning: str = ""
    left: bool = False


def rows_table(title: str, columns: Sequence[Column], rows: list[ResultRow], notes: Sequence[str] = ()) -> Table:
    """The columns some row has a value for ("-" is none); the caption explains each of those,
    then the notes (the title's terms)."""
    cells = {column.header: [column.cell(row) for row in rows] for column in columns}
    kept = [column for column in columns if any(value != "-" for value in cells[column.header])]
    legend = [f"{column.header}: {column.meaning}" for column in kept if column.meaning]
    units = ["GiB = 2^30 B"] if any("GiB" in column.header for column in kept) else []
    table = Table(title=title, caption=escape("; ".join([*units, *legend, *notes]) + "."))
    for column in kept:
        table.add_column(column.header, justify="left" if column.left else "right", no_wrap=True)
    for i in range(len(rows)):
        table.add_row(*(cells[column.header][i] for column in kept))
    return table


def point_title(rows: list[ResultRow], *, seq_len: bool = True) -> tuple[str, list[str]]:
    """The settings the rows of one table share (one point, several methods), for its title, and
    what its terms mean, for the caption."""
    row = rows[0]
    lora = f", LoRA r{row.lora_rank}" if row.lora_rank else ""
    title = f"{row.model} ({row.num_layers or '?'} layers{lora}), {row.objective}, step {row.step}, {row.dtype}"
    title += f", B={row.batch_size}" + (f", T={row.seq_len}" if seq_len else "")
    notes = [
        "B: rows per batch" + ("; T: tokens per row" if seq_len else ""),
        f"step {row.step}: " + ("forward + backward" if row.step == "bp" else "forward + backward + AdamW"),
    ]
    if (row.nproc or 1) > 1:  # several ranks: a memory or time column the largest rank's
        ranks, note = ranks_terms(row)
        title += f", {ranks}"
        notes.append(note)
    chunked = next((r for r in rows if r.chunk_size is not None), None)  # methods that read chunk sizes
    if chunked is not None:
        title += f", chunks {chunked.chunk_size}/{chunked.logits_chunk_size}"
        notes.append(f"chunks {chunked.chunk_size}/{chunked.logits_chunk_size}: positions per layer / logits chunk")
    placed = next((r for r in rows if r.checkpoints), None)  # streambp's checkpoint placement
    if placed is not None:
        title += f", {placement_words(placed)}"
    title += f", {row.protocol} protocol"
    notes.append(f"{row.protocol} protocol: " + PROTOCOL_MEANING.get(row.protocol, row.protocol))
    return title, notes


def placement_words(row: ResultRow) -> str:
    """A row's checkpoint placement as a title says it: `gpu` (on the device) reads as what it is on a CPU."""
    if row.checkpoints == "gpu" and (row.device or "").startswith("cpu"):
        return "checkpoints in the CPU's memory (gpu: on the device)"
    return f"checkpoints {row.checkpoints}"


def ranks_terms(row: ResultRow) -> tuple[str, str]:
    """A several-rank row's ranks, as its title says them, and what that means for the caption:
    data-parallel ranks B rows each, or groups of --sp ranks sharing each sequence; on a CPU with
    more threads than cores, that the times are of shared cores."""
    sp = row.sp or 1
    if sp == 1:
        ranks = f"{row.nproc} ranks"
        note = f"{ranks}: data-parallel processes (FSDP2), B rows each"
    else:
        ranks = f"{row.nproc} ranks, {sp} per sequence"
        note = (
            f"{ranks}: {row.nproc // sp} data-parallel group(s) (FSDP2) of {sp} ranks sharing each sequence "
            "(Ulysses), B rows per group"
        )
    note += "; memory and time: the largest rank's"
    if row.num_cpus and row.nproc * (row.num_threads or 1) > row.num_cpus:
        note += f"; times of {row.num_cpus} oversubscribed CPU(s)"
    return ranks, note


def shared_by(spec) -> str:
    """How a point's GPUs share its sequences, as `sbp estimate` and `sbp plan` say what a number is
    per: "of 8 sharing each sequence (...)" or "of 8, in 2 groups of 4 sharing each sequence (...)"."""
    positions = f"each holds {-(-spec.seq_len // spec.sp):,} positions"
    if spec.nproc == spec.sp:
        return f"of {spec.nproc} sharing each sequence (Ulysses, FSDP2 FULL_SHARD over all {spec.nproc}; {positions})"
    return (
        f"of {spec.nproc}, in {spec.nproc // spec.sp} groups of {spec.sp} sharing each sequence (Ulysses in a group, "
        f"B rows per group; FSDP2 FULL_SHARD over all {spec.nproc}; {positions})"
    )


PROTOCOL_MEANING = {
    "steady": "gradients resident before the step, as in every step after a run's first",
    "first": "gradients allocated in the step, as in a run's first",
}


def _status(row: ResultRow) -> str:
    colour = {"ok": "green", "oom": "yellow"}.get(row.status, "red")
    return f"[{colour}]{row.status}[/]"


def _spread(row: ResultRow) -> str:
    if row.time_median_s is None:
        return "-"
    return f"{100 * (row.time_max_s - row.time_min_s) / row.time_median_s:.0f}%"


def _nvml(row: ResultRow) -> str:
    if row.nvml_peak_used_bytes is None or row.nvml_idle_used_bytes is None:
        return "-"
    return gib(row.nvml_peak_used_bytes - row.nvml_idle_used_bytes)


def _peak_meaning(rows: list[ResultRow]) -> str:
    if all(row.memory_source == "torch.cuda" for row in rows):
        return "max allocated (torch.cuda)"
    if all(row.memory_source == "tensor-tracker" for row in rows):
        return "resident tensors + the peak of tracked live tensors (CPU)"
    return "max allocated (CUDA), resident + tracked live tensors (CPU)"


def _time(row: ResultRow) -> str:
    """The median step time; LOADED_MARK beside one taken at load above the cores (records.select.is_loaded)."""
    if row.time_median_s is None:
        return "-"
    return f"{row.time_median_s:.3f}" + (LOADED_MARK if is_loaded(row) else "")


def _loaded_meaning(rows: list[ResultRow]) -> str:
    return f" ({LOADED_MARK}: at load above the cores)" if any(is_loaded(r) for r in rows) else ""


def load_warning(rows: list[ResultRow]) -> str | None:
    """The line a command prints under its table when some of its times were taken at load above the
    cores (their cells carry LOADED_MARK), else None."""
    note = load_note([row for row in rows if row.time_median_s is not None])
    if not note:
        return None
    return (
        f"warning: {note}, marked {LOADED_MARK}: other work competed for the cores, so those times are slower "
        "and noisier than on an idle machine; rerun on an idle one before comparing them"
    )


def _timed(row: ResultRow) -> str:
    steps = f"{row.repeats} timed step(s)" if row.repeats else "the timed steps"
    return f"median of {steps}" + (f" after {row.warmup_steps} warm-up" if row.warmup_steps else "")


def results_table(rows: list[ResultRow], title: str, notes: Sequence[str] = ()) -> Table:
    """Measured points, a row per method (`sbp run`)."""
    columns = (
        Column("method", lambda r: r.method, left=True),
        Column("status", _status, left=True),
        Column("peak GiB", lambda r: gib(r.peak_allocated_bytes), _peak_meaning(rows)),
        Column("resv GiB", lambda r: gib(r.peak_reserved_bytes), "max reserved by the allocator"),
        Column("nvml GiB", _nvml, "device memory used minus idle (NVML)"),
        Column("act GiB", lambda r: gib(r.activation_peak_bytes), "the peak above what was resident before the step"),
        Column("time s", _time, _timed(rows[0]) + _loaded_meaning(rows)),
        Column("spread", _spread, "(max - min) / median time"),
        Column("tok/s", lambda r: "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}", "B x T / time"),
        Column(
            "TFLOP/s",
            lambda r: "-" if r.tflops_per_s is None else f"{r.tflops_per_s:.3g}",
            "model FLOPs of the step (recomputation not counted) / time",
        ),
    )
    return rows_table(title, columns, rows, notes)


def _fits(row: ResultRow) -> str:
    if row.status in ("error", "unsupported"):
        return f"[red]{row.status}[/]"
    return "[green]yes[/]" if row.status == "ok" else "[yellow]no[/]"


def estimate_table(rows: list[ResultRow], gpu_memory_bytes: int, margin_note: str) -> Table:
    """Predicted peaks, a row per method (`sbp estimate`); margin_note: how the margin is made
    (simulate MARGIN_NOTE)."""
    first = rows[0]
    title, notes = point_title(rows)
    title = f"predicted peak memory: {title}\n{first.device_name} ({first.device}), fake tensors"
    columns = (
        Column("method", lambda r: r.method, left=True),
        Column(
            "peak GiB",
            lambda r: gib(r.peak_allocated_bytes),
            "predicted max allocated = weights + grads + optimizer state + batch + act",
        ),
        Column("weights", lambda r: gib(r.weights_bytes), "GiB of parameters"),
        Column("grads", lambda r: gib(r.grads_bytes), "GiB of gradients"),
        Column("optim", lambda r: gib(r.optimizer_state_bytes), "GiB of AdamW moments"),
        Column("act GiB", lambda r: gib(r.activation_peak_bytes), "the step's peak above them"),
        Column("peak phase", lambda r: escape(r.peak_phase or "-"), "where in the step the peak falls", left=True),
        Column("attention", lambda r: r.attention_kernel or "-", "the CUDA attention kernel modelled", left=True),
        Column("margin", lambda r: gib(r.margin_bytes), f"GiB not in peak: {margin_note}"),
        Column(f"fits {gib(gpu_memory_bytes)} GiB", _fits, "peak + margin <= the GPU's memory"),
    )
    return rows_table(title, columns, rows, notes)


def _maxlen_title(rows: list[ResultRow]) -> tuple[str, list[str]]:
    """A max-length table's title (the point, its budget, the device) and notes."""
    first = rows[0]
    budget = first.device_total_memory_bytes if first.source == "simulated" else first.memory_limit_bytes
    title, notes = point_title(rows, seq_len=False)
    title = (
        f"max sequence length: {title}, budget {gib(budget)} GiB\n"
        f"{first.device_name} ({first.source}, {first.memory_source})"
    )
    if first.source == "simulated":
        notes.append(
            "simulated: a prediction, not a measurement; our bp/ckpt free the logits after the loss, the paper's"
            " script keeps them through the backward (sbpbench/simulate/paper_baseline.py), so ours reach longer"
        )
    return title, notes


def maxlen_table(rows: list[ResultRow]) -> Table:
    """Max T per method, the ratio to ckpt, and the paper's number where it has one."""
    title, notes = _maxlen_title(rows)
    prompted = rows[0].objective != "sft"
    ckpt = next((r.max_seq_len for r in rows if r.method == "ckpt" and r.max_seq_len), None)

    def shown(row: ResultRow) -> str:
        answer = seq_bound(row)
        if prompted and row.max_seq_len is not None and row.prompt_len:
            answer += f" [{row.max_seq_len - row.prompt_len:,}]"
        return answer

    def ratio(row: ResultRow) -> str:
        if not (ckpt and row.max_seq_len):
            return "-"
        return f"{row.max_seq_len / ckpt:.2f}" if row.oom_seq_len is not None else f">= {row.max_seq_len / ckpt:.2f}"

    columns = (
        Column("method", lambda r: r.method, left=True),
        Column(
            "max T",
            shown,
            "the longest length that fit" + (" (in brackets: minus prompt_len, the completion)" if prompted else ""),
        ),
        Column("first OOM", lambda r: "-" if r.oom_seq_len is None else f"{r.oom_seq_len:,}", "shortest that failed"),
        Column("x ckpt", ratio, "max T / ckpt's"),
        Column(
            "paper",
            lambda r: paper_max_len(r) or "-",
            "the paper's max T" + (" (its completion length)" if prompted else ""),
        ),
        Column("probes", lambda r: f"{r.num_probes}", "lengths the search used, cached ones included"),
        Column("peak GiB", lambda r: gib(r.peak_allocated_bytes), "max allocated at max T"),
    )
    if any(row.seed_seq_len is not None for row in rows):  # a blind or simulated search has none
        seed = Column(
            "seed",
            lambda r: "-" if r.seed_seq_len is None else f"{r.seed_seq_len:,}",
            "the predicted max T the search started from",
        )
        columns = (*columns[:-2], seed, *columns[-2:])
    return rows_table(title, columns, rows, notes)


def points_table(title: str, rows: list[ResultRow]) -> Table:
    """Every point of a sweep, a row each (the model too when they differ)."""
    one_model = len({row.model for row in rows}) == 1  # then the caller names it in the title
    columns = (
        *(() if one_model else (Column("model", lambda r: r.model, left=True),)),
        Column("method", lambda r: r.method, left=True),
        Column("T", lambda r: f"{r.seq_len:,}", "tokens per row"),
        Column("B", lambda r: str(r.batch_size), "rows per batch"),
        Column("status", lambda r: r.status, left=True),
        Column("peak GiB", lambda r: gib(r.peak_allocated_bytes), _peak_meaning(rows)),
        Column("act GiB", lambda r: gib(r.activation_peak_bytes), "the peak above what was resident before the step"),
        Column("time s", _time, "median step time" + _loaded_meaning(rows)),
    )
    return rows_table(title, columns, rows)


@cache
def _reference():
    from ..records.reference import load_reference

    try:
        return load_reference()
    except (FileNotFoundError, ValueError):  # an installed wheel has no experiments/ folder
        return None


def paper_max_len(row: ResultRow) -> str | None:
    """The paper's max sequence length for this row's setting on one 80 GB GPU (Figure 3 for a
    backpropagation step, Table 3 for a training step), by the rule `sbp report` uses; None where
    the paper has none."""
    reference = _reference()
    if reference is None or row.step not in MAXLEN_TABLE or (row.nproc or 1) > 1:
        return None
    match = paper_rows(reference, table=MAXLEN_TABLE[row.step], metric="max_seq_len", like=row.as_dict())
    if match.empty:
        return None
    paper = match.iloc[0]
    return "OOM" if paper["status"] != "ok" else f"{int(paper['value']):,}"
