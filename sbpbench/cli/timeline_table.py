"""`sbp run --timeline`: where a step's peak memory is, by kind, measured beside predicted, and the
prediction's accuracy per kind and in total (measure/timeline/data.py `peak_accuracy`)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..measure.timeline.data import Timeline, peak_accuracy
from ..records import ResultRow
from .tables import placement_words

MIB = 2**20


def timeline_table(row: ResultRow, measured: Timeline, predicted: Timeline | None) -> Table:
    """A row per kind at the peak: measured and predicted MiB, predicted / measured; then the total
    and the phase of each peak."""
    where = "CPU, live-tensor tracker" if measured.memory_source == "tensor-tracker" else "PyTorch's memory history"
    table = Table(
        title=escape(
            f"The peak by kind: {row.method} {row.model}, B={row.batch_size}, T={row.seq_len}, {row.dtype}"
            + (f", {placement_words(row)}" if row.checkpoints else "")
            + f", {row.device_name} ({where})"
        ),
        caption=escape(
            "MiB at the step's peak; predicted: `sbp estimate`'s walk of the same step on fake tensors"
            + (", for a GPU" if predicted is not None and predicted.point.get("device_name") == "simulated GPU" else "")
            + "; ratio: predicted / measured."
            + (" " + " ".join(measured.notes) if measured.notes else "")
        ),
    )
    for header in ("kind", "measured MiB", "predicted MiB", "ratio"):
        table.add_column(header, justify="left" if header == "kind" else "right", no_wrap=True)
    for bucket in peak_accuracy(measured, predicted):
        table.add_row(
            bucket.kind,
            f"{bucket.measured_bytes / MIB:,.2f}",
            "-" if bucket.predicted_bytes is None else f"{bucket.predicted_bytes / MIB:,.2f}",
            "-" if bucket.ratio is None else f"{bucket.ratio:.3f}",
        )
    table.add_row("peak phase", escape(measured.peak.phase), escape(predicted.peak.phase) if predicted else "-", "")
    if measured.allocator_peak_bytes is not None:
        table.add_row("allocator peak", f"{measured.allocator_peak_bytes / MIB:,.2f}", "", "")
    return table
