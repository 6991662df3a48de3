"""`sbp selftest`: its plans, the long point's length, the estimate's error and the summary are
checked on a CPU with stand-in rows and steps; the CPU subset runs end to end (slow tier)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sbpbench.measure.environment import capture_environment
from sbpbench.measure.progress import PROGRESS_PREFIX
from sbpbench.models import load_config
from sbpbench.records import ResultRow, upsert_rows
from sbpbench.runner import selftest as st
from sbpbench.runner.selftest_summary import (
    TEST_REPORT_ENV,
    estimate_errors,
    message_excerpt,
    progress_seconds,
    pytest_counts,
    step_output_tail,
)


def _row(model, seq_len, method, *, source="measured", status="ok", peak=None, time_s=None, checkpoints=""):
    return ResultRow(
        checkpoints=checkpoints,
        model=model,
        seq_len=seq_len,
        method=method,
        source=source,
        status=status,
        peak_allocated_bytes=peak,
        time_median_s=time_s,
        dtype="bf16",
        device="cuda:0",
        batch_size=1,
        objective="sft",
        step="bp",
        protocol="steady",
        lora_rank=0,
    )


def test_output_directories_name_the_device():
    """A GPU's results go to OUT/gpu/<device name with dashes>/, a CPU's to OUT/cpu-selftest/."""
    assert st.output_dir(Path("r"), "cuda", "NVIDIA H100 80GB HBM3") == Path("r/gpu/NVIDIA-H100-80GB-HBM3")
    assert st.output_dir(Path("r"), "cpu", "AMD EPYC") == Path("r/cpu-selftest")


def test_cpu_plan_is_a_check_a_run_and_its_estimate(tmp_path):
    """The CPU subset: sbp check, a short sbp run and the estimate of the same point, into OUT."""
    test = st.Selftest("cpu", tmp_path, st.CPU_BUDGET_S)
    names = [step.argv[1] for step in st.cpu_plan(test)]
    assert names == ["check", "run", "estimate"]
    run, estimate = st.cpu_plan(test)[1:]
    assert str(test.runs_csv) in run.argv and str(test.estimates_csv) in estimate.argv
    shared = lambda argv: [a for a in argv if a in ("small/qwen3", "512", "128", "100")]
    assert shared(run.argv) == shared(estimate.argv)  # the estimate predicts the point that was run


def _value(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_gpu_plan_covers_its_points(tmp_path):
    """On a GPU, in order: the default run (no options), Qwen3-8B StreamBP at 64k with checkpoints
    cpu and recompute:4 (one memory step, one timed: the offload path on first contact), 8B bp
    T=4608 and ckpt T=20000 memory-only, the long point, then the quick gpu-marked tests (their
    files named, each test's result recorded); an estimate of every point beside them."""
    test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S)
    steps = st.gpu_plan(test, tests_dir=Path(__file__).parents[1])
    foreground = [s.argv for s in steps if not s.background]
    assert foreground[0] == ("sbpbench", "run", "--out", str(test.runs_csv))
    offload = [a for a in foreground if "--checkpoints" in a]
    assert [(_value(a, "--model"), _value(a, "--seq"), _value(a, "--checkpoints")) for a in offload] == [
        ("Qwen/Qwen3-8B", "65536", "cpu"),
        ("Qwen/Qwen3-8B", "65536", "recompute:4"),
    ]
    assert all((_value(a, "--warmup"), _value(a, "--repeats")) == ("0", "1") for a in offload)
    assert foreground[1:3] == offload  # right after the default run, before anything that may run long
    probes = [a for a in foreground if _value(a, "--repeats") == "0"]
    assert [(_value(a, "--seq"), _value(a, "--method")) for a in probes] == [("4608", "bp"), ("20000", "ckpt")]
    assert foreground[3:5] == probes
    assert [s for s in steps if not s.background][5] is st.LONG_POINT  # before the tests
    tests = steps[-1]
    assert tests.argv[:5] == ("pytest", "-v", "--tb=short", "-m", "gpu and quick")
    assert [Path(a).name for a in tests.argv[5:]] == ["test_gpu.py", "test_gpu_measure.py"]
    assert dict(tests.env) == {TEST_REPORT_ENV: str(test.tests_report)}
    estimated_offload = {_value(s.argv, "--checkpoints") for s in steps if s.background}
    assert {"cpu", "recompute:4"} <= estimated_offload
    estimated = {
        (a[a.index("--seq") + 1], m)
        for a in (s.argv for s in steps if s.background)
        for m in a[a.index("--method") + 1 :]
        if not m.startswith("--") and m != str(test.estimates_csv)
    }
    assert {(str(t), m) for _, t, m in st.GPU_POINTS} <= estimated


