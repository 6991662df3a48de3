"""Results CSV: schema, upsert by key, atomic writes, reading old schemas back."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
import textwrap

import pytest

from sbpbench.records import (
    COLUMNS,
    KEY_COLUMNS,
    SCHEMA_VERSION,
    ResultRow,
    RowsNotSaved,
    check_writable,
    completed_keys,
    decode_row,
    keeps_earlier,
    load_results,
    read_rows,
    row_key,
    upsert_rows,
)


def _row(seq_len: int, method: str = "bp", **values) -> ResultRow:
    return ResultRow(
        model="tiny/qwen3", method=method, seq_len=seq_len, device_name="cpu", **{"status": "ok", **values}
    )


def test_columns_follow_the_dataclass_and_units_are_in_names(tmp_path):
    """The header is the dataclass field order; byte and second columns say their unit."""
    path = tmp_path / "r.csv"
    upsert_rows(path, [_row(8)])
    with path.open() as f:
        assert tuple(next(csv.reader(f))) == COLUMNS
    assert set(KEY_COLUMNS) <= set(COLUMNS)
    assert not [c for c in COLUMNS if "memory" in c and not c.endswith(("_bytes", "_source"))]
    assert read_rows(path)[0]["schema_version"] == str(SCHEMA_VERSION)


def test_upsert_replaces_a_rerun_point_and_keeps_the_others(tmp_path):
    """Same key: the new row replaces the old in place; replace=False keeps the old one."""
    path = tmp_path / "r.csv"
    upsert_rows(path, [_row(8, loss=1.0), _row(16, loss=2.0)])
    upsert_rows(path, [_row(8, loss=3.0), _row(32, loss=4.0)])
    assert [(r["seq_len"], r["loss"]) for r in read_rows(path)] == [("8", "3.0"), ("16", "2.0"), ("32", "4.0")]
    upsert_rows(path, [_row(16, loss=9.0)], replace=False)
    assert read_rows(path)[1]["loss"] == "2.0"
    assert row_key(_row(32)) in completed_keys(path)


def test_values_round_trip_exactly(tmp_path):
    """Floats keep full precision, None is empty, bools are true/false."""
    path = tmp_path / "r.csv"
    upsert_rows(path, [_row(8, loss=0.1 + 0.2, fp32_grad_accumulation=True)])
    row = read_rows(path)[0]
    assert float(row["loss"]) == 0.1 + 0.2
    assert row["fp32_grad_accumulation"] == "true" and row["time_median_s"] == ""


def test_rows_of_an_older_schema_read_back(tmp_path):
    """A file written with fewer columns (an older schema): its rows read back with the new columns empty, and upsert keeps them."""
    path = tmp_path / "r.csv"
    path.write_text("schema_version,model,method,seq_len,status,device_name\n0,tiny/qwen3,bp,4,ok,cpu\n")
    upsert_rows(path, [_row(8)])
    rows = read_rows(path)
    assert rows[0]["schema_version"] == "0" and rows[0]["loss"] == ""
    assert rows[1]["seq_len"] == "8"
    table = load_results(path)
    assert list(table.columns[: len(COLUMNS)]) == list(COLUMNS) and len(table) == 2


@pytest.mark.parametrize("failure", ["oom", "error", "timeout", "skipped", "unsupported"])
def test_a_failed_rerun_keeps_the_ok_row_and_notes_the_attempt(tmp_path, failure):
    """A failed rerun of an ok point leaves the ok row (its measurement and time) with the attempt
    in its error column; a failure replaces a failure; an ok rerun replaces the ok row."""
    path = tmp_path / "r.csv"
    stamp = "2025-01-01T00:00:00+00:00"
    upsert_rows(path, [_row(8, loss=1.0, timestamp_utc=stamp), _row(16, status="error", error="first")])
    failed = dict(status=failure, error="no result after 0.5 s", timestamp_utc="2025-02-02T00:00:00+00:00")
    upsert_rows(path, [_row(8, git_commit="b" * 40, **failed), _row(16, **failed)])
    kept, replaced = read_rows(path)
    assert (kept["status"], kept["loss"], kept["timestamp_utc"]) == ("ok", "1.0", stamp)
    note = f"rerun failed at 2025-02-02T00:00:00+00:00 (commit bbbbbbb): {failure}: no result after 0.5 s"
    assert kept["error"] == note
    assert (replaced["status"], replaced["error"]) == (failure, "no result after 0.5 s")
    upsert_rows(path, [_row(8, loss=2.0)])
    first = read_rows(path)[0]
    assert (first["status"], first["loss"], first["error"]) == ("ok", "2.0", "")
    assert keeps_earlier({"status": "ok"}, {"status": failure}) and not keeps_earlier(
        {"status": failure}, {"status": "ok"}
    )


def test_a_point_in_several_files_is_read_as_its_ok_row(tmp_path):
    """A folder whose CSVs hold one point ok and, later, timed out: load_results gives one row, the ok one."""
    upsert_rows(tmp_path / "a.csv", [_row(8, loss=1.0, timestamp_utc="2025-01-01T00:00:00+00:00")])
    late = _row(8, status="timeout", timestamp_utc="2025-02-02T00:00:00+00:00")
    upsert_rows(tmp_path / "b.csv", [late, _row(16, status="oom")])
    table = load_results(tmp_path)
    assert sorted(zip(table["seq_len"], table["status"])) == [(8, "ok"), (16, "oom")]
    assert table.loc[table["seq_len"] == 8, "source_file"].item() == str(tmp_path / "a.csv")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("schema_version,model,method,seq_len,status,note\n12,tiny/qwen3,bp,4,ok,hello\n", "column(s) note"),
        (f"schema_version,model,method,seq_len,status\n{SCHEMA_VERSION + 1},tiny/qwen3,bp,4,ok\n", "line 2 is of"),
    ],
)
def test_a_file_of_a_newer_schema_is_refused_and_never_rewritten(tmp_path, text, words):
    """An unknown column or a higher schema_version (a newer sbpbench wrote it): reading, checking
    before a run and upserting each fail with one line naming the file; the file is left as it was."""
    path = tmp_path / "r.csv"
    path.write_text(text)
    for call in (lambda: read_rows(path), lambda: load_results(path), lambda: check_writable(path)):
        with pytest.raises(ValueError, match=f"{path}.*{re.escape(words)}.*newer") as error:
            call()
        assert "\n" not in str(error.value)
    with pytest.raises(RowsNotSaved):
        upsert_rows(path, [_row(8)])
    assert path.read_text() == text


KILL_MID_WRITE = textwrap.dedent(
    """
    import csv, os, signal, sys
    from sbpbench.records import ResultRow, upsert_rows

    def dying_writerows(self, rows):
        rows = list(rows)
        for row in rows[: len(rows) // 2]:
            self.writerow(row)
        os.kill(os.getpid(), signal.SIGKILL)  # killed with half the table written

    csv.DictWriter.writerows = dying_writerows
    upsert_rows(sys.argv[1], [ResultRow(model="m", method="bp", seq_len=n, status="ok") for n in range(100, 110)])
    """
)


def test_a_writer_killed_mid_write_leaves_every_earlier_row(tmp_path):
    """SIGKILL in the middle of writing the table: the CSV still parses and holds exactly the earlier rows."""
    path = tmp_path / "r.csv"
    upsert_rows(path, [_row(n) for n in (8, 16, 32)])
    before = path.read_bytes()
    done = subprocess.run([sys.executable, "-c", KILL_MID_WRITE, str(path)], check=False, timeout=120)
    assert done.returncode == -9
    assert path.read_bytes() == before
    assert [r["seq_len"] for r in read_rows(path)] == ["8", "16", "32"]
    upsert_rows(path, [_row(64)])  # a later write is not disturbed by the dead writer's temp file
    assert len(read_rows(path)) == 4


def test_unwritable_outputs_are_refused_before_any_work(tmp_path):
    """A directory, a non-CSV name, a parent that cannot be created: each a message that says what to pass."""
    with pytest.raises(ValueError, match="is a directory"):
        check_writable(tmp_path)
    with pytest.raises(ValueError, match=r"\.csv"):
        check_writable(tmp_path / "r.txt")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match="writable --out"):  # NotADirectoryError: not a permission matter
        check_writable(blocker / "sub" / "r.csv")


def test_load_results_reads_a_directory_and_names_a_missing_one(tmp_path):
    upsert_rows(tmp_path / "a.csv", [_row(8)])
    upsert_rows(tmp_path / "sub" / "b.csv", [_row(8, method="ckpt")])
    assert sorted(load_results(tmp_path)["method"]) == ["bp", "ckpt"]
    with pytest.raises(FileNotFoundError, match="sbp run"):
        load_results(tmp_path / "none")


def _v3_row(method: str, chunk_size: str, timestamp: str, peak: str) -> dict:
    """A row as schema 3 wrote it: every method recorded StreamBP's chunk sizes."""
    return {
        "schema_version": "3", "timestamp_utc": timestamp, "status": "ok", "kind": "point", "source": "measured",
        "model": "tiny/qwen3", "num_layers": "2", "method": method, "objective": "sft", "step": "bp",
        "lora_rank": "0", "seq_len": "64", "batch_size": "1", "dtype": "fp32", "device": "cpu",
        "device_name": "AMD EPYC", "protocol": "steady", "chunk_size": chunk_size, "logits_chunk_size": "100",
        "fp32_grad_accumulation": "true", "attn_implementation": "sdpa", "seed": "0", "peak_allocated_bytes": peak,
    }  # fmt: skip


def test_schema_3_rows_migrate_to_keys_without_unread_settings(tmp_path):
    """Schema 4: bp/ckpt rows of a schema-3 CSV lose the chunk settings they never read, so two bp
    rows that differed only in chunk size become one point (the later one), while a streambp row
    keeps its chunk size; a new row of the same point replaces the migrated one."""
    path = tmp_path / "old.csv"
    rows = [
        _v3_row("bp", "500", "2026-01-01T00:00:00+00:00", "100"),
        _v3_row("bp", "128", "2026-01-02T00:00:00+00:00", "200"),
        _v3_row("streambp", "128", "2026-01-01T00:00:00+00:00", "50"),
    ]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    migrated = read_rows(path)
    assert [(r["method"], r["chunk_size"], r["peak_allocated_bytes"]) for r in migrated] == [
        ("bp", "", "200"),
        ("streambp", "128", "50"),
    ]
    assert migrated[0]["logits_chunk_size"] == "" and migrated[0]["fp32_grad_accumulation"] == ""
    new = decode_row({**migrated[0], "schema_version": str(SCHEMA_VERSION), "peak_allocated_bytes": "300"})
    upsert_rows(path, [new])
    assert [(r["method"], r["peak_allocated_bytes"]) for r in read_rows(path)] == [("bp", "300"), ("streambp", "50")]
    assert SCHEMA_VERSION == 15
    assert SCHEMA_VERSION >= 4


def test_old_streambp_rows_read_back_with_gpu_checkpoints(tmp_path):
    """Schema 5: a streambp row written before placements existed kept its checkpoints on the
    device, so it reads back as checkpoints gpu (one key with a new gpu row); bp rows stay empty."""
    path = tmp_path / "old.csv"
    rows = [
        _v3_row("streambp", "128", "2026-01-01T00:00:00+00:00", "50"),
        _v3_row("bp", "", "2026-01-01T00:00:00+00:00", "9"),
    ]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    assert [(r["method"], r["checkpoints"]) for r in read_rows(path)] == [("streambp", "gpu"), ("bp", "")]


def test_rows_before_schema_6_read_back_as_one_process(tmp_path):
    """Schema 6: a row written before --nproc existed ran in one process, so it reads back with
    nproc 1 and keys as a new one-process row of the same point (which replaces it)."""
    path = tmp_path / "old.csv"
    old = {**_v3_row("bp", "", "2026-01-01T00:00:00+00:00", "9"), "schema_version": "5"}
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(old))
        writer.writeheader()
        writer.writerow(old)
    (migrated,) = read_rows(path)
    assert migrated["nproc"] == "1" and not migrated.get("rank_peak_bytes")
    upsert_rows(path, [decode_row({**migrated, "schema_version": str(SCHEMA_VERSION), "peak_allocated_bytes": "7"})])
    assert [(r["nproc"], r["peak_allocated_bytes"]) for r in read_rows(path)] == [("1", "7")]
    two = decode_row({**migrated, "schema_version": str(SCHEMA_VERSION), "nproc": "2", "rank_peak_bytes": "5;6"})
    upsert_rows(path, [two])
    assert sorted((r["nproc"], r["rank_peak_bytes"]) for r in read_rows(path)) == [("1", ""), ("2", "5;6")]


