"""`sbp selftest`: its plans, their price, the budget's rules, the verdicts on what a step wrote and
the summary are checked on a CPU with stand-in steps and rows; a step's process group is stopped at
its limit; the CPU subset runs end to end (slow tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from sbpbench.measure.copy_rate import DEVICE_TO_HOST, HOST_REGISTER, HOST_TO_DEVICE, PIN_MEMORY, CopyRate, write_csv
from sbpbench.measure.environment import capture_environment
from sbpbench.records import ResultRow, upsert_rows
from sbpbench.records.exactness import ExactnessRow, write_exactness
from sbpbench.runner import selftest as st
from sbpbench.runner.selftest_summary import (
    TEST_REPORT_ENV,
    estimate_errors,
    message_excerpt,
    pytest_counts,
    step_output_tail,
)

REPOSITORY = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"
GIB = 2**30


def _row(model, seq_len, method, *, source="measured", status="ok", peak=None, time_s=None, **values):
    defaults = {"checkpoints": "gpu" if method == "streambp" else "", "num_layers": st.meta_depth(model)}
    return ResultRow(
        model=model, seq_len=seq_len, method=method, source=source, status=status, peak_allocated_bytes=peak,
        time_median_s=time_s, dtype="bf16", device="cuda:0", batch_size=1, objective="sft", step="bp",
        protocol="steady", lora_rank=0, **{**defaults, **values},
    )  # fmt: skip


def _value(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def _foreground(steps):
    return [s for s in steps if not s.background]


@pytest.fixture(scope="module")
def h100_rates():
    """The rates fitted to the H100 rows committed under results/gpu/: what the plan is priced at."""
    test = st.Selftest("cuda", Path("/nonexistent"), st.GPU_BUDGET_S, H100)
    rates = st.plan_rates(test, REPOSITORY)
    assert rates.measured and H100 in rates.describe()
    return rates


def test_output_directories_name_the_device():
    """A GPU's results go to OUT/gpu/<device name with dashes>/, a CPU's to OUT/cpu-selftest/."""
    assert st.output_dir(Path("r"), "cuda", H100) == Path("r/gpu/NVIDIA-H100-80GB-HBM3")
    assert st.output_dir(Path("r"), "cpu", "AMD EPYC") == Path("r/cpu-selftest")


def test_a_cpu_selftest_with_its_defaults_leaves_the_checkout_as_it_was():
    """The default CPU output (`--out results`) is ignored by git and holds no tracked file, so checking
    a machine from a clone changes nothing git would show."""
    if not (REPOSITORY / ".git").exists():
        pytest.skip("not a git checkout")
    default_out = st.output_dir(Path("results"), "cpu", "AMD EPYC")
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{default_out}/runs.csv"], cwd=REPOSITORY, check=False)
    assert ignored.returncode == 0, f"{default_out}/ is not ignored by git"
    tracked = subprocess.run(["git", "ls-files", str(default_out)], cwd=REPOSITORY, capture_output=True, text=True)
    assert tracked.stdout == "", tracked.stdout


def test_cpu_plan_is_a_check_a_run_and_its_estimate(tmp_path):
    """The CPU subset: sbp check, a short sbp run and the estimate of the same point, into OUT."""
    test = st.Selftest("cpu", tmp_path, st.CPU_BUDGET_S)
    steps = st.cpu_plan(test)
    assert [step.argv[:3] for step in steps] == [("-m", "sbpbench", c) for c in ("check", "run", "estimate")]
    run, estimate = steps[1:]
    assert str(test.runs_csv) in run.argv and str(test.estimates_csv) in estimate.argv
    shared = lambda argv: [a for a in argv if a in ("small/qwen3", "512", "128", "100")]
    assert shared(run.argv) == shared(estimate.argv)  # the estimate predicts the point that was run
    assert all(dict(step.env)["SBP_CACHE_DIR"] == str(tmp_path) for step in steps)


def test_gpu_plan_runs_in_order_of_value(tmp_path, h100_rates):
    """On a GPU, in order: the quick tests (the new files first), the attention benchmark on a Qwen3-8B
    step's calls at 65,536 tokens writing the kernel table into OUT, Qwen3-4B T=9000 ckpt and streambp
    with phases (auto: the table), Qwen3-8B at 262,144 tokens streamed on 3 layers and at 65,536 with
    cpu checkpoints (a warm-up, a memory and a timed step each, the lower-right kernel), the copy
    rate; each point's estimate, with the run's own options, submitted beside them first."""
    test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S, H100)
    steps = st.gpu_plan(test, REPOSITORY, h100_rates)
    assert [s.kind for s in steps] == ["estimate"] * 3 + ["tests", "benchmark", "run", "run", "run", "copy rate"]
    tests, benchmark, short, long, gpu_64k, copies = _foreground(steps)
    assert tests.argv[:8] == ("-m", "pytest", "-v", "--tb=short", "-p", "no:cacheprovider", "-m", "gpu and quick")
    names = [Path(a).name for a in tests.argv[8:]]
    assert names[:3] == list(st.QUICK_FIRST) and set(names) == {*st.QUICK_FIRST, "test_gpu.py"}
    assert dict(tests.env)[TEST_REPORT_ENV] == str(test.tests_report)
    assert Path(benchmark.argv[0]).name == "attention_kernels.py"
    assert [_value(benchmark.argv, f) for f in ("--model", "--seq", "--chunk-size")] == [
        "Qwen/Qwen3-8B",
        "65536",
        "4096",
    ]
    assert _value(benchmark.argv, "--out") == str(tmp_path / st.BENCHMARK_CSV)
    assert _value(benchmark.argv, "--table") == str(tmp_path / "attention-kernels.json")
    assert short.argv[2] == "run" and "--phases" in short.argv and "--set" not in short.argv
    assert (_value(short.argv, "--model"), _value(short.argv, "--seq")) == ("Qwen/Qwen3-4B", "9000")
    assert short.argv[short.argv.index("--method") + 1 : short.argv.index("--method") + 3] == ("ckpt", "streambp")
    flags = ("--model", "--seq", "--checkpoints", "--num-layers", "--warmup", "--repeats", "--set")
    lower_right = "chunk_attention=lower-right"
    assert [_value(long.argv, f) for f in flags] == ["Qwen/Qwen3-8B", "262144", "stream:2", "3", "1", "1", lower_right]
    assert [_value(gpu_64k.argv, f) for f in flags] == ["Qwen/Qwen3-8B", "65536", "cpu", None, "1", "1", lower_right]
    assert copies.argv[:2] == ("-m", "sbpbench.measure.copy_rate")
    for run, estimate in zip((short, long, gpu_64k), [s for s in steps if s.background]):
        assert estimate.argv[2] == "estimate" and _value(estimate.argv, "--out") == str(test.estimates_csv)
        point = estimate.argv[3 : estimate.argv.index("--method")]  # the estimate is of the point run
        assert run.argv[3 : 3 + len(point)] == point, (point, run.argv)
        count = len(run.point.methods)
        methods = [argv[argv.index("--method") + 1 :][:count] for argv in (run.argv, estimate.argv)]
        assert methods == [run.point.methods] * 2
        assert _value(run.argv, "--out") == str(test.runs_csv) and _value(run.argv, "--timeout")
    for step in steps:  # one kernel table and one compile cache for all, in the output folder
        env = dict(step.env)
        assert env["SBP_CACHE_DIR"] == str(tmp_path)
        assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / st.COMPILE_CACHE))
        assert env["TRITON_CACHE_DIR"].startswith(str(tmp_path / st.COMPILE_CACHE))


def test_every_price_is_the_sum_of_the_work_it_counts(tmp_path, h100_rates):
    """Each foreground step's prediction is its counted work's sum, never a flat figure; the quick
    tier's work names every file that holds quick tests; the auto run counts its kernel builds, the
    lower-right long points none."""
    steps = _foreground(st.gpu_plan(st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S, H100), REPOSITORY, h100_rates))
    for step in steps:
        assert step.work and step.predicted_s == pytest.approx(sum(w.seconds for w in step.work)), step.name
    tests = next(s for s in steps if s.kind == "tests")
    priced = {w.what.split(":")[0] for w in tests.work if w.what.startswith("test_")}
    assert priced == {p.name for p in st.quick_test_files(REPOSITORY / "tests")}
    short, long, gpu_64k = (s for s in steps if s.kind == "run")
    assert any("kernel builds" in w.what for w in short.work)
    assert not any("kernel builds" in w.what for w in long.work + gpu_64k.work)


def test_on_2_gpus_streambp_sharing_each_sequence_is_checked_and_run_after_the_short_point(tmp_path, h100_rates):
    """With 2 GPUs or more visible, right after Qwen3-4B T=9000: `sbp check` of StreamBP on 2 GPUs
    sharing each sequence in fp32 (its comparison appended to exactness.csv), then Qwen3-4B at
    T=65,536 on 2 GPUs sharing each sequence, whose estimate, submitted second, is of the same point
    (--nproc 2 --sp 2); every other step as on one GPU."""
    one_gpu = st.gpu_plan(st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S, H100), REPOSITORY, h100_rates)
    for num_gpus in (2, 8):
        test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S, H100, num_gpus=num_gpus)
        steps = st.gpu_plan(test, REPOSITORY, h100_rates)
        kinds = ["estimate"] * 4 + ["tests", "benchmark", "run", "check", "run", "run", "run", "copy rate"]
        assert [s.kind for s in steps] == kinds
        short, check, sp_run = _foreground(steps)[2:5]
        assert short.point == st.SHORT_POINT and sp_run.point == st.SP_POINT
        assert check.argv == (
            "-m", "sbpbench", "check", "--device", "cuda", "--model", "Qwen/Qwen3-0.6B", "--seq", "2048",
            "--num-layers", "2", "--nproc", "2", "--sp", "2", "--dtype", "fp32", "--method", "streambp",
            "--out", str(test.exactness_csv),
        )  # fmt: skip
        assert check.predicted_s == pytest.approx(sum(w.seconds for w in check.work))
        assert check.predicted_s < check.timeout_s
        flags = ("--model", "--seq", "--nproc", "--sp", "--warmup", "--repeats", "--method", "--out")
        assert [_value(sp_run.argv, f) for f in flags] == [
            "Qwen/Qwen3-4B", "65536", "2", "2", "0", "1", "streambp", str(test.runs_csv)
        ]  # fmt: skip
        estimate = [s for s in steps if s.background][1]
        point = estimate.argv[3 : estimate.argv.index("--method")]
        assert {"--nproc", "--sp"} <= set(point) and sp_run.argv[3 : 3 + len(point)] == point
        added = {check.name, sp_run.name, estimate.name}
        assert [s for s in steps if s.name not in added] == one_gpu


def test_on_2_gpus_the_plan_at_its_prices_runs_the_new_steps_within_the_budget(tmp_path, monkeypatch, h100_rates):
    """On 2 GPUs, every step taking its price: the check and the run on 2 GPUs run and pass their
    verdicts; any later step the budget can no longer hold is not run (budget), not a failure; the
    whole ends within the budget."""
    monkeypatch.setattr(st, "plan_rates", lambda test, repository: h100_rates)
    test, end = _on_a_clock(tmp_path, monkeypatch, lambda step: step.predicted_s, num_gpus=2)
    status = {o.step.name: o.status for o in _foreground_outcomes(test)}
    print(status, {o.step.name: round(o.step.predicted_s) for o in _foreground_outcomes(test)})
    new = [o for o in _foreground_outcomes(test) if o.step.point in (st.SP_CHECK, st.SP_POINT)]
    assert [(o.step.kind, o.status) for o in new] == [("check", "ok"), ("run", "ok")]
    assert not any(o.failed for o in test.outcomes) and end <= st.GPU_BUDGET_S


def test_the_plan_priced_with_the_h100_rows_fits_the_budget(tmp_path, monkeypatch, h100_rates):
    """Every step priced by its counted work at the rates of the H100 rows measured so far: the
    foreground sums to at most 8 minutes less the margin, every step's own limit covers its price,
    and on a clock that each step moves by its price every step runs, in order, within the budget."""
    test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S, H100)
    steps = _foreground(st.gpu_plan(test, REPOSITORY, h100_rates))
    total = sum(s.predicted_s for s in steps)
    print({s.name: round(s.predicted_s) for s in steps}, f"total {total:.0f} s")
    assert total <= (1 - st.MARGIN) * st.GPU_BUDGET_S
    assert all(s.predicted_s < s.timeout_s for s in steps)
    assert next(s for s in steps if s.kind == "run").predicted_s > 50  # two Qwen3-4B processes, priced
    monkeypatch.setattr(st, "plan_rates", lambda test, repository: h100_rates)
    test, end = _on_a_clock(tmp_path, monkeypatch, lambda step: step.predicted_s)
    assert [o.status for o in _foreground_outcomes(test)] == ["ok"] * 6
    assert end <= st.GPU_BUDGET_S


def _foreground_outcomes(test):
    return [o for o in test.outcomes if not o.step.background]


def _on_a_clock(tmp_path, monkeypatch, seconds_of, budget_s=st.GPU_BUDGET_S, num_gpus=1):
    """run_selftest on a clock that each foreground step advances by seconds_of(step), each step
    writing what it promises (stand_in_step). Returns the selftest and the clock's end."""
    clock = [0.0]
    monkeypatch.setattr(st.time, "perf_counter", lambda: clock[0])
    test = st.Selftest("cuda", tmp_path, budget_s, H100, num_gpus=num_gpus)

    def on_the_clock(step, log, env=None):
        if step.background:
            return stand_in_step(test, step, faults=False)
        seconds = min(seconds_of(step), step.timeout_s)
        clock[0] += seconds
        outcome = stand_in_step(test, step, faults=False)
        if seconds >= step.timeout_s:
            outcome.status = f"timeout ({step.timeout_s:.0f} s)"
        outcome.seconds = seconds
        return outcome

    monkeypatch.setattr(st, "run_step", on_the_clock)
    st.run_selftest(test, repository=REPOSITORY, echo=lambda line: None)
    return test, clock[0]


