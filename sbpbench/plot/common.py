"""What every figure module shares: grouping rows into figures and series, names, titles, saving.

Figures are built with matplotlib's object API (`Figure`, no pyplot), so no global state and no
display backend: PNG through Agg, SVG through its own writer. Output is deterministic (no date in
the SVG, a fixed hash salt), so re-plotting an unchanged table gives the same files.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from ..records.select import (
    cell,
    device_label,
    is_truncated,
    load_note,
    natural_key,
    number,
    present,
    short_model,
    timing_caveat,
    where,
)
from ..settings import default_of
from . import style

FORMATS = ("png", "svg")
# The settings a figure of one model holds fixed; the x axis (seq_len or batch_size) varies.
POINT_GROUP = (
    "model",
    "num_layers",
    "device_name",
    "memory_limit_bytes",
    "protocol",
    "dtype",
    "objective",
    "lora_rank",
    "step",
    "batch_size",
)


def group_rows(rows, keys: Sequence[str]) -> Iterator[tuple[tuple[str, ...], object]]:
    """(key, rows) for each distinct value of `keys`, in natural order; NaN is a value ("")."""
    if rows.empty:
        return
    keyed = keys_of(rows, keys)
    for key in sorted(set(keyed), key=lambda k: tuple(natural_key(part) for part in k)):
        yield key, where(rows, (k == key for k in keyed))


def keys_of(rows, keys: Sequence[str]) -> list[tuple[str, ...]]:
    """Each row's values of `keys` as the CSV wrote them (NaN: "")."""
    return [tuple(cell(value) for value in values) for values in rows[list(keys)].itertuples(index=False)]


def placements_of(rows):
    """Each row's StreamBP checkpoint placement; gpu where none is recorded (other methods, older rows)."""
    if "checkpoints" not in rows:
        return rows["method"].map(lambda _: "gpu")
    return rows["checkpoints"].map(lambda value: cell(value) or "gpu")  # an all-empty column reads as float NaN


def series_marker(method: str, part) -> str:
    """The marker of a series (rows of one method): its placement's where it is one StreamBP
    placement, else the method's."""
    placements = placements_of(part).unique()
    if method == "streambp" and len(placements) == 1:
        return style.placement_marker(placements[0])
    return style.marker(method)


def series(rows) -> Iterator[tuple[str, bool, str, object]]:
    """(method, simulated, extra label, rows) per line or bar set: one per method and source, and
    per StreamBP checkpoint placement and chunk size where a group holds several. Reruns of a
    point: the latest row wins."""
    streambp = rows["method"] == "streambp"
    chunks = rows.loc[streambp, "chunk_size"].dropna().unique()
    placement_of = placements_of(rows)
    placements = sorted(placement_of[streambp].unique())
    for method in sorted(rows["method"].unique(), key=style.method_sort_key):
        for source in ("measured", "simulated"):
            mine = rows[(rows["method"] == method) & (rows["source"] == source)]
            by_chunk = method == "streambp" and len(chunks) > 1
            by_placement = method == "streambp" and len(placements) > 1
            for placement in placements if by_placement else [None]:
                placed = mine if placement is None else mine[placement_of[mine.index] == placement]
                for chunk in sorted(placed["chunk_size"].dropna().unique()) if by_chunk else [None]:
                    part = placed if chunk is None else placed[placed["chunk_size"] == chunk]
                    if part.empty:
                        continue
                    part = part.sort_values("timestamp_utc", kind="stable")
                    point = part["kind"].iloc[0] == "point"
                    part = part.drop_duplicates(
                        subset=["seq_len", "batch_size"] if point else ["model", "num_layers"], keep="last"
                    )
                    labels = ([] if placement is None else [placement]) + (
                        [] if chunk is None else [f"chunk {int(chunk)}"]
                    )
                    yield method, source == "simulated", ", ".join(labels), part


def setting_parts(like, *, always: bool = False) -> list[str]:
    """The settings that tell figures of one model apart. always=False leaves out the paper's
    defaults (sft, full fine-tuning, step bp, bf16, its batch size, the whole model)."""
    objective, rank = like["objective"], int(number(like.get("lora_rank")) or 0)
    batch = number(like.get("batch_size"))
    parts = [
        objective if always or objective != "sft" else "",
        f"lora{rank}" if rank else ("full" if always else ""),
        like["step"] if always or like["step"] != "bp" else "",
        like["dtype"] if like["dtype"] != "bf16" else "",
        f"B{batch:.0f}" if batch is not None and batch != default_of("batch_size", objective=objective) else "",
        f"{cell(like['num_layers'])}layers" if is_truncated(like) else "",
    ]
    return [p for p in parts if p]


def device_part(like) -> str:
    """The device in a file name: "NVIDIA-H200-limit80GiB", "AMD-EPYC"."""
    limit = number(like.get("memory_limit_bytes"))
    name = style.file_safe(like["device_name"] or like["device"])
    return f"{name}-limit{limit / 2**30:g}GiB" if limit else name


def stem(metric: str, *parts: str) -> str:
    """File name without extension: `memory_vs_seq__Qwen3-8B__NVIDIA-H200-limit80GiB__steady`."""
    return "__".join(style.file_safe(p) for p in (metric, *parts) if p)


