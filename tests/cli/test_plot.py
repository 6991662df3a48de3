"""`sbp plot`: the figures a results table has data for, their names, sizes and what they show."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import matplotlib.image
import pytest
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.models import full_depth
from sbpbench.plot import memory_vs_seq, plot_all
from sbpbench.records import load_results, upsert_rows
from sbpbench.records.reference import load_reference
from tests.fixtures.make_results import fixture_rows

FIXTURE = Path(__file__).parents[1] / "fixtures" / "results.csv"
PIXELS = (600, 800)  # style.FIGSIZE_IN (8 x 6 in) at style.DPI (100)
EXPECTED_STEMS = {
    # (e) max T vs time per token, one point per method: the capped H200 has both kinds of rows
    "max_len_vs_time_per_token__Qwen3-8B__NVIDIA-H200-limit80GiB__steady",
    # (a) peak memory vs T: the capped H200 series (paper Figure 3 faint) and the CPU series
    "memory_vs_seq__Qwen3-8B__NVIDIA-H200-limit80GiB__steady",
    "memory_vs_seq__small-qwen3__AMD-EPYC__steady__fp32",
    # (b) step time vs T
    "time_vs_seq__Qwen3-8B__NVIDIA-H200-limit80GiB__steady",
    "time_vs_seq__small-qwen3__AMD-EPYC__steady__fp32",
    # (c) max T bars: per setting and device (the simulated GPU its own, hatched)
    "max_seq_len__sft__full__bp__NVIDIA-H200-limit80GiB__steady",
    "max_seq_len__sft__full__train__NVIDIA-H200-limit80GiB__steady",
    "max_seq_len__grpo__lora32__train__NVIDIA-H200-limit80GiB__steady",
    "max_seq_len__sft__full__bp__NVIDIA-H200__steady",
    "max_seq_len__sft__full__bp__simulated-GPU__steady",
    # (d) time per sample vs batch at T=9000
    "time_per_sample_vs_batch__Qwen3-4B__NVIDIA-H200-limit80GiB__steady__T9000",
}
runner = CliRunner()


@pytest.fixture(scope="module")
def plotted(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("plots")
    result = runner.invoke(app, ["plot", str(FIXTURE), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_plot_writes_each_figure_as_png_and_svg(plotted):
    """Exactly the expected figures, each a PNG of 800 x 600 pixels and an SVG; the paths are printed."""
    out, output = plotted
    names = {p.name for p in out.iterdir()}
    assert names == {f"{stem}.{fmt}" for stem in EXPECTED_STEMS for fmt in ("png", "svg")}
    for stem in EXPECTED_STEMS:
        image = matplotlib.image.imread(out / f"{stem}.png")
        assert image.shape[:2] == PIXELS, f"{stem}.png is {image.shape}"
        assert image.std() > 0, f"{stem}.png is blank"
        svg = (out / f"{stem}.svg").read_text()
        assert svg.startswith("<?xml") and "<svg" in svg and svg.rstrip().endswith("</svg>")
        assert str(out / f"{stem}.png") in output
    assert f"{2 * len(EXPECTED_STEMS)} file(s) written" in output


def test_figures_label_estimates_paper_and_capacity(plotted):
    """Simulated series say "(estimate)"; the paper is drawn only beside an 80 GiB CUDA device; a CPU
    figure without a memory cap has no capacity line."""
    out, _ = plotted
    svg = {stem: (out / f"{stem}.svg").read_text() for stem in EXPECTED_STEMS}
    memory = svg["memory_vs_seq__Qwen3-8B__NVIDIA-H200-limit80GiB__steady"]
    assert "capacity 80.0 GiB (cap)" in memory and "paper Fig. 3" in memory and "weights + grads 30.5 GiB" in memory
    assert "max T 120k (search)" in memory  # the matching max-length search's answer
    cpu = svg["memory_vs_seq__small-qwen3__AMD-EPYC__steady__fp32"]
    assert "capacity" not in cpu and "paper" not in cpu
    assert "StreamBP (estimate)" in svg["max_seq_len__sft__full__bp__simulated-GPU__steady"]
    assert "(estimate)" not in svg["max_seq_len__sft__full__bp__NVIDIA-H200-limit80GiB__steady"]
    assert "paper" not in svg["max_seq_len__sft__full__bp__NVIDIA-H200__steady"]  # 140 GiB: no stand-in for 80 GB
    assert "completion length" in svg["max_seq_len__grpo__lora32__train__NVIDIA-H200-limit80GiB__steady"]
    assert "paper Table 2" in svg["time_per_sample_vs_batch__Qwen3-4B__NVIDIA-H200-limit80GiB__steady__T9000"]


def test_replotting_gives_identical_svg(tmp_path):
    """Figures are a pure function of the table: the same table gives byte-identical SVG files."""
    table, reference = load_results(FIXTURE), load_reference()
    first = memory_vs_seq(table, tmp_path / "a", reference, formats=("svg",))
    second = memory_vs_seq(table.sample(frac=1, random_state=0), tmp_path / "b", reference, formats=("svg",))
    assert [p.name for p in first] == [p.name for p in second] and first
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes(), a.name


def _shallow_fixture(path: Path) -> Path:
    """The fixture rows with every Qwen3-8B row built with 4 of its 36 decoder layers (`--num-layers 4`)."""
    upsert_rows(path, [replace(r, num_layers=4) if r.model == "Qwen/Qwen3-8B" else r for r in fixture_rows()])
    return path


def test_truncated_model_named_by_depth_without_paper_marks(tmp_path):
    """Given the registry's depths, a 4-layer Qwen3-8B gets "4layers" in its file names and no paper line."""
    table = load_results(_shallow_fixture(tmp_path / "shallow.csv"))
    paths = plot_all(table, tmp_path / "plots", load_reference(), ("svg",), full_depth=full_depth)
    memory = tmp_path / "plots" / "memory_vs_seq__Qwen3-8B__NVIDIA-H200-limit80GiB__steady__4layers.svg"
    assert memory in paths
    svg = memory.read_text()
    assert "Qwen/Qwen3-8B (4 layers): peak memory (GiB)" in svg and "paper" not in svg


