"""The results file as a store, from the command line: damaged files refused before any work in one
line, and a failed rerun that keeps the ok row says so."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import sbpbench.runner as runner_package
from sbpbench.cli import app
from sbpbench.records import ResultRow, read_rows, upsert_rows
from sbpbench.workload.rows import spec_fields

runner = CliRunner()
RUN = ["run", "--model", "tiny/qwen3", "--device", "cpu", "--seq", "16", "--method", "bp"]


def _results(tmp_path: Path) -> Path:
    path = tmp_path / "r.csv"
    rows = [ResultRow(model="tiny/qwen3", method="bp", seq_len=n, status="ok", git_dirty="false") for n in (8, 16)]
    upsert_rows(path, rows)
    return path


def _seq_len_xyz(text: str) -> str:
    header, first, rest = text.split("\r\n", 2)
    cells = first.split(",")
    cells[header.split(",").index("seq_len")] = "xyz"
    return "\r\n".join([header, ",".join(cells), rest])


DAMAGES = {
    "two files joined": (lambda text: text + text, "header repeated at line 4"),
    "seq_len xyz": (_seq_len_xyz, "line 2, column seq_len: 'xyz' is not a whole number"),
    "cut mid-row": (lambda text: text[:-30], "line 3 is cut short in column "),
}


def _never_measures(specs, out):
    raise AssertionError("a point was measured into a damaged file")


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_run_plot_and_report_refuse_a_damaged_file_in_one_line(tmp_path, monkeypatch, damage):
    """`sbp run --out` a damaged file: exit 2 before any point runs, one line naming the file, the
    line and the column, the file untouched; `sbp plot` and `sbp report` give the same line."""
    make, words = DAMAGES[damage]
    path = _results(tmp_path)
    path.write_bytes(make(path.read_bytes().decode()).encode())
    before = path.read_bytes()
    monkeypatch.setattr(runner_package, "run_points", _never_measures)
    for command in (
        RUN + ["--out", str(path)],
        ["plot", str(path), "--out", str(tmp_path / "plots")],
        ["report", str(path)],
    ):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, result.output
        assert f"error: invalid input: {path}" in result.output and words in result.output
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "data", [b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", bytes(range(128, 256))], ids=["png", "random"]
)
def test_plot_and_report_of_a_binary_file_name_it_in_one_line(tmp_path, data):
    """A PNG or random bytes given as results: one line naming the file, not a decoding traceback."""
    path = tmp_path / "r.csv"
    path.write_bytes(data)
    for command in ("plot", "report"):
        result = runner.invoke(app, [command, str(path)])
        assert result.exit_code == 2
        assert f"{path} is not a results CSV: byte 0x" in result.output and "Traceback" not in result.output


def _measuring(status: str, stamp: str, commit: str):
    """A run_points that measures nothing: each spec's row, of `status`, upserted then yielded."""

    def run_points(specs, out):
        for spec in specs:
            row = ResultRow(
                **spec_fields(spec), status=status, device_name="a CPU", git_commit=commit, git_dirty="false"
            )
            row.timestamp_utc, row.loss = stamp, 1.0 if status == "ok" else None
            row.error = "" if status == "ok" else "no result after 0.5 s (--timeout)"
            upsert_rows(out, [row])
            yield row

    return run_points


def test_a_failed_rerun_says_the_ok_row_is_kept(tmp_path, monkeypatch):
    """An ok point rerun into a timeout: the run says the earlier ok row is kept (commit, time), the
    CSV still holds it, and `sbp report` reads it as ok."""
    out = tmp_path / "r.csv"
    monkeypatch.setattr(runner_package, "run_points", _measuring("ok", "2025-01-01T00:00:00+00:00", "a" * 40))
    assert runner.invoke(app, [*RUN, "--out", str(out)]).exit_code == 0
    monkeypatch.setattr(runner_package, "run_points", _measuring("timeout", "2025-02-02T00:00:00+00:00", "b" * 40))
    again = runner.invoke(app, [*RUN, "--out", str(out)])
    line = " ".join(again.output.split())
    assert again.exit_code == 1
    assert f"{out} keeps the ok row(s) of bp from an earlier run (commit aaaaaaa, 2025-01-01T00:00:00+00:00)" in line
    assert "row(s) written" not in line
    (row,) = read_rows(out)
    assert (row["status"], row["loss"]) == ("ok", "1.0")
    assert row["error"].startswith("rerun failed at 2025-02-02T00:00:00+00:00 (commit bbbbbbb): timeout")
    report = runner.invoke(app, ["report", str(out)])
    assert report.exit_code == 0 and "timeout" not in report.output
