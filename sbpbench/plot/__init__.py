"""Figures of a results table (`records.load_results`), pure consumers of the CSV.

Each figure function takes the table, an output directory, the paper's reference table (or None)
and the formats, draws every figure the table has the data for, and returns the paths written.
File names: `<metric>__<model>__<device>__<protocol>[__<setting>...].<fmt>`, e.g.
`memory_vs_seq__Qwen3-8B__NVIDIA-H200-limit80GiB__steady.png`; see each module for its figure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ..records.select import complete_columns, with_full_depth
from .common import FORMATS
from .maxlen import max_seq_len_bars
from .memory import memory_vs_seq
from .peers import max_len_vs_time_per_token
from .predicted import measured_on_predicted
from .timeline import memory_timelines
from .timing import time_per_sample_vs_batch, time_vs_seq

FIGURES = (
    memory_vs_seq,
    time_vs_seq,
    max_seq_len_bars,
    time_per_sample_vs_batch,
    max_len_vs_time_per_token,
    measured_on_predicted,
    memory_timelines,
)


def plot_all(
    table,
    out_dir: str | Path,
    reference=None,
    formats: Sequence[str] = FORMATS,
    full_depth: Callable[[str], int | None] | None = None,
) -> list[Path]:
    """Every figure the table has data for, in each format; the written paths, sorted.
    full_depth: a model name's decoder layers (`models.full_depth`), to mark and keep away from the
    paper's numbers a model built with fewer; None: no row is called truncated."""
    for fmt in formats:
        if fmt not in ("png", "svg", "pdf"):
            raise ValueError(f"unknown figure format {fmt!r}; choose from png, svg, pdf")
    table = with_full_depth(complete_columns(table), full_depth)
    return sorted(path for figure in FIGURES for path in figure(table, Path(out_dir), reference, formats))


__all__ = [
    "FIGURES",
    "FORMATS",
    "max_len_vs_time_per_token",
    "max_seq_len_bars",
    "measured_on_predicted",
    "memory_timelines",
    "memory_vs_seq",
    "plot_all",
    "time_per_sample_vs_batch",
    "time_vs_seq",
]
