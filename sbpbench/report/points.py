"""Point by point on a GPU: each measured peak beside `sbp estimate`'s prediction and the paper.

Two tables per CUDA device and setting. The first has one line per measured point: its peak and
step time, the estimate of the same point (simulated rows matched on ESTIMATE_KEY) with its error,
and the paper's number for that model, method and length (Table 1's time, Table 9's peak, or the
paper's max T). The second has one line per method: the paper's max T, the max T predicted for a
card of this capacity (`sbp maxlen --simulate`), and the longest length measured to fit.
"""

from __future__ import annotations

from ..measure.units import GIB
from ..records import KEY_COLUMNS
from ..records.reference import PAPER_DEVICE
from ..records.select import (
    ESTIMATE_KEY,
    MAXLEN_TABLE,
    capacity_bytes,
    cell,
    is_cuda,
    is_oom,
    is_truncated,
    natural_key,
    number,
    paper_rows,
    present,
    short_model,
    timing_caveat,
)
from .placements import placement

# What a line of the first table shares with the others of its table: everything but model,
# method, placement and length.
SETTING = ("device_name", "objective", "lora_rank", "step", "dtype", "batch_size", "protocol", "nproc", "sp")
POINT_HEADERS = ("model", "method", "T", "peak GiB", "predicted GiB", "error", "step s", "the paper")
ROUGH_NOTE = "\\* a rough time: fewer warm-up or timed steps than a ranking needs (the row says how many)."
MAXLEN_HEADERS = ("model", "method", f"paper max T ({PAPER_DEVICE})", "predicted max T", "longest measured ok", "first measured OOM")  # fmt: skip


def points_section(table, reference, markdown_table) -> list[str]:
    """The section's lines (a note, then tables per device and setting, "###" headings); none
    without a measured CUDA point of a whole model."""
    measured = _latest(table[(table["source"] == "measured") & (table["kind"] == "point")])
    measured = [row for row in measured if is_cuda(row) and not is_truncated(row)]
    if not measured:
        return []
    lines = [
        (
            "Peak: max allocated (GiB = 2^30 B). Predicted: `sbp estimate` of the same point, on fake tensors "
            "(a prediction); error = predicted / measured - 1. Step s: median step time (memory-only points: -). "
            f"Paper: the same model and method on its {PAPER_DEVICE}."
        ),
    ]
    estimates = _estimates(table)
    for key in sorted({_setting_key(r) for r in measured}, key=lambda k: tuple(natural_key(p) for p in k)):
        rows = sorted(
            (r for r in measured if _setting_key(r) == key),
            key=lambda r: (natural_key(r["model"]), number(r["seq_len"]) or 0, _method_rank(r["method"]), placement(r)),
        )
        lines += ["", f"### {_setting_title(rows[0])}", ""]
        lines += markdown_table(POINT_HEADERS, [_point_cells(r, estimates, reference) for r in rows])
        if any(_rough(row) for row in rows):
            lines += ["", ROUGH_NOTE]
        maxlen_lines = [_maxlen_cells(model, method, rows, table, reference) for model, method in _model_methods(rows)]
        known = [cells for cells in maxlen_lines if cells[2] != "-" or cells[3] != "-"]  # the paper's or a prediction
        lines += ["", *markdown_table(MAXLEN_HEADERS, known)] if known else []
    return lines


def _latest(rows) -> list:
    """The latest row per results key (a rerun replaces a point)."""
    chosen = {}
    for _, row in rows.sort_values("timestamp_utc", kind="stable").iterrows():
        chosen[tuple(cell(row[c]) for c in KEY_COLUMNS)] = row
    return list(chosen.values())


def _setting_key(row) -> tuple[str, ...]:
    return tuple(cell(row[c]) for c in SETTING)


def _setting_title(row) -> str:
    rank = int(number(row["lora_rank"]) or 0)
    total = number(row["device_total_memory_bytes"])
    device = row["device_name"] + (f" ({total / GIB:.2f} GiB)" if total else "")
    parts = [device, row["objective"], f"LoRA r{rank}" if rank else "full", f"step {row['step']}", row["dtype"]]
    parts += [f"B={cell(row['batch_size'])}", f"{row['protocol']} protocol"]
    if (number(row["nproc"]) or 1) > 1:
        shared = number(row.get("sp")) or 1
        parts.append(f"{cell(row['nproc'])} ranks" + (f", {cell(row['sp'])} per sequence" if shared > 1 else ""))
    return ", ".join(parts)


def _method_rank(method: str) -> tuple:
    order = {"bp": 0, "ckpt": 1, "streambp": 2}
    return order.get(method, len(order)), method


def _method_label(row) -> str:
    where = placement(row)
    return row["method"] if row["method"] != "streambp" or where == "gpu" else f"streambp ({where})"


