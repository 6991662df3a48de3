"""The paper's reference numbers (experiments/reference/streambp_paper.csv) and the Table 3 experiment file,
checked against PAPER.md (Luo et al. 2025, arXiv 2506.03077)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomllib is in the standard library from 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT / "experiments" / "reference" / "streambp_paper.csv"
TOML = ROOT / "experiments" / "paper_table3.toml"
COLUMNS = [
    "source",
    "table",
    "model",
    "method",
    "objective",
    "lora",
    "step",
    "dtype",
    "batch_size",
    "seq_len",
    "num_gpus",
    "device",
    "metric",
    "value",
    "status",
    "layer_chunk",
    "logits_chunk",
    "note",
]
GIB = 2**30
# Table 3 has 3 objectives x 3 methods x 6 model columns = 54 cells; 9 are "-" (GRPO and DPO for
# Qwen3-8B full, GRPO for Qwen3-32B LoRA, each for all three methods), so 45 numbers.
NUM_TABLE3_CELLS = 3 * 3 * 6 - 3 * 3


@pytest.fixture(scope="module")
def ref() -> pd.DataFrame:
    return pd.read_csv(CSV, keep_default_na=False, dtype=str)


def _row(ref: pd.DataFrame, where: dict) -> pd.Series:
    rows = ref
    for column, wanted in where.items():
        rows = rows[rows[column] == str(wanted)]
    assert len(rows) == 1, f"expected one row for {where}, found {len(rows)}"
    return rows.iloc[0]


def _value(ref: pd.DataFrame, where: dict) -> float:
    return float(_row(ref, where)["value"])


def test_csv_has_the_columns_in_order_and_numeric_values(ref):
    """Header is exactly COLUMNS; every value is a finite number, or empty with status "oom"."""
    assert list(ref.columns) == COLUMNS
    for i, row in ref.iterrows():
        if row["value"] == "":
            assert row["status"] == "oom", f"row {i}: empty value but status {row['status']!r}"
        else:
            assert row["status"] == "ok", f"row {i}: value {row['value']!r} but status {row['status']!r}"
            assert math.isfinite(float(row["value"])), f"row {i}: value {row['value']!r}"
    assert set(ref["lora"]) == {"true", "false"}
    assert set(ref["step"]) <= {"bp", "train"}
    assert set(ref["source"]) == {"Luo et al. 2025, arXiv 2506.03077"}
    assert not ref.duplicated(subset=[c for c in COLUMNS if c not in ("value", "status")]).any()


def test_figure3_max_lengths_and_weights_grads(ref):
    """Figure 3: Qwen3-8B max T is 4.7k / 20k / 110k; Qwen3-14B weights + grads is 55.0 GiB."""
    fig3 = {"table": "Figure 3", "model": "Qwen/Qwen3-8B", "metric": "max_seq_len"}
    assert _value(ref, {**fig3, "method": "streambp"}) == 110000
    assert _value(ref, {**fig3, "method": "ckpt"}) == 20000
    assert _value(ref, {**fig3, "method": "bp"}) == 4700
    wg = _value(ref, {"table": "Figure 3", "model": "Qwen/Qwen3-14B", "metric": "weights_grads_bytes"})
    assert wg == round(55.0 * GIB)


def test_table1_times_and_oom(ref):
    """Table 1: w/ ckpt takes 24.3 s at T=24k; w/o ckpt is OOM at 9k."""
    t1 = {"table": "Table 1", "model": "Qwen/Qwen3-4B", "metric": "time_s"}
    assert _value(ref, {**t1, "method": "ckpt", "seq_len": 24000}) == 24.3
    oom = _row(ref, {**t1, "method": "bp", "seq_len": 9000})
    assert (oom["status"], oom["value"]) == ("oom", "")


def test_table3_and_table9_spot_values(ref):
    """Table 3 DPO StreamBP Qwen3-32B LoRA is 7.8k; Table 9 Gemma-3-1B StreamBP at 18k is 7.9 GiB."""
    t3 = {"table": "Table 3", "objective": "dpo", "method": "streambp", "model": "Qwen/Qwen3-32B", "lora": "true"}
    assert _value(ref, {**t3, "metric": "max_seq_len"}) == 7800
    t9 = {"table": "Table 9", "model": "google/gemma-3-1b-pt", "method": "streambp", "seq_len": 18000}
    assert _value(ref, {**t9, "metric": "peak_allocated_bytes"}) == round(7.9 * GIB)


def test_table3_has_one_row_per_reported_cell(ref):
    """Table 3 has 45 rows: every non-"-" cell once, none of the "-" cells."""
    t3 = ref[ref["table"] == "Table 3"]
    assert len(t3) == NUM_TABLE3_CELLS
    assert set(t3["step"]) == {"train"}
    assert not t3.duplicated(subset=["model", "lora", "objective", "method"]).any()
    cells = set(zip(t3["objective"], t3["model"], t3["lora"]))
    assert ("grpo", "Qwen/Qwen3-8B", "false") not in cells
    assert ("dpo", "Qwen/Qwen3-8B", "false") not in cells
    assert ("grpo", "Qwen/Qwen3-32B", "true") not in cells


def test_table3_toml_points_match_the_reference_cells(ref):
    """paper_table3.toml has exactly one [[points]] entry per reported Table 3 (objective, model, LoRA) cell."""
    with TOML.open("rb") as f:
        spec = tomllib.load(f)
    assert spec["kind"] == "maxlen"
    assert spec["reference"] == "experiments/reference/streambp_paper.csv"
    assert spec["defaults"]["method"] == ["bp", "ckpt", "streambp"]
    points = spec["points"]
    keys = [(p["objective"], p["model"], "true" if p["lora_rank"] > 0 else "false") for p in points]
    assert len(keys) == len(set(keys)), "duplicate points"
    t3 = ref[ref["table"] == "Table 3"]
    assert set(keys) == set(zip(t3["objective"], t3["model"], t3["lora"]))
    for p in points:
        assert p["batch_size"] == {"sft": 1, "grpo": 8, "dpo": 2}[p["objective"]]
        assert p["lora_rank"] in (0, 32)
        if p["lora_rank"]:
            assert p["lora_alpha"] == 128
        if p["objective"] in ("grpo", "dpo"):
            assert p["prompt_len"] == 1000
