"""Figure (a): peak allocated memory (GiB) vs sequence length, per method; the paper's Figure 3 and
Table 9 faint behind it.

One figure per model and setting (POINT_GROUP) with at least two sequence lengths. Lines: each
method's ok points; "x" on the top edge (over it, unclipped): its OOMs, which have no peak to draw.
Horizontal lines: the device capacity (the cap if one was set) and weights + gradients. Each
method's max T, in its legend entry (text on the axes overlapped lines and other labels): the
matching max-length search's answer (also a vertical dotted line) if the table has one, else its
longest ok T with the first OOM above it (nothing when it never ran out of memory: its max T is
not known). A method with neither a peak nor an OOM (unsupported here) gets no legend entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..measure.units import GIB
from ..records.select import capacity_bytes, is_oom, is_paper_capacity, is_truncated, number, paper_rows, where
from . import style
from .common import (
    FORMATS,
    POINT_GROUP,
    device_part,
    finish,
    group_rows,
    keys_of,
    log2_x,
    model_title,
    new_figure,
    oom_legend,
    oom_marks,
    placements_of,
    save,
    series,
    series_marker,
    setting_parts,
    setting_title,
    short,
    stem,
    where_title,
)


def memory_vs_seq(table, out_dir: Path, reference=None, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Peak memory (GiB) vs T, one figure per model and setting with two or more T; the written paths."""
    points, maxlen = table[table["kind"] == "point"], table[table["kind"] == "maxlen"]
    paths = []
    for key, rows in group_rows(points, POINT_GROUP):
        if rows["seq_len"].nunique() < 2 or rows["peak_allocated_bytes"].isna().all():
            continue
        searches = where(maxlen, (k == key for k in keys_of(maxlen, POINT_GROUP)))
        paths += _figure(rows, searches, reference, Path(out_dir), formats)
    return paths


def _figure(rows, searches, reference, out_dir: Path, formats) -> list[Path]:
    like = rows.iloc[0]
    fig, ax = new_figure()
    xs = list(rows["seq_len"].dropna())
    peaks = list(rows["peak_allocated_bytes"].dropna() / GIB)
    for method, simulated, extra, part in series(rows):
        xs += _draw_method(ax, method, simulated, extra, part, _search(searches, method, simulated, part))
    capacity = _capacity(rows)
    if capacity:
        kind = "cap" if number(like.get("memory_limit_bytes")) else "device total"
        ax.axhline(capacity / GIB, **style.CAPACITY_STYLE, label=f"capacity {capacity / GIB:.1f} GiB ({kind})")
        peaks.append(capacity / GIB)
    weights_grads = (rows["weights_bytes"] + rows["grads_bytes"]).dropna()
    if len(weights_grads):
        value = weights_grads.median() / GIB
        ax.axhline(value, **style.WEIGHTS_GRADS_STYLE, label=f"weights + grads {value:.1f} GiB")
    if is_paper_capacity(like) and not is_truncated(like):
        xs += _draw_paper(ax, reference, like)
    if rows.apply(is_oom, axis=1).any():
        oom_legend(ax, "top edge")
    ax.set_ylim(0, max(peaks) * 1.12)
    log2_x(ax, xs)
    ax.set_xlabel("sequence length T (tokens per row)", fontsize=style.FONT_SIZE)
    ax.set_ylabel("peak allocated memory (GiB = 2^30 B)", fontsize=style.FONT_SIZE)
    finish(fig, ax, f"{model_title(like)}: peak memory (GiB) vs T, {setting_title(like)}\n{where_title(like)}")
    name = stem("memory_vs_seq", short(like), device_part(like), like["protocol"], *setting_parts(like))
    return save(fig, out_dir, name, formats)


