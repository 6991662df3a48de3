"""`sbp report`: measured rows beside the paper's numbers, the rest, and estimates, as Markdown."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.models import full_depth
from sbpbench.records import load_results, read_rows, upsert_rows
from sbpbench.records.reference import load_reference
from sbpbench.records.schema import COLUMNS
from sbpbench.records.store import csv_header, encode_row
from sbpbench.report import glance_markdown, markdown_report
from tests.fixtures.make_results import fixture_rows

FIXTURES = Path(__file__).parents[1] / "fixtures"
FIXTURE, EXPECTED = FIXTURES / "results.csv", FIXTURES / "expected_report.md"
runner = CliRunner()
CAPPED = "NVIDIA H200, limit 80 GiB, steady"


@pytest.fixture(scope="module")
def table():
    return load_results(FIXTURE)


@pytest.fixture(scope="module")
def reference():
    return load_reference()


@pytest.fixture(scope="module")
def report_text() -> str:
    result = runner.invoke(app, ["report", str(FIXTURE)])
    assert result.exit_code == 0, result.output
    return result.output


def _sections(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#")]


def test_fixture_files_are_up_to_date(reference):
    """results.csv holds make_results.py's rows on its own columns, those rows leave every newer
    column of ResultRow empty, and expected_report.md is the report of it (regenerate both with
    `python tests/fixtures/make_results.py`): a column added with an empty default needs neither."""
    # schema_version says which schema wrote the file; read_rows reads every row as the current one
    columns = [column for column in csv_header(FIXTURE) if column != "schema_version"]
    made = [encode_row(row) for row in fixture_rows()]
    on_its_columns = lambda rows: [{c: row[c] for c in columns} for row in rows]
    assert on_its_columns(read_rows(FIXTURE)) == on_its_columns(made)
    newer = {c: row[c] for row in made for c in COLUMNS if c not in columns and c != "schema_version" and row[c]}
    assert not newer, f"make_results.py fills columns results.csv lacks: {newer}"
    assert markdown_report(load_results(FIXTURE), reference, full_depth=full_depth) == EXPECTED.read_text()


def test_paper_rows_beside_ours_with_ratios(report_text):
    """Figure 3, Table 2 and Table 3 lines: paper, ours, ours/paper; an OOM on both sides has no ratio."""
    lines = report_text.splitlines()
    for expected in (
        f"| Qwen/Qwen3-8B | bp | sft, full, bp, bf16, B=1 | {CAPPED} | 4700 | 5100 | 1.09 |",
        f"| Qwen/Qwen3-8B | streambp | sft, full, bp, bf16, B=1, chunks 500/100 | {CAPPED} | 110000 | 120000 | 1.09 |",
        f"| Qwen/Qwen3-8B | all | sft, full, bp, bf16, B=1 | {CAPPED} | 30.50 | 30.50 | 1.00 |",
        f"| Qwen/Qwen3-4B | ckpt | sft, full, bp, bf16, B=2, T=9000 | {CAPPED} | 7.12 | 7.05 | 0.99 |",
        f"| Qwen/Qwen3-4B | ckpt | sft, full, bp, bf16, B=16, T=9000 | {CAPPED} | OOM | OOM | - |",
        f"| Qwen/Qwen3-4B | ckpt | sft, full, bp, bf16, B=1, T=9000 | {CAPPED} | 4.70 | 7.20 | 1.53 |",
        # grpo: the paper's T is the completion, ours max_seq_len 18000 minus the 1000-token prompt
        (
            "| Qwen/Qwen3-8B | streambp | grpo, LoRA r32, train, bf16, B=8, prompt 1000, chunks 500/100 "
            f"| {CAPPED} | 16500 | 17000 | 1.03 |"
        ),
    ):
        assert expected in lines, f"missing line:\n{expected}"
    assert "grpo/dpo: the paper's number is read as the completion length" in report_text
    assert "GiB (2^30 bytes)" in report_text


def test_sections_in_order_and_estimates_kept_apart(report_text):
    """The GPU points first, then paper tables in reference order, unmatched measured rows, and
    estimates, which appear in no section before their own but the points' predicted column."""
    assert _sections(report_text) == [
        "# sbpbench results beside the StreamBP paper",
        "## Point by point on a GPU: measured, predicted, the paper",
        "### NVIDIA H200 (140.40 GiB), sft, full, step bp, bf16, B=1, steady protocol",
        "### NVIDIA H200 (140.40 GiB), sft, full, step bp, bf16, B=2, steady protocol",
        "### NVIDIA H200 (140.40 GiB), sft, full, step bp, bf16, B=4, steady protocol",
        "### NVIDIA H200 (140.40 GiB), sft, full, step bp, bf16, B=16, steady protocol",
        "## Measured beside the paper",
        "### Figure 3: max T (tokens)",
        "### Figure 3: weights + grads (GiB)",
        "### Table 1: step time (s)",
        "### Table 2: time per sample (s)",
        "### Table 3: max T (tokens)",
        "## Measured, no paper counterpart",
        "## Estimates vs measurements",
        "### Estimated peak memory beside the measured one (error = estimate / measured - 1)",
        "### Estimated max T beside the paper's (Figure 3 for step bp, Table 3 for train)",
    ]
    measured_part, estimates = report_text.split("## Estimates vs measurements")
    assert "simulated GPU" not in measured_part.split("## Measured beside the paper")[1]
    assert (
        "| Qwen/Qwen3-8B | streambp | sft, full, bp, bf16, B=1, T=16384, chunks 500/100 "
        f"| {CAPPED} | 32.50 | 33.00 | +1.5% |"
    ) in estimates
    assert (
        "| Qwen/Qwen3-8B | streambp | sft, full, bp, bf16, B=1, chunks 500/100 "
        "| simulated GPU (80 GiB), steady | 110000 | 118000 | 1.07 |"
    ) in estimates


