"""Results files a newcomer can trust: checked before work, read robustly, tidy on disk."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
import warnings

import pytest

from sbpbench.records import ResultRow, check_writable, load_results, read_rows, upsert_rows
from sbpbench.records.store import ResultsFileWarning, lock_path
from sbpbench.runner.isolated import POINT_DIR_PREFIX, point_directory, remove_stale_point_dirs


def _row(seq_len: int, **values) -> ResultRow:
    values = {"git_dirty": "false", **values}  # a last column with a value, to cut inside
    return ResultRow(model="tiny/qwen3", method="bp", seq_len=seq_len, status="ok", device_name="cpu", **values)


def _two_rows(tmp_path):
    path = tmp_path / "r.csv"
    upsert_rows(path, [_row(8), _row(16)])
    return path


def test_a_truncated_last_line_is_skipped_with_its_line_number(tmp_path):
    """A file cut mid-row: the whole rows read, the cut one is named by line and skipped."""
    path = _two_rows(tmp_path)
    text = path.read_text()
    path.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 2])
    with pytest.warns(ResultsFileWarning, match="line 3 .*cut short"):
        rows = read_rows(path)
    assert [r["seq_len"] for r in rows] == ["8"]


def test_a_row_cut_inside_its_last_field_is_skipped(tmp_path):
    """The right number of fields but no line end: an interrupted copy, skipped with a warning."""
    path = _two_rows(tmp_path)
    path.write_text(path.read_text().rstrip("\r\n")[:-1])
    with pytest.warns(ResultsFileWarning, match="line 3 has no line end"):
        assert len(read_rows(path)) == 1


def test_a_row_missing_required_fields_is_skipped(tmp_path):
    """A row without status (or model, method, schema_version) is named and skipped; others read."""
    path = _two_rows(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = lines[1].replace(",ok,", ",,", 1)
    path.write_text("".join(lines))
    with pytest.warns(ResultsFileWarning, match="line 2 lacks the required field.* status"):
        assert [r["seq_len"] for r in read_rows(path)] == ["16"]


def test_a_file_that_is_not_a_results_csv_says_so(tmp_path):
    """Garbage text is 'not a results CSV', not an empty table; in a folder it is skipped with a warning."""
    path = tmp_path / "notes.csv"
    path.write_text("hello world\nthis is not, a table\n")
    with pytest.raises(ValueError, match="not a results CSV"):
        read_rows(path)
    with pytest.raises(ValueError, match="not a results CSV"):
        load_results(path)
    _two_rows(tmp_path)
    with pytest.warns(ResultsFileWarning, match="notes.csv is not a results CSV"):
        assert len(load_results(tmp_path)) == 2


def test_a_csv_gets_the_umask_mode_and_keeps_a_chosen_one(tmp_path):
    """New CSVs are 0666 & ~umask (mkstemp alone gives 0600); a chmod of an existing file survives writes."""
    old = os.umask(0o022)
    try:
        path = _two_rows(tmp_path)
        assert path.stat().st_mode & 0o777 == 0o644
        path.chmod(0o600)
        upsert_rows(path, [_row(32)])
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_no_lock_file_is_left_and_a_stale_one_is_taken(tmp_path):
    """A write removes its lock; a lock file no process holds (a killed writer's) does not block."""
    path = _two_rows(tmp_path)
    assert not lock_path(path).exists()
    lock_path(path).write_text("")  # left by a SIGKILLed writer
    upsert_rows(path, [_row(32)])
    assert not lock_path(path).exists() and len(read_rows(path)) == 3


def test_a_held_lock_is_waited_for_not_removed(tmp_path):
    """While another process holds the CSV's lock, a writer waits (here: still waiting after 3 s)."""
    path = _two_rows(tmp_path)
    code = f"import sbpbench.records as r; print('ready', flush=True); r.check_writable({str(path)!r})"
    with lock_path(path).open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(1)
        assert writer.poll() is None, "a writer took a lock another process held"
        fcntl.flock(held, fcntl.LOCK_UN)
        assert writer.wait(timeout=60) == 0  # and goes on once it is released


def test_unwritable_output_is_refused_naming_the_csv_not_its_lock(tmp_path):
    """A folder we may not create files in: the error names the CSV (and says what to pass)."""
    if os.geteuid() == 0:
        target = "/proc/forbidden.csv"  # root may write anywhere else
    else:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o500)
        target = str(folder / "r.csv")
    with pytest.raises(OSError) as error:  # as root: NotWritable (/proc takes no files), else PermissionError
        check_writable(target)
    assert target in str(error.value) and ".lock" not in str(error.value) and "--out" in str(error.value)


def test_stale_point_directories_are_removed_and_live_ones_kept(tmp_path):
    """A point directory no process holds (a killed run's) is removed; one in use is not."""
    stale = tmp_path / f"{POINT_DIR_PREFIX}dead"
    stale.mkdir()
    (stale / ".held").write_text("")
    (stale / "result.json").write_text("{}")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    remove_stale_point_dirs.cache_clear()
    with point_directory() as live:
        os.utime(live, (old, old))
        assert remove_stale_point_dirs(str(tmp_path)) == 1
        assert not stale.exists()
        remove_stale_point_dirs.cache_clear()
        assert remove_stale_point_dirs(live.parent.as_posix()) >= 0 and live.exists()
    assert not live.exists()


def test_reading_a_clean_file_warns_nothing(tmp_path):
    """A file sbpbench wrote reads without a warning."""
    path = _two_rows(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_rows(path)) == 2
