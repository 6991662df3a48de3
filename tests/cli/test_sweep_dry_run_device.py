"""`sbp sweep --dry-run` prices an experiment for the device it runs on: a GPU's for a GPU
experiment, none for a CPU one (runner/pricing.py, simulate/cost.py CPU_NOT_PRICED)."""

from __future__ import annotations

import math
from pathlib import Path

from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.config.experiment import load_experiment
from sbpbench.measure.environment import capture_environment
from sbpbench.records import ResultRow, upsert_rows
from sbpbench.runner.pricing import price_experiment
from sbpbench.workload.rows import spec_fields

ROOT = Path(__file__).resolve().parents[2]
SMOKE_CPU = ROOT / "experiments" / "smoke_cpu.toml"
runner = CliRunner()


def _experiment(tmp_path: Path, device: str) -> Path:
    path = tmp_path / f"on_{device}.toml"
    path.write_text(
        f'name = "on_{device}"\n[defaults]\nmodel = "tiny/qwen3"\ndevice = "{device}"\ndtype = "fp32"\n'
        'method = ["bp", "ckpt"]\n[[points]]\ntitle = "grid"\nseq_len = [64, 128]\n'
    )
    return path


def test_a_cpu_experiments_dry_run_names_no_gpu_and_says_why_it_has_no_price(tmp_path):
    """smoke_cpu.toml's dry run lists its 14 points to run on the CPU, with no GPU named and no
    minutes, says why no time is predicted, and writes nothing."""
    out = tmp_path / "smoke.csv"
    result = runner.invoke(app, ["sweep", str(SMOKE_CPU), "--dry-run", "--out", str(out)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "14 point(s) to run on the CPU" in said
    assert "No time predicted for the CPU" in said and "the time model (timing.py) is a GPU's" in said
    assert "NVIDIA" not in said and "Predicted for" not in said and "device min" not in said
    assert not out.exists()


def test_the_same_points_are_priced_for_a_gpu_only_where_they_run_on_one(tmp_path):
    """One experiment file, device "cuda": priced for a GPU (finite device seconds); device "cpu",
    or "cuda" with --device cpu: listed unpriced, with the CPU's name."""
    gpu = price_experiment(_experiment(tmp_path, "cuda"), results=tmp_path)
    assert gpu.rates is not None and gpu.device == "H100"
    assert all(math.isfinite(cost.device_s) for cost in gpu.costs)
    cpu_name = capture_environment("cpu").device_name
    for path, device in ((_experiment(tmp_path, "cpu"), None), (_experiment(tmp_path, "cuda"), "cpu")):
        cpu = price_experiment(path, results=tmp_path, device=device)
        assert cpu.rates is None and cpu.device == cpu_name
        assert [c.label for c in cpu.costs] == [c.label for c in gpu.costs]
        assert all(math.isnan(cost.device_s) and cost.title == "grid" for cost in cpu.costs)
    said = " ".join(runner.invoke(app, ["sweep", str(_experiment(tmp_path, "cuda")), "--dry-run"]).output.split())
    assert "Predicted for" in said and "No time predicted" not in said


def test_a_cpu_experiments_points_done_are_this_cpus_rows(tmp_path):
    """A CPU experiment's dry run counts as done the points its results CSV holds for this CPU
    (the key its sweep writes), as that sweep would skip them."""
    path, out = _experiment(tmp_path, "cpu"), tmp_path / "on_cpu.csv"
    first = load_experiment(path).grid[0]
    row = ResultRow(**spec_fields(first), kind="point", source="measured", status="ok")
    row.device_name = capture_environment("cpu").device_name
    upsert_rows(out, [row])
    pricing = price_experiment(path, results=tmp_path, out=out)
    assert (pricing.done, len(pricing.costs)) == (1, 3)
