"""The exactness table: what `sbp check --out FILE` measured, one row per method compared with
standard BP on one model and batch, so that `sbp report --exactness FILE` shows by how much each
method differs (a peer that is not exact is recorded, never assumed either way).

A CSV of its own (not the results schema): a row is a comparison, not a measured point. Errors are
relative, max |ours - bp| / max |bp| (methods/exactness.py); result is exact | differs | unsupported.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(kw_only=True)
class ExactnessRow:
    timestamp_utc: str = ""
    method: str = ""
    reference: str = "bp"
    result: str = ""  # exact | differs | unsupported
    loss_rel_error: float | None = None
    grad_rel_error: float | None = None  # the worst parameter's
    worst_tensor: str = ""
    tolerance: float | None = None
    note: str = ""  # unsupported: why
    model: str = ""
    num_layers: int | None = None
    objective: str = ""
    lora_rank: int | None = None
    dtype: str = ""
    batch_size: int | None = None
    seq_len: int | None = None
    settings: str = ""  # the method's settings, "name=value" joined by spaces
    device: str = ""
    torch_version: str = ""
    transformers_version: str = ""
    git_commit: str = ""
    git_dirty: str = ""


EXACTNESS_COLUMNS = tuple(f.name for f in fields(ExactnessRow))


def write_exactness(path: str | Path, rows: list[ExactnessRow]) -> None:
    """Append rows (the header once)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=EXACTNESS_COLUMNS)
        if new:
            writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


def read_exactness(path: str | Path) -> list[dict[str, str]]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))