def test_rows_before_schema_15_read_back_with_whole_sequences_per_rank(tmp_path):
    """Schema 15: a row written before --sp existed held whole sequences on every rank, so it reads
    back with sp 1 (and num_cpus empty) and keys as the same point's new sp-1 row, which replaces it;
    a row of the same point with --sp 2 is another point."""
    path = tmp_path / "old.csv"
    old = {**_v3_row("streambp", "128", "2026-01-01T00:00:00+00:00", "9"), "schema_version": "14", "nproc": "2"}
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(old))
        writer.writeheader()
        writer.writerow(old)
    (migrated,) = read_rows(path)
    assert (migrated["sp"], migrated["num_cpus"]) == ("1", "")
    upsert_rows(path, [decode_row({**migrated, "schema_version": str(SCHEMA_VERSION), "peak_allocated_bytes": "7"})])
    assert [(r["sp"], r["peak_allocated_bytes"]) for r in read_rows(path)] == [("1", "7")]
    shared = decode_row({**migrated, "schema_version": str(SCHEMA_VERSION), "sp": "2", "rank_peak_bytes": "5;6"})
    upsert_rows(path, [shared])
    assert sorted((r["sp"], r["peak_allocated_bytes"]) for r in read_rows(path)) == [("1", "7"), ("2", "9")]


