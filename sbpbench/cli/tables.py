"""The tables commands print: measured points, predictions, max-length answers. Shared by the
commands that print the same kind of row (`sbp run`/`sweep`, `sbp maxlen`/`sweep`)."""

from __future__ import annotations

from functools import cache

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..measure.units import gib
from ..records import ResultRow
from ..records.select import MAXLEN_TABLE, paper_rows
from ..simulate import MARGIN_NOTE


def print_table(console: Console, table: Table) -> None:
    """Print a table that fits the console: as built; else without its all-empty ("-") columns;
    else transposed (a row per column, a column per row: three methods fit 80 columns); else one
    block of "header  value" lines per row."""
    for candidate in (table, _without_empty_columns(table)):
        if _width(console, candidate) <= console.width:
            console.print(candidate)
            return
    narrow = _without_empty_columns(table)
    flipped = _transposed(narrow)
    if _width(console, flipped) <= console.width:
        console.print(flipped)
        return
    console.print(_records(narrow))


def _width(console: Console, table: Table) -> int:
    """The width a table takes unsqueezed (a measure is otherwise capped at the console's width)."""
    return console.measure(table, options=console.options.update_width(10_000)).maximum


def _cells(table: Table) -> list[list]:
    return [list(column.cells) for column in table.columns]


def _like(table: Table, **options) -> Table:
    return Table(title=table.title, caption=table.caption, **options)


def _without_empty_columns(table: Table) -> Table:
    narrow = _like(table)
    kept = [(c, cells) for c, cells in zip(table.columns, _cells(table), strict=True) if any(v != "-" for v in cells)]
    for column, _ in kept:
        narrow.add_column(column.header, justify=column.justify, no_wrap=column.no_wrap)
    for values in zip(*(cells for _, cells in kept), strict=True):
        narrow.add_row(*values)
    return narrow


def _transposed(table: Table) -> Table:
    """Columns become rows: the first column's values (a method, a model) head the new columns."""
    columns = _cells(table)
    flipped = _like(table)
    flipped.add_column(table.columns[0].header, justify="left", no_wrap=True)
    for name in columns[0]:
        flipped.add_column(name, justify="right", no_wrap=True)
    for column, cells in zip(table.columns[1:], columns[1:], strict=True):
        flipped.add_row(column.header, *cells)
    return flipped


def _records(table: Table) -> Table:
    """One block per row, "header  value" per line: fits any width."""
    records = _like(table, show_header=False, show_lines=True)
    records.add_column("column", justify="left", no_wrap=True)
    records.add_column("value", justify="left")
    headers = [str(column.header) for column in table.columns]
    for values in zip(*_cells(table), strict=True):
        records.add_row("\n".join(headers), "\n".join(str(v) for v in values))
    return records


def point_title(rows: list[ResultRow], *, seq_len: bool = True) -> str:
    """The settings the rows of one table share (one point, several methods), for its title."""
    row = rows[0]
    lora = f", LoRA r{row.lora_rank}" if row.lora_rank else ""
    title = f"{row.model} ({row.num_layers or '?'} layers{lora}), {row.objective}, step {row.step}, {row.dtype}"
    title += f", B={row.batch_size}" + (f", T={row.seq_len}" if seq_len else "")
    chunked = next((r for r in rows if r.chunk_size is not None), None)  # methods that read chunk sizes
    if chunked is not None:
        title += f", chunks {chunked.chunk_size}/{chunked.logits_chunk_size}"
    return title + f", {row.protocol} protocol"


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


CAPTION = (
    "GiB = 2^30 B. peak: max allocated (CPU: resident tensors + tracked peak); resv: max reserved; "
    "nvml: device used minus idle; act: peak minus the resident baseline; time: median of the timed "
    "steps, spread (max-min)/median"
)


def results_table(rows: list[ResultRow], title: str) -> Table:
    table = Table(title=title, caption=CAPTION)
    headers = (
        "method",
        "status",
        "peak GiB",
        "resv GiB",
        "nvml GiB",
        "act GiB",
        "time s",
        "spread",
        "tok/s",
        "TFLOP/s",
    )
    for header in headers:
        table.add_column(header, justify="left" if header in ("method", "status") else "right", no_wrap=True)
    for row in rows:
        table.add_row(
            row.method,
            _status(row),
            gib(row.peak_allocated_bytes),
            gib(row.peak_reserved_bytes),
            _nvml(row),
            gib(row.activation_peak_bytes),
            "-" if row.time_median_s is None else f"{row.time_median_s:.3f}",
            _spread(row),
            "-" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}",
            "-" if row.tflops_per_s is None else f"{row.tflops_per_s:.3g}",
        )
    return table


def _fits(row: ResultRow) -> str:
    if row.status == "error":
        return "[red]error[/]"
    return "[green]yes[/]" if row.status == "ok" else "[yellow]no[/]"


def estimate_table(rows: list[ResultRow], gpu_memory_bytes: int) -> Table:
    first = rows[0]
    title = f"predicted peak memory: {point_title(rows)}\n{first.device_name} ({first.device}), fake tensors"
    caption = (
        "GiB = 2^30 B. peak: predicted max_memory_allocated = weights + grads + optimizer + batch + activations "
        "(act: the step's peak above them, in the phase shown). "
        f"margin, not in peak: {MARGIN_NOTE}. fits: peak + margin <= the GPU memory."
    )
    table = Table(title=title, caption=caption)
    fits = f"fits {gib(gpu_memory_bytes)} GiB"
    headers = ("method", "peak GiB", "weights", "grads", "optim", "act GiB", "peak phase", "attention", "margin", fits)
    for header in headers:
        table.add_column(
            header, justify="left" if header in ("method", "peak phase", "attention") else "right", no_wrap=True
        )
    for row in rows:
        table.add_row(
            row.method,
            gib(row.peak_allocated_bytes),
            gib(row.weights_bytes),
            gib(row.grads_bytes),
            gib(row.optimizer_state_bytes),
            gib(row.activation_peak_bytes),
            escape(row.peak_phase or "-"),
            row.attention_kernel or "-",
            gib(row.margin_bytes),
            _fits(row),
        )
    return table


def seq_bound(row: ResultRow) -> str:
    """A search's answer in words: its status where it has no length (unsupported, error)."""
    if row.status != "ok" or (row.max_seq_len is None and row.oom_seq_len is None):
        return row.status
    if row.max_seq_len is None:
        return f"< {row.oom_seq_len:,}"
    return f"{row.max_seq_len:,}" if row.oom_seq_len is not None else f">= {row.max_seq_len:,} (ceiling)"


def maxlen_table(rows: list[ResultRow]) -> Table:
    """Max T per method, the ratio to ckpt, and the paper's number where it has one."""
    first = rows[0]
    budget = first.device_total_memory_bytes if first.source == "simulated" else first.memory_limit_bytes
    title = (
        f"max sequence length: {point_title(rows, seq_len=False)}, budget {gib(budget)} GiB\n"
        f"{first.device_name} ({first.source}, {first.memory_source})"
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
        shown = seq_bound(row)
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
    if reference is None or row.step not in MAXLEN_TABLE:
        return None
    match = paper_rows(reference, table=MAXLEN_TABLE[row.step], metric="max_seq_len", like=row.as_dict())
    if match.empty:
        return None
    paper = match.iloc[0]
    return "OOM" if paper["status"] != "ok" else f"{int(paper['value']):,}"
