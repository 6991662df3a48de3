"""`sbp selftest`: check a machine with one command, in a few minutes.

Every check is an ordinary command (`sbp check`, `sbp run`, `sbp estimate`, pytest) in its own
process with a time limit, its output appended to one raw log; what it decides is written beside
it (selftest_summary.py). The plan is pure data, so it is tested on any machine.

On a GPU (GPU_BUDGET_S, 8 minutes on one H100), in this order: the default `sbp run` (Qwen3-4B,
T=9000: its ckpt and streambp rows are two of the estimate's points); two Qwen3-8B StreamBP points
at T=64k with the checkpoints offloaded (`cpu`) and recomputed (`recompute:4`), one memory step and
one timed step each (so that first contact runs the offload path); memory-only probes of Qwen3-8B
bp at T=4608 and ckpt at T=20000; the longest Qwen3-8B StreamBP memory-only point whose predicted
time fits (`long_seq_len`); then the quick subset of the gpu-marked tests (pytest -m "gpu and
quick"), each test's outcome and message recorded as it finishes. The `sbp estimate` of each
point runs beside them on the host CPU (fake tensors, no GPU). Written to OUT/gpu/<device name>/.

Budget: each step is cut to what the budget leaves less the time kept for the `reserved` steps
after it (the offload points: the default run cannot eat their time). The long point's length is
chosen from the default run's measured speed so that it fits what is left less the predicted time
of the steps after it (the tests). A step's prediction is its wall time in this device's earlier
selftest.log when one ran ok there, else PREDICTED_S (measured by this command on one H100). A step
left less than MIN_START_S (budget.py, the rule of --budget) is not started: "not run (budget)",
which is not a failure. The offload points' limits come from the FLOP model at the assumed H100
rate (`offload_timeout_s`); with the default run's cap they fit the budget, which test_selftest.py
checks, as it checks that the plan priced with the measured step times fits with the long point.
On a CPU: a small `sbp check`, a short default-like `sbp run` and its `sbp estimate --target
cpu`, within CPU_BUDGET_S on 2 cores. Written to OUT/cpu-selftest/.
"""

from __future__ import annotations

import os
import queue
import re
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core import Placement
from ..measure.environment import Environment
from ..measure.flops import phase_flops
from ..models import load_config
from ..records import read_rows
from .budget import MIN_START_S
from .selftest_summary import (
    NOT_RUN,
    TEST_REPORT_ENV,
    estimate_errors,
    progress_seconds,
    pytest_counts,
    read_test_report,
    summary_markdown,
)
from .timeout import executed_flops

GPU_BUDGET_S = 480.0  # 8 minutes on one H100
# The CPU subset's own work is about 150 CPU-seconds (three commands and three workers, each
# importing torch and transformers, ~8 s of it); on 2 idle cores that is under 3 minutes. The
# budget is a hard stop set wider, so a machine shared with other jobs still finishes; the
# summary gives each step's wall and CPU seconds, so a slow step says whether it waited or worked.
CPU_BUDGET_S = 480.0
# Qwen3-8B StreamBP lengths tried for the long point, longest first (the paper's headline ~110k)
LONG_MODEL = "Qwen/Qwen3-8B"
LONG_SEQ_LENS = (110_000, 96_000, 80_000, 64_000, 48_000, 32_000)
# A memory-only point's cost besides its one step: start `sbp run` and its worker, import torch
# and transformers, build 8B random bf16 weights on the GPU. Measured on one H100 80GB HBM3: the
# Qwen3-8B bp T=4608 and ckpt T=20000 probes took 30.5 and 33.7 s wall for steps of a few seconds.
POINT_OVERHEAD_S = 30.0
# The offload path on first contact: Qwen3-8B StreamBP at 64k, checkpoints in pinned host memory or
# recomputed per segment of 4 layers, one memory step and one timed step (no warm-up).
OFFLOAD_SEQ_LEN = 65_536
OFFLOAD_PLACEMENTS = ("cpu", "recompute:4")
OFFLOAD_MARGIN = 1.25  # on the predicted point: the host copies and the first step's set-up
DEFAULT_RUN_S = 180.0  # the default run's cap
TESTS_S = 180.0  # the quick tests' cap
# Model TFLOP/s assumed for StreamBP when the default run gave no streambp time (measured on one
# H100: 187 at Qwen3-4B T=9000, 208 at T=24000).
ASSUMED_MODEL_TFLOPS = 187.0
TESTS_STEP = "pytest -m 'gpu and quick'"
# Each GPU step's predicted wall time when this device has no earlier selftest.log to take it from:
# measured by `sbp selftest` on one NVIDIA H100 80GB HBM3 (2026-11-26), except the quick tests',
# a prediction (the subset is newer than that run): pytest's start-up and imports, one isolated
# Qwen3-0.6B worker and two in-process T=9000 checks of a 6-layer Qwen3-0.6B.
PREDICTED_S = {
    "default run": 77.7,
    "offload cpu": 92.7,
    "offload recompute:4": 94.5,
    "probe bp": 30.5,
    "probe ckpt": 33.7,
    "tests": 45.0,
}
GPU_POINTS = (  # (model, seq_len, method) measured and estimated besides the long point
    ("Qwen/Qwen3-4B", 9000, "ckpt"),
    ("Qwen/Qwen3-4B", 9000, "streambp"),
    ("Qwen/Qwen3-8B", 4608, "bp"),
    ("Qwen/Qwen3-8B", 20000, "ckpt"),
)
CPU_POINT = {"model": "small/qwen3", "seq_len": 512}  # small/qwen3 at a short T, all methods


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]  # after `python -m`
    timeout_s: float
    background: bool = False  # host-only work (an estimate) that runs beside the GPU steps
    reserved: bool = False  # its timeout is kept free while the steps before it run
    predicted_s: float = 0.0  # its expected wall time (PREDICTED_S or this device's earlier log)
    env: tuple[tuple[str, str], ...] = ()  # set for its process, beside the inherited environment