def test_the_long_point_is_the_longest_that_fits_the_time_left():
    """110k with time to spare, a shorter T with less, none when not even 32k fits."""
    config = load_config("Qwen/Qwen3-8B")
    rate = 1 / 300e12  # seconds per executed FLOP at 300 TFLOP/s: 110k takes ~70 s
    assert st.long_seq_len(400, seconds_per_flop=rate, config=config) == 110_000
    assert st.long_seq_len(90, seconds_per_flop=rate, config=config) in st.LONG_SEQ_LENS[1:]
    assert st.long_seq_len(30, seconds_per_flop=rate, config=config) is None


def test_the_speed_comes_from_the_default_runs_streambp_row():
    """seconds per executed FLOP = the 4B T=9000 step time / that step's executed FLOPs (of the
    row's model, not the long point's); without a row the assumed model rate is used."""
    from sbpbench.measure.flops import phase_flops

    config4b, config8b = load_config("Qwen/Qwen3-4B"), load_config("Qwen/Qwen3-8B")
    flops = sum(m + a for m, a in phase_flops(config4b, method="streambp", batch_size=1, seq_len=9000).values())
    row = {"model": "Qwen/Qwen3-4B", "seq_len": "9000", "batch_size": "1", "time_median_s": "2.0"}
    assert st.seconds_per_executed_flop(row, config8b) == pytest.approx(2.0 / flops)  # the row's own model
    assert 1 / st.seconds_per_executed_flop(None, config8b) > st.ASSUMED_MODEL_TFLOPS * 1e12  # executed > model


def test_estimate_error_per_point():
    """error = (estimate - measured) / measured on peak allocated; an OOM or a missing row has none."""
    gib = 2**30
    measured = [
        _row("m", 9000, "ckpt", peak=32 * gib).as_dict(),
        _row("m", 9000, "bp", status="oom", peak=75 * gib).as_dict(),
    ]
    simulated = [
        _row("m", 9000, "ckpt", source="simulated", peak=int(32.32 * gib)).as_dict(),
        _row("m", 9000, "bp", source="simulated", peak=91 * gib).as_dict(),
    ]
    points = [("m", 9000, "ckpt"), ("m", 9000, "bp"), ("m", 9000, "streambp")]
    ckpt, bp, streambp = estimate_errors([_strings(r) for r in measured], [_strings(r) for r in simulated], points)
    assert ckpt.error == pytest.approx(0.01, abs=1e-3)
    assert bp.error is None and bp.measured_status == "oom"
    assert streambp.error is None and streambp.measured_status == "missing"


def _strings(row: dict) -> dict:
    return {k: "" if v is None else str(v) for k, v in row.items()}


def test_log_readers():
    """The long step's time is its last progress line; pytest results are counted from -v lines."""
    log = "\n".join(
        [
            f"{PROGRESS_PREFIX} streambp Qwen/Qwen3-8B T=110000: checkpoint pass and head done, 20.5 s",
            f"{PROGRESS_PREFIX} streambp Qwen/Qwen3-8B T=110000: layer 36 of 36 backward done, 81.0 s",
            "tests/gpu/test_gpu.py::test_a[x] PASSED  [ 50%]",
            "tests/gpu/test_gpu.py::test_b FAILED  [100%]",
        ]
    )
    assert progress_seconds(log, "streambp Qwen/Qwen3-8B T=110000") == 81.0
    assert progress_seconds(log, "streambp Qwen/Qwen3-8B T=96000") is None
    assert pytest_counts(log) == {"PASSED": 1, "FAILED": 1}


def test_a_failed_steps_last_lines_are_read_from_its_last_run():
    """A step's output tail comes from its last section in the log (an earlier run's is older),
    up to its end line, or to the end of the log when a kill left no end line."""
    name = "run Qwen/Qwen3-8B T=4608 bp (memory only)"
    log = "\n".join(
        [
            f"===== {name}: python -m sbpbench run ...",
            "an earlier run's line",
            f"===== {name}: ok, 30.5 s",
            f"===== {name}: python -m sbpbench run ...",
            *(f"line {i}" for i in range(12)),
            f"===== {name}: failed (exit 1), 12.0 s",
            "===== pytest -m 'gpu and quick': python -m pytest ...",
            "tests/gpu/test_gpu.py::test_a PASSED",
            "tests/gpu/test_gpu.py::test_b ===== pytest -m 'gpu and quick': timeout (60 s), 60.0 s",  # killed mid-line
            "===== estimate Qwen/Qwen3-8B T=4608 bp: python -m sbpbench estimate ...",
            "an estimate's line",
        ]
    )
    assert step_output_tail(log, name, max_lines=3) == ["line 9", "line 10", "line 11"]
    assert step_output_tail(log, "pytest -m 'gpu and quick'") == [
        "tests/gpu/test_gpu.py::test_a PASSED",
        "tests/gpu/test_gpu.py::test_b",
    ]
    assert step_output_tail(log, "never ran") == []