def test_a_slow_machine_runs_what_the_budget_holds_and_skips_the_rest(tmp_path, monkeypatch, h100_rates):
    """Every step taking its whole limit (a slow machine): each is cut to what the budget leaves,
    the steps whose prediction no longer fits are `not run (budget)`, not failures, and the whole
    selftest ends within its budget."""
    monkeypatch.setattr(st, "plan_rates", lambda test, repository: h100_rates)
    test, end = _on_a_clock(tmp_path, monkeypatch, lambda step: step.timeout_s)
    statuses = [o.status for o in _foreground_outcomes(test)]
    assert statuses[0].startswith("timeout") and st.NOT_RUN in statuses
    skipped = [o for o in test.outcomes if o.status == st.NOT_RUN]
    assert not any(o.failed for o in skipped)
    assert end <= st.GPU_BUDGET_S


def test_a_step_starts_only_with_time_for_its_prediction(tmp_path, monkeypatch, h100_rates):
    """With 200 s of budget and every step at its price, the tests and the benchmark run; the first
    run step (priced near 80 s) would not fit what is left and is not started, nor is a later one
    unless its own price fits: the copy rate (under 10 s) still runs."""
    monkeypatch.setattr(st, "plan_rates", lambda test, repository: h100_rates)
    test, end = _on_a_clock(tmp_path, monkeypatch, lambda step: step.predicted_s, budget_s=200)
    by_kind = {o.step.kind: o.status for o in _foreground_outcomes(test) if o.step.kind != "run"}
    runs = [o.status for o in _foreground_outcomes(test) if o.step.kind == "run"]
    assert by_kind == {"tests": "ok", "benchmark": "ok", "copy rate": "ok"}
    assert runs == [st.NOT_RUN] * 3 and end <= 200


