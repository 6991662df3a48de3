"""Figure: one step's memory over time, a panel per method, measured beside predicted.

One figure per point (model, T, batch, dtype, device, setting) whose rows name memory timelines
(`sbp run --timeline`: the row's timeline_file, relative to its CSV). Each panel is one method (and
StreamBP placement): allocated memory against the step's time normalised to [0, 1] (ops on a CPU,
microseconds on a GPU), the measured curve solid, the estimator's prediction of the same point
dashed; its phases shaded; its peak marked with its size and phase; the cap that applied (a memory
limit, or a GPU's total memory) as a line; for an offloading placement, the host copies as a
dotted line. Panels share the memory axis, so methods compare by height.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..measure.timeline.data import Timeline, load_timeline
from ..measure.timeline.marks import phase_group
from ..records.select import cell, short_model
from . import style
from .common import FORMATS, device_part, save, setting_parts, stem

# What one figure holds fixed: its panels differ by method and placement only.
FIGURE_KEYS = (
    "model", "num_layers", "seq_len", "batch_size", "dtype", "device_name", "objective", "lora_rank", "step",
    "protocol", "memory_limit_bytes",
)  # fmt: skip
MEASURED_SUFFIX, PREDICTED_SUFFIX = ".measured.json", ".predicted.json"
# Shades of the phases a step goes through (light, so the curves stay readable); others cycle OTHER_SHADES.
PHASE_SHADES = {
    "forward": "#DCE9F5",
    "checkpoint pass": "#DCE9F5",
    "embedding": "#EEEEEE",
    "head": "#FBE3C8",
    "head sums": "#FDF0DC",
    "backward": "#E2F0D9",
    "K/V capture": "#E8DDF0",
    "chunk forward": "#D5EFEA",
    "chunk backward": "#E2F0D9",
    "rebuild": "#F6DDE8",
    "host copies": "#FFF6C8",
    "copy waits": "#F2E6D0",
    "backward embedding": "#EEEEEE",
    "optimizer": "#E6E6E6",
}
OTHER_SHADES = ("#F0F0F0", "#E4ECF4", "#F4ECE4")
MIB, GIB = 2**20, 2**30


def memory_timelines(table, out_dir: Path, reference=None, formats: Sequence[str] = FORMATS) -> list[Path]:
    """One figure per point whose rows name a memory timeline that can be read."""
    rows = table[(table["kind"] == "point") & table["timeline_file"].map(lambda v: bool(cell(v))).astype(bool)]
    if rows.empty or "source_file" not in rows:
        return []
    rows = rows.sort_values("timestamp_utc", kind="stable").drop_duplicates(
        subset=[*FIGURE_KEYS, "method", "checkpoints"], keep="last"
    )
    paths = []
    for _, group in rows.groupby(list(FIGURE_KEYS), sort=True, dropna=False):
        panels = [panel for panel in map(_panel, group.to_dict("records")) if panel is not None]
        if panels:
            paths += _figure(group.iloc[0], panels, Path(out_dir), formats)
    return paths


def _panel(row: dict) -> tuple[dict, Timeline, Timeline | None] | None:
    """(row, measured, predicted or None); None where the measured file is gone."""
    path = Path(row["source_file"]).parent / cell(row["timeline_file"])
    if not path.is_file():
        return None
    predicted = path.with_name(path.name.removesuffix(MEASURED_SUFFIX) + PREDICTED_SUFFIX)
    return row, load_timeline(path), load_timeline(predicted) if predicted.is_file() else None


def _unit(panels) -> tuple[int, str]:
    top = max(max(t.peak.bytes for t in (m, p) if t is not None) for _, m, p in panels)
    return (GIB, "GiB") if top >= GIB else (MIB, "MiB")


def _figure(like, panels, out_dir: Path, formats) -> list[Path]:
    panels.sort(key=lambda panel: (style.method_sort_key(panel[0]["method"]), _placement(panel[0]) != "gpu"))
    count = len(panels)
    columns = 2 if count == 4 else min(count, 3)
    grid = -(-count // columns)
    width, height = style.FIGSIZE_IN
    fig = Figure(figsize=(width, height * (0.75 if grid == 1 else 0.55 * grid)), dpi=style.DPI, layout="constrained")
    axes = fig.subplots(grid, columns, sharey=True, squeeze=False).ravel()
    scale, unit = _unit(panels)
    shades: dict[str, str] = {}
    for ax, (row, measured, predicted) in zip(axes, panels):
        _draw(ax, row, measured, predicted, scale, unit, shades)
    for ax in axes[count:]:
        ax.set_visible(False)
    for ax in axes[::columns]:
        ax.set_ylabel(f"allocated ({unit})", fontsize=style.FONT_SIZE)
    top = max(max(t.peak.bytes, t.capacity_bytes or 0) for _, m, p in panels for t in (m, p) if t is not None)
    axes[0].set_ylim(0, 1.25 * top / scale)  # room above the peaks for their labels (the axis is shared)
    cpu = panels[0][1].memory_source == "tensor-tracker"
    source = "CPU, live-tensor tracker" if cpu else "PyTorch's memory history"
    fig.suptitle(_title(like, source), fontsize=style.FONT_SIZE + 1)
    fig.legend(handles=_legend(panels, shades), loc="outside lower center", ncols=4, fontsize=style.LEGEND_FONT_SIZE)
    name = stem(
        "memory_timeline", short_model(like["model"]), device_part(like), like["protocol"], *setting_parts(like),
        f"T{cell(like['seq_len'])}",
    )  # fmt: skip
    return save(fig, out_dir, name, formats)


def _title(like, source: str) -> str:
    batch = cell(like["batch_size"])
    device = like["device_name"] or like["device"]
    return (
        f"Memory over one step: {like['model']}, T={cell(like['seq_len'])}, B={batch}, {like['dtype']}, "
        f"{like['objective']}, step {like['step']}\n{device} ({source}); time normalised to the step"
    )


def _draw(ax, row: dict, measured: Timeline, predicted: Timeline | None, scale: int, unit: str, shades: dict) -> None:
    colour = style.colour(row["method"])
    ax.tick_params(labelsize=style.FONT_SIZE)
    ax.grid(True, alpha=0.3, linewidth=0.5)
    end = measured.end or 1
    for start, stop, phase in measured.span_bounds():
        group = phase_group(phase)
        if group not in shades:
            shades[group] = PHASE_SHADES.get(group, OTHER_SHADES[len(shades) % len(OTHER_SHADES)])
        ax.axvspan(start / end, stop / end, color=shades[group], linewidth=0, zorder=0)
    xs = [at / end for at in measured.samples["at"]]
    ax.plot(xs, [b / scale for b in measured.samples["bytes"]], color=colour, linewidth=1.2, zorder=3)
    if predicted is not None:
        their_end = predicted.end or 1
        ax.plot(
            [at / their_end for at in predicted.samples["at"]],
            [b / scale for b in predicted.samples["bytes"]],
            color=colour, linestyle=style.ESTIMATE_LINESTYLE, linewidth=1.0, zorder=4,
        )  # fmt: skip
    peak = measured.peak
    ax.plot([peak.at / end], [peak.bytes / scale], marker="o", color=colour, markersize=4, zorder=5)
    ax.annotate(
        f"peak {peak.bytes / scale:.3g} {unit}\n{peak.phase}",
        (peak.at / end, peak.bytes / scale), xytext=(0, 6), textcoords="offset points",
        ha="left" if peak.at / end < 0.5 else "right", fontsize=style.LEGEND_FONT_SIZE, zorder=6,
    )  # fmt: skip
    if measured.capacity_bytes:
        ax.axhline(measured.capacity_bytes / scale, **style.CAPACITY_STYLE)
    if measured.host and any(measured.host["pinned_bytes"]):
        host = measured.host
        ax.step(
            [at / end for at in host["at"]], [(b or 0) / scale for b in host["pinned_bytes"]],
            where="post", color=colour, linestyle=":", linewidth=1.0, zorder=2,
        )  # fmt: skip
    placement = _placement(row)
    extra = f"checkpoints {placement}" if placement != "gpu" else ""
    ax.set_title(style.label(row["method"], extra=extra), fontsize=style.FONT_SIZE)
    ax.set_xlim(0, 1)
    ax.set_xlabel("step time (normalised)", fontsize=style.FONT_SIZE)


def _placement(row: dict) -> str:
    return cell(row.get("checkpoints")) or "gpu"


def _legend(panels, shades: dict) -> list:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="#333333", linewidth=1.2, label="measured")]
    if any(p is not None for _, _, p in panels):
        handles.append(
            Line2D([], [], color="#333333", linestyle=style.ESTIMATE_LINESTYLE, label="predicted (estimate)")
        )
    if any(m.capacity_bytes for _, m, _ in panels):
        handles.append(Line2D([], [], label="capacity (the cap that applied)", **style.CAPACITY_STYLE))
    if any(m.host and any(m.host["pinned_bytes"]) for _, m, _ in panels):
        handles.append(Line2D([], [], color="#333333", linestyle=":", label="host copies of checkpoints"))
    groups: dict[str, list[str]] = {}  # shade -> the phases drawn in it
    for group, shade in shades.items():
        groups.setdefault(shade, []).append(group)
    handles += [Patch(color=shade, label=" / ".join(names)) for shade, names in groups.items()]
    return handles