# Where the plan runs the long point: its length is chosen when its turn comes
LONG_POINT = Step("the long point", (), 0.0)


@dataclass
class Outcome:
    step: Step
    status: str = "not run"  # ok | failed (exit code) | timeout | not run
    seconds: float = 0.0
    cpu_seconds: float | None = None  # user + system of the step's processes (foreground steps)
    returncode: int | None = None

    @property
    def failed(self) -> bool:
        """Anything but ok, except a step the budget left no time for."""
        return self.status not in ("ok", NOT_RUN)


@dataclass
class Selftest:
    kind: str  # cpu | cuda
    out_dir: Path
    budget_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    long_seq_len: int | None = None

    @property
    def log(self) -> Path:
        return self.out_dir / "selftest.log"

    @property
    def runs_csv(self) -> Path:
        return self.out_dir / "runs.csv"

    @property
    def estimates_csv(self) -> Path:
        return self.out_dir / "estimates.csv"

    @property
    def tests_report(self) -> Path:
        return self.out_dir / "tests.jsonl"


def device_slug(device_name: str) -> str:
    """A directory name for a device: 'NVIDIA H100 80GB HBM3' -> 'NVIDIA-H100-80GB-HBM3'."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", device_name).strip("-") or "unknown-device"


def output_dir(out: Path, kind: str, device_name: str) -> Path:
    return out / "gpu" / device_slug(device_name) if kind == "cuda" else out / "cpu-selftest"


def _sbp(*args: str) -> tuple[str, ...]:
    return ("sbpbench", *args)


def cpu_plan(test: Selftest) -> list[Step]:
    """The CPU subset: about 100 CPU-seconds (CPU_BUDGET_S)."""
    point = ("--model", CPU_POINT["model"], "--seq", str(CPU_POINT["seq_len"]))
    chunks = ("--chunk-size", "128", "--logits-chunk-size", "100")
    return [
        # one after another, each with whatever the budget has left (run_selftest cuts it)
        Step("check", _sbp("check", "--model", "small/qwen3", "--seq", "128"), test.budget_s),
        Step("run", _sbp("run", *point, *chunks, "--repeats", "1", "--out", str(test.runs_csv)), test.budget_s),
        Step(
            "estimate",
            _sbp("estimate", *point, *chunks, "--dtype", "fp32", "--target", "cpu", "--out", str(test.estimates_csv)),
            test.budget_s,
        ),
    ]


def _estimate(test: Selftest, model: str, seq_len: int, methods: tuple[str, ...], checkpoints: str = "") -> Step:
    argv = ("estimate", "--model", model, "--seq", str(seq_len))
    argv += ("--checkpoints", checkpoints) if checkpoints else ()
    argv += ("--method", *methods, "--out", str(test.estimates_csv))
    name = f"estimate {model} T={seq_len} {' '.join(methods)}" + (f" {checkpoints}" if checkpoints else "")
    return Step(name, _sbp(*argv), 300, background=True)


def _probe(test: Selftest, model: str, seq_len: int, method: str, timeout_s: float, predicted_s: float = 0.0) -> Step:
    """A memory-only point (repeats 0: one step, no warm-up)."""
    argv = ("run", "--model", model, "--seq", str(seq_len), "--method", method, "--repeats", "0")
    argv += ("--timeout", f"{timeout_s:g}", "--out", str(test.runs_csv))
    name = f"run {model} T={seq_len} {method} (memory only)"
    return Step(name, _sbp(*argv), timeout_s + 30, predicted_s=predicted_s)


def offload_timeout_s(placement: str, config) -> float:
    """The offload point's time limit: OFFLOAD_MARGIN x its prediction, POINT_OVERHEAD_S plus its
    two steps' executed FLOPs (timeout.py: a recompute placement runs one forward more) at the
    assumed rate."""
    checkpoints = Placement.parse(placement)
    flops = executed_flops(config, method="streambp", batch_size=1, seq_len=OFFLOAD_SEQ_LEN, checkpoints=checkpoints)
    return OFFLOAD_MARGIN * (POINT_OVERHEAD_S + 2 * flops * seconds_per_executed_flop(None, config))


def _offload_point(test: Selftest, placement: str, config) -> Step:
    """Qwen3-8B StreamBP at OFFLOAD_SEQ_LEN with its checkpoints placed: one memory step, one timed."""
    timeout_s = offload_timeout_s(placement, config)
    argv = ("run", "--model", LONG_MODEL, "--seq", str(OFFLOAD_SEQ_LEN), "--method", "streambp")
    argv += ("--checkpoints", placement, "--warmup", "0", "--repeats", "1")
    argv += ("--timeout", f"{timeout_s - 30:.0f}", "--out", str(test.runs_csv))
    name = f"run {LONG_MODEL} T={OFFLOAD_SEQ_LEN} streambp --checkpoints {placement} (memory, then one timed step)"
    return Step(name, _sbp(*argv), timeout_s, reserved=True, predicted_s=PREDICTED_S[f"offload {placement}"])


def quick_test_files(tests_dir: Path) -> list[Path]:
    """The test files that mark a test `quick` (named, so pytest imports only them)."""
    return [p for p in sorted(tests_dir.rglob("test_*.py")) if "pytest.mark.quick" in p.read_text()]


def _tests(test: Selftest, tests_dir: Path) -> Step:
    """The quick gpu-marked tests, short tracebacks, each test's outcome recorded as it finishes."""
    files = quick_test_files(tests_dir) or [tests_dir]
    argv = ("pytest", "-v", "--tb=short", "-m", "gpu and quick", *map(str, files))
    env = ((TEST_REPORT_ENV, str(test.tests_report)),)
    return Step(TESTS_STEP, argv, TESTS_S, predicted_s=PREDICTED_S["tests"], env=env)