def test_an_estimate_starts_only_within_the_budget(tmp_path, monkeypatch):
    """A background estimate reached with under MIN_START_S of the budget left is not run (budget),
    not a failure; one reached in time runs under a limit that ends with the budget."""
    ran = []
    monkeypatch.setattr(st, "run_step", lambda step, log, env=None: ran.append(step) or st.Outcome(step, "ok"))
    step = st.Step("estimate", ("-m", "sbpbench", "estimate"), 300, background=True, kind="estimate")
    for left_s, status in ((st.MIN_START_S - 1, st.NOT_RUN), (100, "ok")):
        background = st.Background(tmp_path / "estimates.log", time.perf_counter() + left_s)
        background.submit(step)
        (outcome,) = background.finish(tmp_path / "selftest.log")
        assert outcome.status == status and not outcome.failed
    (started,) = ran
    assert started.timeout_s <= 100 - st.GRACE_S


def test_predictions_come_from_this_devices_earlier_log(tmp_path, h100_rates):
    """A step's prediction is its wall time in the device's earlier selftest.log when it ran ok there;
    a step that timed out there keeps its price."""
    plan = st.gpu_plan(st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S, H100), REPOSITORY, h100_rates)
    tests, benchmark = _foreground(plan)[:2]
    earlier = f"===== {tests.name}: ok, 60.0 s\n===== {benchmark.name}: timeout (75 s), 75.0 s\n"
    predicted = {s.name: s.predicted_s for s in st.with_measured_predictions(plan, earlier)}
    assert predicted[tests.name] == 60.0
    assert predicted[benchmark.name] == benchmark.predicted_s  # its price


