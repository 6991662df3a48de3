"""benchmarks/hopper_goals.py, the one command that measures the speed goals on a GPU: its points
(the two goals first, then the chunk variants), the goal table it reads back from the rows (MFU from
the device's peak), and, slow, the whole script on tiny CPU shapes."""

from __future__ import annotations

import re

import pytest

from ..conftest import load_script


def _script():
    return load_script("benchmarks/hopper_goals.py", "hopper_goals")


def test_the_goal_points_come_first_and_the_variants_set_their_chunks():
    """Qwen3-4B T=9000 ckpt + streambp and Qwen3-8B T=65536 streambp (cpu placement, one timed step)
    first; the variants: 4B in 2 chunks and in 1, 8B in chunks of 8192."""
    goals = _script()
    runs = goals.commands(smoke=False, goals_only=False)
    assert runs[0] == [*goals.SHORT, "--method", "ckpt", "streambp"]
    assert runs[1] == [*goals.LONG, "--method", "streambp"] and "cpu" in goals.LONG
    assert [run[-1] for run in runs[2:]] == ["4500", "9000", "8192"]
    assert goals.commands(smoke=False, goals_only=True) == runs[:2]


def _row(model, seq, method, **values):
    auto = "chunk_size;logits_chunk_size" if method == "streambp" else ""
    row = {"model": model, "seq_len": str(seq), "method": method, "status": "ok", "auto_settings": auto}
    return row | {"checkpoints": "gpu" if method == "streambp" else ""} | values


def test_the_goal_table_reads_the_ratio_and_the_mfu_from_the_rows():
    """ratio = streambp / ckpt median time at the short point (a variant with its own chunk is not the
    goal's row); MFU = TFLOP/s over the device's dense bf16 peak; a missing point says so."""
    goals = _script()
    rows = [
        _row("Qwen/Qwen3-4B", 9000, "ckpt", time_median_s="1.6"),
        _row("Qwen/Qwen3-4B", 9000, "streambp", time_median_s="1.2"),
        _row("Qwen/Qwen3-4B", 9000, "streambp", time_median_s="0.5", auto_settings="logits_chunk_size"),
        _row("Qwen/Qwen3-8B", 65536, "streambp", checkpoints="cpu", tflops_per_s="395.76",
             device_name="NVIDIA H100 80GB HBM3"),
    ]  # fmt: skip
    table = "\n".join(goals.goal_lines(rows, goals.SHORT, goals.LONG))
    assert "| 0.750 | <= 0.75 |" in table
    assert "| 40.0% (395.8 TFLOP/s) | >= 40% |" in table
    assert "not measured" in "\n".join(goals.goal_lines(rows[:1], goals.SHORT, goals.LONG))
    assert goals.peak_tflops("NVIDIA H100 PCIe") == 756.0 and goals.peak_tflops("a CPU") is None


@pytest.mark.slow
def test_the_script_runs_its_commands_and_prints_the_goal_table(tmp_path, capfd):
    """--smoke --goals-only on a CPU: both points' rows written, a phase table each, the goal table."""
    goals = _script()
    out = tmp_path / "goals.csv"
    assert goals.main(["--smoke", "--goals-only", "--out", str(out)]) == 0
    printed = capfd.readouterr().out
    assert printed.count("Where the time went") == 2
    assert re.search(r"\| StreamBP / ckpt step time, tiny/qwen3 T=96 \| \d+\.\d{3} \|", printed)
    assert re.search(r"\| StreamBP MFU, tiny/qwen3 T=192, checkpoints cpu \| [\d.e-]+ TFLOP/s", printed)