def test_gpu_selftest_runs_its_plan_and_writes_the_summary(tmp_path, monkeypatch):
    """The GPU path end to end with stand-in steps: the default run's streambp speed picks the
    long point, whose estimate joins the background; summary.md holds every point's error, the
    long point and the FLOP breakdown."""
    gib = 2**30
    test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S)
    ran = []

    def fake_run_step(step, log, env=None):
        ran.append(step)
        argv = step.argv
        placement = _value(argv, "--checkpoints") or ""
        if argv[:2] == ("sbpbench", "run"):
            if "--model" not in argv:  # the default run
                upsert_rows(test.runs_csv, [_row("Qwen/Qwen3-4B", 9000, "streambp", peak=19 * gib, time_s=2.0)])
            else:
                seq, method = int(argv[argv.index("--seq") + 1]), argv[argv.index("--method") + 1]
                row = _row(argv[argv.index("--model") + 1], seq, method, peak=50 * gib, checkpoints=placement)
                upsert_rows(test.runs_csv, [row])
                with log.open("a") as out:
                    out.write(
                        f"{PROGRESS_PREFIX} {method} Qwen/Qwen3-8B T={seq}: layer 36 of 36 backward done, 75.0 s\n"
                    )
        if argv[:2] == ("sbpbench", "estimate"):
            seq = int(argv[argv.index("--seq") + 1])
            methods = argv[argv.index("--method") + 1 : argv.index("--out")]
            model = argv[argv.index("--model") + 1]
            rows = [
                _row(model, seq, m, source="simulated", peak=int(50.5 * gib), checkpoints=placement) for m in methods
            ]
            upsert_rows(test.estimates_csv, rows)
        if argv[0] == "pytest":  # what tests/conftest.py records, a failure and a test cut short
            assert dict(step.env)[TEST_REPORT_ENV] == str(test.tests_report)
            test.tests_report.write_text(_TEST_REPORT)
            return st.Outcome(step, "timeout (45 s)", 45.0)
        return st.Outcome(step, "ok", 1.0)

    test.tests_report.write_text('{"event": "start", "test": "from/an/earlier/run"}\n')
    monkeypatch.setattr(st, "run_step", fake_run_step)
    st.run_selftest(test, tests_dir=Path(__file__).parents[1], echo=lambda line: None)
    assert test.long_seq_len == 110_000
    assert sum(s.background for s in ran) == 6  # five fixed points' estimates and the long one's
    summary = st.write_summary(test, capture_environment("cpu")).read_text()
    assert "| run (the default: Qwen/Qwen3-4B, T=9000, every method) | ok | 1 | 78 | - |" in summary
    # predicted: 30 s plus its FLOPs at the speed of a 2 s Qwen3-4B step
    assert "| run Qwen/Qwen3-8B T=110000 streambp (memory only) | ok | 1 | 139 | - |" in summary
    assert "gpu-marked tests: 1 failed, 1 passed (details in selftest.log)." in summary
    assert "Failed: `tests/gpu/test_gpu.py::test_dpo` (12 s):" in summary
    assert "AssertionError: bp vs streambp fp64:\n  loss: rel error 1.897e-04 (tolerance 1e-05)" in summary
    assert "Cut while running: `tests/gpu/test_gpu_measure.py::test_memory[bp]`." in summary
    assert "Not reached: 1 (`tests/gpu/test_gpu_measure.py::test_memory[streambp]`)." in summary
    assert "earlier/run" not in summary  # the report is this run's
    assert "`pytest -m 'gpu and quick'`: timeout (45 s); its last lines in selftest.log:" in summary
    assert "| Qwen/Qwen3-8B | 110000 | streambp | - | 50.00 | 50.50 | +1.0% |" in summary
    assert "| Qwen/Qwen3-8B | 65536 | streambp (recompute:4) | - | 50.00 | 50.50 | +1.0% |" in summary
    assert "| Qwen/Qwen3-4B | 9000 | streambp | - | 19.00 | 50.50 |" in summary  # off by > 5%: flagged
    assert "off by more than 5%" in summary
    assert "streambp Qwen/Qwen3-8B T=110000 (memory only, one step, no warm-up): ok, peak 50.00 GiB" in summary
    assert "75 s into the step" in summary and "| chunk backward |" in summary