def test_the_output_folder_keeps_the_kernel_choices_and_ignores_the_compile_cache(tmp_path):
    """prepare() writes a .gitignore naming the compile cache (large binaries) and not the kernel
    choices, and drops an earlier run's test report."""
    test = st.Selftest("cuda", tmp_path / "out", st.GPU_BUDGET_S, H100)
    test.out_dir.mkdir()
    test.tests_report.write_text("{}\n")
    st.prepare(test)
    ignored = (test.out_dir / ".gitignore").read_text().splitlines()
    assert f"{st.COMPILE_CACHE}/" in ignored and not any(
        "attention-kernels" in line for line in ignored if line[:1] != "#"
    )
    assert not test.tests_report.exists()


def test_a_run_step_that_exits_0_fails_on_a_row_not_ok(tmp_path):
    """verdict: a point's row this step wrote that is not ok, or missing, fails the step with the
    row's error; an older row of the same point (before the step started) does not count."""
    test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S, H100)
    step = st.Step("run", (), 10.0, kind="run", point=st.SHORT_POINT)
    upsert_rows(test.runs_csv, [_row("Qwen/Qwen3-4B", 9000, "ckpt", timestamp_utc="2026-01-01T00:00:00+00:00")])
    outcome = st.Outcome(step, "ok", started_utc="2026-06-01T00:00:00+00:00")
    assert st.verdict(test, outcome) == "ckpt: no row; streambp: no row"
    rows = [
        _row("Qwen/Qwen3-4B", 9000, "ckpt", timestamp_utc="2026-06-01T00:01:00+00:00"),
        _row("Qwen/Qwen3-4B", 9000, "streambp", status="oom", error="OutOfMemoryError: CUDA out of memory.\nmore",
             timestamp_utc="2026-06-01T00:02:00+00:00"),
    ]  # fmt: skip
    upsert_rows(test.runs_csv, rows)
    assert st.verdict(test, outcome) == "streambp: oom (OutOfMemoryError: CUDA out of memory.)"


def test_a_run_on_2_gpus_fails_without_an_ok_row_holding_each_ranks_peak(tmp_path):
    """verdict on the run of SP_POINT: its row is keyed by its ranks (a one-process row of the same
    model and length is another point's), must be ok and must hold both ranks' peaks (rank_peak_bytes
    "a;b")."""
    test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S, H100, num_gpus=2)
    outcome = st.Outcome(st.Step("run", (), 10.0, kind="run", point=st.SP_POINT), "ok", started_utc="2026-06-01")
    at = {"timestamp_utc": "2026-06-01T00:01:00+00:00"}
    upsert_rows(test.runs_csv, [_row("Qwen/Qwen3-4B", 65536, "streambp", peak=50 * GIB, **at)])  # one process
    assert st.verdict(test, outcome) == "streambp: no row"
    ranked = {"nproc": 2, "sp": 2, **at}
    oom = _row("Qwen/Qwen3-4B", 65536, "streambp", status="oom", error="rank 1: OutOfMemoryError: CUDA out of memory.",
               rank_peak_bytes=f"{49 * GIB};", **ranked)  # fmt: skip
    upsert_rows(test.runs_csv, [oom])
    assert st.verdict(test, outcome) == "streambp: oom (rank 1: OutOfMemoryError: CUDA out of memory.)"
    for peaks in ("", f"{49 * GIB};", f"{GIB}"):  # ok rows (each replaces the one before)
        upsert_rows(test.runs_csv, [_row("Qwen/Qwen3-4B", 65536, "streambp", rank_peak_bytes=peaks, **ranked)])
        assert st.verdict(test, outcome) == f"streambp: rank_peak_bytes {peaks!r}, not 2 peaks"
    upsert_rows(test.runs_csv, [_row("Qwen/Qwen3-4B", 65536, "streambp", rank_peak_bytes=f"{49 * GIB};{50 * GIB}",
                                     **ranked)])  # fmt: skip
    assert st.verdict(test, outcome) is None