def gpu_plan(test: Selftest, tests_dir: Path | None) -> list[Step]:
    """The GPU steps in order, LONG_POINT where the long point runs (its length is chosen from the
    default run's speed when its turn comes); predictions from PREDICTED_S (with_measured_predictions
    puts this device's own in)."""
    config = load_config(LONG_MODEL)
    steps = [
        _estimate(test, "Qwen/Qwen3-4B", 9000, ("ckpt", "streambp")),
        *(_estimate(test, LONG_MODEL, OFFLOAD_SEQ_LEN, ("streambp",), p) for p in OFFLOAD_PLACEMENTS),
        _estimate(test, "Qwen/Qwen3-8B", 4608, ("bp",)),
        _estimate(test, "Qwen/Qwen3-8B", 20000, ("ckpt",)),
        Step(
            "run (the default: Qwen/Qwen3-4B, T=9000, every method)",
            _sbp("run", "--out", str(test.runs_csv)),
            DEFAULT_RUN_S,
            predicted_s=PREDICTED_S["default run"],
        ),
        *(_offload_point(test, p, config) for p in OFFLOAD_PLACEMENTS),
        _probe(test, "Qwen/Qwen3-8B", 4608, "bp", 90, PREDICTED_S["probe bp"]),
        _probe(test, "Qwen/Qwen3-8B", 20000, "ckpt", 120, PREDICTED_S["probe ckpt"]),
        LONG_POINT,
    ]
    if tests_dir is not None:
        steps.append(_tests(test, tests_dir))
    return steps


