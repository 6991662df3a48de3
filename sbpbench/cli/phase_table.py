"""`sbp run --phases`: where a streambp step's time went, a row per phase (the row's phase_*_s
columns, core/phases.py) beside the FLOPs it executes and its achieved rate (measure/flops.py).

Shares are of the step: the compute stream's phases and the rest add up to it. On a GPU the host
copies run on a side stream beside them, so they get no share; the wait they leave is "copy waits".
FLOPs are modelled for full fine-tuning with SFT (measure/flops.py phase_flops); other points show
seconds only.
"""

from __future__ import annotations

import re

from rich.markup import escape
from rich.table import Table

from ..records import ResultRow
from ..records.schema import phase_column
from .tables import placement_words

# core/phases.py PHASES, in order (the CLI's help imports no torch; tests/cli/test_cli_phases.py checks it)
PHASE_NAMES = (
    "checkpoint pass",
    "head",
    "K/V capture",
    "chunk forward",
    "chunk backward",
    "rebuild",
    "host copies",
    "copy waits",
)
BESIDE = "host copies"  # on a GPU: a side stream's time, beside the compute stream's phases


def has_phases(row: ResultRow) -> bool:
    return row.phase_other_s is not None


def _flops(row: ResultRow) -> dict[str, float]:
    """phase -> FLOPs one step executes, for a full fine-tuning SFT point; {} otherwise."""
    if row.objective != "sft" or row.lora_rank:
        return {}
    from ..measure.flops import phase_flops
    from ..models import load_config

    recompute = re.search(r"recompute:(\d+)", row.checkpoints or "")  # core/placements/placement.py's names
    config = load_config(row.model, **({"num_hidden_layers": row.num_layers} if row.num_layers else {}))
    phases = phase_flops(
        config,
        method="streambp",
        batch_size=row.batch_size,
        seq_len=row.seq_len,
        recompute_every=int(recompute.group(1)) if recompute else 1,
    )
    return {name: matmul + attention for name, (matmul, attention) in phases.items()}


def phase_table(row: ResultRow) -> Table:
    """A row per phase that ran (seconds, share of the step, TFLOP, TFLOP/s), then the rest and the step."""
    beside = row.device.startswith("cuda")
    seconds = {name: getattr(row, phase_column(name)) or 0.0 for name in PHASE_NAMES}
    step = row.phase_other_s + sum(s for name, s in seconds.items() if not (beside and name == BESIDE))
    flops = _flops(row)
    table = Table(
        title=escape(
            f"Where the time went: streambp {row.model}, B={row.batch_size}, T={row.seq_len}, {row.dtype}, "
            f"{placement_words(row)}, chunks {row.chunk_size}/{row.logits_chunk_size}, {row.device_name}"
        ),
        caption=escape(
            "s: seconds of the median timed step, summed over layers; share: of the step"
            + ("; host copies run beside the step on a side stream" if beside else "")
            + ("; TFLOP: executed by the phase (measure/flops.py), TFLOP/s: TFLOP / s" if flops else "")
            + "."
        ),
    )
    for header in ("phase", "s", "share", *(("TFLOP", "TFLOP/s") if flops else ())):
        table.add_column(header, justify="left" if header == "phase" else "right", no_wrap=True)
    for name, value in seconds.items():
        if value == 0.0 and name not in flops:
            continue
        share = "beside" if beside and name == BESIDE else f"{value / step:.0%}" if step else "-"
        table.add_row(name, f"{value:.3f}", share, *_rate(flops.get(name), value, flops))
    other = f"{row.phase_other_s / step:.0%}" if step else "-"
    table.add_row("other", f"{row.phase_other_s:.3f}", other, *_rate(None, 0, flops))
    table.add_row("step", f"{step:.3f}", "100%", *_rate(sum(flops.values()) or None, step, flops))
    return table


def _rate(flops: float | None, seconds: float, shown: dict) -> tuple[str, ...]:
    if not shown:
        return ()
    if flops is None:
        return ("-", "-")
    return (f"{flops / 1e12:.3g}", f"{flops / seconds / 1e12:.3g}" if seconds else "-")