def test_rows_before_schema_9_read_back_with_torchs_own_sdpa_choice(tmp_path):
    """Schema 9: a row written before --sdpa-backend existed left the kernel to torch, so it reads
    back as sdpa_backend auto and keys as a new auto row of the same point (which replaces it); a
    forced-math row is another point; the new columns read back empty."""
    path = tmp_path / "old.csv"
    old = {**_v3_row("bp", "", "2026-01-01T00:00:00+00:00", "9"), "schema_version": "8", "nproc": "1"}
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(old))
        writer.writeheader()
        writer.writerow(old)
    (migrated,) = read_rows(path)
    assert migrated["sdpa_backend"] == "auto"
    assert not migrated.get("memory_limit_effective_bytes") and not migrated.get("timeout_s")
    upsert_rows(path, [decode_row({**migrated, "schema_version": str(SCHEMA_VERSION), "peak_allocated_bytes": "7"})])
    assert [(r["sdpa_backend"], r["peak_allocated_bytes"]) for r in read_rows(path)] == [("auto", "7")]
    upsert_rows(path, [decode_row({**migrated, "schema_version": str(SCHEMA_VERSION), "sdpa_backend": "math"})])
    assert sorted(r["sdpa_backend"] for r in read_rows(path)) == ["auto", "math"]


