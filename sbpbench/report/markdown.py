"""`markdown_report`: the results table beside the paper's numbers, as deterministic Markdown.

Three sections: measured rows beside the paper (one table per paper table and metric, ratio =
ours / paper); measured rows the paper has nothing to compare with; estimates (simulated rows),
beside measurements of the same point and beside the paper's max T, never mixed with the above.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from ..measure.units import GIB
from ..records.reference import PAPER_DEVICE
from ..records.select import (
    LOADED_MARK,
    complete_columns,
    is_loaded,
    load_note,
    natural_key,
    no_reference,
    number,
    present,
    timing_caveat,
    with_full_depth,
)
from ..records.select import is_truncated as truncated
from .compare import Comparison, estimate_comparisons, estimates_vs_paper, paper_comparisons, run, setting
from .placements import placements_section, seq_and_max_t_cells
from .points import points_section

METRIC_TITLES = {
    "max_seq_len": "max T (tokens)",
    "weights_grads_bytes": "weights + grads (GiB)",
    "peak_allocated_bytes": "peak memory (GiB)",
    "time_s": "step time (s)",
    "time_per_sample_s": "time per sample (s)",
}
COMPARE_HEADERS = ("model", "method", "setting", "ours ran on", "paper", "ours", "ours/paper")
METHOD_ORDER = {"bp": 0, "ckpt": 1, "mst": 2, "streambp": 3}
PAPER_METHODS = ("bp", "ckpt", "mst", "streambp")
POINTS_HEADING = "## Point by point on a GPU: measured, predicted, the paper"
TARGET_RATIO = 1.3  # the peers' target: StreamBP's max T over the best peer's, at equal or lower step time
PEERS_GROUP = ("model", "num_layers", "device_name", "memory_limit_bytes", "protocol", "dtype", "objective", "lora_rank", "step", "batch_size")  # fmt: skip


def peers_section(table, exactness: list[dict]) -> list[str]:
    """One table per model and setting whose measured rows include a peer (a method beyond the
    paper's): per method its peak memory and time per token at each T, its max T, and how exact it
    was in the exactness CSV (the latest fp64 check, else fp32)."""
    groups = _peer_groups(table)
    if not groups:
        return []
    lines = ["", "## Peers", ""]
    lines += [
        (
            "Peak memory (GiB) and time per token (ms, median step / (B x T)) at each measured T; max T from the "
            "max-length search (≥: no OOM up to its ceiling); exact: `sbp check` vs bp (relative error of the worst "
            "gradient), from the exactness CSV given with --exactness."
        ),
    ]
    for rows in groups:
        like = rows.iloc[-1]
        seqs = sorted({int(number(t)) for t in rows.loc[rows["kind"] == "point", "seq_len"] if present(t)})
        lines += ["", f"### {like['model']}: {setting(like, seq_len=False)}, {run(like)}", ""]
        lines += _peers_table(rows, seqs, exactness)
        lines += _verdict(rows)
    return lines


def glance_table(table, exactness: list[dict]) -> list[str]:
    """The first peers table (`peers_section`) cut to the lengths every method ran at, under a
    one-line caption naming model, setting and device: a summary short enough for a README
    (`sbp report --glance`). [] when no group has a peer."""
    groups = _peer_groups(table)
    if not groups:
        return []
    rows = groups[0]
    points = rows[rows["kind"] == "point"]
    per_method = [{int(number(t)) for t in g["seq_len"] if present(t)} for _, g in points.groupby("method")]
    seqs = sorted(set.intersection(*per_method)) if per_method else []
    like = rows.iloc[-1]
    caption = f"{like['model']}: {setting(like, seq_len=False)}, {run(like)}"
    return [caption, "", *_peers_table(rows, seqs, exactness)]


def _peer_groups(table) -> list:
    """The measured rows of each model and setting (PEERS_GROUP) that include a peer, in a stable
    order, each sorted by time."""
    measured = table[(table["source"] == "measured")]
    groups = {}
    for index, row in measured.iterrows():
        groups.setdefault(tuple(str(row[c]) for c in PEERS_GROUP), []).append(index)
    found = []
    for key in sorted(groups, key=lambda k: tuple(natural_key(p) for p in k)):
        rows = measured.loc[groups[key]].sort_values("timestamp_utc", kind="stable")
        if not rows["method"].isin(PAPER_METHODS).all():
            found.append(rows)
    return found


def _peers_table(rows, seqs: list[int], exactness: list[dict]) -> list[str]:
    """Per method: peak and time per token at each T of seqs, its max T, how exact it was."""
    headers = ["method", *(f"T={t}" for t in seqs), "max T", "exact vs bp"]
    cells = []
    for method in sorted(rows["method"].unique(), key=_method_rank):
        own = seq_and_max_t_cells(rows[rows["method"] == method], seqs, _peer_cell)
        cells.append([method, *own, _exact_cell(method, exactness)])
    return _markdown_table(tuple(headers), cells) + _load_footnote(cells)


def _load_footnote(cells: list[list[str]]) -> list[str]:
    """The footnote of a table whose times carry LOADED_MARK; [] for one without."""
    if not any(LOADED_MARK in value for row in cells for value in row):
        return []
    return ["", LOADED_FOOTNOTE]


LOADED_FOOTNOTE = (
    f"{LOADED_MARK} timed at a load above the machine's cores (its 1-minute load average over the worker's "
    "threads): slower and noisier than on an idle machine, so no ranking by it."
)


def _verdict(rows) -> list[str]:
    """The peers' target, judged from the rows: StreamBP's max T at least TARGET_RATIO x the best
    other method's, at equal or lower step time (the median ratio over every T both ran, each listed);
    not judged from times without a warm-up step, from one timed step or from times taken at load
    above the cores. Nothing when a side lacks an answer."""
    answers = {}
    for method in rows["method"].unique():
        found = rows[(rows["method"] == method) & (rows["kind"] == "maxlen") & (rows["status"] == "ok")]
        if len(found):
            last = found.iloc[-1]
            answers[method] = (int(number(last["max_seq_len"])), not present(last["oom_seq_len"]))
    if "streambp" not in answers or len(answers) < 2:
        return []
    rival = max((m for m in answers if m != "streambp"), key=lambda m: answers[m][0])
    (ours, ours_capped), (theirs, _) = answers["streambp"], answers[rival]
    ratio = f"{'≥' if ours_capped else ''}{ours / theirs:.2f}x"
    text = f"StreamBP's max T is {ratio} the best other method's ({rival}: {theirs})"
    points = rows[(rows["kind"] == "point") & (rows["status"] == "ok") & rows["time_median_s"].map(present)]
    both = points[points["method"].isin(["streambp", rival])]
    common = [t for t, g in both.groupby(both["seq_len"].map(number)) if set(g["method"]) == {"streambp", rival}]
    if common:
        ratios = []
        for t in common:
            times = {m: number(both[(both["method"] == m) & (both["seq_len"].map(number) == t)].iloc[-1]["time_median_s"]) for m in ("streambp", rival)}  # fmt: skip
            ratios.append(times["streambp"] / times[rival])
        listed = ", ".join(f"{r:.2f}x at T={t:.0f}" for r, t in zip(ratios, common))
        median = statistics.median(ratios)
        text += f"; its step time over {rival}'s: {listed} (median {median:.2f}x)"
        compared = both[both["seq_len"].map(number).isin(common)]
        caveat = timing_caveat(compared) or load_note(compared)
        if caveat:  # a single cold step or a busy machine ranks nothing (records.select)
            text += f"; {caveat}, so the target ({TARGET_RATIO}x at equal or lower step time) is not judged."
        else:
            met = ours >= TARGET_RATIO * theirs and median <= 1.0
            text += f". Target ({TARGET_RATIO}x at equal or lower step time, median): {'met' if met else 'not met'}."
    else:
        text += f"; no T where both were timed, so the step-time half of the target ({TARGET_RATIO}x) is not judged."
    return ["", text]


def _peer_cell(row) -> str:
    if row["status"] != "ok":
        return row["status"]
    peak = number(row["peak_allocated_bytes"])
    time = number(row["time_median_s"])
    tokens = number(row["batch_size"]) * number(row["seq_len"])
    per_token = "" if time is None else f", {1e3 * time / tokens:.2f} ms/tok" + _loaded_mark(row)
    return ("" if peak is None else f"{peak / GIB:.2f} GiB") + per_token


def _loaded_mark(row) -> str:
    return LOADED_MARK if is_loaded(row) else ""


def _exact_cell(method: str, exactness: list[dict]) -> str:
    if method == "bp":
        return "reference"
    mine = [r for r in exactness if r["method"] == method]
    for dtype in ("fp64", "fp32"):
        checked = [r for r in mine if r["dtype"] == dtype]
        if checked:
            last = checked[-1]
            if last["result"] == "unsupported":
                return "unsupported here"
            return f"{last['result']} ({dtype} {float(last['grad_rel_error']):.1e})"
    return "not checked"


def exactness_section(rows: list[dict]) -> list[str]:
    """Every comparison of the exactness CSV, as `sbp check` recorded it."""
    lines = ["", "## Exactness vs bp (`sbp check --out`)", ""]
    lines += [
        (
            "Relative errors max|method - bp| / max|bp| of the loss and of the worst parameter gradient; "
            "tolerance fp64 1e-10, fp32 1e-5."
        ),
        "",
    ]
    headers = (
        "method",
        "result",
        "loss err",
        "grad err",
        "worst gradient",
        "model",
        "dtype",
        "B",
        "T",
        "settings",
        "note",
    )
    cells = [
        [
            r["method"],
            r["result"],
            f"{float(r['loss_rel_error']):.1e}" if r["loss_rel_error"] else "",
            f"{float(r['grad_rel_error']):.1e}" if r["grad_rel_error"] else "",
            r["worst_tensor"],
            r["model"] + (f" ({r['num_layers']} layers)" if r["num_layers"] else ""),
            r["dtype"],
            r["batch_size"],
            r["seq_len"],
            r["settings"],
            r["note"],
        ]
        for r in rows
    ]
    return lines + _markdown_table(headers, cells)


def markdown_report(
    table, reference=None, full_depth: Callable[[str], int | None] | None = None, exactness=None
) -> str:
    """The report as Markdown; `reference`: `records.reference.load_reference()` or None; full_depth:
    a model name's decoder layers (`models.full_depth`), to mark and keep away from the paper's
    numbers a model built with fewer; None: no row is called truncated. exactness: rows of an
    exactness CSV (`records.exactness.read_exactness`), or None."""
    table = with_full_depth(complete_columns(table), full_depth)
    paper = no_reference() if reference is None else reference
    lines = [
        "# sbpbench results beside the StreamBP paper",
        "",
        f"Paper: Luo et al. 2025, StreamBP, arXiv 2506.03077, on one {PAPER_DEVICE} GPU.",
        "Units: memory in GiB (2^30 bytes), lengths in tokens, times in seconds (our median); ratio = ours / paper.",
        _counts(table),
    ]
    if reference is None:
        lines.append("No paper reference was loaded: nothing to compare with.")
    points = points_section(table, reference, _markdown_table)
    if points:
        lines += ["", POINTS_HEADING, "", *points]
    comparisons, matched, coverage = paper_comparisons(table, paper)
    lines += _paper_section(comparisons, coverage)
    lines += _unmatched_section(table[(table["source"] == "measured") & ~table.index.isin(matched)])
    lines += _estimates_section(table, paper)
    lines += peers_section(table, exactness or [])
    lines += placements_section(table, _markdown_table)
    if exactness:
        lines += exactness_section(exactness)
    return "\n".join(lines) + "\n"


def points_markdown(table, reference=None, full_depth: Callable[[str], int | None] | None = None) -> str:
    """`sbp report --points`: the point-by-point section without its heading, or a line saying why
    there is none."""
    table = with_full_depth(complete_columns(table), full_depth)
    lines = points_section(table, reference, _markdown_table)
    return "\n".join(lines or ["No measured GPU point of a whole model: no point-by-point table."]) + "\n"


def glance_markdown(table, exactness=None) -> str:
    """`sbp report --glance`: `glance_table` of the results as Markdown, or a line saying why there
    is none."""
    lines = glance_table(complete_columns(table), exactness or [])
    return "\n".join(lines or ["No measured rows of a peer method: no summary table."]) + "\n"


def _counts(table) -> str:
    measured = int((table["source"] == "measured").sum())
    return f"Results: {len(table)} rows, {measured} measured, {len(table) - measured} simulated (estimates)."


def _paper_section(comparisons: list[Comparison], coverage) -> list[str]:
    lines = [
        "",
        "## Measured beside the paper",
        "",
        (
            "Comparable: memory and max-T numbers need a CUDA device whose capacity (the memory limit if set, "
            "else the device total) is within 10% of 80 GiB; times need a CUDA device (named in each row; "
            f"the paper used an {PAPER_DEVICE}). Whole models only. OOM on either side: no ratio. "
            "A max T marked ≥ reached the search's ceiling without an OOM."
        ),
    ]
    for table, metric in dict.fromkeys((c.table, c.metric) for c in comparisons):
        rows = [c for c in comparisons if (c.table, c.metric) == (table, metric)]
        lines += ["", f"### {table}: {METRIC_TITLES[metric]}", ""]
        if metric == "max_seq_len" and any(_prompted(c.setting) for c in rows):
            note = "grpo/dpo: the paper's number is read as the completion length, so ours is max_seq_len - prompt_len"
            lines += [f"{note} (experiments/paper_table3.toml).", ""]
        lines += _markdown_table(COMPARE_HEADERS, [_compare_cells(c) for c in rows])
    if not comparisons:
        lines += ["", "No measured row is comparable with a paper number."]
    counts = ", ".join(f"{name}: {done} of {total}" for name, done, total in coverage)
    lines += [
        "",
        f"Paper numbers with a comparable measurement: {counts or 'none'}.",
        "Tables 4-5 (ZeRO-2 on several GPUs) and Table 6 (gradient error) have no counterpart in a results table.",
    ]
    return lines


def _unmatched_section(rows) -> list[str]:
    lines = ["", "## Measured, no paper counterpart", ""]
    if rows.empty:
        return lines + ["None."]
    headers = ("model", "method", "setting", "ran on", "status", "peak GiB", "time s", "max T")
    ordered = sorted(
        (_row_cells(row) for _, row in rows.iterrows()),
        key=lambda cells: (natural_key(cells[0]), natural_key(cells[3]), _method_rank(cells[1]), natural_key(cells[2])),
    )
    return lines + _markdown_table(headers, ordered) + _load_footnote(ordered)


def _estimates_section(table, reference) -> list[str]:
    lines = [
        "",
        "## Estimates vs measurements",
        "",
        "Simulated rows: a fake-tensor estimate of a GPU, not a measurement.",
    ]
    if not (table["source"] == "simulated").any():
        return [*lines, "", "This table has none: `sbp estimate` and `sbp maxlen --simulate` write them."]
    against_measured, unmatched = estimate_comparisons(table)
    headers = ("model", "method", "setting", "measured on", "measured GiB", "estimate GiB", "error")
    lines += ["", "### Estimated peak memory beside the measured one (error = estimate / measured - 1)", ""]
    lines += _markdown_table(headers, [_estimate_cells(c) for c in against_measured]) or ["None."]
    if unmatched:
        lines += ["", f"{unmatched} simulated point(s) have no measured counterpart."]
    against_paper = estimates_vs_paper(table, reference)
    headers = ("model", "method", "setting", "estimated for", "paper", "estimate", "estimate/paper")
    lines += ["", "### Estimated max T beside the paper's (Figure 3 for step bp, Table 3 for train)", ""]
    lines += _markdown_table(headers, [_compare_cells(c) for c in against_paper]) or ["None."]
    return lines


def _compare_cells(c: Comparison) -> list[str]:
    ceiling = "≥" if c.at_ceiling else ""
    paper = "-" if c.no_reference else _value(c.reference, c.metric)
    ratio = "-" if c.ratio is None else f"{c.ratio:.2f}"
    return [c.model, c.method, c.setting, c.run, paper, ceiling + _value(c.ours, c.metric), ratio]


def _estimate_cells(c: Comparison) -> list[str]:
    error = "-" if c.ratio is None else f"{100 * (c.ratio - 1):+.1f}%"
    return [c.model, c.method, c.setting, c.run, _value(c.reference, c.metric), _value(c.ours, c.metric), error]


def _row_cells(row) -> list[str]:
    model = row["model"] + (f" ({number(row['num_layers']):.0f} layers)" if truncated(row) else "")
    peak, time, max_t = (_shown(row, c) for c in ("peak_allocated_bytes", "time_median_s", "max_seq_len"))
    time += _loaded_mark(row) if time else ""
    if max_t and not present(row["oom_seq_len"]):
        max_t = "≥" + max_t
    return [model, row["method"], setting(row, seq_len=True), run(row), row["status"], peak, time, max_t]


def _value(value: float | None, metric: str) -> str:
    if value is None:
        return "OOM"
    if metric.endswith("_bytes"):
        return f"{value / GIB:.2f}"
    if metric == "max_seq_len":
        return f"{value:.0f}"
    return f"{value:.2f}"


def _shown(row, column: str) -> str:
    """A recorded number as the report shows it; "" where the row has none."""
    return _value(number(row[column]), column.replace("time_median_s", "time_s")) if present(row[column]) else ""


def _prompted(text: str) -> bool:
    return text.startswith(("grpo", "dpo"))


def _method_rank(method: str) -> tuple:
    return METHOD_ORDER.get(method, len(METHOD_ORDER)), method


def _markdown_table(headers, rows: list[list[str]]) -> list[str]:
    """A GitHub Markdown table, numbers right-aligned; [] for no rows."""
    if not rows:
        return []
    text = {"model", "method", "setting", "ours ran on", "ran on", "measured on", "estimated for", "status"}
    text |= {"result", "worst gradient", "dtype", "settings", "note", "exact vs bp", "the paper"}
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" if h in text else "---:" for h in headers) + "|"]
    return lines + ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
