"""The command line's edges: --version, SIGTERM, a bare unknown model name, what `sbp run
--timeline` leaves in a checkout, sizes of a tiny model."""

from __future__ import annotations

import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbpbench.cli import _terminated, app
from sbpbench.measure.units import gib

ROOT = Path(__file__).resolve().parents[2]


def test_version_prints_the_package_version():
    """`sbp --version` prints the installed version and exits 0."""
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"sbp {version('sbpbench')}"


def test_sigterm_says_one_line_and_exits_143(capsys):
    """The SIGTERM handler prints one line on stderr and exits 143 (128 + 15)."""
    with pytest.raises(SystemExit) as ended:
        _terminated(15, None)
    assert ended.value.code == 143 and len(capsys.readouterr().err.splitlines()) == 1


def test_a_bare_unknown_model_name_is_not_sent_to_hf_download():
    """`--model qwen3` suggests the registry's names, not `hf download qwen3` (no such Hub id)."""
    result = CliRunner().invoke(app, ["run", "--model", "qwen3"])
    assert result.exit_code == 2 and "hf download" not in result.output and "`sbp models`" in result.output


def test_the_default_timeline_folder_is_ignored_by_git():
    """`sbp run --timeline` writes beside results/runs.csv: results/timelines/ is ignored, a study's
    timelines under results/<device>/ are not."""
    ignored = subprocess.run(["git", "check-ignore", "-q", "results/timelines/a.json"], cwd=ROOT)
    kept = subprocess.run(["git", "check-ignore", "-q", "results/gpu/x/timelines/a.json"], cwd=ROOT)
    assert (ignored.returncode, kept.returncode) == (0, 1)


def test_the_trainer_examples_output_folder_is_ignored_by_git():
    """docs/trainers.md's examples write output_dir="out": out/ in the checkout is ignored, docs/out is not."""
    assert 'output_dir="out"' in (ROOT / "docs" / "trainers.md").read_text()
    ignored = subprocess.run(["git", "check-ignore", "-q", "out/checkpoint-3/model.safetensors"], cwd=ROOT)
    kept = subprocess.run(["git", "check-ignore", "-q", "docs/out/a.md"], cwd=ROOT)
    assert (ignored.returncode, kept.returncode) == (0, 1)


def test_a_size_that_rounds_to_zero_gib_keeps_two_significant_digits():
    """A tiny model's 3.4e-5 GiB shows 0.000034, not 0.00; zero and large sizes as before."""
    assert [gib(3.4e-5 * 2**30), gib(0.0034 * 2**30), gib(0), gib(2**30)] == ["0.000034", "0.0034", "0.00", "1.00"]