def test_a_file_older_than_a_knob_reads_back_with_the_knobs_default(tmp_path):
    """A CSV written before a knob's column existed reads back with the column: the knob's default
    for a method that reads it (it ran at that default), empty for one that does not."""
    path = tmp_path / "old.csv"
    upsert_rows(
        path, [ResultRow(model="m", method="tiled", status="ok"), ResultRow(model="m", method="bp", status="ok")]
    )
    lines = path.read_text().splitlines()
    drop = lines[0].split(",").index("mlp_tile_size")
    path.write_text("".join(",".join(c for i, c in enumerate(line.split(",")) if i != drop) + "\n" for line in lines))
    rows = {row["method"]: row for row in read_rows(path)}
    assert (rows["tiled"]["mlp_tile_size"], rows["bp"]["mlp_tile_size"]) == ("2048", "")


def test_streambp_rows_before_schema_10_read_back_with_the_lower_right_chunk_kernel(tmp_path):
    """Schema 10: a streambp row written before --chunk-attention existed ran its chunks on the
    lower-right SDPA path, so it reads back as chunk_attention lower-right (an auto row is another
    point); a bp row, which reads no such knob, stays empty."""
    path = tmp_path / "old.csv"
    rows = [
        {**_v3_row(method, chunk, "2026-01-01T00:00:00+00:00", "9"), "schema_version": "9", "nproc": "1"}
        for method, chunk in (("streambp", "128"), ("bp", ""))
    ]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    migrated = read_rows(path)
    assert [(r["method"], r.get("chunk_attention", "")) for r in migrated] == [("streambp", "lower-right"), ("bp", "")]
    upsert_rows(path, [decode_row({**migrated[0], "schema_version": str(SCHEMA_VERSION), "chunk_attention": "auto"})])
    assert sorted(r["chunk_attention"] for r in read_rows(path) if r["method"] == "streambp") == ["auto", "lower-right"]


def test_maxlen_rows_before_schema_12_read_back_without_a_seed_or_probes(tmp_path):
    """Schema 12: a search's answer written before seeding read back with seed_seq_len and
    search_probes empty (a blind search that recorded no probes), and keys as a new answer of the
    same search (which replaces it, seed and probes with it)."""
    path = tmp_path / "old.csv"
    old = {
        **_v3_row("bp", "", "2026-01-01T00:00:00+00:00", "9"),
        "schema_version": "11", "nproc": "1", "sdpa_backend": "auto", "kind": "maxlen", "seq_len": "",
        "max_seq_len": "4736", "oom_seq_len": "4800", "search_resolution": "2%", "num_probes": "10",
    }  # fmt: skip
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(old))
        writer.writeheader()
        writer.writerow(old)
    (migrated,) = read_rows(path)
    assert not migrated.get("seed_seq_len") and not migrated.get("search_probes")
    decoded = decode_row(migrated)
    assert decoded.seed_seq_len is None and decoded.search_probes == "" and decoded.num_probes == 10
    seeded = {**migrated, "schema_version": str(SCHEMA_VERSION), "seed_seq_len": "4736"}
    upsert_rows(path, [decode_row({**seeded, "search_probes": "4736:ok 4800:oom", "num_probes": "2"})])
    (row,) = read_rows(path)
    assert (row["seed_seq_len"], row["search_probes"], row["num_probes"]) == ("4736", "4736:ok 4800:oom", "2")