def test_rows_without_counterpart(report_text):
    """CPU rows, Qwen3-8B memory points and a search on the uncapped 140 GiB H200 are listed, not compared."""
    unmatched = report_text.split("## Measured, no paper counterpart")[1].split("## Estimates")[0]
    assert "| small/qwen3 | bp | sft, full, bp, fp32, B=1, T=2048 | AMD EPYC (cpu), steady | ok | 1.08 | 1.93 |  |" in (
        unmatched
    )
    assert f"| Qwen/Qwen3-8B | bp | sft, full, bp, bf16, B=1, T=8192 | {CAPPED} | oom |  |  |  |" in unmatched
    assert "NVIDIA H200 (140 GiB), steady | ok |  |  | ≥200000 |" in unmatched
    assert "Qwen/Qwen3-4B" not in unmatched  # every Qwen3-4B point met Table 1 or Table 2


def test_comparable_device_rules(table, reference):
    """Without the 80 GiB cap the H200 still meets the paper's times (any CUDA device) but no
    memory or max-T number; a CPU device meets nothing."""
    uncapped = table.assign(memory_limit_bytes=float("nan"))
    text = markdown_report(uncapped, reference)
    assert "### Table 2: time per sample (s)" in text and "### Figure 3" not in text
    on_cpu = table.assign(device="cpu", memory_limit_bytes=float("nan"))
    assert "No measured row is comparable with a paper number." in markdown_report(on_cpu, reference)


def test_report_is_deterministic_and_written_to_a_file(table, reference, tmp_path, report_text):
    """Row order does not change the report; --out writes what stdout would show."""
    assert markdown_report(table.sample(frac=1, random_state=1), reference) == report_text
    out = tmp_path / "sub" / "report.md"
    result = runner.invoke(app, ["report", str(FIXTURE), "--out", str(out)])
    assert result.exit_code == 0 and out.read_text() == report_text


def _shallow_qwen8(table):
    """The fixture with every Qwen3-8B row built with 4 of its 36 decoder layers (`--num-layers 4`)."""
    return table.assign(num_layers=table["num_layers"].mask(table["model"] == "Qwen/Qwen3-8B", 4.0))


