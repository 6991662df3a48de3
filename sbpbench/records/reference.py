"""The StreamBP paper's published numbers (experiments/reference/streambp_paper.csv) as a DataFrame.

One row per number in the paper (Luo et al. 2025, arXiv 2506.03077): which table, the setting
(model, method, objective, lora, step, dtype, batch_size, seq_len, num_gpus, device), the metric
and its value in raw units (bytes, seconds, tokens). An OOM cell has status "oom" and no value.
Plots and the report read it through `load_reference`; tests/unit/test_reference.py checks it.
"""

from __future__ import annotations

from pathlib import Path

# The repository's copy; a wheel installed without the repository has none (pass a path).
DEFAULT_REFERENCE = Path(__file__).resolve().parents[2] / "experiments" / "reference" / "streambp_paper.csv"
PAPER_DEVICE = "A800-80GB"  # every single-GPU number in the paper
NUMERIC_COLUMNS = ("value", "batch_size", "seq_len", "num_gpus", "layer_chunk", "logits_chunk")
REQUIRED_COLUMNS = ("table", "model", "method", "objective", "lora", "step", "dtype", "batch_size", "seq_len")
REQUIRED_COLUMNS += ("num_gpus", "metric", "value", "status")


def load_reference(path: str | Path | None = None):
    """The reference CSV with numeric columns as numbers (empty -> NaN) and `lora` as a bool."""
    import pandas as pd

    path = Path(path) if path is not None else DEFAULT_REFERENCE
    if not path.is_file():
        raise FileNotFoundError(f"no paper reference CSV at {path}; pass --reference PATH/streambp_paper.csv")
    table = pd.read_csv(path, keep_default_na=False, dtype=str)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"{path} is not a paper reference CSV (no column {', '.join(missing)})")
    for column in NUMERIC_COLUMNS:
        if column in table.columns:
            table[column] = pd.to_numeric(table[column].replace("", None), errors="coerce")
    table["lora"] = table["lora"] == "true"
    return table
