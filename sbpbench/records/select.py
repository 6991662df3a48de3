"""Reading rows of a results table: capacity, OOM, comparability with the paper, stable ordering.

Shared by the plots, the report and the CLI, so all call the same rows comparable and draw the same
OOMs. Rows are pandas Series of `load_results` (numbers as floats, empty as NaN, strings "").
Whether a row's model is truncated needs the named model's full depth, which the model registry
knows and this package does not: `with_full_depth` writes it into a column the caller fills.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import fields

from ..measure.units import GIB
from .reference import REQUIRED_COLUMNS
from .schema import KEY_COLUMNS, SKIPPED_TIMEOUT, ResultRow

# skipped = a certain OOM that was not run (records/schema.py): shown exactly like an OOM, unless
# it was skipped as a certain timeout (SKIPPED_TIMEOUT), which says nothing about memory
OOM_STATUSES = ("oom", "skipped")
# The paper's GPU is an A800-80GB; a CUDA row whose capacity is within 10% of 80 GiB stands in for
# it (an H100 80GB has 79.6 GiB, an H200 capped with --memory-limit 80GiB exactly 80).
PAPER_CAPACITY_BYTES = 80 * GIB
CAPACITY_TOLERANCE = 0.10
PROMPTED_OBJECTIVES = ("grpo", "dpo")  # seq_len includes prompt_len; the paper's T is the completion
MAXLEN_TABLE = {"bp": "Figure 3", "train": "Table 3"}  # the paper's max-T table for each step
# An estimate is of the same point as a measurement when these agree: the key, less where it ran.
ESTIMATE_KEY = tuple(c for c in KEY_COLUMNS if c not in ("source", "device_name", "memory_limit_bytes"))
# Times that can rank methods: at least one warm-up step (the first step pays one-off costs: the
# allocator's growth, kernel selection, cold caches) and two timed steps (a spread to tell noise from
# a difference). A smoke run's single cold step made every method faster at T=2048 than at 1024.
MIN_RELIABLE_WARMUP, MIN_RELIABLE_REPEATS = 1, 2
# Not a schema column: the named model's decoder layers, written by `with_full_depth` (NaN: unknown).
FULL_DEPTH_COLUMN = "full_num_layers"


def complete_columns(table):
    """The table with every schema column (a CSV of an older schema lacks some): empty text for
    text columns, NaN for numbers."""
    missing = {f.name: "" if f.type == "str" else math.nan for f in fields(ResultRow) if f.name not in table.columns}
    return table.assign(**missing) if missing else table


def where(rows, keep):
    """rows[keep] for a per-row list of bools, also when both are empty (rows[[]] would select columns)."""
    import numpy as np

    return rows[np.asarray(list(keep), dtype=bool)] if len(rows) else rows


def present(value) -> bool:
    """A cell that holds a value (not NaN, None or "")."""
    if value is None or (isinstance(value, str) and value == ""):
        return False
    return not (isinstance(value, float) and math.isnan(value))


def number(value) -> float | None:
    return float(value) if present(value) else None


def cell(value) -> str:
    """A cell as the CSV wrote it, for exact key comparison: 8192.0 -> "8192", NaN -> ""."""
    if not present(value):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def is_oom(row) -> bool:
    """Ran out of memory, or was skipped as certain to (a results row, a dict of one, or a ResultRow)."""
    status, error = (row.status, row.error) if isinstance(row, ResultRow) else (row["status"], row.get("error"))
    return status in OOM_STATUSES and not (status == "skipped" and str(error or "").startswith(SKIPPED_TIMEOUT))


def timing_caveat(rows) -> str:
    """Why the timed `rows`' times cannot rank methods ("times unreliable (warm-up 0, 1 repeat)"), or
    "" when the warm-up and repeats they record allow it. A row that records neither says nothing."""
    warmups = [w for w in map(number, rows.get("warmup_steps", ())) if w is not None]
    repeats = [r for r in map(number, rows.get("repeats", ())) if r is not None]
    reasons = [f"warm-up {min(warmups):.0f}"] if warmups and min(warmups) < MIN_RELIABLE_WARMUP else []
    if repeats and min(repeats) < MIN_RELIABLE_REPEATS:
        reasons.append(f"{min(repeats):.0f} repeat")
    return f"times unreliable ({', '.join(reasons)})" if reasons else ""


def is_cuda(row) -> bool:
    return str(row["device"]).startswith("cuda")


def _field(row, name: str):
    """A column of a results row, a dict of one, or a ResultRow."""
    return getattr(row, name) if isinstance(row, ResultRow) else row.get(name)


def is_loaded(row) -> bool:
    """A CPU row measured while the machine's 1-minute load exceeded its cores: other work competed
    for them, so its time is slower and noisier than an idle machine's and can bend a curve's shape.
    Rows do not record the machine's cores, so the worker's thread count stands in for them (one per
    physical core unless --threads said otherwise). A GPU row never is: host load delays kernel
    launches, not the kernels a long step's time is spent in. Memory is not affected either way."""
    load, threads = number(_field(row, "load_avg_1m")), number(_field(row, "num_threads"))
    if load is None or threads is None or str(_field(row, "device")).startswith("cuda"):
        return False
    return load > threads


LOADED_MARK = "†"  # beside a time measured at load above the cores (is_loaded), in reports and tables