def _draw_method(ax, method: str, simulated: bool, extra: str, part, search) -> list[float]:
    """One method's line, OOM marks and max T (a dotted line, and in its legend entry); returns the
    extra x values it drew."""
    colour = style.colour(method)
    ok = part[(part["status"] == "ok") & part["peak_allocated_bytes"].notna()].sort_values("seq_len")
    ooms = part.loc[part.apply(is_oom, axis=1), "seq_len"].dropna().sort_values()
    if ok.empty and ooms.empty:  # unsupported or failed here: nothing to draw, no legend entry
        return []
    label, drawn = style.label(method, simulated=simulated, extra=extra), []
    if search is not None and number(search["max_seq_len"]) is not None:
        max_t = number(search["max_seq_len"])
        ceiling = "≥ " if number(search.get("oom_seq_len")) is None else ""  # no OOM up to the search's ceiling
        ax.axvline(max_t, color=colour, linestyle=":", linewidth=1.2)
        label += f", max T {ceiling}{style.thousands(max_t)} (search{', estimate' if simulated else ''})"
        drawn = [max_t]
    else:
        first_oom = ooms[ooms > ok["seq_len"].max()] if len(ok) else ooms[:0]
        if len(first_oom):  # no search: the max T lies between the longest ok and the first OOM
            label += f", max ok T {ok['seq_len'].iloc[-1]:.0f} (OOM at {first_oom.iloc[0]:.0f})"
    ax.plot(
        ok["seq_len"],
        ok["peak_allocated_bytes"] / GIB,
        linestyle=style.ESTIMATE_LINESTYLE if simulated else "-",
        marker=series_marker(method, part),
        color=colour,
        label=label,
    )
    oom_marks(ax, ooms, "top edge", color=colour)
    return drawn


def _draw_paper(ax, reference, like) -> list[float]:
    """Figure 3 (max T per method, weights + grads) and Table 9 (peak memory) faint; the x values drawn."""
    xs = []
    for _, paper in paper_rows(reference, table="Figure 3", metric="max_seq_len", like=like, method=False).iterrows():
        colour = style.colour(paper["method"])
        ax.axvline(
            paper["value"],
            color=colour,
            alpha=style.PAPER_ALPHA,
            linewidth=2.5,
            label=f"{style.label(paper['method'])} max T, paper Fig. 3",
        )
        xs.append(paper["value"])
    for _, paper in paper_rows(
        reference, table="Figure 3", metric="weights_grads_bytes", like=like, method=False
    ).iterrows():
        ax.axhline(
            paper["value"] / GIB,
            color="#555555",
            alpha=style.PAPER_ALPHA,
            linewidth=2.5,
            label=f"weights + grads, paper Fig. 3 ({paper['value'] / GIB:.1f} GiB)",
        )
    table9 = paper_rows(reference, table="Table 9", metric="peak_allocated_bytes", like=like, method=False)
    for method, rows in table9.groupby("method", sort=False):
        colour, rows = style.colour(method), rows.sort_values("seq_len")
        ok = rows[rows["status"] == "ok"]
        ax.plot(
            ok["seq_len"],
            ok["value"] / GIB,
            color=colour,
            alpha=style.PAPER_ALPHA,
            marker=style.marker(method),
            markerfacecolor="none",
            linewidth=2.5,
            label=f"{style.label(method)}, paper Table 9",
        )
        oom_marks(ax, rows.loc[rows["status"] == "oom", "seq_len"], "top edge", color=colour, alpha=style.PAPER_ALPHA)
        xs += list(rows["seq_len"])
    return xs


def _capacity(rows) -> float | None:
    """The group's capacity; a measured row's where the table has one."""
    ordered = rows.sort_values("source", kind="stable")  # "measured" < "simulated"
    return next((c for _, row in ordered.iterrows() if (c := capacity_bytes(row))), None)


def _search(searches, method: str, simulated: bool, part):
    """The latest max-length search of this method and source for the series' rows (part): the
    same checkpoint placement, and the same chunk size where the series has one; or None."""
    mine = searches[(searches["method"] == method) & (searches["source"] == ("simulated" if simulated else "measured"))]
    placement, placements = placements_of(mine), placements_of(part).unique()
    if len(placements) == 1:
        mine = mine[placement == placements[0]]
    chunks = part["chunk_size"].dropna().unique()
    if method == "streambp" and len(chunks) == 1:
        mine = mine[mine["chunk_size"] == chunks[0]]
    return None if mine.empty else mine.sort_values("timestamp_utc", kind="stable").iloc[-1]