def model_title(like) -> str:
    layers = number(like.get("num_layers"))
    depth = f" ({layers:.0f} layers)" if layers is not None and is_truncated(like) else ""
    return f"{like['model']}{depth}"


def setting_title(like, *, batch: bool = True) -> str:
    """ "sft, full, step bp, bf16, B=1" """
    rank, size = int(number(like.get("lora_rank")) or 0), number(like.get("batch_size"))
    parts = [like["objective"], f"LoRA r{rank}" if rank else "full", f"step {like['step']}", like["dtype"]]
    return ", ".join(parts + ([f"B={size:.0f}"] if batch and size is not None else []))


def timing_title(rows) -> str:
    """The title line a time figure of `rows` gets where their warm-up and repeats make the times
    unreliable, so that no one ranks methods by it; "" otherwise."""
    timed = rows[(rows["status"] == "ok") & rows["time_median_s"].map(present)]
    caveat = timing_caveat(timed)
    return f"\n{caveat}: not a ranking of the methods" if caveat else ""


def load_title(rows) -> str:
    """The title line a time figure gets where some of its times were measured at load above the
    cores (records.select.is_loaded): they are drawn hollow and the shape may be load's, not the
    method's; "" otherwise. `rows`: the rows whose times the figure draws."""
    timed = rows[(rows["status"] == "ok") & rows["time_median_s"].map(present)]
    note = load_note(timed)
    return f"\n{note}: hollow, slower than idle" if note else ""


# Where an OOM's cross sits, in axes fraction: on an edge, so that it reads as no value. A memory
# figure puts it on the top edge (the peak went past the cap), a time figure on the x axis (no time).
OOM_EDGES = {"top edge": 1.0, "x axis": 0.0}
OOM_MEANING = {"top edge": "no peak", "x axis": "no time"}


def oom_marks(ax, xs, edge: str, **options) -> None:
    """OOMs as crosses at each x on an edge of the axes (OOM_EDGES), drawn over it, not clipped.
    Left out of the layout: the extent of an unclipped line in axes fraction misleads it into
    shrinking the axes by a third."""
    (line,) = ax.plot(
        list(xs),
        [OOM_EDGES[edge]] * len(xs),
        style.OOM_MARKER,
        markersize=8,
        markeredgewidth=2,
        linestyle="none",
        clip_on=False,
        zorder=5,
        transform=ax.get_xaxis_transform(),
        **options,
    )
    line.set_in_layout(False)


def oom_legend(ax, edge: str) -> None:
    """The legend entry of the OOM crosses: where they sit and what that means."""
    ax.plot([], [], style.OOM_MARKER, color="black", markeredgewidth=2, label=oom_label(edge))


def oom_label(edge: str) -> str:
    return f"out of memory (crosses on the {edge}: {OOM_MEANING[edge]})"


def where_title(like) -> str:
    return f"{device_label(like)}, {like['protocol'] or '?'} protocol"


def new_figure() -> tuple[Figure, object]:
    fig = Figure(figsize=style.FIGSIZE_IN, dpi=style.DPI, layout="constrained")
    ax = fig.add_subplot()
    ax.tick_params(labelsize=style.FONT_SIZE)
    ax.grid(True, alpha=0.3, linewidth=0.5)
    return fig, ax


LEGEND_COLUMN_CHARS = 56  # the longest label three legend columns hold at LEGEND_FONT_SIZE in FIGSIZE_IN


def finish(fig: Figure, ax, title: str, handles: Sequence = ()) -> None:
    """Title over the figure; the legend under the axes (never over the data): ours first, then
    capacity and weights lines, the paper's numbers, OOM. `handles`: proxies for bars."""
    fig.suptitle(title, fontsize=style.FONT_SIZE + 1)
    drawn, labels = ax.get_legend_handles_labels()
    entries = list(zip(drawn, labels)) + [(h, h.get_label()) for h in handles]
    entries.sort(key=lambda entry: _legend_rank(entry[1]))
    longest = max((len(text) for _, text in entries), default=0)
    fig.legend(
        [h for h, _ in entries],
        [t for _, t in entries],
        loc="outside lower center",
        ncols=3 if longest <= LEGEND_COLUMN_CHARS else 2,  # a max T in a label: wider columns, within the figure
        fontsize=style.LEGEND_FONT_SIZE,
    )


def _legend_rank(text: str) -> int:
    if text.startswith("out of memory"):
        return 3
    if "paper" in text:
        return 2
    return 1 if text.startswith(("capacity", "weights")) else 0


def save(fig: Figure, out_dir: Path, name: str, formats: Sequence[str]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out_dir / f"{name}.{fmt}"
        metadata = {"Date": None} if fmt in ("svg", "pdf") else None
        with _deterministic_svg():
            fig.savefig(path, format=fmt, dpi=style.DPI, metadata=metadata)
        paths.append(path)
    return paths


def _deterministic_svg():
    import matplotlib

    return matplotlib.rc_context({"svg.hashsalt": "sbpbench", "svg.fonttype": "none"})


def log2_x(ax, values) -> None:
    """A base-2 log x axis where values span 8x or more (doubling sweeps), with plain tick labels."""
    from matplotlib.ticker import FuncFormatter

    values = [v for v in values if v and v > 0]
    if values and max(values) / min(values) >= 8:
        ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f}"))


def short(like) -> str:
    return short_model(like["model"])