def test_a_check_on_2_gpus_fails_unless_its_comparison_says_exact(tmp_path):
    """verdict on the check (which exits 1 itself when StreamBP differs): no comparison written since
    the step started, or StreamBP unsupported there (which exits 0), fails the step with the reason."""
    test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S, H100, num_gpus=2)
    outcome = st.Outcome(st.Step("check", (), 10.0, kind="check", point=st.SP_CHECK), "ok", started_utc="2026-06-01")
    assert st.verdict(test, outcome) == "streambp: no comparison"
    _exactness_csv(test, "unsupported", note="streambp cannot share a sequence here\nmore")
    assert st.verdict(test, outcome) == "streambp: unsupported (streambp cannot share a sequence here)"
    _exactness_csv(test, "exact")
    assert st.verdict(test, outcome) is None
    assert st.verdict(test, replace(outcome, started_utc="2026-07-01")) == "streambp: no comparison"  # older


def test_a_benchmark_or_copy_rate_step_fails_on_what_it_wrote(tmp_path):
    """A kernel row wrong or in error fails the benchmark step, named with its reason (unavailable
    kernels do not); a copy rate without both directions fails its step."""
    test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S, H100)
    benchmark = st.Outcome(st.Step("bench", (), 10.0, kind="benchmark"), "ok")
    copies = st.Outcome(st.Step("copy", (), 10.0, kind="copy rate"), "ok")
    assert st.verdict(test, benchmark) == "no rows written"
    _benchmark_csv(tmp_path, wrong=False)
    assert st.verdict(test, benchmark) is None
    _benchmark_csv(tmp_path, wrong=True)
    assert (
        st.verdict(test, benchmark) == "flex at 65536 keys: wrong (differs from lower-right by 6.0x the error allowed)"
    )
    assert st.verdict(test, copies) == "no rate for both directions from both kinds of buffer"
    _copy_rate_csv(tmp_path, kinds=(PIN_MEMORY,))
    assert st.verdict(test, copies) == "no rate for both directions from both kinds of buffer"
    _copy_rate_csv(tmp_path)
    assert st.verdict(test, copies) is None


def _benchmark_csv(folder: Path, wrong: bool) -> None:
    header = "kernel,status,reason,queries,keys,forward_tflops,train_tflops,build_s,error_ratio,chosen\n"
    lines = [
        "lower-right,ok,,4096,65536,610,400,0.0,0.0,False",
        "split,ok,,4096,65536,650,430,0.31,0.4,True",
        f"flex,{'wrong' if wrong else 'ok'},{'differs from lower-right by 6.0x the error allowed' if wrong else ''},"
        "4096,65536,500,300,41.5,6.0,False",
        "fa3,unavailable,fa3 is not installed (build flash-attention's hopper/),4096,65536,,,,,False",
    ]
    (folder / st.BENCHMARK_CSV).write_text(header + "\n".join(lines) + "\n")


def _copy_rate_csv(folder: Path, kinds=(PIN_MEMORY, HOST_REGISTER)) -> None:
    rates = [CopyRate(d, 2**29, True, 5, s, s * 0.99, s * 1.02, 2**29 / s / 1e9, host_buffer=kind) for kind in kinds
             for d, s in ((HOST_TO_DEVICE, 0.0107), (DEVICE_TO_HOST, 0.0102))]  # fmt: skip
    write_csv(rates, folder / st.COPY_RATE_CSV)


def stand_in_step(test, step, faults: bool = True) -> st.Outcome:
    """What each step of the GPU plan writes, made up: rows at the points (streambp's with phases),
    estimates 1% above them, the benchmark's rows and the copy rates; with `faults`
    a test report with a failure, a skip and a test cut short, and a kernel wrong. A point on several
    ranks gets each rank's peak (49 and 50 GiB), a check an exact comparison."""
    argv = step.argv
    if step.kind in ("run", "estimate"):
        source = "simulated" if step.kind == "estimate" else "measured"
        model, seq = _value(argv, "--model"), int(_value(argv, "--seq"))
        placement = _value(argv, "--checkpoints") or "gpu"
        layers = int(_value(argv, "--num-layers") or st.meta_depth(model))
        nproc, sp = int(_value(argv, "--nproc") or 1), int(_value(argv, "--sp") or 1)
        rows = []
        for method in step.point.methods if step.point else argv[argv.index("--method") + 1 : argv.index("--out")]:
            peak = int((50 if source == "measured" else 50.5) * GIB)
            values = {"checkpoints": placement if method == "streambp" else "", "num_layers": layers}
            if nproc > 1:
                values |= {"nproc": nproc, "sp": sp}
                values |= {"rank_peak_bytes": f"{49 * GIB};{50 * GIB}"} if source == "measured" else {}
            if source == "measured" and method == "streambp":
                values |= {"phase_checkpoint_pass_s": 0.31, "phase_chunk_backward_s": 0.72, "phase_other_s": 0.05}
            rows.append(_row(model, seq, method, source=source, peak=peak, time_s=1.35, **values))
        upsert_rows(test.estimates_csv if source == "simulated" else test.runs_csv, rows)
    elif step.kind == "tests" and faults:
        assert dict(step.env)[TEST_REPORT_ENV] == str(test.tests_report)
        test.tests_report.write_text(_TEST_REPORT)
        return st.Outcome(step, "timeout (45 s)", 45.0)
    elif step.kind == "benchmark":
        _benchmark_csv(test.out_dir, wrong=faults)
    elif step.kind == "copy rate":
        _copy_rate_csv(test.out_dir)
    elif step.kind == "check":
        _exactness_csv(test, "exact")
    return st.Outcome(step, "ok", 1.0)