def load_note(rows) -> str:
    """What the times of `rows` (rows with a time) owe to load: "3 of 8 times taken at load above
    the cores (up to 7.5 on 2 threads)", or "" when none was. `rows`: a table or a list of rows."""
    rows = [row for _, row in rows.iterrows()] if hasattr(rows, "iterrows") else list(rows)
    loaded = [row for row in rows if is_loaded(row)]
    if not loaded:
        return ""
    top = max(loaded, key=lambda row: number(_field(row, "load_avg_1m")))
    load, threads = number(_field(top, "load_avg_1m")), number(_field(top, "num_threads"))
    plural = "" if threads == 1 else "s"
    return (
        f"{len(loaded)} of {len(rows)} times taken at load above the cores "
        f"(up to {load:.1f} on {threads:.0f} thread{plural})"
    )


def capacity_bytes(row) -> float | None:
    """Memory the step could use: the cap that applied if one was set (the one asked for, or the
    device's capacity where that was smaller: memory_limit_effective_bytes), else a GPU's total;
    None for a CPU row without a cap (host RAM is no meaningful limit for the tracked tensors)."""
    limit = number(row.get("memory_limit_effective_bytes")) or number(row.get("memory_limit_bytes"))
    if limit:
        return limit
    total = number(row.get("device_total_memory_bytes"))
    return total if total and is_cuda(row) else None


def is_paper_capacity(row) -> bool:
    """A CUDA row whose capacity stands in for the paper's 80 GB GPU (within CAPACITY_TOLERANCE)."""
    capacity = capacity_bytes(row)
    return is_cuda(row) and capacity is not None and abs(capacity / PAPER_CAPACITY_BYTES - 1) <= CAPACITY_TOLERANCE


def with_full_depth(table, full_depth: Callable[[str], int | None] | None):
    """The table with FULL_DEPTH_COLUMN: `full_depth(model)` for each row (`models.full_depth`: the
    model's depth from its config, None where it cannot be read offline). full_depth None: every depth
    unknown, so no row is called truncated."""
    depths = {} if full_depth is None else {m: full_depth(m) for m in set(map(str, table["model"]))}
    column = [math.nan if depths.get(str(m)) is None else float(depths[str(m)]) for m in table["model"]]
    return table.assign(**{FULL_DEPTH_COLUMN: column})


def is_truncated(row) -> bool:
    """Built with fewer decoder layers than the named model has (`--num-layers`): not the paper's
    model. The named model's depth is the row's FULL_DEPTH_COLUMN (`with_full_depth`); none: False."""
    layers, full = number(row.get("num_layers")), number(row.get(FULL_DEPTH_COLUMN))
    return layers is not None and full is not None and layers < full


def prompt_offset(row) -> int:
    """Tokens of seq_len that are prompt, for objectives whose paper number is a completion length."""
    if row["objective"] in PROMPTED_OBJECTIVES and present(row.get("prompt_len")):
        return int(row["prompt_len"])
    return 0


def natural_key(text) -> tuple:
    """Sort "Qwen3-4B" before "Qwen3-14B": digit runs compare as numbers."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", str(text)))


def short_model(model: str) -> str:
    """ "Qwen/Qwen3-8B" -> "Qwen3-8B"; the package's own shapes keep their prefix ("tiny-qwen3")."""
    prefix, _, name = str(model).rstrip("/").rpartition("/")
    if prefix in ("tiny", "small"):
        return f"{prefix}-{name}"
    return name or str(model)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}".removesuffix(".0")


def device_label(row) -> str:
    """ "NVIDIA H200, limit 80 GiB" / "NVIDIA H100 80GB HBM3 (79.6 GiB, not the paper's 80)" /
    "NVIDIA H100 80GB HBM3, limit 80 GiB capped at 79.6 (the device's)" / "AMD EPYC (cpu)". Marked:
    a cap that applied below the one asked for, and a GPU row compared with the paper's 80 GiB card
    (is_paper_capacity) whose capacity is not exactly that."""
    name = row["device_name"] or row["device"] or "unknown device"
    limit, total = number(row.get("memory_limit_bytes")), number(row.get("device_total_memory_bytes"))
    applied = number(row.get("memory_limit_effective_bytes"))
    not_paper = is_paper_capacity(row) and capacity_bytes(row) != PAPER_CAPACITY_BYTES
    if limit:
        label = f"{name}, limit {limit / GIB:g} GiB"
        if applied and applied < limit:
            label += f" capped at {_gib(applied)} ({'the device' if is_cuda(row) else 'the RAM'}'s)"
        return label + (f", not the paper's {PAPER_CAPACITY_BYTES / GIB:g} GiB" if not_paper else "")
    if not is_cuda(row):
        return f"{name} ({row['device'] or 'cpu'})"
    if not total:
        return name
    return f"{name} ({_gib(total)} GiB, not the paper's 80)" if not_paper else f"{name} ({total / GIB:.0f} GiB)"


def no_reference():
    """An empty reference table: what plots and the report use when the paper's CSV is absent."""
    import pandas as pd

    return pd.DataFrame({c: [] for c in (*REQUIRED_COLUMNS, "note")})


def paper_rows(reference, *, table: str | tuple[str, ...], metric: str, like, method: bool = True, batch: bool = True):
    """Reference rows of `table` and `metric` in the setting of row `like` (model, objective, LoRA or
    not, step, dtype; the batch size and method too unless turned off), single-GPU numbers only."""
    reference = no_reference() if reference is None else reference
    tables = (table,) if isinstance(table, str) else table
    keep = (
        reference["table"].isin(tables)
        & (reference["metric"] == metric)
        & (reference["model"] == like["model"])
        & (reference["objective"] == like["objective"])
        & (reference["lora"] == ((number(like.get("lora_rank")) or 0) > 0))
        & (reference["step"] == like["step"])
        & (reference["dtype"] == like["dtype"])
        & (reference["num_gpus"] == 1)
    )
    if batch:
        keep &= reference["batch_size"] == number(like.get("batch_size"))
    if method:
        keep &= reference["method"] == like["method"]
    return reference[keep]
