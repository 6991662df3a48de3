"""Figures (b) and (d): step time vs sequence length (paper Table 1) and time per sample vs batch
size at one T (paper Table 2), per method, median with min-max error bars.

The paper's times are drawn faint on figures of a CUDA device only (it timed an A800-80GB; a CPU
time beside it says nothing). Times without a warm-up step or from a single timed step say so in
the title (records.select.timing_caveat): a smoke run's cold single steps rank methods wrongly.
"x" on the x axis (drawn over it, outside the data area): an OOM at that x, which has no time; the
legend says so. The y label mentions min-max bars only when a point has a spread to draw. A CPU
time measured at load above the cores (records.select.is_loaded) is drawn hollow, and the title
counts them. A method with neither a time nor an OOM (unsupported here) gets no line and no legend entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..records.select import is_cuda, is_loaded, is_oom, is_truncated, paper_rows
from . import style
from .common import (
    FORMATS,
    POINT_GROUP,
    device_part,
    finish,
    group_rows,
    load_title,
    log2_x,
    model_title,
    new_figure,
    oom_legend,
    oom_marks,
    save,
    series,
    series_marker,
    setting_parts,
    setting_title,
    short,
    stem,
    timing_title,
    where_title,
)

LOADED_LABEL = "hollow: timed at load above the cores"
BATCH_GROUP = tuple(c for c in POINT_GROUP if c != "batch_size") + ("seq_len",)


def time_vs_seq(table, out_dir: Path, reference=None, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Step time (s) vs T, one figure per model and setting with times at two or more T; the written paths."""
    points = table[table["kind"] == "point"]
    paths = []
    for _, rows in group_rows(points, POINT_GROUP):
        if rows.loc[rows["time_median_s"].notna(), "seq_len"].nunique() < 2:
            continue
        paths += _figure(rows, "seq_len", reference, Path(out_dir), formats)
    return paths


def time_per_sample_vs_batch(table, out_dir: Path, reference=None, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Time per sample (s) vs batch size at one T, where a method was timed at several batch sizes."""
    points = table[table["kind"] == "point"]
    paths = []
    for _, rows in group_rows(points, BATCH_GROUP):
        timed = rows[rows["time_median_s"].notna()]
        if not (timed.groupby(["method", "source"])["batch_size"].nunique() >= 2).any():
            continue
        paths += _figure(rows, "batch_size", reference, Path(out_dir), formats)
    return paths


def _figure(rows, x: str, reference, out_dir: Path, formats) -> list[Path]:
    per_sample = x == "batch_size"
    like = rows.iloc[0]
    fig, ax = new_figure()
    xs = list(rows[x].dropna())
    bars = False
    for method, simulated, extra, part in series(rows):
        ok = part[(part["status"] == "ok") & part["time_median_s"].notna()].sort_values(x)
        ooms = part.loc[part.apply(is_oom, axis=1), x].dropna()
        if ok.empty and ooms.empty:  # unsupported or failed here: nothing to draw, no legend entry
            continue
        scale = ok["batch_size"] if per_sample else 1
        median, low, high = ok["time_median_s"] / scale, ok["time_min_s"] / scale, ok["time_max_s"] / scale
        bars = bars or bool(((high - low).fillna(0) > 0).any())
        ax.errorbar(
            ok[x],
            median,
            yerr=[(median - low).fillna(0), (high - median).fillna(0)],
            linestyle=style.ESTIMATE_LINESTYLE if simulated else "-",
            marker=series_marker(method, part),
            color=style.colour(method),
            capsize=3,
            label=style.label(method, simulated=simulated, extra=extra),
        )
        _hollow_if_loaded(ax, ok[x].to_numpy(), median.to_numpy(), ok, method, part)
        oom_marks(ax, ooms, "x axis", color=style.colour(method))
    if is_cuda(like) and not is_truncated(like):
        xs += _draw_paper(ax, reference, like, x)
    if rows.apply(is_oom, axis=1).any():
        oom_legend(ax, "x axis")
    if load_title(rows):
        ax.plot([], [], "o", linestyle="none", markerfacecolor="white", markeredgecolor="black", label=LOADED_LABEL)
    ax.set_ylim(bottom=0)
    log2_x(ax, xs)
    if per_sample:
        ax.set_xticks(sorted(set(xs)))
    what = "time per sample (s)" if per_sample else "step time (s)"
    ax.set_xlabel("batch size (rows)" if per_sample else "sequence length T (tokens per row)", fontsize=style.FONT_SIZE)
    ax.set_ylabel(f"{what}: median" + (", bars min-max" if bars else ""), fontsize=style.FONT_SIZE)
    fixed = f"T={like['seq_len']:.0f}, " if per_sample else ""
    setting = setting_title(like, batch=not per_sample)
    versus = "batch size" if per_sample else "T"
    title = f"{model_title(like)}: {what} vs {versus}, {fixed}{setting}\n{where_title(like)}{timing_title(rows)}{load_title(rows)}"
    finish(fig, ax, title)
    parts = setting_parts(like)
    if per_sample:
        parts = [p for p in parts if not p.startswith("B")] + [f"T{like['seq_len']:.0f}"]
    metric = "time_per_sample_vs_batch" if per_sample else "time_vs_seq"
    return save(fig, out_dir, stem(metric, short(like), device_part(like), like["protocol"], *parts), formats)


def _draw_paper(ax, reference, like, x: str) -> list[float]:
    """Table 1 (time vs T) or Table 2 (time per sample vs batch at its T) faint; the x values drawn."""
    if x == "batch_size":
        paper = paper_rows(reference, table="Table 2", metric="time_per_sample_s", like=like, method=False, batch=False)
        paper, name = paper[paper["seq_len"] == like["seq_len"]], "Table 2"
    else:
        paper, name = paper_rows(reference, table="Table 1", metric="time_s", like=like, method=False), "Table 1"
    for method, rows in paper.groupby("method", sort=False):
        colour, rows = style.colour(method), rows.sort_values(x)
        ok = rows[rows["status"] == "ok"]
        ax.plot(
            ok[x],
            ok["value"],
            color=colour,
            alpha=style.PAPER_ALPHA,
            marker=style.marker(method),
            markerfacecolor="none",
            linewidth=2.5,
            label=f"{style.label(method)}, paper {name} (A800-80GB)",
        )
        _oom_marks(ax, rows.loc[rows["status"] == "oom", x], color=colour, alpha=style.PAPER_ALPHA)
    return list(paper[x])


def _hollow_if_loaded(ax, xs, times, ok, method: str, part) -> None:
    """Hollow markers over a series' own at the times measured at load above the cores."""
    loaded = ok.apply(is_loaded, axis=1).to_numpy(dtype=bool) if len(ok) else []
    if any(loaded):
        ax.plot(
            xs[loaded],
            times[loaded],
            linestyle="none",
            marker=series_marker(method, part),
            markerfacecolor="white",
            markeredgecolor=style.colour(method),
            zorder=4,
        )


def _oom_marks(ax, xs, **options) -> None:
    """The paper's OOMs: crosses on the x axis, as ours."""
    oom_marks(ax, xs, "x axis", **options)