# What tests/conftest.py writes of a pytest run killed in its third test
_TESTS = (
    "test_gpu.py::test_fp32",
    "test_gpu.py::test_dpo",
    "test_gpu_measure.py::test_memory[bp]",
    "test_gpu_measure.py::test_memory[streambp]",
)
_TEST_REPORT = "\n".join(
    json.dumps(line)
    for line in [
        {"event": "collected", "tests": [f"tests/gpu/{t}" for t in _TESTS]},
        {"event": "start", "test": "tests/gpu/test_gpu.py::test_fp32"},
        {
            "event": "result",
            "test": "tests/gpu/test_gpu.py::test_fp32",
            "when": "call",
            "outcome": "passed",
            "seconds": 9.0,
            "message": "",
        },
        {"event": "start", "test": "tests/gpu/test_gpu.py::test_dpo"},
        {
            "event": "result",
            "test": "tests/gpu/test_gpu.py::test_dpo",
            "when": "call",
            "outcome": "failed",
            "seconds": 12.3,
            "message": "tests/gpu/test_gpu.py:95: in test_dpo\n    _assert_judged(results)\n"
            "E   AssertionError: bp vs streambp fp64:\n"
            "E     loss: rel error 1.897e-04 (tolerance 1e-05)\nE   assert False",
        },
        {"event": "start", "test": "tests/gpu/test_gpu_measure.py::test_memory[bp]"},
    ]
)


def test_a_failures_message_is_cut_to_its_error_lines():
    """The summary shows pytest's E lines of a failure (its assertion and how it failed), or the
    traceback's last lines when it has none."""
    message = "t.py:3: in f\n    g()\nE   ValueError: bad\nE     detail"
    assert message_excerpt(message) == ["ValueError: bad", "  detail"]
    assert message_excerpt("\n".join(f"line {i}" for i in range(20)), max_lines=2) == ["line 18", "line 19"]


@pytest.mark.slow
def test_cpu_selftest_runs_end_to_end(tmp_path):
    """`sbp selftest` on this CPU machine says so in one line, runs check, run and estimate, and
    writes the rows, the log and a summary with the estimate's error for each method."""
    done = subprocess.run(
        [sys.executable, "-m", "sbpbench", "selftest", "--out", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("No CUDA GPU visible: running the CPU subset")
    out = tmp_path / "cpu-selftest"
    summary = (out / "summary.md").read_text()
    assert (out / "runs.csv").exists() and (out / "estimates.csv").exists() and (out / "selftest.log").exists()
    for method in ("bp", "ckpt", "streambp"):
        line = next(text for text in summary.splitlines() if text.startswith(f"| small/qwen3 | 512 | {method} |"))
        assert "%" in line, line  # measured and estimated, with an error


def test_the_offload_points_fit_the_budget_beside_the_default_run():
    """Budget arithmetic: each offload point's limit is the overhead plus 1.25 x its two steps at the
    assumed H100 rate (recompute:4 one forward more, so longer), and the default run's cap plus both
    fit the 8 minutes, so no earlier step can leave them without their time."""
    config = load_config(st.LONG_MODEL)
    cpu, recompute = (st.offload_timeout_s(p, config) for p in st.OFFLOAD_PLACEMENTS)
    assert st.POINT_OVERHEAD_S < cpu < recompute
    assert st.DEFAULT_RUN_S + cpu + recompute <= st.GPU_BUDGET_S


def test_a_slow_machine_keeps_the_offload_points_and_skips_what_the_budget_cannot_hold(tmp_path, monkeypatch):
    """Every step taking its whole limit (a slow machine): the default run is cut short so that the
    offload points get their full limits (reserved), the steps after them that the budget cannot
    start are `not run (budget)`, not failures, and the whole selftest ends within its budget."""
    clock = [0.0]
    monkeypatch.setattr(st.time, "perf_counter", lambda: clock[0])
    test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S)
    limits = {}

    def slow_run_step(step, log, env=None):
        limits[step.name] = step.timeout_s
        if not step.background:
            clock[0] += step.timeout_s
        return st.Outcome(step, f"timeout ({step.timeout_s:.0f} s)", step.timeout_s)

    monkeypatch.setattr(st, "run_step", slow_run_step)
    st.run_selftest(test, tests_dir=Path("tests"), echo=lambda line: None)
    config = load_config(st.LONG_MODEL)
    for placement in st.OFFLOAD_PLACEMENTS:
        name = next(n for n in limits if f"--checkpoints {placement}" in n)
        assert limits[name] == pytest.approx(st.offload_timeout_s(placement, config))
    assert clock[0] <= st.GPU_BUDGET_S
    skipped = [o for o in test.outcomes if o.status == st.NOT_RUN]
    assert skipped and not any(o.failed for o in skipped)
    assert test.long_seq_len is None


# Wall seconds of the steps of `sbp selftest --budget 535` on one NVIDIA H100 80GB HBM3 (2026-11-26,
# that run's selftest.log); its default run's streambp step took 1.348 s (its runs.csv).
H100_STEP_S = {
    "run (the default": 77.7,
    "--checkpoints cpu": 92.7,
    "--checkpoints recompute:4": 94.5,
    "T=4608 bp": 30.5,
    "T=20000 ckpt": 33.7,
}
H100_STREAMBP_STEP_S = 1.348
# The long point, Qwen3-8B StreamBP T=110000 memory-only, run alone on that machine: its row came
# 80 s into `sbp run` (its log); the probes above spent 13-15 s of their wall time outside that count.
H100_LONG_S = 80 + 15


def _priced(tmp_path, monkeypatch, seconds_of):
    """run_selftest on a clock that each step advances by seconds_of(step); the default run writes
    the H100's streambp row. Returns the selftest and the clock's end."""
    clock = [0.0]
    monkeypatch.setattr(st.time, "perf_counter", lambda: clock[0])
    test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S)

    def priced_run_step(step, log, env=None):
        if step.background:
            return st.Outcome(step, "ok", 1.0)
        seconds = seconds_of(step)
        assert seconds <= step.timeout_s, f"{step.name}: {seconds} s over its limit {step.timeout_s:.0f} s"
        clock[0] += seconds
        if "(the default" in step.name:
            upsert_rows(test.runs_csv, [_row("Qwen/Qwen3-4B", 9000, "streambp", peak=1, time_s=H100_STREAMBP_STEP_S)])
        return st.Outcome(step, "ok", seconds)

    monkeypatch.setattr(st, "run_step", priced_run_step)
    st.run_selftest(test, tests_dir=Path(__file__).parents[1], echo=lambda line: None)
    return test, clock[0]