def _exactness_csv(test, result: str, note: str = "on 2 ranks (FSDP2, 2 sharing each sequence (Ulysses))") -> None:
    row = ExactnessRow(timestamp_utc="2026-06-01T00:01:00+00:00", method="streambp", reference="bp fp64",
                       result=result, note=note, model="Qwen/Qwen3-0.6B", dtype="fp32", seq_len=2048)  # fmt: skip
    write_exactness(test.exactness_csv, [row])


def test_gpu_selftest_runs_its_plan_and_writes_the_summary(tmp_path, monkeypatch, h100_rates):
    """The GPU path end to end with stand-in steps: the benchmark's wrong kernel fails its step with
    its reason; summary.md names each failure with its message, lists the skipped test's reason, and
    holds every measured point, StreamBP's phases, each point's estimate error, the kernels (the
    table's marked) and the copy rates of both kinds of buffer beside the planner's."""
    monkeypatch.setattr(st, "plan_rates", lambda test, repository: h100_rates)
    test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S, H100)
    test.tests_report.write_text('{"event": "start", "test": "from/an/earlier/run"}\n')
    monkeypatch.setattr(st, "run_step", lambda step, log, env=None: stand_in_step(test, step))
    st.run_selftest(test, repository=REPOSITORY, echo=lambda line: None)
    assert sum(o.step.background for o in test.outcomes) == 3
    summary = st.write_summary(test, capture_environment("cpu")).read_text()
    print(summary)
    benchmark = next(o for o in test.outcomes if o.step.kind == "benchmark")
    assert benchmark.status == "failed (flex at 65536 keys: wrong (differs from lower-right by 6.0x the error allowed))"
    assert f"| {benchmark.step.name} | {benchmark.status} | 1 | {benchmark.step.predicted_s:.0f} | - |" in summary
    assert "gpu-marked tests: 1 failed, 1 passed, 1 skipped (details in selftest.log)." in summary
    assert (
        "Failed: `tests/gpu/test_gpu_stream.py::test_cuda_stream_placement_gives_gpu_gradients[stream:2-B2]`" in summary
    )
    assert "AssertionError: stream:2: model.layers.1.mlp.up_proj.weight differs by 0.25" in summary
    assert (
        "Skipped: `tests/gpu/test_gpu_kernels.py::test_each_attention_kernel_matches_the_reference[fa3]` (fa3: fa3 is not installed"
        in summary
    )
    assert "Cut while running: `tests/gpu/test_gpu_measure.py::test_cuda_timeline_holds_the_backward`." in summary
    assert "earlier/run" not in summary  # the report is this run's
    assert "`pytest -m 'gpu and quick'`: timeout (45 s); its last lines in selftest.log:" in summary
    assert "| Qwen/Qwen3-8B T=262144 streambp (stream:2) | 3 | ok | 50.00 | 1.35 |" in summary
    assert "| Qwen/Qwen3-8B | 262144 | streambp (stream:2), 3 layers | - | 50.00 | 50.50 | +1.0% |  |" in summary
    assert "| Qwen/Qwen3-8B | 65536 | streambp (cpu) | - | 50.00 | 50.50 | +1.0% |  |" in summary
    assert "| Qwen/Qwen3-4B | 9000 | ckpt | - | 50.00 | 50.50 | +1.0% |  |" in summary
    assert "| chunk backward | 0.720 | 0.720 | 0.720 |" in summary
    assert "| split (table) | 4096 | 65536 | ok | 650 | 430 | 0.31 | 0.40 |  |" in summary
    assert "| flex | 4096 | 65536 | wrong | 500 | 300 | 41.50 | 6.00 |" in summary
    assert "| host to device | pin_memory | 512 | 50.2 | 0.0106 - 0.0109 | 0.78 |" in summary
    assert "| device to host | cudaHostRegister | 512 |" in summary
    assert "The planner assumes 64 GB/s for both directions together" in summary
    assert (
        "Rates: matmul 230 TFLOP/s, attention forward 700 TFLOP/s, attention backward 444 TFLOP/s: fitted to 4 rows"
        in summary
    )


def test_pack_holds_the_rows_log_table_and_summary_and_nothing_large(tmp_path, monkeypatch, h100_rates):
    """After the GPU path with stand-in steps (and a compile cache and a memory snapshot beside them),
    --pack writes one archive of at most 8 files, each of PACKED, under the output folder's name."""
    monkeypatch.setattr(st, "plan_rates", lambda test, repository: h100_rates)
    test = st.Selftest("cuda", tmp_path / "gpu" / "NVIDIA-H100-80GB-HBM3", st.GPU_BUDGET_S, H100)
    monkeypatch.setattr(st, "run_step", lambda step, log, env=None: stand_in_step(test, step, faults=False))
    st.run_selftest(test, repository=REPOSITORY, echo=lambda line: None)
    st.write_summary(test, capture_environment("cpu"))
    test.log.write_text("===== the raw log (the stand-in steps write none)\n")
    (test.out_dir / "attention-kernels.json").write_text('{"format": 1, "tables": {}}\n')
    (test.out_dir / st.COMPILE_CACHE / "inductor").mkdir(parents=True)
    (test.out_dir / st.COMPILE_CACHE / "inductor" / "big.so").write_bytes(b"0" * 1024)
    (test.out_dir / "timelines").mkdir()
    (test.out_dir / "timelines" / "streambp.snapshot.pickle").write_bytes(b"0" * 1024)
    members = st.pack_files(test, tmp_path / "out" / "selftest.tgz")
    with tarfile.open(tmp_path / "out" / "selftest.tgz") as archive:
        names = archive.getnames()
    assert len(names) == len(members) <= 8 and set(members) <= set(st.PACKED)
    assert {"summary.md", "selftest.log", "runs.csv", "estimates.csv", "attention-kernels.json"} <= set(members)
    assert all(name.startswith("NVIDIA-H100-80GB-HBM3/") for name in names)


