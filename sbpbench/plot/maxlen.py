"""Figure (c): maximum sequence length, grouped bars: models on x, one bar per method (paper Figure 3
for step bp, Table 3 for step train, as faint markers beside the bars).

One figure per setting and device (MAXLEN_GROUP) from kind=maxlen rows. A bar is the longest T
that ran. Where the search reached its ceiling without an OOM the answer is a lower bound: an open
bar (its outline only) with "≥" above it, and a legend entry saying so. "OOM" under a method that
did not fit even its shortest probe. For grpo/dpo the paper's number is read as the completion
length (experiments/paper_table3.toml), so the bars are max_seq_len - prompt_len.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ..records.select import (
    MAXLEN_TABLE,
    PROMPTED_OBJECTIVES,
    is_oom,
    is_paper_capacity,
    is_truncated,
    natural_key,
    number,
    paper_rows,
    present,
    prompt_offset,
    short_model,
)
from . import style
from .common import (
    FORMATS,
    device_part,
    finish,
    group_rows,
    new_figure,
    save,
    series,
    setting_parts,
    setting_title,
    stem,
    where_title,
)

MAXLEN_GROUP = (
    "objective",
    "lora_rank",
    "step",
    "device_name",
    "memory_limit_bytes",
    "protocol",
    "dtype",
    "batch_size",
)
PAPER_MARK = {"marker": "_", "linestyle": "none", "color": "black", "alpha": 0.55, "markeredgewidth": 3}
BAR_SPAN, MAX_BAR_WIDTH = 0.8, 0.3  # of one model's slot on the x axis
LOWER_BOUND_LABEL = "open bar, ≥: a lower bound (no OOM up to the search's ceiling)"


def max_seq_len_bars(table, out_dir: Path, reference=None, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Max T bars per model and method, one figure per setting and device; the written paths."""
    searches = table[table["kind"] == "maxlen"]
    return [
        path
        for _, rows in group_rows(searches, MAXLEN_GROUP)
        for path in _figure(rows, reference, Path(out_dir), formats)
    ]


def _figure(rows, reference, out_dir: Path, formats) -> list[Path]:
    like = rows.iloc[0]
    fig, ax = new_figure()
    slot_rows = {}  # a model on the x axis -> one of its rows (for its label)
    for _, r in rows.iterrows():
        slot_rows.setdefault(_slot(r), r)
    slots = {key: i for i, key in enumerate(sorted(slot_rows, key=_slot_order))}
    bars = list(series(rows))
    width = min(BAR_SPAN / len(bars), MAX_BAR_WIDTH)
    values, paper_values, handles = [], [], []
    per_method = [method for method, *_ in bars]
    for b, (method, simulated, extra, part) in enumerate(bars):
        offset = (b - (len(bars) - 1) / 2) * width
        same = [i for i, m in enumerate(per_method) if m == method]  # the method's bar sets, in order
        colour = style.shade(style.colour(method), same.index(b), len(same))
        for _, row in part.iterrows():
            x = slots[_slot(row)] + offset
            values += _draw_bar(ax, row, x, width, colour, simulated)
            if is_paper_capacity(row) and not is_truncated(row):
                paper_values += _draw_paper(ax, reference, row, x, width)
        handles.append(_bar_handle(colour, simulated, style.label(method, simulated=simulated, extra=extra)))
    if any(number(row["max_seq_len"]) is not None and not present(row["oom_seq_len"]) for _, row in rows.iterrows()):
        handles.append(Patch(facecolor="none", edgecolor="black", linewidth=1.5, label=LOWER_BOUND_LABEL))
    if paper_values:
        table = MAXLEN_TABLE[like["step"]]
        handles.append(Line2D([], [], label=f"paper {table} (A800-80GB)", **PAPER_MARK, markersize=14))
    values = [v for v in values + paper_values if v > 0]
    if values and max(values) / min(values) > 30:  # e.g. 0.4k to 247k: bars on a log axis
        ax.set_yscale("log")
        ax.set_ylim(min(values) / 2, max(values) * 3)
    else:
        ax.set_ylim(0, max(values, default=1) * 1.15)
    ax.set_xlim(-0.6, len(slots) - 0.4)
    ax.set_xticks(range(len(slots)), [_slot_label(slot_rows[key]) for key in slots], fontsize=style.FONT_SIZE)
    ax.set_ylabel(
        "max completion length (tokens) = max_seq_len − prompt_len\n(the paper's number read as completion length)"
        if like["objective"] in PROMPTED_OBJECTIVES
        else "max sequence length T (tokens)",
        fontsize=style.FONT_SIZE,
    )
    finish(fig, ax, f"Max sequence length (tokens): {setting_title(like)}\n{where_title(like)}", handles)
    name = stem("max_seq_len", *setting_parts(like, always=True), device_part(like), like["protocol"])
    return save(fig, out_dir, name, formats)


def _bar_handle(colour: str, simulated: bool, label: str) -> Patch:
    hatch = style.ESTIMATE_HATCH if simulated else None
    return Patch(
        facecolor=colour,
        edgecolor="white" if simulated else colour,
        hatch=hatch,
        label=label,
    )


def _slot(row) -> tuple[str, float]:
    """A model on the x axis: its name and depth (-1: not recorded)."""
    return row["model"], number(row["num_layers"]) or -1.0


def _slot_order(slot: tuple[str, float]) -> tuple:
    return natural_key(slot[0]), slot[1]


def _slot_label(row) -> str:
    """A model's tick label: its short name, and its depth where it was built truncated."""
    depth = f"\n({number(row['num_layers']):.0f} layers)" if is_truncated(row) else ""
    return short_model(row["model"]) + depth


def _draw_bar(ax, row, x: float, width: float, colour: str, simulated: bool) -> list[float]:
    """One bar, its value above it; "OOM" (or the failure) where the search found no length that fits."""
    max_t = number(row["max_seq_len"])
    if max_t is None:
        text = "OOM" if is_oom(row) or row["status"] == "ok" else row["status"]
        ax.text(
            x,
            0.02,
            text,
            rotation=90,
            fontsize=7,
            color=colour,
            ha="center",
            va="bottom",
            transform=ax.get_xaxis_transform(),
        )
        return []
    value = max_t - prompt_offset(row)
    lower_bound = number(row["oom_seq_len"]) is None  # the search reached its ceiling: at least this
    ax.bar(
        x,
        value,
        width * 0.95,
        color="none" if lower_bound else colour,  # open: the true max T lies above it
        edgecolor=colour if lower_bound or not simulated else "white",
        linewidth=1.5 if lower_bound else None,
        hatch=style.ESTIMATE_HATCH if simulated else None,
    )
    ceiling = "≥" if lower_bound else ""
    ax.text(x, value, f"{ceiling}{style.thousands(value)}", fontsize=7, ha="center", va="bottom", color=colour)
    return [value]


def _draw_paper(ax, reference, row, x: float, width: float) -> list[float]:
    """The paper's max T for this bar's model and method: a dark dash across the bar (its colour would hide it)."""
    table = MAXLEN_TABLE.get(row["step"])
    if table is None:
        return []
    paper = paper_rows(reference, table=table, metric="max_seq_len", like=row)
    paper = paper[paper["status"] == "ok"]
    ax.plot([x] * len(paper), paper["value"], **PAPER_MARK, markersize=width * 60)  # a dash across the bar
    return list(paper["value"])
