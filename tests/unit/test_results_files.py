"""Results files a newcomer can trust: checked before work, read robustly, tidy on disk."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
import warnings

import pytest

from sbpbench.records import ResultRow, RowsNotSaved, check_writable, load_results, read_rows, upsert_rows
from sbpbench.records.store import ResultsFileWarning, lock_path
from sbpbench.runner.isolated import POINT_DIR_PREFIX, point_directory, remove_stale_point_dirs


def _row(seq_len: int, **values) -> ResultRow:
    values = {"git_dirty": "false", **values}  # a last column with a value, to cut inside
    return ResultRow(model="tiny/qwen3", method="bp", seq_len=seq_len, status="ok", device_name="cpu", **values)


def _two_rows(tmp_path):
    path = tmp_path / "r.csv"
    upsert_rows(path, [_row(8), _row(16)])
    return path


def _cat(text: str) -> str:
    return text + text  # `cat a.csv a.csv`: the second header is line 4


def _cut_mid_row(text: str) -> str:
    return text[: len(text) - len(text.splitlines()[-1]) // 2 - 2]


def _cut_in_last_field(text: str) -> str:
    return text.rstrip("\r\n")[:-1]


def _cell(column: str, value: str):
    """A damage: line 2's `column` set to `value`."""

    def damage(text: str) -> str:
        lines = [line.rstrip("\r\n").split(",") for line in text.splitlines()]
        lines[1][lines[0].index(column)] = value
        return "".join(",".join(line) + "\r\n" for line in lines)

    return damage


def _extra_field(text: str) -> str:
    header, first, rest = text.split("\r\n", 2)
    return "\r\n".join([header, first + ",x", rest])


DAMAGES = {
    "two files joined": (_cat, "header repeated at line 4"),
    "a key value that is not a number": (
        _cell("seq_len", "xyz"),
        "line 2, column seq_len: 'xyz' is not a whole number",
    ),
    "a bool that is not one": (_cell("fp32_grad_accumulation", "yes"), "line 2, column fp32_grad_accumulation"),
    "a status the schema does not know": (_cell("status", "fine"), "line 2, column status: 'fine' is not one of"),
    "a required value missing": (_cell("status", ""), "line 2, column status: empty"),
    "a row cut mid-row": (_cut_mid_row, r"line 3 is cut short in column \w+ \(\d+ of \d+ fields\)"),
    "a row cut in its last field": (_cut_in_last_field, "line 3 has no line end: cut short in column git_dirty"),
    "a row with an extra field": (_extra_field, r"line 2 has (\d+) fields, the header \d+"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_file_is_refused_by_line_and_column_and_never_rewritten(tmp_path, damage):
    """Each damage: reading, checking before a run and upserting each fail with one line naming the
    file, the line and the column (or the repeated header); the file is left byte for byte."""
    make, words = DAMAGES[damage]
    path = _two_rows(tmp_path)
    path.write_bytes(make(path.read_bytes().decode()).encode())
    before = path.read_bytes()
    for call in (lambda: read_rows(path), lambda: load_results(path), lambda: check_writable(path)):
        with pytest.raises(ValueError, match=f"^{path}.*{words}") as error:
            call()
        assert "\n" not in str(error.value)
    with pytest.raises(RowsNotSaved, match=words):
        upsert_rows(path, [_row(32)])
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (bytes(range(256)) * 2, "byte 0x80 at offset 128 is not UTF-8 text"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "byte 0x89 at offset 0 is not UTF-8 text"),
        (b"schema_version,status,model,method\n\x00\x00\n", "it holds NUL bytes"),
    ],
    ids=["random bytes", "a PNG", "NUL bytes"],
)
def test_a_binary_file_is_refused_in_one_line_naming_it(tmp_path, data, words):
    """Bytes that are not text (a PNG, random data, NULs): one line naming the file, never rewritten."""
    path = tmp_path / "r.csv"
    path.write_bytes(data)
    for call in (lambda: read_rows(path), lambda: check_writable(path)):
        with pytest.raises(ValueError, match=f"^{path} is not a results CSV: {words}"):
            call()
    with pytest.raises(RowsNotSaved):
        upsert_rows(path, [_row(32)])
    assert path.read_bytes() == data


def test_a_csv_with_a_byte_order_mark_reads_and_takes_rows(tmp_path):
    """A UTF-8 BOM before a valid file (a spreadsheet's export) is read past; an upsert keeps its rows."""
    path = _two_rows(tmp_path)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert [r["seq_len"] for r in read_rows(path)] == ["8", "16"]
    upsert_rows(path, [_row(32)])
    assert [r["seq_len"] for r in read_rows(path)] == ["8", "16", "32"]


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
