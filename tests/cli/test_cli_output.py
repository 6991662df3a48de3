"""What a newcomer sees: progress lines in a log, output within 80 columns, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.records import read_rows

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _sbp(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -m sbpbench ARGS` of this checkout, stdout a pipe (not a terminal), 80 columns."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80", "OMP_NUM_THREADS": "1"}
    env.pop("FORCE_COLOR", None)
    return subprocess.run(
        [sys.executable, "-m", "sbpbench", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def _fits(text: str, width: int = 80) -> None:
    """Every line but progress lines (log lines: "[n/N] ..." and "  probe ...", never broken) fits."""
    wide = [line for line in text.splitlines() if len(line) > width and not line.startswith(("[", "  "))]
    assert not wide, f"{len(wide)} line(s) over {width} columns, e.g. {wide[0]!r}"


@pytest.mark.slow
def test_run_in_a_log_prints_a_line_per_point_with_eta_and_records_threads(tmp_path):
    """`sbp run | cat`: one line per finished point (elapsed, ETA), an 80-column table naming the
    thread count, rows with num_threads (as asked) and the load average."""
    out = tmp_path / "r.csv"
    done = _sbp("run", "--model", "tiny/qwen3", "--seq", "32", "--repeats", "1", "--warmup", "0", "--threads", "1",
                "--method", "bp", "streambp", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("[1/2] bp T=32: ok") and "elapsed, ETA" in lines[0]
    assert lines[1].startswith("[2/2] streambp T=32: ok") and "elapsed" in lines[1]
    assert "1 thread(s)" in done.stdout and "streambp" in done.stdout
    _fits(done.stdout.replace(str(tmp_path), "DIR"))  # a path is never broken
    rows = read_rows(out)
    assert [r["num_threads"] for r in rows] == ["1", "1"] and all(float(r["load_avg_1m"]) >= 0 for r in rows)
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.slow
def test_maxlen_in_a_log_prints_each_probe_and_each_answer(tmp_path):
    """`sbp maxlen 2>&1 | cat`: a line per probe as it finishes and one per search, on stderr (progress);
    the table on stdout."""
    out = tmp_path / "m.csv"
    done = _sbp("maxlen", "--model", "tiny/qwen3", "--method", "bp", "--memory-limit", "2MB", "--start", "64",
                "--resolution", "25%", "--max-seq", "2048", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    probes = [line for line in done.stderr.splitlines() if line.startswith("  bp: probe bp T=")]
    assert len(probes) >= 2 and all("elapsed)" in line for line in probes)
    assert any(line.startswith("[1/1] bp: max T ") for line in done.stderr.splitlines())
    assert done.stderr.index("probe") < done.stderr.index("[1/1]") and "bp: probe" not in done.stdout
    _fits(done.stdout.replace(str(tmp_path), "DIR"))  # a path is never broken
    _fits(done.stderr.replace(str(tmp_path), "DIR"))


@pytest.mark.slow
def test_help_wraps_at_80_columns_without_boxes():
    """`COLUMNS=80 sbp run --help`: every line within 80 columns, paragraphs wrapped, no box drawing."""
    done = _sbp("run", "--help")
    assert done.returncode == 0
    _fits(done.stdout)
    assert "│" not in done.stdout and "--threads" in done.stdout


@pytest.mark.slow
def test_a_typer_type_error_is_one_line(tmp_path):
    """`--seq abc` in a real process: `error: ...` on one line, exit 2, no box, nothing written."""
    done = _sbp("run", "--seq", "abc", "--out", str(tmp_path / "r.csv"))
    assert done.returncode == 2
    assert done.stderr.strip() == "error: invalid input: --seq must be an integer, got 'abc'"
    assert not (tmp_path / "r.csv").exists()


def test_models_fits_80_columns():
    """`sbp models` at 80 columns: every name whole, every line within 80 columns, a legend."""
    result = runner.invoke(app, ["models"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    _fits(result.output)
    for name in ("mistralai/Mistral-7B-v0.3", "google/gemma-3-1b-pt", "gemma3_text", "tiny/gemma3"):
        assert name in result.output
    assert "…" not in result.output and "hd: head dim" in result.output


def test_plot_of_garbage_says_not_a_results_csv(tmp_path):
    """A text file given to `sbp plot` / `sbp report`: one line saying it is not a results CSV."""
    path = tmp_path / "notes.csv"
    path.write_text("hello, world\nnot a table\n")
    for command in ("plot", "report"):
        result = runner.invoke(app, [command, str(path)])
        assert result.exit_code == 2
        assert "is not a results CSV" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_report_of_a_truncated_csv_refuses_it_naming_the_line(tmp_path):
    """A fixture CSV cut mid-row: `sbp report` refuses it in one line naming the file, the line and
    the column where it was cut, exit 2, and writes no report."""
    text = (ROOT / "tests" / "fixtures" / "results.csv").read_text()
    path = tmp_path / "cut.csv"
    path.write_text(text[: len(text) - 40])
    done = _sbp("report", str(path), "--out", str(tmp_path / "report.md"))
    assert done.returncode == 2, done.stderr
    count = len(text.splitlines())
    assert f"error: invalid input: {path} line {count} is cut short in column " in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "report.md").exists()


def test_the_progress_bar_keeps_its_times_whole_at_80_columns():
    """On an 80-column terminal the bar's elapsed time and ETA are whole (they were cut to `0:0…`);
    a finished point's line is printed whole above the bar."""
    import io
    import re

    from rich.console import Console

    from sbpbench.cli.progress import Progress

    stream = io.StringIO()
    console = Console(file=stream, width=80, force_terminal=True, color_system=None)
    finished = "streambp T=110000: ok, peak 70.12 GiB, 81.234 s/step"
    with Progress(console, 3) as progress:
        progress.start("measuring streambp (Qwen/Qwen3-8B, T=110000, cuda:0)")
        progress.advance(finished)
    frames = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue()).replace("\r", "\n").splitlines()
    last = [frame for frame in frames if "1/3" in frame and "elapsed" in frame][-1]
    assert re.search(r"elapsed \d:\d\d:\d\d ETA (\d:\d\d:\d\d|-:--:--)$", last.rstrip()), last
    assert len(last.rstrip()) <= 80 and f"[1/3] {finished}" in frames
