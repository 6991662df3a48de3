"""The report's checkpoint-placement section (experiments/long_context.toml): StreamBP with
its layer inputs on the GPU, in pinned host memory, recomputed per segment, or both, side by side.

One table per model and setting whose StreamBP rows hold more than one placement: per placement and
T, the device peak, the host's pinned peak, the bytes copied between them and the step's TFLOP/s;
then each placement's max T from its search. Measured and simulated rows are never mixed in a
table (a simulated one says so in its heading).
"""

from __future__ import annotations

from ..measure.units import GIB
from ..records.select import natural_key, number, present
from .compare import run, setting

GROUP = ("source", "model", "num_layers", "device_name", "memory_limit_bytes", "protocol", "dtype", "objective", "lora_rank", "step", "batch_size")  # fmt: skip


def placement(row) -> str:
    value = row.get("checkpoints")
    return str(value) if present(value) and str(value) else "gpu"


def placements_section(table, markdown_table) -> list[str]:
    """The section's lines; none when no group compares placements."""
    rows = table[table["method"] == "streambp"].copy()
    if rows.empty:
        return []
    rows["placement"] = [placement(row) for _, row in rows.iterrows()]
    groups: dict[tuple, list] = {}
    for index, row in rows.iterrows():
        groups.setdefault(tuple(str(row[c]) for c in GROUP), []).append(index)
    tables = []
    for key in sorted(groups, key=lambda k: tuple(natural_key(p) for p in k)):
        mine = rows.loc[groups[key]].sort_values("timestamp_utc", kind="stable")
        if mine["placement"].nunique() < 2:
            continue
        tables += _group_table(mine, markdown_table)
    if not tables:
        return []
    intro = (
        "StreamBP's layer inputs per placement (`--checkpoints`): device peak / host pinned peak (GiB), "
        "bytes copied host<->device per step (GiB) and TFLOP/s, per T; max T from each placement's search "
        "(≥: no OOM up to its ceiling). Simulated tables are predictions (`sbp maxlen --simulate`), not measurements."
    )
    return ["", "## Checkpoint placements", "", intro, *tables]


def _group_table(rows, markdown_table) -> list[str]:
    like = rows.iloc[-1]
    points = rows[rows["kind"] == "point"]
    seqs = sorted({int(number(t)) for t in points["seq_len"] if present(t)})
    headers = ("placement", *(f"T={t}" for t in seqs), "max T")
    cells = []
    for name in sorted(rows["placement"].unique(), key=_placement_rank):
        cells.append([name, *seq_and_max_t_cells(rows[rows["placement"] == name], seqs, _point_cell)])
    simulated = " (simulated)" if like["source"] == "simulated" else ""
    heading = f"### {like['model']}{simulated}: {setting(like, seq_len=False, method_chunks=False)}, {run(like)}"
    return ["", heading, "", *markdown_table(headers, cells)]


def _placement_rank(name: str) -> tuple:
    order = {"gpu": 0, "cpu": 1}
    return (order.get(name, 2 if name.startswith("recompute") else 3), natural_key(name))


def _gib(value) -> str:
    bytes_ = number(value)
    return "-" if bytes_ is None else f"{bytes_ / GIB:.1f}"


def _point_cell(row) -> str:
    if row["status"] != "ok":
        return str(row["status"])
    cell = f"{_gib(row['peak_allocated_bytes'])} / {_gib(row.get('host_pinned_peak_bytes'))}"
    moved = number(row.get("transfer_bytes"))
    if moved:
        cell += f", moved {moved / GIB:.1f}"
    tflops = number(row.get("tflops_per_s"))
    return cell + ("" if tflops is None else f", {tflops:.0f} TFLOP/s")


def seq_and_max_t_cells(rows, seqs: list[int], point_cell) -> list[str]:
    """A group's table cells: point_cell of its latest point at each T of seqs ("" if none), then its
    latest search's max T. Also the peers table's."""
    cells = []
    for t in seqs:
        at = rows[(rows["kind"] == "point") & (rows["seq_len"].map(number) == t)]
        cells.append(point_cell(at.iloc[-1]) if len(at) else "")
    answers = rows[rows["kind"] == "maxlen"]
    cells.append(max_t_cell(answers.iloc[-1]) if len(answers) else "")
    return cells


def max_t_cell(row) -> str:
    """A search's answer: its status, or max T ("≥": no OOM up to the ceiling)."""
    if row["status"] != "ok":
        return str(row["status"])
    return ("" if present(row.get("oom_seq_len")) else "≥") + f"{number(row['max_seq_len']):.0f}"