def _estimates(table) -> dict[tuple[str, ...], object]:
    """The latest simulated point per ESTIMATE_KEY."""
    simulated = table[(table["source"] == "simulated") & (table["kind"] == "point")]
    return {tuple(cell(r[c]) for c in ESTIMATE_KEY): r for r in _latest(simulated)}


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _point_cells(row, estimates, reference) -> list[str]:
    oom = is_oom(row)
    peak = None if oom else number(row["peak_allocated_bytes"])
    estimate = estimates.get(tuple(cell(row[c]) for c in ESTIMATE_KEY))
    predicted = None if estimate is None or is_oom(estimate) else number(estimate["peak_allocated_bytes"])
    error = "-" if peak is None or predicted is None else f"{100 * (predicted / peak - 1):+.1f}%"
    time = number(row["time_median_s"])
    rough = "*" if _rough(row) else ""
    measured = "OOM" if oom else (_gib(peak) if row["status"] == "ok" else row["status"])
    return [
        short_model(row["model"]),
        _method_label(row),
        f"{int(number(row['seq_len'])):,}",
        measured,
        _gib(predicted),
        error,
        "-" if time is None else f"{time:.3f}{rough}",
        _paper_cell(row, reference),
    ]


def _rough(row) -> bool:
    """A timed row whose warm-up or repeats are too few to rank methods by (select.timing_caveat)."""
    steps = {"warmup_steps": [row["warmup_steps"]], "repeats": [row["repeats"]]}
    return number(row["time_median_s"]) is not None and bool(timing_caveat(steps))


def _paper_cell(row, reference) -> str:
    """The paper's numbers for this model, method and length: a time or peak at the same T (Table 1,
    Table 9), else the method's max T (Figure 3 for a bp step, Table 3 for a training step)."""
    if reference is None:
        return "-"
    seq_len = number(row["seq_len"])
    found = []
    for table, metric, unit in (("Table 1", "time_s", "s"), ("Table 9", "peak_allocated_bytes", "GiB")):
        rows = paper_rows(reference, table=table, metric=metric, like=row)
        rows = rows[rows["seq_len"] == seq_len]
        for _, paper in rows.iterrows():
            value = "OOM" if paper["status"] == "oom" else _paper_value(paper["value"], metric)
            found.append(f"{value}{'' if value == 'OOM' else ' ' + unit} ({table})")
    if not found and row["step"] in MAXLEN_TABLE:
        table = MAXLEN_TABLE[row["step"]]
        for _, paper in paper_rows(reference, table=table, metric="max_seq_len", like=row).iterrows():
            found.append(f"max T {float(paper['value']):,.0f} ({table})")
    return "; ".join(found) or "-"


def _paper_value(value, metric: str) -> str:
    value = float(value)
    return f"{value / GIB:.2f}" if metric.endswith("_bytes") else f"{value:.2f}"


def _model_methods(rows) -> list[tuple[str, str]]:
    return list(dict.fromkeys((r["model"], r["method"]) for r in rows))


def _maxlen_cells(model: str, method: str, rows, table, reference) -> list[str]:
    """One method's max T: the paper's, the prediction for this card, and what the points measured."""
    mine = [r for r in rows if (r["model"], r["method"]) == (model, method) and placement(r) == "gpu"]
    like = mine[0] if mine else next(r for r in rows if (r["model"], r["method"]) == (model, method))
    paper = "-"
    if reference is not None and like["step"] in MAXLEN_TABLE:
        found = paper_rows(reference, table=MAXLEN_TABLE[like["step"]], metric="max_seq_len", like=like)
        if len(found):
            paper = f"{float(found['value'].iloc[0]):,.0f}"
    ok = [number(r["seq_len"]) for r in mine if r["status"] == "ok"]
    oom = [number(r["seq_len"]) for r in mine if is_oom(r)]
    return [
        short_model(model),
        method,
        paper,
        _predicted_max_t(table, like),
        f"{max(ok):,.0f}" if ok else "-",
        f"{min(oom):,.0f}" if oom else "-",
    ]


def _predicted_max_t(table, like) -> str:
    """The latest simulated max-length search of this model, method and setting (default placement),
    with the memory it was predicted for."""
    searches = table[(table["source"] == "simulated") & (table["kind"] == "maxlen")]
    same = [
        r
        for r in _latest(searches)
        if all(cell(r[c]) == cell(like[c]) for c in ("model", "method", *SETTING[1:]))
        and placement(r) == "gpu"
        and not is_truncated(r)
    ]
    if not same:
        return "-"
    search = same[-1]
    max_t = number(search["max_seq_len"])
    if max_t is None:
        return "none fits"
    bound = "" if present(search["oom_seq_len"]) else "≥"
    capacity = capacity_bytes(search)
    return f"{bound}{max_t:,.0f}" + (f" ({capacity / GIB:.2f} GiB)" if capacity else "")
