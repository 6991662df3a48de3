"""benchmarks/hopper_goals.py, the one command that measures the speed goals on a GPU: its points
(the two goals first, then the chunk variants), the time limit each point runs under and the
script's deadline, the goal table it reads back from the rows (MFU from the device's peak), and,
slow, the whole script on tiny CPU shapes. Nothing here needs a GPU."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

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


def test_each_point_has_a_limit_a_10_minute_command_holds():
    """A point's limit is the FLOP model's with its models' start-up: 86 s at Qwen3-4B (5 steps),
    300 s at Qwen3-8B T=65536 (2 steps), over twice what the selftest measured on an H100 (about
    26 s per 4B method, 93 s for the 8B point), where `sbp run`'s default would allow over 600 s;
    every command, its points and its start, ends within 10 minutes."""
    from sbpbench.runner.timeout import START_S

    goals = _script()
    runs = goals.commands(smoke=False, goals_only=False)
    limits = [goals.point_timeout_s(run) for run in runs]
    assert limits == [86.0, 300.0, 86.0, 86.0, 300.0]
    assert min(limits[0], limits[2]) > 2 * 77.7 / 3 and min(limits[1], limits[4]) > 2 * 92.7 and START_S >= 600
    assert all(len(goals.methods_of(run)) * limit + goals.START_UP_S < 600 for run, limit in zip(runs, limits))
    assert goals.methods_of(runs[2]) == ["streambp"] and goals.methods_of(runs[0]) == ["ckpt", "streambp"]


def test_the_script_gives_each_command_its_limit_and_stops_at_the_deadline(monkeypatch, tmp_path, capsys):
    """Each command passes --timeout and runs under its points' limits and its start, cut to what
    the deadline leaves; one stopped there is reported, the rest are not started, the goal table
    is still printed and the exit code is 1."""
    goals = _script()
    now = [0.0]
    started = []

    def run_command(command, limit_s):
        started.append((command, limit_s))
        spent = 150.0 if len(started) == 1 else limit_s  # the second stalls until it is stopped
        now[0] += spent
        return 0 if len(started) == 1 else None

    monkeypatch.setattr(goals, "run_command", run_command)
    out = tmp_path / "goals.csv"
    assert goals.main(["--deadline", "400", "--out", str(out)], clock=lambda: now[0]) == 1
    printed = capsys.readouterr().out
    (first, first_limit), (second, second_limit) = started
    assert first[:4] == [sys.executable, "-m", "sbpbench", "run"] and first[-2:] == ["--out", str(out)]
    assert first[first.index("--timeout") + 1] == "86" and first_limit == 2 * 86 + goals.START_UP_S
    assert second[second.index("--timeout") + 1] == "300" and second_limit == 400 - 150
    assert "stopped at --deadline: sbp run --model Qwen/Qwen3-8B" in printed
    assert printed.count("not started (0 s left of --deadline)") == 3
    assert "| StreamBP MFU, Qwen/Qwen3-8B T=65536, checkpoints cpu | not measured |" in printed


PYTHON = [sys.executable, "-I", "-S", "-c"]  # a bare interpreter: started in tens of milliseconds


def test_a_command_past_its_limit_gets_ctrl_c(monkeypatch):
    """At its limit a command gets Ctrl-C, so it can clean up (`sbp run` kills its workers and keeps
    its rows), and there is no exit code; before its limit, its exit code comes back. A stand-in
    process: a real one may still be starting at the limit on a loaded machine."""
    goals = _script()

    class Process:
        def __init__(self, command):
            self.signals, self.waits = [], []

        def wait(self, timeout=None):
            self.waits.append(timeout)
            if not self.signals:  # runs until told to stop
                raise subprocess.TimeoutExpired("command", timeout)
            return -2

        def send_signal(self, number):
            self.signals.append(number)

    made = []
    monkeypatch.setattr(goals.subprocess, "Popen", lambda command: made.append(Process(command)) or made[-1])
    assert goals.run_command(["sbp", "run"], 1.0) is None
    assert made[0].signals == [signal.SIGINT] and made[0].waits == [1.0, goals.STOP_GRACE_S]
    monkeypatch.undo()
    assert _script().run_command([*PYTHON, "raise SystemExit(3)"], 10.0) == 3


def test_a_command_that_ignores_ctrl_c_is_killed(monkeypatch):
    """A command that ignores the Ctrl-C is killed STOP_GRACE_S after it, not waited for."""
    goals = _script()
    monkeypatch.setattr(goals, "STOP_GRACE_S", 0.5)
    stubborn = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)"
    started = time.monotonic()
    assert goals.run_command([*PYTHON, stubborn], 1.0) is None
    assert time.monotonic() - started < 10


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
    """--smoke --goals-only on a CPU: each command under its --timeout, both points' rows written,
    a phase table each, the goal table."""
    goals = _script()
    out = tmp_path / "goals.csv"
    assert goals.main(["--smoke", "--goals-only", "--out", str(out)]) == 0
    printed = capfd.readouterr().out
    assert len(re.findall(r"^\$ sbp run .* --timeout 61 --phases ", printed, re.MULTILINE)) == 2
    assert printed.count("Where the time went") == 2
    assert re.search(r"\| StreamBP / ckpt step time, tiny/qwen3 T=96 \| \d+\.\d{3} \|", printed)
    assert re.search(r"\| StreamBP MFU, tiny/qwen3 T=192, checkpoints cpu \| [\d.e-]+ TFLOP/s", printed)