def _h100_seconds(step) -> float:
    """A step's H100 wall time; the quick tests (newer than that run) and a long point shorter than
    110k (not measured) at the plan's own prediction."""
    if "T=110000" in step.name:
        return H100_LONG_S
    if step.argv[0] == "pytest" or "streambp (memory only)" in step.name:  # a shorter long point: predicted
        return step.predicted_s
        return st.PREDICTED_S["tests"]
    return next(s for key, s in H100_STEP_S.items() if key in step.name)


def test_the_plan_priced_with_the_h100s_step_times_fits_the_budget_with_the_long_point(tmp_path, monkeypatch):
    """Every step at the wall time one H100 measured (the quick tests at their prediction): all of
    them run, the long point at the paper's 110k, and the whole plan ends within the 8 minutes."""
    test, end = _priced(tmp_path, monkeypatch, _h100_seconds)
    assert [o.status for o in test.outcomes if not o.step.background] == ["ok"] * 7
    assert test.long_seq_len == 110_000
    assert end <= st.GPU_BUDGET_S
    assert test.outcomes[6].step.argv[0] == "pytest"  # the tests last, after the long point


def test_predictions_come_from_this_devices_earlier_log(tmp_path, monkeypatch):
    """A step's prediction is its wall time in the device's earlier selftest.log when it ran ok
    there: tests measured at 60 s there leave the long point less time, so it is shorter."""
    tests_step = st.TESTS_STEP
    earlier = (
        f"===== {tests_step}: ok, 60.0 s\n"
        "===== run Qwen/Qwen3-8B T=4608 bp (memory only): timeout (120 s), 120.0 s\n"  # not a prediction
    )
    plan = st.gpu_plan(st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S), Path(__file__).parents[1])
    steps = st.with_measured_predictions(plan, earlier)
    predicted = {s.name: s.predicted_s for s in steps}
    assert predicted[tests_step] == 60.0
    assert predicted["run Qwen/Qwen3-8B T=4608 bp (memory only)"] == st.PREDICTED_S["probe bp"]
    (tmp_path / "selftest.log").write_text(earlier)
    test, end = _priced(tmp_path, monkeypatch, _h100_seconds)
    assert test.long_seq_len == 96_000 and end <= st.GPU_BUDGET_S
