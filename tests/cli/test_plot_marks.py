"""What a figure's marks say beyond their values: times taken at load above the cores, OOMs on an
axis edge, lower bounds drawn open, and no legend entry for a method with nothing drawn."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.colors import to_rgba

from sbpbench.plot import maxlen, memory, timing
from sbpbench.plot.common import OOM_EDGES
from sbpbench.records import ResultRow, load_results, upsert_rows
from sbpbench.records.select import is_loaded, load_note

GIB = 2**30
CPU = {"model": "small/qwen3", "num_layers": 4, "device": "cpu", "device_name": "AMD EPYC", "dtype": "fp32",
       "objective": "sft", "step": "bp", "lora_rank": 0, "batch_size": 1, "protocol": "steady",
       "memory_limit_bytes": GIB, "warmup_steps": 1, "repeats": 3, "num_threads": 2}  # fmt: skip
PEAKS = {1024: 0.2, 2048: 0.4, 4096: 0.8, 8192: 0.9}  # 8x: a log2 x axis


def _table(tmp_path, *, load: float = 0.5, device: str = "cpu"):
    """bp and streambp timed at four T (bp OOM from 4096), liger unsupported everywhere, and a
    max-length search per method (streambp's reached its ceiling: a lower bound)."""
    rows, n = [], 0
    for method in ("bp", "streambp", "liger"):
        for seq_len, gib in PEAKS.items():
            n += 1
            stamp = f"2026-01-01T00:00:{n:02d}"
            common = {**CPU, "device": device, "method": method, "seq_len": seq_len, "timestamp_utc": stamp}
            if method == "liger":
                rows.append(ResultRow(**common, status="unsupported", error="needs CUDA"))
            elif method == "bp" and seq_len >= 4096:
                rows.append(ResultRow(**common, status="oom", error="out of memory", load_avg_1m=load))
            else:
                time = seq_len / 1000
                rows.append(ResultRow(**common, status="ok", peak_allocated_bytes=int(gib * GIB), time_median_s=time,
                                      time_min_s=time, time_max_s=time, load_avg_1m=load))  # fmt: skip
    search = {**CPU, "device": device, "kind": "maxlen", "status": "ok", "seq_len": 1024}
    rows.append(ResultRow(**search, method="bp", max_seq_len=3000, oom_seq_len=3100, timestamp_utc="2026-01-01T01"))
    rows.append(ResultRow(**search, method="streambp", max_seq_len=8192, timestamp_utc="2026-01-01T01"))
    upsert_rows(tmp_path / "r.csv", rows)
    return load_results(tmp_path / "r.csv")


def _figures(monkeypatch, module, draw, table, tmp_path) -> list:
    """The matplotlib figures `draw` (a figure function of `module`) makes of the table, unsaved."""
    figures = []
    monkeypatch.setattr(module, "save", lambda fig, *_: figures.append(fig) or [])
    draw(table, tmp_path)
    return figures


def _legend_texts(fig) -> list[str]:
    return [text.get_text() for legend in fig.legends for text in legend.get_texts()]


def _crosses(ax) -> list:
    """The OOM crosses drawn (legend proxies have no data)."""
    return [line for line in ax.get_lines() if line.get_marker() == "x" and len(line.get_xdata())]


@pytest.mark.parametrize(("load", "device", "said"), [(5.0, "cpu", True), (2.0, "cpu", False), (40.0, "cuda:0", False)])
def test_a_time_figure_says_its_times_were_taken_under_load(tmp_path, monkeypatch, load, device, said):
    """CPU times taken at a load above the cores (threads stand in for them) put a count in the title
    and hollow markers over the points; at load equal to the threads, or on a GPU, nothing is said."""
    table = _table(tmp_path, load=load, device=device)
    (fig,) = _figures(monkeypatch, timing, timing.time_vs_seq, table, tmp_path)
    title = fig.get_suptitle()
    assert ("6 of 6 times taken at load above the cores (up to 5.0 on 2 threads)" in title) is said, title
    hollow = [line for line in fig.axes[0].get_lines() if line.get_markerfacecolor() in ("white", (1, 1, 1, 1))]
    assert bool(hollow) is said
    assert (timing.LOADED_LABEL in _legend_texts(fig)) is said


def test_a_memory_figure_is_not_marked_for_load(tmp_path, monkeypatch):
    """Tracked memory does not depend on load: a memory figure of loaded rows says nothing of it."""
    (fig,) = _figures(monkeypatch, memory, memory.memory_vs_seq, _table(tmp_path, load=5.0), tmp_path)
    assert "load" not in fig.get_suptitle() and not any("load" in t for t in _legend_texts(fig))


def test_the_load_rule_reads_a_results_row_and_a_result_row(tmp_path):
    """is_loaded: CPU rows above their thread count; not at it, not without a record, never on CUDA."""
    assert is_loaded(ResultRow(device="cpu", load_avg_1m=2.5, num_threads=2))
    assert not is_loaded(ResultRow(device="cpu", load_avg_1m=2.0, num_threads=2))
    assert not is_loaded(ResultRow(device="cpu", load_avg_1m=None, num_threads=2))
    assert not is_loaded(ResultRow(device="cuda:0", load_avg_1m=9.0, num_threads=2))
    table = _table(tmp_path, load=5.0)
    assert table[table["time_median_s"].notna()].apply(is_loaded, axis=1).all()


def test_oom_crosses_sit_on_an_axis_edge_unclipped(tmp_path, monkeypatch):
    """An OOM has no value: memory figures put its cross on the top edge (axes fraction 1), time
    figures on the x axis (0), both over the edge and unclipped, and the legend says where and why.
    """
    table = _table(tmp_path)
    for module, draw, edge, y in ((memory, memory.memory_vs_seq, "top edge", 1.0), (timing, timing.time_vs_seq, "x axis", 0.0)):  # fmt: skip
        (fig,) = _figures(monkeypatch, module, draw, table, tmp_path)
        crosses = _crosses(fig.axes[0])
        assert crosses and OOM_EDGES[edge] == y, edge
        for line in crosses:
            assert set(line.get_ydata()) == {y} and not line.get_clip_on()
        assert any(t.startswith(f"out of memory (crosses on the {edge}") for t in _legend_texts(fig))


def test_oom_crosses_leave_the_axes_their_height(tmp_path, monkeypatch):
    """The committed CPU peers' time figure (OOMs past the timed lengths) keeps its axes over 60% of
    the figure's height: the unclipped crosses' extent once shrank them to 53%."""
    peers = load_results(Path(__file__).parents[2] / "results" / "cpu" / "peers_cpu.csv")
    (fig,) = _figures(monkeypatch, timing, timing.time_vs_seq, peers, tmp_path)
    fig.draw_without_rendering()
    assert fig.axes[0].get_position().height > 0.6


def test_a_method_with_nothing_drawn_has_no_legend_entry_and_labels_do_not_overlap(tmp_path, monkeypatch):
    """liger, unsupported at every T, is in neither legend; each method's max T is in its legend
    entry, so no text is written over the data (where labels overlapped lines and each other)."""
    table = _table(tmp_path)
    for module, draw in ((memory, memory.memory_vs_seq), (timing, timing.time_vs_seq)):
        (fig,) = _figures(monkeypatch, module, draw, table, tmp_path)
        texts = _legend_texts(fig)
        assert not any("liger" in t for t in texts), texts
        assert len(fig.axes[0].texts) == 0
    (fig,) = _figures(monkeypatch, memory, memory.memory_vs_seq, table, tmp_path)
    assert "StreamBP, max T ≥ 8.19k (search)" in _legend_texts(fig)


def test_a_lower_bound_bar_is_open_and_the_legend_says_so(tmp_path, monkeypatch):
    """A search that reached its ceiling draws an open bar (outline only) with "≥", unlike a filled
    measured one, and the legend names open bars as lower bounds."""
    (fig,) = _figures(monkeypatch, maxlen, maxlen.max_seq_len_bars, _table(tmp_path), tmp_path)
    bars = {round(patch.get_height()): patch for patch in fig.axes[0].patches}
    assert to_rgba(bars[8192].get_facecolor())[3] == 0  # open
    assert to_rgba(bars[3000].get_facecolor())[3] == 1  # a measured answer, filled
    assert "≥8.19k" in [text.get_text() for text in fig.axes[0].texts]
    assert maxlen.LOWER_BOUND_LABEL in _legend_texts(fig)


def test_the_load_note_counts_one_thread_in_the_singular():
    """The note names the busiest row's threads: "on 1 thread", "on 2 threads"."""

    def row(threads: int) -> ResultRow:
        return ResultRow(device="cpu", status="ok", time_median_s=1.0, load_avg_1m=3.0, num_threads=threads)

    assert load_note([row(1)]).endswith("(up to 3.0 on 1 thread)")
    assert load_note([row(2), row(1)]).endswith("(up to 3.0 on 2 threads)")