def test_the_dry_run_text_lists_each_steps_work_and_the_total():
    """The dry run's text: one line per step with its prediction and limit, its counted work beneath,
    the estimates as host work, and the total beside the budget with its margin."""
    text = st.dry_run_text(Path("/nonexistent"), "cuda", st.GPU_BUDGET_S, 1, None)
    assert "estimate Qwen/Qwen3-4B T=9000 ckpt streambp: on the host's CPU, beside the GPU steps" in text
    assert "run Qwen/Qwen3-8B T=262144 streambp --checkpoints stream:2 3 layers: predicted" in text
    assert "    1 x 10 s: pytest's start and imports" in text
    assert (
        f"of a {st.GPU_BUDGET_S:.0f} s budget, {(1 - st.MARGIN) * st.GPU_BUDGET_S:.0f} s with its 10% margin: fits"
        in text
    )
    cpu = st.dry_run_text(Path("/nonexistent"), "cpu", st.CPU_BUDGET_S, 1, None)
    assert cpu.splitlines()[0].startswith("check: python -m sbpbench check") and "(not priced)" in cpu


@pytest.mark.slow
def test_the_dry_run_prices_the_one_gpu_plan_within_the_budget(tmp_path):
    """`sbp selftest --dry-run` on this CPU machine prints the one-GPU plan, the 8B 64k point with cpu
    checkpoints among it, each step with its counted work, and a total within the budget less its margin."""
    done = subprocess.run(
        [sys.executable, "-m", "sbpbench", "selftest", "--dry-run", "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=300, cwd=REPOSITORY,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("run Qwen/Qwen3-8B T=65536 streambp --checkpoints cpu: predicted") for line in lines)
    assert any(line.startswith("    1 x ") for line in lines)  # counted work under each step
    total = next(line for line in lines if line.startswith("total predicted"))
    seconds = float(total.split()[2])
    assert seconds <= (1 - st.MARGIN) * st.GPU_BUDGET_S and total.endswith(": fits"), total
    assert "Predicted, not measured." in done.stdout


def test_on_2_gpus_the_summary_lists_the_point_shared_over_them_apart(tmp_path, monkeypatch, h100_rates):
    """On 2 GPUs with stand-in steps: the check and the run on 2 GPUs pass their verdicts; summary.md
    lists that point apart from the one-process points (its label names its GPUs), with each rank's
    peak, and beside its estimate."""
    monkeypatch.setattr(st, "plan_rates", lambda test, repository: h100_rates)
    test = st.Selftest("cuda", tmp_path, st.GPU_BUDGET_S, H100, num_gpus=2)
    monkeypatch.setattr(st, "run_step", lambda step, log, env=None: stand_in_step(test, step, faults=False))
    st.run_selftest(test, repository=REPOSITORY, echo=lambda line: None)
    assert not any(o.failed for o in test.outcomes) and sum(o.step.background for o in test.outcomes) == 4
    summary = st.write_summary(test, capture_environment("cpu")).read_text()
    print(summary)
    check = next(o for o in test.outcomes if o.step.kind == "check")
    assert f"| {check.step.name} | ok |" in summary
    assert "check Qwen/Qwen3-0.6B T=2048 streambp 2 layers on 2 GPUs, 2 per sequence, fp32" == check.step.name
    assert "| Qwen/Qwen3-4B T=65536 streambp, 2 GPUs, 2 per sequence | 36 | ok | 50.00 | 1.35 |" in summary
    assert "- Qwen/Qwen3-4B T=65536 streambp, 2 GPUs, 2 per sequence: peak per rank 49.00, 50.00 GiB." in summary
    assert "| Qwen/Qwen3-4B | 65536 | streambp, 2 GPUs, 2 per sequence | - | 50.00 | 50.50 | +1.0% |  |" in summary
    assert "| Qwen/Qwen3-4B | 9000 | streambp | - | 50.00 | 50.50 | +1.0% |  |" in summary  # one process, apart


# What tests/conftest.py writes of a pytest run killed in its fourth test
_TESTS = (
    "test_gpu_stream.py::test_cuda_stream_placement_gives_gpu_gradients[stream:2-B2]",
    "test_gpu_kernels.py::test_each_attention_kernel_matches_the_reference[split]",
    "test_gpu_kernels.py::test_each_attention_kernel_matches_the_reference[fa3]",
    "test_gpu_measure.py::test_cuda_timeline_holds_the_backward",
)
_TEST_REPORT = "\n".join(
    json.dumps(line)
    for line in [
        {"event": "collected", "tests": [f"tests/gpu/{t}" for t in _TESTS]},
        {"event": "start", "test": f"tests/gpu/{_TESTS[0]}"},
        {
            "event": "result", "test": f"tests/gpu/{_TESTS[0]}", "when": "call", "outcome": "failed", "seconds": 2.3,
            "message": "tests/gpu/test_gpu_stream.py:95: in test_cuda_stream_placement_gives_gpu_gradients\n"
            "E   AssertionError: stream:2: model.layers.1.mlp.up_proj.weight differs by 0.25\nE   assert False",
        },
        {"event": "start", "test": f"tests/gpu/{_TESTS[1]}"},
        {"event": "result", "test": f"tests/gpu/{_TESTS[1]}", "when": "call", "outcome": "passed", "seconds": 41.0,
         "message": ""},
        {"event": "start", "test": f"tests/gpu/{_TESTS[2]}"},
        {"event": "result", "test": f"tests/gpu/{_TESTS[2]}", "when": "setup", "outcome": "skipped", "seconds": 0.0,
         "message": "fa3: fa3 is not installed (build flash-attention's hopper/ directory: cd hopper && pip install .)"},
        {"event": "start", "test": f"tests/gpu/{_TESTS[3]}"},
    ]
)  # fmt: skip


def test_estimate_error_per_point():
    """error = (estimate - measured) / measured on peak allocated; an OOM or a missing row has none;
    a reduced model's rows are its own point."""
    measured = [
        _row("Qwen/Qwen3-8B", 9000, "ckpt", peak=32 * GIB).as_dict(),
        _row("Qwen/Qwen3-8B", 9000, "bp", status="oom", peak=75 * GIB).as_dict(),
        _row("Qwen/Qwen3-8B", 9000, "streambp", peak=20 * GIB, num_layers=3).as_dict(),
    ]
    simulated = [
        _row("Qwen/Qwen3-8B", 9000, "ckpt", source="simulated", peak=int(32.32 * GIB)).as_dict(),
        _row("Qwen/Qwen3-8B", 9000, "bp", source="simulated", peak=91 * GIB).as_dict(),
    ]
    points = [("Qwen/Qwen3-8B", 9000, m, "", None) for m in ("ckpt", "bp", "streambp")]
    strings = lambda rows: [{k: "" if v is None else str(v) for k, v in row.items()} for row in rows]
    ckpt, bp, streambp = estimate_errors(strings(measured), strings(simulated), points, st._key)
    assert ckpt.error == pytest.approx(0.01, abs=1e-3)
    assert bp.error is None and bp.measured_status == "oom"
    assert streambp.error is None and streambp.measured_status == "missing"  # its row has 3 layers


def test_pytest_counts_come_from_its_verbose_lines():
    """Without a test report, the tests are counted from pytest's -v lines."""
    log = "tests/gpu/test_gpu.py::test_a[x] PASSED  [ 50%]\ntests/gpu/test_gpu.py::test_b FAILED  [100%]\n"
    assert pytest_counts(log) == {"PASSED": 1, "FAILED": 1}


def test_a_failed_steps_last_lines_are_read_from_its_last_run():
    """A step's output tail comes from its last section in the log (an earlier run's is older),
    up to its end line, or to the end of the log when a kill left no end line."""
    name = "run Qwen/Qwen3-8B T=65536 streambp"
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
            "===== estimate Qwen/Qwen3-8B T=65536 streambp: python -m sbpbench estimate ...",
            "an estimate's line",
        ]
    )
    assert step_output_tail(log, name, max_lines=3) == ["line 9", "line 10", "line 11"]
    assert step_output_tail(log, "pytest -m 'gpu and quick'") == [
        "tests/gpu/test_gpu.py::test_a PASSED",
        "tests/gpu/test_gpu.py::test_b",
    ]
    assert step_output_tail(log, "never ran") == []


