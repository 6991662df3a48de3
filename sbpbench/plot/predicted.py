"""Figure (f): peaks measured on a GPU, drawn on the estimator's predicted curves.

One figure per CUDA device, model and setting that has measured points and, for some method, a
predicted peak (source simulated) at two or more lengths. Dashed lines: each method's predicted
peak against T (`sbp estimate` or the probes of `sbp maxlen --simulate`, default placement),
OOM predictions included, since an estimate has a peak either way. Filled markers: the measured
peaks, each labelled with the prediction's error where the same point was predicted; StreamBP's
other placements get their own marker. Horizontal lines: the device's total memory and the budget
the predictions were made for. Faint vertical lines: the paper's max T (Figure 3 or Table 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..measure.units import GIB
from ..records.select import ESTIMATE_KEY, MAXLEN_TABLE, cell, is_cuda, is_oom, is_truncated, number, paper_rows
from . import style
from .common import (
    FORMATS,
    finish,
    log2_x,
    model_title,
    new_figure,
    oom_label,
    oom_marks,
    save,
    setting_parts,
    setting_title,
    short,
    stem,
)

# Measured and predicted rows of one figure share these; the device and its cap are where they differ.
SHARED = ("model", "objective", "lora_rank", "step", "dtype", "batch_size", "protocol", "nproc", "sp")


def measured_on_predicted(table, out_dir: Path, reference=None, formats: Sequence[str] = FORMATS) -> list[Path]:
    """One figure per device, model and setting with measured GPU peaks and a predicted curve."""
    points = table[table["kind"] == "point"]
    measured = points[(points["source"] == "measured") & points.apply(is_cuda, axis=1)]
    measured = measured[~measured.apply(is_truncated, axis=1)] if len(measured) else measured
    predicted = points[(points["source"] == "simulated") & points["peak_allocated_bytes"].notna()]
    paths = []
    for (_device, *shared), rows in measured.groupby(["device_name", *SHARED], sort=True, dropna=False):
        curves = predicted[_same(predicted, dict(zip(SHARED, shared)))]
        curves = curves[curves.apply(_default_placement, axis=1)] if len(curves) else curves
        if curves.empty or curves.groupby("method")["seq_len"].nunique().max() < 2:
            continue
        paths += _figure(rows, curves, predicted, reference, Path(out_dir), formats)
    return paths


def _same(rows, values: dict):
    keep = rows["model"].notna()
    for column, value in values.items():
        keep &= rows[column].map(cell) == cell(value)
    return keep


def _placement(row) -> str:
    value = row.get("checkpoints")
    return value if isinstance(value, str) and value else "gpu"


def _default_placement(row) -> bool:
    return row["method"] != "streambp" or _placement(row) == "gpu"


def _figure(rows, curves, predicted, reference, out_dir: Path, formats) -> list[Path]:
    like = rows.iloc[0]
    fig, ax = new_figure()
    xs, ys = [], []
    for method in sorted(curves["method"].unique(), key=style.method_sort_key):
        # several searches may predict one length (budgets differ, the peak does not): the latest
        curve = curves[curves["method"] == method].sort_values("timestamp_utc").drop_duplicates("seq_len", keep="last")
        curve = curve.sort_values("seq_len")
        ax.plot(
            curve["seq_len"],
            curve["peak_allocated_bytes"] / GIB,
            linestyle=style.ESTIMATE_LINESTYLE,
            color=style.colour(method),
            linewidth=1.2,
            label=style.label(method, simulated=True),
        )
        xs += list(curve["seq_len"])
    for _, row in rows.sort_values(["method", "seq_len"]).iterrows():
        xs.append(number(row["seq_len"]))
        ys.append(_draw_measured(ax, row, predicted))
    capacity = number(like["device_total_memory_bytes"])
    if capacity:
        ax.axhline(capacity / GIB, **style.CAPACITY_STYLE, label=f"device memory {capacity / GIB:.2f} GiB")
        ys.append(capacity / GIB)
    budgets = sorted({number(b) for b in curves["memory_limit_bytes"] if number(b)})
    for budget in budgets:
        if capacity and abs(budget - capacity) > GIB / 100:
            ax.axhline(
                budget / GIB, color="black", linestyle=":", linewidth=0.8, label=f"predicted for {budget / GIB:.2f} GiB"
            )
    xs += _draw_paper(ax, reference, like)
    top = max([y for y in ys if y] + [1.0])
    ax.set_ylim(0, top * 1.12)
    log2_x(ax, xs)
    ax.set_xlabel("sequence length T (tokens per row)", fontsize=style.FONT_SIZE)
    ax.set_ylabel("peak allocated memory (GiB = 2^30 B)", fontsize=style.FONT_SIZE)
    title = (
        f"{model_title(like)}: peak memory measured on {like['device_name']} (markers)\n"
        f"beside the prediction of sbp estimate (dashed), {setting_title(like)}, {like['protocol']} protocol"
    )
    finish(fig, ax, title)
    name = stem("measured_on_predicted", short(like), style.file_safe(like["device_name"]), like["protocol"])
    return save(fig, out_dir, "__".join([name, *setting_parts(like)]), formats)


def _draw_measured(ax, row, predicted) -> float | None:
    """One measured point (an OOM as an "x" on the top edge, as in every memory figure); its label names its error against the
    prediction of the same point, if any. Returns its peak in GiB."""
    method, where = row["method"], _placement(row)
    colour = style.colour(method)
    marker = style.placement_marker(where) if method == "streambp" else style.marker(method)
    extra = "" if where == "gpu" or method != "streambp" else f"checkpoints {where}"
    text = style.label(method, extra=extra) + " measured"
    if is_oom(row):
        oom_marks(ax, [row["seq_len"]], "top edge", color=colour, label=f"{text}: {oom_label('top edge')}")
        return None
    peak = number(row["peak_allocated_bytes"])
    if peak is None:
        return None
    twin = predicted[_same(predicted, {c: row[c] for c in ESTIMATE_KEY})]
    error = ""
    if len(twin):
        estimate = number(twin.sort_values("timestamp_utc").iloc[-1]["peak_allocated_bytes"])
        error = f" ({100 * (estimate / peak - 1):+.1f}% predicted)"
    ax.plot([row["seq_len"]], [peak / GIB], marker, color=colour, markersize=8, linestyle="none", label=text)
    ax.annotate(
        f"{peak / GIB:.1f} GiB{error}",
        (row["seq_len"], peak / GIB),
        textcoords="offset points",
        xytext=(6, -10 if where != "gpu" else 4),
        fontsize=7,
        color=colour,
    )
    return peak / GIB


def _draw_paper(ax, reference, like) -> list[float]:
    """The paper's max T per method (Figure 3 for step bp, Table 3 for train), faint; the x drawn."""
    if reference is None or like["step"] not in MAXLEN_TABLE:
        return []
    xs = []
    table = MAXLEN_TABLE[like["step"]]
    for _, paper in paper_rows(reference, table=table, metric="max_seq_len", like=like, method=False).iterrows():
        value = float(paper["value"])
        ax.axvline(
            value,
            color=style.colour(paper["method"]),
            alpha=style.PAPER_ALPHA,
            linewidth=2.5,
            label=f"{style.label(paper['method'])} max T {style.thousands(value)}, paper {table} (A800-80GB)",
        )
        xs.append(value)
    return xs
