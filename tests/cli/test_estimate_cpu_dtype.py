"""`sbp estimate`'s dtype follows its --target unless --dtype is given: fp32 for a CPU target (what
`sbp run --device cpu` runs), bf16 for a GPU's."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.records import read_rows

runner = CliRunner()
POINT = ["estimate", "--model", "small/qwen3", "--seq", "256", "--method", "ckpt"]


def _estimate(tmp_path, *args: str) -> tuple[str, dict]:
    """The table `sbp estimate POINT args` prints, and the row it writes."""
    out = tmp_path / f"{len(list(tmp_path.iterdir()))}.csv"
    result = runner.invoke(app, [*POINT, *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    (row,) = read_rows(out)
    return result.stdout.replace(str(out), "OUT"), row


@pytest.mark.slow  # three sbp estimate runs: 15 s on 2 busy cores
def test_a_cpu_targets_default_dtype_is_fp32_as_sbp_run_on_a_cpu(tmp_path):
    """--target cpu without --dtype predicts the fp32 point to the byte, says fp32, and differs from
    the bf16 point; --target cuda without --dtype is still bf16's."""
    default, default_row = _estimate(tmp_path, "--target", "cpu")
    fp32, fp32_row = _estimate(tmp_path, "--target", "cpu", "--dtype", "fp32")
    _, bf16_row = _estimate(tmp_path, "--target", "cpu", "--dtype", "bf16")
    assert default == fp32 and ", fp32," in default
    assert default_row["dtype"] == "fp32" and default_row["peak_allocated_bytes"] == fp32_row["peak_allocated_bytes"]
    assert bf16_row["peak_allocated_bytes"] != fp32_row["peak_allocated_bytes"]
    gpu, gpu_row = _estimate(tmp_path, "--target", "cuda")
    assert gpu_row["dtype"] == "bf16" and ", bf16," in gpu


def test_the_estimates_dtype_help_names_both_defaults():
    """`sbp estimate --help` says the dtype default of each target."""
    said = " ".join(runner.invoke(app, ["estimate", "--help"]).output.split())
    assert "(default: bf16; fp32 with --target cpu)" in said