def test_truncated_model_is_named_so_and_never_beside_the_paper(table, reference):
    """Given the registry's depths, a 4-layer Qwen3-8B meets no paper number and is listed as such."""
    text = markdown_report(_shallow_qwen8(table), reference, full_depth=full_depth)
    measured = text.split("## Estimates vs measurements")[0]
    compared, unmatched = measured.split("## Measured, no paper counterpart")
    assert "Qwen/Qwen3-8B" not in compared and "| Qwen/Qwen3-4B | ckpt |" in compared
    assert f"| Qwen/Qwen3-8B (4 layers) | bp | sft, full, bp, bf16, B=1, T=8192 | {CAPPED} | oom |" in unmatched


def test_sbp_report_knows_model_depths(table, tmp_path):
    """`sbp report` reads each model's full depth from the registry, as markdown_report(full_depth=...) does."""
    shallow = tmp_path / "shallow.csv"
    upsert_rows(shallow, [replace(r, num_layers=4) if r.model == "Qwen/Qwen3-8B" else r for r in fixture_rows()])
    result = runner.invoke(app, ["report", str(shallow)])
    assert result.exit_code == 0 and "Qwen/Qwen3-8B (4 layers)" in result.output


def test_without_reference_every_measured_row_is_unmatched(table):
    """No paper table: the report says so and lists all measured rows."""
    text = markdown_report(table, None)
    assert "No paper reference was loaded" in text and "### Figure 3" not in text
    unmatched = text.split("## Measured, no paper counterpart")[1].split("## Estimates")[0]
    assert sum(line.startswith(("| Qwen", "| small")) for line in unmatched.splitlines()) == 26