_STEP_END = re.compile(r"^===== (?P<name>.+): ok, (?P<seconds>[0-9.]+) s$", re.MULTILINE)


def logged_seconds(log_text: str) -> dict[str, float]:
    """Step name -> its wall time in a selftest.log, for the steps that ended ok (the last run wins)."""
    return {m["name"]: float(m["seconds"]) for m in _STEP_END.finditer(log_text)}


def with_measured_predictions(steps: list[Step], log_text: str) -> list[Step]:
    """The steps with each prediction replaced by its measured wall time in `log_text` (an earlier
    selftest.log of this device) where that step ran ok there."""
    seconds = logged_seconds(log_text)
    return [replace(s, predicted_s=seconds[s.name]) if s.name in seconds and s.argv else s for s in steps]


def long_point_s(seq_len: int, *, seconds_per_flop: float, config) -> float:
    """A memory-only StreamBP point's predicted wall time: POINT_OVERHEAD_S plus one step's executed
    FLOPs (measure/flops.py) at the measured speed."""
    flops = sum(m + a for m, a in phase_flops(config, method="streambp", batch_size=1, seq_len=seq_len).values())
    return POINT_OVERHEAD_S + flops * seconds_per_flop


def long_seq_len(seconds_left: float, *, seconds_per_flop: float, config) -> int | None:
    """The longest of LONG_SEQ_LENS whose predicted point (long_point_s) fits seconds_left."""
    for seq_len in LONG_SEQ_LENS:
        if long_point_s(seq_len, seconds_per_flop=seconds_per_flop, config=config) <= seconds_left:
            return seq_len
    return None


def seconds_per_executed_flop(streambp_row: dict | None, config) -> float:
    """From the default run's streambp row (one step's time at its model and T), seconds per
    executed FLOP; without such a row, ASSUMED_MODEL_TFLOPS turned into executed FLOPs with
    `config` (the long point's). Attention kernels run faster at longer T, so this errs long."""
    if streambp_row is not None and streambp_row.get("time_median_s") not in (None, ""):
        timed = load_config(streambp_row["model"])
        seq_len, batch_size = int(streambp_row["seq_len"]), int(streambp_row.get("batch_size") or 1)
        phases = phase_flops(timed, method="streambp", batch_size=batch_size, seq_len=seq_len)
        return float(streambp_row["time_median_s"]) / sum(m + a for m, a in phases.values())
    # model FLOPs (bp's) -> executed: same ratio at the long point's scale
    return 1 / (ASSUMED_MODEL_TFLOPS * 1e12) * _model_over_executed(config, LONG_SEQ_LENS[0])


def _model_over_executed(config, seq_len: int) -> float:
    total = {
        m: sum(a + b for a, b in phase_flops(config, method=m, batch_size=1, seq_len=seq_len).values())
        for m in ("bp", "streambp")
    }
    return total["bp"] / total["streambp"]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_step(step: Step, log: Path, *, env: dict | None = None) -> Outcome:
    """Run one step to completion (or its timeout), its output appended to `log`; `env` replaces
    the inherited environment, step.env adds to it."""
    outcome = Outcome(step)
    if step.env:
        env = {**(env or os.environ), **dict(step.env)}
    with log.open("a") as out:
        out.write(f"\n===== {step.name}: python -m {' '.join(step.argv)}\n")
        out.flush()
        start, used = time.perf_counter(), _children_cpu_s()
        try:
            done = subprocess.run(
                [sys.executable, "-m", *step.argv],
                check=False,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=step.timeout_s,
                env=env,
            )
            outcome.returncode = done.returncode
            outcome.status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            outcome.status = f"timeout ({step.timeout_s:.0f} s)"
        outcome.seconds = time.perf_counter() - start
        if not step.background:  # background steps run beside others: their children's times mix
            outcome.cpu_seconds = _children_cpu_s() - used
        out.write(f"===== {step.name}: {outcome.status}, {outcome.seconds:.1f} s\n")
    return outcome