def test_a_failures_message_is_cut_to_its_error_lines():
    """The summary shows pytest's E lines of a failure (its assertion and how it failed), or the
    traceback's last lines when it has none."""
    message = "t.py:3: in f\n    g()\nE   ValueError: bad\nE     detail"
    assert message_excerpt(message) == ["ValueError: bad", "  detail"]
    assert message_excerpt("\n".join(f"line {i}" for i in range(20)), max_lines=2) == ["line 18", "line 19"]


def test_a_step_at_its_limit_is_stopped_with_its_whole_process_group(tmp_path, monkeypatch):
    """A real step that starts a child and hangs: at its limit the step and the child it started are
    stopped (SIGINT to its process group, then SIGKILL), its status a timeout, the log closed."""
    monkeypatch.setattr(st, "GRACE_S", 1.0)
    child = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
    step = st.Step("hangs", ("-c", child + " print(p.pid, flush=True); time.sleep(60)"), timeout_s=1.5)
    log = tmp_path / "selftest.log"
    outcome = st.run_step(step, log)
    assert outcome.status == "timeout (2 s)" and outcome.seconds < 10
    pid = int(log.read_text().splitlines()[2])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid), f"the step's child {pid} outlived it"
    assert log.read_text().splitlines()[-1].startswith("===== hangs: timeout (2 s)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")  # a zombie is gone


@pytest.mark.slow
def test_cpu_selftest_runs_end_to_end(tmp_path):
    """`sbp selftest --device cpu --pack FILE` says it runs the CPU subset in one line, runs check, run
    and estimate, writes the rows, the log and a summary with the estimate's error for each method,
    and packs them into one archive of at most 8 files."""
    packed = tmp_path / "selftest.tgz"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sbpbench",
            "selftest",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--pack",
            str(packed),
        ],
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
    with tarfile.open(packed) as archive:
        names = archive.getnames()
    assert len(names) <= 8 and {f"cpu-selftest/{n}" for n in ("summary.md", "selftest.log", "runs.csv")} <= set(names)