def test_bad_input_is_a_one_line_error(tmp_path):
    """A missing or empty results file, or a missing --reference: exit 2 with one line."""
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    for args in (
        ["report", str(tmp_path / "nope.csv")],
        ["report", str(empty)],
        ["report", str(FIXTURE), "--reference", str(tmp_path / "paper.csv")],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("error:"), result.output
    assert "sbp run" in runner.invoke(app, ["report", str(empty)]).output


def test_peers_verdict_judges_the_issue_16_target_from_the_rows():
    """StreamBP's max T over the best other method's, and its step time at the longest common T;
    the step-time half is not judged from single cold steps (warm-up 0, 1 repeat)."""
    import pandas as pd

    from sbpbench.report.markdown import _verdict

    def row(method, kind, seq, status="ok", time=None, max_t=None, oom=None):
        return {"method": method, "kind": kind, "seq_len": seq, "status": status, "time_median_s": time,
                "max_seq_len": max_t, "oom_seq_len": oom}  # fmt: skip

    rows = pd.DataFrame(
        [
            row("ckpt", "point", 1024, time=2.0),
            row("streambp", "point", 1024, time=3.0),
            row("ckpt-chunked-ce", "point", 1024, time=1.0),
            row("ckpt", "maxlen", 1024, max_t=2000, oom=2100),
            row("ckpt-chunked-ce", "maxlen", 1024, max_t=3000, oom=3100),
            row("streambp", "maxlen", 1024, max_t=4096),  # no OOM up to the ceiling
        ]
    )
    text = " ".join(_verdict(rows))
    assert "≥1.37x the best other method's (ckpt-chunked-ce: 3000)" in text
    assert "over ckpt-chunked-ce's: 3.00x at T=1024 (median 3.00x" in text and "not met" in text
    rows.loc[rows["method"] == "streambp", "time_median_s"] = 0.9
    assert "median): met." in " ".join(_verdict(rows))
    assert _verdict(rows[rows["method"] != "streambp"]) == []
    rows["warmup_steps"], rows["repeats"] = 0, 1  # a smoke run's single cold steps
    cold = " ".join(_verdict(rows))
    assert "times unreliable (warm-up 0, 1 repeat), so the target" in cold and "not judged" in cold
    assert "met." not in cold  # neither "met." nor "not met."


def test_placements_section_compares_streambp_placements(tmp_path):
    """Issue 15: one table per setting with several placements: device / host peaks, copies, TFLOP/s, max T."""
    from sbpbench.records import ResultRow
    from sbpbench.report.markdown import _markdown_table
    from sbpbench.report.placements import placements_section

    common = {"model": "Qwen/Qwen3-8B", "num_layers": 36, "method": "streambp", "objective": "sft", "step": "bp",
              "lora_rank": 0, "dtype": "bf16", "protocol": "steady", "batch_size": 1, "device": "cuda:0",
              "device_name": "NVIDIA H100", "chunk_size": 2000, "logits_chunk_size": 500, "git_commit": "x", "status": "ok",
              "source": "measured"}  # fmt: skip
    gib = 2**30
    rows = [
        ResultRow(timestamp_utc="2026-01-01T00:00:01+00:00", kind="point", seq_len=65536, checkpoints="gpu",
                  peak_allocated_bytes=60 * gib, host_pinned_peak_bytes=0, tflops_per_s=400.0, **common),
        ResultRow(timestamp_utc="2026-01-01T00:00:02+00:00", kind="point", seq_len=65536, checkpoints="cpu",
                  peak_allocated_bytes=40 * gib, host_pinned_peak_bytes=19 * gib, transfer_bytes=38 * gib,
                  tflops_per_s=380.0, **common),
        ResultRow(timestamp_utc="2026-01-01T00:00:03+00:00", kind="maxlen", seq_len=32768, checkpoints="cpu",
                  max_seq_len=262144, **common),
    ]  # fmt: skip
    upsert_rows(tmp_path / "r.csv", rows)
    text = "\n".join(placements_section(load_results(tmp_path / "r.csv"), _markdown_table))
    assert "## Checkpoint placements" in text
    assert "| gpu | 60.0 / 0.0, 400 TFLOP/s |  |" in text
    assert "| cpu | 40.0 / 19.0, moved 38.0, 380 TFLOP/s | ≥262144 |" in text
    one_placement = [r for r in rows if r.checkpoints == "gpu"]
    upsert_rows(tmp_path / "one.csv", one_placement)
    assert placements_section(load_results(tmp_path / "one.csv"), _markdown_table) == []


def test_glance_without_peers_says_so(table):
    """`sbp report --glance` of rows with no peer method prints one line saying there is no table."""
    assert glance_markdown(table) == "No measured rows of a peer method: no summary table.\n"


GPU_ROWS = Path(__file__).parents[2] / "results" / "gpu" / "NVIDIA-H100-80GB-HBM3"


def test_points_put_each_gpu_peak_beside_its_estimate_and_the_paper(report_text):
    """Each measured CUDA point has one line: peak, the same point's estimate and its error, step
    time, the paper's number at that length (Table 1) or the method's max T (Figure 3); then each
    method's max T: the paper's, the prediction for a card of its budget, and the points' bounds."""
    points = report_text.split("## Point by point")[1].split("## Measured beside the paper")[0]
    lines = points.splitlines()
    assert "| Qwen3-8B | streambp | 16,384 | 32.50 | 33.00 | +1.5% | 6.840 | max T 110,000 (Figure 3) |" in lines
    assert "| Qwen3-4B | ckpt | 9,000 | 36.00 | - | - | 7.200 | 4.70 s (Table 1) |" in lines
    assert "| Qwen3-8B | bp | 8,192 | OOM | - | - | - | max T 4,700 (Figure 3) |" in lines
    assert "| Qwen3-8B | streambp | 110,000 | 118,000 (80.00 GiB) | 32,768 | - |" in lines
    assert "| Qwen3-8B | bp | 4,700 | - | 4,096 | 8,192 |" in lines
    assert "small/qwen3" not in points  # a CPU row is no GPU point


def test_points_keep_placements_apart_and_mark_rough_times():
    """On the committed H100 rows, StreamBP's two T=65536 placements are two lines, each beside its
    own estimate, and their single-step times are marked rough."""
    result = runner.invoke(app, ["report", str(GPU_ROWS), "--points"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert (
        "| Qwen3-8B | streambp (cpu) | 65,536 | 35.59 | 35.52 | -0.2% | 28.350* | max T 110,000 (Figure 3) |" in lines
    )
    assert any(
        line.startswith("| Qwen3-8B | streambp (recompute:4) | 65,536 | 40.59 | 40.52 | -0.2% | 32.671* |")
        for line in lines
    )
    assert any(line.startswith("\\* a rough time") for line in lines)
    assert "## Measured beside the paper" not in result.output  # --points: that section only


def test_points_and_glance_together_is_a_one_line_error():
    """--points and --glance are two summaries: asking for both is exit 2 with one line, no report."""
    result = runner.invoke(app, ["report", str(FIXTURE), "--points", "--glance"])
    assert result.exit_code == 2
    assert "--glance and --points" in result.output and "|" not in result.output


def test_setting_names_a_streambp_placement(table):
    """A StreamBP row with its checkpoints off the GPU says where in its setting, so two placements
    of one point are not taken for one (the report's latest-row rule would drop one)."""
    from sbpbench.report.compare import setting

    row = table[table["method"] == "streambp"].iloc[0].copy()
    row["checkpoints"] = "cpu+recompute:2"
    assert setting(row, seq_len=False).endswith("checkpoints cpu+recompute:2")
    row["checkpoints"] = "gpu"
    assert "checkpoints" not in setting(row, seq_len=False)


def test_times_taken_under_load_are_marked_with_a_footnote_and_judge_nothing():
    """A CPU time taken at load above the cores carries † in the peers and glance tables, with a
    footnote under the table; the peers' target is then not judged from it. GPU rows are never marked."""
    import pandas as pd

    from sbpbench.records.select import complete_columns
    from sbpbench.report.markdown import LOADED_FOOTNOTE, _verdict, glance_table

    def row(method, kind, load, device="cpu", **values):
        return {"method": method, "kind": kind, "seq_len": 1024, "status": "ok", "source": "measured",
                "device": device, "load_avg_1m": load, "num_threads": 2, "batch_size": 1, "model": "small/qwen3",
                "timestamp_utc": "2026", "peak_allocated_bytes": 2**28, **values}  # fmt: skip

    def rows(load, device="cpu"):
        return complete_columns(pd.DataFrame(
            [row("tiled", "point", 1.0, device, time_median_s=2.0), row("streambp", "point", load, device, time_median_s=1.0),
             row("tiled", "maxlen", None, device, max_seq_len=2000, oom_seq_len=2100),
             row("streambp", "maxlen", None, device, max_seq_len=4096, oom_seq_len=4200)]
        ))  # fmt: skip

    loaded = "\n".join(glance_table(rows(5.0), []))
    assert "0.98 ms/tok†" in loaded and "1.95 ms/tok |" in loaded and LOADED_FOOTNOTE in loaded
    assert "not judged" in " ".join(_verdict(rows(5.0))) and "1 of 2 times taken at load" in " ".join(
        _verdict(rows(5.0))
    )
    for calm in (rows(1.5), rows(5.0, device="cuda:0")):
        assert "†" not in "\n".join(glance_table(calm, [])) and "met." in " ".join(_verdict(calm))


def test_a_table_without_estimates_says_where_they_come_from(tmp_path):
    """A measured-only table (the CPU smoke sweep's): the estimates section says none are there and what writes them, never a bare "None."."""
    measured = tmp_path / "measured.csv"
    upsert_rows(measured, [row for row in fixture_rows() if row.source == "measured"])
    result = runner.invoke(app, ["report", str(measured)])
    assert result.exit_code == 0, result.output
    estimates = result.output.split("## Estimates vs measurements")[1]
    assert "This table has none: `sbp estimate` and `sbp maxlen --simulate` write them." in estimates
    assert "None." not in estimates