class Background:
    """Host-only steps (estimates) run one after another on a thread beside the GPU steps, with
    few threads each so the measured worker's host thread keeps a core; their output goes to a
    log of its own, appended to the main log at the end."""

    THREADS = "4"

    def __init__(self, log: Path):
        self.log = log
        self.queue: queue.Queue[Step | None] = queue.Queue()
        self.outcomes: list[Outcome] = []
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def submit(self, step: Step) -> None:
        self.queue.put(step)

    def _work(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": self.THREADS}
        while (step := self.queue.get()) is not None:
            self.outcomes.append(run_step(step, self.log, env=env))

    def finish(self, into: Path, timeout_s: float) -> list[Outcome]:
        self.queue.put(None)
        self.thread.join(timeout=max(1.0, timeout_s))  # each step has its own timeout besides
        if self.log.exists():
            with into.open("a") as out:
                out.write(self.log.read_text())
            self.log.unlink()
        return self.outcomes


def _budget(step: Step, deadline: float, reserve_s: float = 0.0) -> Step:
    """The step with its timeout cut to what the budget leaves (less `reserve_s` for later steps)."""
    left = deadline - time.perf_counter() - reserve_s
    return replace(step, timeout_s=max(10.0, min(step.timeout_s, left)))


def run_selftest(test: Selftest, *, tests_dir: Path | None, echo=print) -> Selftest:
    """Run the plan of test.kind within test.budget_s; outcomes in order, estimates last."""
    test.out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + test.budget_s
    if test.kind != "cuda":
        for step in cpu_plan(test):
            test.outcomes.append(run_step(_budget(step, deadline), test.log))
            echo(_line(test.outcomes[-1]))
        return test

    earlier_log = test.log.read_text() if test.log.exists() else ""
    test.tests_report.unlink(missing_ok=True)  # this run's test results only
    background = Background(test.out_dir / "selftest-estimates.log")
    steps = with_measured_predictions(gpu_plan(test, tests_dir), earlier_log)
    for i, step in enumerate(steps):
        if step.background:
            background.submit(_budget(step, deadline))
            continue
        later = [s for s in steps[i + 1 :] if not s.background]
        if step is LONG_POINT:
            step = _long_point(test, deadline - time.perf_counter() - sum(s.predicted_s for s in later), echo)
            if step is None:
                continue
            background.submit(_budget(_estimate(test, LONG_MODEL, test.long_seq_len, ("streambp",)), deadline))
        reserve = sum(s.timeout_s for s in later if s.reserved)
        if deadline - time.perf_counter() - reserve < MIN_START_S:
            test.outcomes.append(Outcome(step, NOT_RUN))
        else:
            test.outcomes.append(run_step(_budget(step, deadline, reserve), test.log))
        test.outcomes[-1].cpu_seconds = None  # mixed with the background estimates'
        echo(_line(test.outcomes[-1]))
    for outcome in background.finish(test.log, deadline - time.perf_counter()):
        test.outcomes.append(outcome)
        echo(_line(outcome))
    return test


def _long_point(test: Selftest, window_s: float, echo) -> Step | None:
    """The longest memory-only point whose prediction fits window_s (what is left less the later
    steps' predictions), at the default run's measured speed; None (not a failure) if none fits."""
    config = load_config(LONG_MODEL)
    rate = seconds_per_executed_flop(_default_run_row(test, "streambp"), config)
    test.long_seq_len = long_seq_len(window_s, seconds_per_flop=rate, config=config)
    if test.long_seq_len is None:  # not a failure: the budget went to the steps before it
        echo(f"no time left for a long point ({window_s:.0f} s of the budget beside the steps after it)")
        return None
    predicted_s = long_point_s(test.long_seq_len, seconds_per_flop=rate, config=config)
    return _probe(test, LONG_MODEL, test.long_seq_len, "streambp", max(10.0, window_s - 30), predicted_s)


def _default_run_row(test: Selftest, method: str) -> dict | None:
    if not test.runs_csv.exists():
        return None
    model, seq_len, _ = GPU_POINTS[0]
    rows = [
        r for r in read_rows(test.runs_csv) if (r["model"], r["seq_len"], r["method"]) == (model, str(seq_len), method)
    ]
    ok = [r for r in rows if r["status"] == "ok" and r.get("time_median_s")]
    return ok[-1] if ok else None


def _line(outcome: Outcome) -> str:
    cpu = "" if outcome.cpu_seconds is None else f", {outcome.cpu_seconds:.0f} CPU-s"
    return f"{outcome.step.name}: {outcome.status} ({outcome.seconds:.0f} s{cpu})"


def find_tests_dir() -> Path | None:
    """The repository's tests/ beside the package (an editable install), or None (a wheel)."""
    tests = Path(__file__).resolve().parents[2] / "tests"
    return tests if (tests / "gpu" / "test_gpu.py").exists() else None


def _rows(path: Path) -> list[dict]:
    return read_rows(path) if path.exists() else []


def _provenance(env: Environment) -> str:
    dirty = {"true": " (uncommitted changes)", "false": ""}.get(env.git_dirty, " (dirty: unknown)")
    return (
        f"{env.device_name} ({env.device}) on {env.host}, {env.num_cpus} CPUs; driver {env.driver_version}, "
        f"CUDA {env.cuda_version}, torch {env.torch_version}, transformers {env.transformers_version}, "
        f"Python {env.python_version}; sbpbench {env.sbpbench_version} at {env.git_commit[:12]}{dirty}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Rows with full provenance: runs.csv, "
        "estimates.csv; every command's output: selftest.log."
    )


def _long_point_text(test: Selftest, measured: list[dict], log_text: str) -> str | None:
    if test.kind != "cuda":
        return None
    if test.long_seq_len is None:
        return "Not run: no time left in the budget for even the shortest candidate."
    label = f"streambp {LONG_MODEL} T={test.long_seq_len}"
    rows = [
        r
        for r in measured
        if (r["model"], r["seq_len"], r["method"]) == (LONG_MODEL, str(test.long_seq_len), "streambp")
    ]
    if not rows:
        return f"{label}: no row (see selftest.log)."
    row = rows[-1]
    text = f"{label} (memory only, one step, no warm-up): {row['status']}"
    if row.get("peak_allocated_bytes"):
        text += f", peak {int(row['peak_allocated_bytes']) / 2**30:.2f} GiB"
    if row.get("error"):
        text += f" ({row['error']})"
    seconds = progress_seconds(log_text, label)
    if seconds is not None:
        text += f"; its last progress line: {seconds:.0f} s into the step"
    return text + "."


def write_summary(test: Selftest, env: Environment) -> Path:
    """summary.md in test.out_dir, from the outcomes, the CSVs and the log."""
    measured, simulated = _rows(test.runs_csv), _rows(test.estimates_csv)
    log_text = test.log.read_text() if test.log.exists() else ""
    if test.kind == "cuda":
        offload = [(LONG_MODEL, OFFLOAD_SEQ_LEN, "streambp", p) for p in OFFLOAD_PLACEMENTS]
        points = (
            list(GPU_POINTS) + offload + ([(LONG_MODEL, test.long_seq_len, "streambp")] if test.long_seq_len else [])
        )
        title = f"sbp selftest on {env.device_name}"
    else:
        points = [(CPU_POINT["model"], CPU_POINT["seq_len"], m) for m in ("bp", "ckpt", "streambp")]
        title = f"sbp selftest, CPU subset ({env.device_name})"
    config = load_config(LONG_MODEL)
    seq_len = test.long_seq_len or LONG_SEQ_LENS[0]
    timed = _default_run_row(test, "streambp") if test.kind == "cuda" else None
    rate = 1 / seconds_per_executed_flop(timed, config) / 1e12
    note = (
        f"The rate is the default run's: its streambp step at {GPU_POINTS[0][0]} T={GPU_POINTS[0][1]} took "
        f"{float(timed['time_median_s']):.2f} s for its executed FLOPs; attention kernels run faster at longer T."
        if timed
        else f"The rate is assumed: {ASSUMED_MODEL_TFLOPS:g} model TFLOP/s (an H100's StreamBP at Qwen3-4B "
        "T=9000) in executed FLOPs; no GPU step was timed here."
    )
    text = summary_markdown(
        title=title,
        provenance=_provenance(env),
        steps=[(o.step.name, o.status, o.seconds, o.cpu_seconds, o.step.predicted_s) for o in test.outcomes],
        errors=estimate_errors(measured, simulated, points),
        pytest=pytest_counts(log_text) if test.kind == "cuda" else None,
        tests=read_test_report(test.tests_report.read_text()) if test.tests_report.exists() else None,
        long_point=_long_point_text(test, measured, log_text),
        log_text=log_text,
        flops=(config, LONG_MODEL, "streambp", seq_len, round(rate), note),
    )
    path = test.out_dir / "summary.md"
    path.write_text(text)
    return path
