"""Figure (e): max T against time per token, one point per method (StreamBP beside the peers
users reach for). Up and to the left is better: longer sequences, less time per token.

One figure per model and setting (PEERS_GROUP) that has both kind=maxlen answers and timed points.
y: the method's max T (kind maxlen, "≥" when the search reached its ceiling). x: its median step
time / (B x T) at one common length T_ref, the length at which the most methods have a timed ok
row (the longest such). A method without a timed row there is named under the axes, and so is
one whose rows are status unsupported (with the reason's start). Where the times at T_ref had no
warm-up or a single timed step, the markers are hollow and the title says the x order is no ranking;
so are those timed at load above the cores (records.select.is_loaded), which the title counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..records.select import is_loaded, number, present
from . import style
from .common import (
    FORMATS,
    POINT_GROUP,
    device_part,
    finish,
    group_rows,
    load_title,
    model_title,
    new_figure,
    save,
    setting_parts,
    setting_title,
    short,
    stem,
    timing_title,
    where_title,
)

PEERS_GROUP = POINT_GROUP  # a peers figure holds fixed what a memory-vs-T figure does


def max_len_vs_time_per_token(table, out_dir: Path, reference=None, formats: Sequence[str] = FORMATS) -> list[Path]:
    """The written paths (none where a group lacks either max T answers or timed points)."""
    measured = table[table["source"] == "measured"]
    paths = []
    for _, rows in group_rows(measured, PEERS_GROUP):
        paths += _figure(rows, Path(out_dir), formats)
    return paths


def _latest(rows):
    return rows.sort_values("timestamp_utc", kind="stable")


def _figure(rows, out_dir: Path, formats) -> list[Path]:
    answers = _latest(rows[(rows["kind"] == "maxlen") & (rows["status"] == "ok")]).drop_duplicates(
        "method", keep="last"
    )
    timed = rows[(rows["kind"] == "point") & (rows["status"] == "ok") & rows["time_median_s"].map(present)]
    if answers.empty or timed.empty:
        return []
    counts = timed.groupby("seq_len")["method"].nunique()
    t_ref = max(counts[counts == counts.max()].index)
    at_ref = _latest(timed[timed["seq_len"] == t_ref]).drop_duplicates("method", keep="last").set_index("method")
    like = rows.iloc[0]
    caveat = timing_title(at_ref)
    loaded = load_title(at_ref.reset_index())
    fig, ax = new_figure()
    missing = []
    for _, answer in answers.iterrows():
        method = answer["method"]
        if method not in at_ref.index:
            missing.append(method)
            continue
        point = at_ref.loc[method]
        per_token = number(point["time_median_s"]) / (number(point["batch_size"]) * number(point["seq_len"]))
        max_t = number(answer["max_seq_len"])
        ceiling = not present(answer["oom_seq_len"])
        ax.scatter(
            [per_token * 1e3],
            [max_t],
            edgecolors=style.colour(method),
            facecolors="none" if caveat or is_loaded(point) else style.colour(method),  # hollow: its x is no ranking
            marker=style.marker(method),
            s=60,
            label=style.label(method) + (" (≥: no OOM up to the ceiling)" if ceiling else ""),
            zorder=3,
        )
        ax.annotate(
            ("≥" if ceiling else "") + style.thousands(max_t),
            (per_token * 1e3, max_t),
            textcoords="offset points",
            xytext=(6, 4),
            fontsize=style.LEGEND_FONT_SIZE,
        )
    unsupported = _latest(rows[rows["status"] == "unsupported"]).drop_duplicates("method", keep="last")
    notes = [f"no timed row at T={t_ref:.0f}: {', '.join(missing)}"] if missing else []
    notes += [f"unsupported: {r['method']} ({str(r['error']).split(';')[0][:60]})" for _, r in unsupported.iterrows()]
    ax.set_xlabel(f"time per token at T = {t_ref:.0f} (ms)", fontsize=style.FONT_SIZE)
    ax.set_ylabel("max sequence length T (tokens)", fontsize=style.FONT_SIZE)
    if notes:
        ax.text(0.01, 0.01, "\n".join(notes), transform=ax.transAxes, fontsize=style.LEGEND_FONT_SIZE, va="bottom")
    ax.margins(x=0.25, y=0.2)
    title = f"{model_title(like)}: max T vs time per token, per method\n{setting_title(like)}; {where_title(like)}"
    finish(fig, ax, title + caveat + loaded)
    name = stem("max_len_vs_time_per_token", short(like), *setting_parts(like), device_part(like), like["protocol"])
    return save(fig, out_dir, name, formats)