@pytest.mark.slow  # over 3 s on 2 cores
def test_sbp_plot_knows_model_depths(tmp_path):
    """`sbp plot` reads each model's full depth from the registry, as plot_all(full_depth=...) does."""
    out = tmp_path / "plots"
    result = runner.invoke(app, ["plot", str(_shallow_fixture(tmp_path / "shallow.csv")), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "memory_vs_seq__Qwen3-8B__NVIDIA-H200-limit80GiB__steady__4layers.svg").is_file()


def test_format_option_and_no_data(tmp_path):
    """--format svg writes SVG only; a table with nothing to draw says so and writes nothing."""
    table = load_results(FIXTURE)
    one = tmp_path / "one.csv"
    table.iloc[[0]].drop(columns="source_file").to_csv(one, index=False)
    result = runner.invoke(app, ["plot", str(one), "--out", str(tmp_path / "none"), "--format", "svg"])
    assert result.exit_code == 0, result.output
    assert "no figure" in result.output and not (tmp_path / "none").exists()
    result = runner.invoke(app, ["plot", str(FIXTURE), "--out", str(tmp_path / "x"), "--format", "jpg"])
    assert result.exit_code == 2 and "unknown figure format 'jpg'" in result.output


def test_missing_results_is_a_one_line_error(tmp_path):
    """A missing results file: exit 2, one line saying what to run, no traceback."""
    result = runner.invoke(app, ["plot", str(tmp_path / "nope.csv"), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert result.output.startswith("error:") and "sbp run" in result.output and "Traceback" not in result.output


def test_time_plot_ooms_sit_on_the_axis_and_bars_are_named_only_when_drawn(tmp_path):
    """OOM crosses are drawn on the x axis and the legend says they carry no time; "bars min-max"
    is in the y label only when some point has a spread (not for single timed steps)."""
    from sbpbench.plot.timing import time_vs_seq

    table = load_results(FIXTURE)
    (with_bars,) = [p for p in time_vs_seq(table, tmp_path / "a", formats=("svg",)) if "Qwen3-8B" in p.name]
    svg = with_bars.read_text()
    assert "bars min-max" in svg and "out of memory (crosses on the x axis: no time)" in svg
    table["time_min_s"] = table["time_max_s"] = table["time_median_s"]
    (without,) = [p for p in time_vs_seq(table, tmp_path / "b", formats=("svg",)) if "Qwen3-8B" in p.name]
    assert "bars min-max" not in without.read_text() and "median" in without.read_text()


UNRELIABLE = "times unreliable (warm-up 0, 1 repeat): not a ranking of the methods"


@pytest.mark.parametrize(
    ("warmup", "repeats", "said"), [(0, 1, UNRELIABLE), (0, 3, "(warm-up 0)"), (1, 1, "(1 repeat)"), (1, 3, None)]
)
def test_time_figures_say_when_warmup_and_repeats_make_times_unreliable(tmp_path, warmup, repeats, said):
    """Step-time and time-per-sample figures of rows timed without a warm-up step or from one timed
    step say so in the title, and that they rank nothing; with a warm-up and repeats they say nothing."""
    from sbpbench.plot.timing import time_per_sample_vs_batch, time_vs_seq

    table = load_results(FIXTURE)
    table["warmup_steps"], table["repeats"] = warmup, repeats
    paths = time_vs_seq(table, tmp_path, formats=("svg",)) + time_per_sample_vs_batch(table, tmp_path, formats=("svg",))
    assert len(paths) == 3
    for path in paths:
        svg = path.read_text()
        assert (said in svg) if said else ("unreliable" not in svg), path.name


def test_streambp_placements_are_separate_series():
    """Rows of several checkpoint placements draw one series each, labelled by the placement."""
    import pandas as pd

    from sbpbench.plot.common import series

    base = {"method": "streambp", "source": "simulated", "kind": "point", "seq_len": 1024, "batch_size": 1,
            "chunk_size": 500, "timestamp_utc": "2026-01-01", "model": "m", "num_layers": 2}  # fmt: skip
    rows = pd.DataFrame([{**base, "checkpoints": p} for p in ("gpu", "cpu", "recompute:4")])
    assert sorted(extra for _, _, extra, _ in series(rows)) == ["cpu", "gpu", "recompute:4"]


def test_each_placement_gets_its_own_search_marker_and_a_ceiling_reads_as_a_bound(tmp_path):
    """A memory figure with two StreamBP placements, each with a max-length search (one that hit its
    ceiling): each series finds its own placement's search, a ceiling answer reads "max T ≥", and
    the placements get different markers."""
    from sbpbench.records import ResultRow

    common = {"model": "Qwen/Qwen3-8B", "method": "streambp", "source": "simulated", "device_name": "simulated GPU",
              "chunk_size": 2000, "logits_chunk_size": 500, "memory_limit_bytes": 80 << 30, "dtype": "bf16",
              "protocol": "steady", "num_layers": 36, "weights_bytes": 16 << 30, "grads_bytes": 1 << 29,
              "objective": "sft", "step": "bp", "batch_size": 1, "lora_rank": 64}  # fmt: skip
    rows = []
    for placement, peaks, answer, oom in (
        ("cpu+recompute:4", {524288: 55, 1048576: 93}, 786432, 1048576),
        ("cpu+recompute:4+spill", {524288: 40, 1048576: 73}, 1048576, None),
    ):
        for seq_len, gib in peaks.items():
            status = "ok" if gib < 80 else "oom"
            rows.append(ResultRow(**common, checkpoints=placement, seq_len=seq_len, status=status,
                                  peak_allocated_bytes=gib << 30, timestamp_utc="2026-11-23T10:00:00"))  # fmt: skip
        rows.append(ResultRow(**common, checkpoints=placement, kind="maxlen", status="ok", max_seq_len=answer,
                              oom_seq_len=oom, timestamp_utc="2026-11-23T11:00:00"))  # fmt: skip
    upsert_rows(tmp_path / "r.csv", rows)
    (figure,) = memory_vs_seq(load_results(tmp_path / "r.csv"), tmp_path / "plots", formats=("svg",))
    svg = figure.read_text()
    assert "max T 786k (search, estimate)" in svg and "max T ≥ 1.05M (search, estimate)" in svg
    assert "StreamBP cpu+recompute:4 (estimate)" in svg and "StreamBP cpu+recompute:4+spill (estimate)" in svg


def test_token_counts_read_as_the_paper_writes_them():
    from sbpbench.plot.style import placement_marker, thousands

    assert [thousands(t) for t in (440, 4700, 110000, 786432, 1048576)] == ["440", "4.7k", "110k", "786k", "1.05M"]
    markers = {placement_marker(p) for p in ("gpu", "cpu", "recompute:4", "cpu+recompute:2", "cpu+recompute:4+spill")}
    assert len(markers) == 5


GPU_ROWS = Path(__file__).parents[2] / "results" / "gpu" / "NVIDIA-H100-80GB-HBM3"


def test_measured_on_predicted_draws_gpu_peaks_on_the_estimates(tmp_path):
    """From the committed H100 rows: one Qwen3-8B figure with each method's predicted curve (dashed,
    "(estimate)"), the measured peaks labelled with their prediction's error, StreamBP's offloaded
    placements as their own series, the device's memory and the paper's max T."""
    from sbpbench.plot import measured_on_predicted
    from sbpbench.records.select import complete_columns

    table = complete_columns(load_results(GPU_ROWS))
    paths = measured_on_predicted(table, tmp_path, load_reference(), formats=("svg",))
    assert [p.name for p in paths] == ["measured_on_predicted__Qwen3-8B__NVIDIA-H100-80GB-HBM3__steady.svg"]
    svg = paths[0].read_text()
    for text in ("StreamBP (estimate)", "ckpt (w/ ckpt) (estimate)", "66.5 GiB (-0.1% predicted)",
                 "StreamBP checkpoints cpu measured", "device memory 79.65 GiB", "paper Figure 3"):  # fmt: skip
        assert text in svg, text


def test_measured_on_predicted_needs_a_predicted_curve(tmp_path):
    """No figure without predicted peaks at two lengths: the fixture's one estimated point is no curve."""
    from sbpbench.plot import measured_on_predicted
    from sbpbench.records.select import complete_columns

    assert measured_on_predicted(complete_columns(load_results(FIXTURE)), tmp_path, None) == []
