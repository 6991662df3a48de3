"""`sbp selftest`: prove every CUDA path of a machine in one command, in order of value.

Every check is an ordinary command (pytest, a benchmark script, `sbp run`, `sbp estimate`, a measure
module) in its own process with its own time limit, its output appended to one raw log; what it
decides is written beside it (selftest_summary.py). The plan is pure data, so it is priced and
tested on any machine (`sbp selftest --dry-run`).

On a GPU (GPU_BUDGET_S, 8 minutes on one H100), in this order:
  1. the quick gpu-marked tests (pytest -m "gpu and quick", tests/gpu/): the stream placements in
     fp64 with rebuilds, the phase timer's CUDA events, the attention kernels but flex against the
     lower-right reference in bf16, the memory history's timeline, the worker's memory sources,
     exactness at T=9000 (StreamBP on the lower-right kernel); each test's outcome recorded as it ends;
  2. the attention benchmark (benchmarks/attention_kernels.py) on the calls of a Qwen3-8B step at
     BENCHMARK_SEQ, which writes this device's table of measured kernels (runner/kernel_table.py);
  3. Qwen3-4B T=9000, ckpt and streambp with --phases, auto reading that table (its kernels built
     before the timed steps, on the step's own call shapes);
  4. Qwen3-8B StreamBP at T=262,144 streamed through host buffers (LONG_POINT: `stream:2` on 3
     layers, one layer rebuilt), a warm-up, a memory step and a timed step;
  5. Qwen3-8B StreamBP at T=65,536 with the checkpoints on the host (`cpu`: the MFU goal's point,
     benchmarks/hopper_goals.py), a warm-up, a memory step and a timed step;
  6. the host copy rate each way, from both kinds of page-locked buffer (measure/copy_rate.py).
The two long points run the lower-right kernel, the estimator's, so their times compare with earlier rows.
With 2 GPUs or more visible, StreamBP sharing each sequence over 2 of them (Ulysses over nccl, one
GPU per rank) comes right after step 3: `sbp check` of it in fp32 (SP_CHECK), then SP_POINT run.
`sbp estimate` of each measured point runs beside them on the host CPU (fake tensors, no GPU).
Everything goes to OUT/gpu/<device name>/: every step's process gets SBP_CACHE_DIR there (the
kernel table, attention-kernels.json) and one Inductor and Triton cache (compile-cache/, ignored by
a .gitignore written beside it: large binaries of this torch and driver). `--pack FILE` then writes
one archive of what a reader needs (PACKED): the rows, the raw log, the kernel table, the summary.

Budget: a step starts only while the budget left covers its prediction and MIN_START_S (budget.py);
else it is "not run (budget)", which is not a failure. Its limit is its own (TIMEOUT_FACTOR x its
price plus TIMEOUT_SLACK_S), cut to what the budget leaves. A step's prediction is its wall time in
this device's earlier selftest.log where it ran ok there, else its price: the sum of the work it
counts (selftest_prices.py: starts, steps at the rates fitted to this device's rows, else the H100
rows in results/gpu/, else the time model's defaults; kernel builds per call shape; compiles).
The one-GPU plan's price leaves MARGIN of the budget free (test_selftest.py checks it). A step that
exits 0 still fails when what it wrote says so: a point's row not ok, a kernel wrong, a rate missing.

On a CPU: a small `sbp check`, a short `sbp run` and its `sbp estimate --target cpu`, within
CPU_BUDGET_S on 2 cores. Written to OUT/cpu-selftest/.
"""

from __future__ import annotations

import csv
import functools
import os
import queue
import re
import resource
import signal
import subprocess
import sys
import tarfile
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from ..config import RunSpec
from ..config.run import BeyondContextWarning, point_specs
from ..measure.environment import Environment
from ..models import load_config
from ..records import read_rows
from ..settings import SettingChanged
from ..simulate.plan import meta_model
from ..simulate.timing import Rates, fitted_rates
from .budget import MIN_START_S
from .kernel_table import FILE_NAME
from .selftest_prices import (
    Work,
    benchmark_work,
    copy_rate_work,
    quick_tier_work,
    run_work,
    sp_check_work,
    total_s,
)
from .selftest_summary import (
    KERNEL_FAILURES,
    NOT_RUN,
    TEST_REPORT_ENV,
    SummaryInputs,
    first_line,
    ranks_label,
    summary_markdown,
)

GPU_BUDGET_S = 480.0  # 8 minutes on one H100
PRICED_DEVICE = "NVIDIA H100 80GB HBM3"  # whose rows (results/gpu/) price a plan made where no GPU is visible
# The CPU subset's own work is about 40 CPU-seconds (three commands and three workers, each
# importing torch and transformers); on 2 idle cores that is under a minute. The budget is a hard
# stop set wider, so a machine shared with other jobs still finishes; the summary gives each step's
# wall and CPU seconds, so a slow step says whether it waited or worked.
CPU_BUDGET_S = 480.0
CPU_POINT = {"model": "small/qwen3", "seq_len": 512}  # small/qwen3 at a short T, all methods

TIMEOUT_FACTOR, TIMEOUT_SLACK_S = 1.5, 30.0  # a step's own limit over its price
GRACE_S = 15.0  # after SIGINT at a step's limit (a Ctrl-C: `sbp run` stops its workers), then SIGKILL
# The share of the budget the one-GPU plan's price leaves free: its prices are predictions
MARGIN = 0.1
COMPILE_CACHE = "compile-cache"  # Inductor's and Triton's, under the output folder, ignored by git
GITIGNORE = (
    "# Inductor's and Triton's compile caches (sbp selftest): large binaries of this torch and driver,\n"
    "# rebuilt by the next run. attention-kernels.json, the table of measured kernels, is committed.\n"
    f"{COMPILE_CACHE}/\n"
)
BENCHMARK_CSV, COPY_RATE_CSV, EXACTNESS_CSV = "attention-benchmark.csv", "copy-rate.csv", "exactness.csv"
KERNEL_TABLE = FILE_NAME  # attention-kernels.json (kernel_table.py), in the output folder: SBP_CACHE_DIR's
# The benchmark's step: Qwen3-8B at 65,536 tokens in chunks of 4096 (auto's at long T): its shape classes
# (prefixes of 4k to 64k) hold the calls of the 4B point at 9000 too (32 query, 8 key heads of 128)
BENCHMARK_MODEL, BENCHMARK_SEQ, BENCHMARK_CHUNK, BENCHMARK_REPS = "Qwen/Qwen3-8B", 65_536, 4096, 3
# What --pack holds, beside nothing else: no compile cache, no memory snapshot (pickles of hundreds of MiB)
PACKED = (
    "summary.md", "selftest.log", "runs.csv", "estimates.csv", EXACTNESS_CSV, KERNEL_TABLE, BENCHMARK_CSV,
    COPY_RATE_CSV,
)  # fmt: skip
TESTS_STEP = "pytest -m 'gpu and quick'"
# New test files of the quick subset first: code no GPU has run yet, then the rest by name
QUICK_FIRST = ("test_gpu_stream.py", "test_gpu_kernels.py", "test_gpu_measure.py")


@dataclass(frozen=True)
class Point:
    """A point of the plan as `sbp run` and `sbp estimate` take it (one process per method)."""

    model: str
    seq_len: int
    methods: tuple[str, ...]
    checkpoints: str = ""  # streambp's placement; empty: the default (gpu)
    num_layers: int | None = None  # the first N layers; None: all
    chunk_size: int | None = None  # None: auto
    warmup: int | None = None  # None: the point's default
    repeats: int | None = None
    nproc: int = 1  # ranks, one GPU each
    sp: int = 1  # of the ranks, how many share each sequence (Ulysses)
    chunk_attention: str = ""  # StreamBP's chunk kernel; empty: auto (the table of measured kernels, if any)

    def flags(self) -> tuple[str, ...]:
        """The options the run and the estimate share."""
        argv = ("--model", self.model, "--seq", str(self.seq_len))
        argv += ("--checkpoints", self.checkpoints) if self.checkpoints else ()
        argv += ("--num-layers", str(self.num_layers)) if self.num_layers else ()
        argv += ("--chunk-size", str(self.chunk_size)) if self.chunk_size else ()
        argv += ("--nproc", str(self.nproc), "--sp", str(self.sp)) if self.nproc > 1 else ()
        argv += ("--set", f"chunk_attention={self.chunk_attention}") if self.chunk_attention else ()
        return argv

    def run_flags(self) -> tuple[str, ...]:
        argv = self.flags()
        argv += ("--warmup", str(self.warmup)) if self.warmup is not None else ()
        argv += ("--repeats", str(self.repeats)) if self.repeats is not None else ()
        return argv + ("--method", *self.methods)

    def specs(self) -> list[RunSpec]:
        """One RunSpec per method with a GPU's defaults, made on any machine (to price it)."""
        given = dict(model=self.model, seq_len=self.seq_len, checkpoints=self.checkpoints or None)
        given.update(num_layers=self.num_layers, chunk_size=self.chunk_size, warmup=self.warmup, repeats=self.repeats)
        given.update(nproc=self.nproc, sp=self.sp, chunk_attention=self.chunk_attention or None)
        # a price needs no word on lengths past a model's context, nor on ranks past this host's
        # cores (its specs are made on the CPU for a GPU run)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BeyondContextWarning)
            warnings.simplefilter("ignore", SettingChanged)
            return point_specs({**given, "device": "cpu"}, self.methods, defaults_for="cuda")

    def keys(self) -> list[tuple]:
        """(model, seq_len, method, checkpoints, num_layers) of each method, then (nproc, sp) on
        several ranks: its rows' key here."""
        ranks = (self.nproc, self.sp) if self.nproc > 1 else ()
        return [(self.model, self.seq_len, m, self.checkpoints, self.num_layers, *ranks) for m in self.methods]

    @property
    def label(self) -> str:
        parts = [self.model, f"T={self.seq_len}", " ".join(self.methods)]
        parts += [f"--checkpoints {self.checkpoints}"] if self.checkpoints else []
        parts += [f"{self.num_layers} layers"] if self.num_layers else []
        parts += [f"on {ranks_label(self.nproc, self.sp)}"] if self.nproc > 1 else []
        return " ".join(parts)


SHORT_POINT = Point("Qwen/Qwen3-4B", 9000, ("ckpt", "streambp"))  # the paper's Table 1 length
# 262,144 tokens streamed: two host buffers of one layer input each on 3 layers rebuild one layer
# (rebuild_schedule.py), as stream:7 rebuilds 37 of Qwen3-8B's 36 at 2M tokens; all 36 layers
# would take 10 minutes a step. The long points take one untimed step before their one timed step
# (on a GPU the warm-up comes before the memory step), and the lower-right kernel.
LONG_POINT = Point(
    "Qwen/Qwen3-8B", 262_144, ("streambp",), "stream:2", 3, 4096, warmup=1, repeats=1, chunk_attention="lower-right"
)
# the MFU goal's point (benchmarks/hopper_goals.py): the checkpoints on the host
GPU_64K_POINT = Point("Qwen/Qwen3-8B", 65_536, ("streambp",), "cpu", warmup=1, repeats=1, chunk_attention="lower-right")
GPU_POINTS = (SHORT_POINT, LONG_POINT, GPU_64K_POINT)
# With 2 GPUs or more: StreamBP sharing each sequence over 2 of them, 32,768 positions each, one
# memory step and one timed; and its exactness first, on a 2-layer Qwen3-0.6B in fp32 against bp's
# fp64 step in one process (`sbp check`), 1,024 positions per rank in 8 chunks of 128 (its default).
# bp's fp64 step holds its memory on the first GPU, beside rank 0: 25 GiB at T=2048 (B=2, `sbp
# estimate --exact`), so the check fits 40 GB GPUs; 52 GiB at T=4096 would not
SP_POINT = Point("Qwen/Qwen3-4B", 65_536, ("streambp",), warmup=0, repeats=1, nproc=2, sp=2)
SP_CHECK = Point("Qwen/Qwen3-0.6B", 2048, ("streambp",), num_layers=2, nproc=2, sp=2)


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]  # after `python`
    timeout_s: float
    background: bool = False  # host-only work (an estimate) that runs beside the GPU steps
    predicted_s: float = 0.0  # its expected wall time (its price, or this device's earlier log)
    env: tuple[tuple[str, str], ...] = ()  # set for its process, beside the inherited environment
    kind: str = ""  # tests | benchmark | run | check | copy rate | estimate: how its output is judged
    point: Point | None = None  # a run's point, whose rows it must leave ok; a check's, exact
    work: tuple[Work, ...] = ()  # what its price counts (selftest_prices.py)


@dataclass
class Outcome:
    step: Step
    status: str = "not run"  # ok | failed (why) | timeout (N s) | not run (budget)
    seconds: float = 0.0
    cpu_seconds: float | None = None  # user + system of the step's processes (foreground steps)
    returncode: int | None = None
    started_utc: str = ""

    @property
    def failed(self) -> bool:
        """Anything but ok, except a step the budget left no time for."""
        return self.status not in ("ok", NOT_RUN)


@dataclass
class Selftest:
    kind: str  # cpu | cuda
    out_dir: Path
    budget_s: float
    device_name: str = ""
    outcomes: list[Outcome] = field(default_factory=list)
    rates: Rates | None = None  # what the run steps were priced at
    num_gpus: int = 1  # visible (measure/environment.py visible_gpu_count): 2 or more add SP_POINT

    @property
    def points(self) -> tuple[Point, ...]:
        """The GPU points in order of value: SP_POINT after the short one where it has its GPUs."""
        if self.num_gpus < SP_POINT.nproc:
            return GPU_POINTS
        return (SHORT_POINT, SP_POINT, LONG_POINT, GPU_64K_POINT)

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
    def exactness_csv(self) -> Path:
        return self.out_dir / EXACTNESS_CSV

    @property
    def tests_report(self) -> Path:
        return self.out_dir / "tests.jsonl"

    def env(self) -> tuple[tuple[str, str], ...]:
        """What every step's process shares: the kernel table's folder and one compile cache."""
        compiled = self.out_dir / COMPILE_CACHE
        return (
            ("SBP_CACHE_DIR", str(self.out_dir)),
            ("TORCHINDUCTOR_CACHE_DIR", str(compiled / "inductor")),
            ("TRITON_CACHE_DIR", str(compiled / "triton")),
        )


def device_slug(device_name: str) -> str:
    """A directory name for a device: 'NVIDIA H100 80GB HBM3' -> 'NVIDIA-H100-80GB-HBM3'."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", device_name).strip("-") or "unknown-device"


def output_dir(out: Path, kind: str, device_name: str) -> Path:
    return out / "gpu" / device_slug(device_name) if kind == "cuda" else out / "cpu-selftest"


def find_repository() -> Path | None:
    """The checkout beside the package (an editable install), with its tests and benchmarks; None
    for a wheel."""
    root = Path(__file__).resolve().parents[2]
    found = (root / "tests" / "gpu" / "test_gpu.py").exists() and (
        root / "benchmarks" / "attention_kernels.py"
    ).exists()
    return root if found else None


def _sbp(*args: str) -> tuple[str, ...]:
    return ("-m", "sbpbench", *args)


def cpu_plan(test: Selftest) -> list[Step]:
    """The CPU subset: about 40 CPU-seconds, stopped at CPU_BUDGET_S."""
    point = ("--model", CPU_POINT["model"], "--seq", str(CPU_POINT["seq_len"]))
    chunks = ("--chunk-size", "128", "--logits-chunk-size", "100")
    estimate = ("estimate", *point, *chunks, "--dtype", "fp32", "--target", "cpu", "--out", str(test.estimates_csv))
    steps = [
        # one after another, each with whatever the budget has left (run_selftest cuts it)
        Step("check", _sbp("check", "--model", "small/qwen3", "--seq", "128"), test.budget_s),
        Step("run", _sbp("run", *point, *chunks, "--repeats", "1", "--out", str(test.runs_csv)), test.budget_s),
        Step("estimate", _sbp(*estimate), test.budget_s),
    ]
    return [replace(step, env=test.env()) for step in steps]


def plan_rates(test: Selftest, repository: Path | None) -> Rates:
    """The rates a run step is priced at: fitted to this device's rows in its output folder, else to
    the H100 rows of the checkout's results/gpu/, else the time model's defaults."""
    places = [(test.out_dir, test.device_name)]
    if repository is not None:
        places.append((repository / "results" / "gpu", "H100"))
    for folder, device in places:
        if device and folder.exists():
            rates = fitted_rates(folder, device, meta_model)
            if rates.measured:
                return rates
    return Rates()


def own_limit_s(predicted_s: float) -> float:
    return TIMEOUT_FACTOR * predicted_s + TIMEOUT_SLACK_S


def _priced(name: str, argv: tuple[str, ...], work: list[Work], **fields) -> Step:
    """A step whose prediction is the sum of its counted work, under its own limit."""
    predicted = total_s(work)
    return Step(name, argv, own_limit_s(predicted), predicted_s=predicted, work=tuple(work), **fields)


def _run(test: Selftest, point: Point, rates: Rates) -> Step:
    """`sbp run` of the point with --phases, each of its processes under the limit of the slowest (--timeout)."""
    specs = point.specs()
    slowest = max(total_s(run_work([spec], rates)) for spec in specs)
    argv = ("run", *point.run_flags(), "--timeout", f"{own_limit_s(slowest):.0f}", "--phases")
    step = _priced(
        f"run {point.label}", _sbp(*argv, "--out", str(test.runs_csv)), run_work(specs, rates), kind="run", point=point
    )
    return replace(step, timeout_s=step.timeout_s + GRACE_S)


def _sp_check(test: Selftest, point: Point, rates: Rates) -> Step:
    """`sbp check` of the point's methods on its GPUs in fp32, judged against bp's fp64 step in one
    process; exit 1 when one differs, each comparison appended to exactness.csv."""
    argv = ("check", "--device", "cuda", *point.flags(), "--dtype", "fp32", "--method", *point.methods)
    work = sp_check_work(point.specs()[0], rates)
    return _priced(
        f"check {point.label}, fp32", _sbp(*argv, "--out", str(test.exactness_csv)), work, kind="check", point=point
    )


def _estimate(test: Selftest, point: Point) -> Step:
    argv = ("estimate", *point.flags(), "--method", *point.methods, "--out", str(test.estimates_csv))
    return Step(f"estimate {point.label}", _sbp(*argv), 300, background=True, kind="estimate")


def quick_test_files(tests_dir: Path) -> list[Path]:
    """The test files that mark a test `quick` (named, so pytest imports only them): QUICK_FIRST's
    in its order, then the rest by name."""
    files = [p for p in sorted(tests_dir.rglob("test_*.py")) if "pytest.mark.quick" in p.read_text()]
    first = {name: i for i, name in enumerate(QUICK_FIRST)}
    return sorted(files, key=lambda p: first.get(p.name, len(first)))


def _tests(test: Selftest, repository: Path, rates: Rates) -> Step:
    """The quick gpu-marked tests, short tracebacks, each test's outcome recorded as it finishes."""
    tests_dir = repository / "tests"
    files = quick_test_files(tests_dir) or [tests_dir]
    argv = ("-m", "pytest", "-v", "--tb=short", "-p", "no:cacheprovider", "-m", "gpu and quick", *map(str, files))
    env = ((TEST_REPORT_ENV, str(test.tests_report)),)
    return _priced(TESTS_STEP, argv, quick_tier_work(rates), env=env, kind="tests")


def _benchmark(test: Selftest, repository: Path, rates: Rates) -> Step:
    """The attention benchmark on a Qwen3-8B step's calls: its CSV, and this device's kernel table."""
    script = repository / "benchmarks" / "attention_kernels.py"
    argv = (str(script), "--model", BENCHMARK_MODEL, "--seq", str(BENCHMARK_SEQ), "--chunk-size", str(BENCHMARK_CHUNK))
    argv += ("--reps", str(BENCHMARK_REPS), "--out", str(test.out_dir / BENCHMARK_CSV))
    argv += ("--table", str(test.out_dir / KERNEL_TABLE))
    work = benchmark_work(BENCHMARK_MODEL, BENCHMARK_SEQ, BENCHMARK_CHUNK, BENCHMARK_REPS, rates)
    name = f"attention kernels on the calls of {BENCHMARK_MODEL} at T={BENCHMARK_SEQ}"
    return _priced(name, argv, work, kind="benchmark")


def _copy_rate(test: Selftest, rates: Rates) -> Step:
    argv = ("-m", "sbpbench.measure.copy_rate", "--out", str(test.out_dir / COPY_RATE_CSV))
    return _priced("host copy rate each way, both kinds of page-locked buffer", argv, copy_rate_work(rates),
                   kind="copy rate")  # fmt: skip


def gpu_plan(test: Selftest, repository: Path | None, rates: Rates) -> list[Step]:
    """The GPU steps in order of value, each point's estimate submitted beside them first; priced at
    `rates`. Without a checkout (a wheel) the tests and the benchmark are left out."""
    steps = [_estimate(test, point) for point in test.points]
    if repository is not None:
        steps += [_tests(test, repository, rates), _benchmark(test, repository, rates)]
    steps.append(_run(test, SHORT_POINT, rates))
    if SP_POINT in test.points:  # new code first among the runs: no GPU has run it yet
        steps += [_sp_check(test, SP_CHECK, rates), _run(test, SP_POINT, rates)]
    steps += [_run(test, LONG_POINT, rates), _run(test, GPU_64K_POINT, rates)]
    steps.append(_copy_rate(test, rates))
    return [replace(step, env=test.env() + step.env) for step in steps]


def dry_run_lines(steps: list[Step], budget_s: float, rates: Rates) -> list[str]:
    """The plan as `--dry-run` prints it: each step's prediction, limit and counted work, the total
    beside the budget and its margin. Predictions, not measurements."""
    lines = []
    for step in steps:
        if step.background:
            lines.append(f"{step.name}: on the host's CPU, beside the GPU steps")
            continue
        lines.append(f"{step.name}: predicted {step.predicted_s:.0f} s (limit {step.timeout_s:.0f} s)")
        lines += [f"    {work.describe()}" for work in step.work]
    total = sum(step.predicted_s for step in steps if not step.background)
    room = (1 - MARGIN) * budget_s
    verdict = "fits" if total <= room else "does not fit: the last steps would be not run (budget)"
    lines += [
        f"total predicted {total:.0f} s of a {budget_s:.0f} s budget, {room:.0f} s with its {MARGIN:.0%} margin: {verdict}",
        f"Predicted, not measured. Rates: {rates.describe()}.",
    ]
    return lines


def pack_files(test: Selftest, path: Path) -> list[str]:
    """One gzipped tar of the files of PACKED that the selftest wrote, under the output folder's
    name; the member names."""
    members = [name for name in PACKED if (test.out_dir / name).is_file()]
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as archive:
        for name in members:
            archive.add(test.out_dir / name, arcname=f"{test.out_dir.name}/{name}")
    return members


def dry_run_text(out: Path, kind: str, budget_s: float, num_gpus: int, device_name: str | None) -> str:
    """`sbp selftest --dry-run`: the plan of `kind` priced, on any machine. A GPU's at the rates of its
    rows (PRICED_DEVICE's in the checkout where no GPU is visible), with the times of its earlier
    selftest.log; the CPU subset's listed, unpriced (the time model is a GPU's)."""
    name = device_name or PRICED_DEVICE
    test = Selftest(kind, output_dir(out, kind, name), budget_s, name, num_gpus=num_gpus)
    if kind != "cuda":
        return "\n".join(f"{step.name}: python {' '.join(step.argv)} (not priced)" for step in cpu_plan(test))
    repository = find_repository()
    rates = plan_rates(test, repository)
    earlier = test.log.read_text() if test.log.exists() else ""
    steps = with_measured_predictions(gpu_plan(test, repository, rates), earlier)
    return "\n".join(dry_run_lines(steps, test.budget_s, rates))


_STEP_END = re.compile(r"^===== (?P<name>.+): ok, (?P<seconds>[0-9.]+) s$", re.MULTILINE)


def logged_seconds(log_text: str) -> dict[str, float]:
    """Step name -> its wall time in a selftest.log, for the steps that ended ok (the last run wins)."""
    return {m["name"]: float(m["seconds"]) for m in _STEP_END.finditer(log_text)}


def with_measured_predictions(steps: list[Step], log_text: str) -> list[Step]:
    """The steps with each prediction replaced by its measured wall time in `log_text` (an earlier
    selftest.log of this device) where that step ran ok there."""
    seconds = logged_seconds(log_text)
    return [replace(s, predicted_s=seconds[s.name]) if s.name in seconds else s for s in steps]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _stop(process: subprocess.Popen) -> None:
    """SIGINT to the step's process group (what Ctrl-C does: `sbp run` and pytest stop their workers),
    then SIGKILL after GRACE_S."""
    for sig, wait_s in ((signal.SIGINT, GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, log: Path, *, env: dict | None = None) -> Outcome:
    """Run one step in a process group of its own to completion (or its timeout), its output appended
    to `log`; `env` replaces the inherited environment, step.env adds to it."""
    outcome = Outcome(step, started_utc=datetime.now(UTC).isoformat(timespec="seconds"))
    env = {**(env or os.environ), **dict(step.env)}
    with log.open("a") as out:
        out.write(f"\n===== {step.name}: python {' '.join(step.argv)}\n")
        out.flush()
        start, used = time.perf_counter(), _children_cpu_s()
        process = subprocess.Popen(
            [sys.executable, *step.argv], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            outcome.returncode = process.wait(timeout=step.timeout_s)
            outcome.status = "ok" if outcome.returncode == 0 else f"failed (exit {outcome.returncode})"
        except subprocess.TimeoutExpired:
            outcome.status = f"timeout ({step.timeout_s:.0f} s)"
        finally:
            if process.poll() is None:  # its limit, or this command interrupted
                _stop(process)
        outcome.seconds = time.perf_counter() - start
        if not step.background:  # background steps run beside others: their children's times mix
            outcome.cpu_seconds = _children_cpu_s() - used
        out.write(f"===== {step.name}: {outcome.status}, {outcome.seconds:.1f} s\n")
    return outcome


class Background:
    """Host-only steps (estimates) run one after another on a thread beside the GPU steps, with
    few threads each so the measured worker's host thread keeps a core, each within what the budget
    leaves when it starts; their output goes to a log of its own, appended to the main log at the end."""

    THREADS = "4"

    def __init__(self, log: Path, deadline: float):
        self.log, self.deadline = log, deadline
        self.queue: queue.Queue[Step | None] = queue.Queue()
        self.outcomes: list[Outcome] = []
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def submit(self, step: Step) -> None:
        self.queue.put(step)

    def _work(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": self.THREADS}
        while (step := self.queue.get()) is not None:
            if self.deadline - time.perf_counter() < MIN_START_S:
                self.outcomes.append(Outcome(step, NOT_RUN))
            else:
                self.outcomes.append(run_step(_budget(step, self.deadline), self.log, env=env))

    def finish(self, into: Path) -> list[Outcome]:
        """Wait for the steps submitted (each ends by the deadline and its stop's grace)."""
        self.queue.put(None)
        self.thread.join(timeout=max(1.0, self.deadline - time.perf_counter() + 2 * GRACE_S))
        if self.log.exists():
            with into.open("a") as out:
                out.write(self.log.read_text())
            self.log.unlink()
        return self.outcomes


def _budget(step: Step, deadline: float) -> Step:
    """The step with its timeout cut to what the budget leaves (less the grace of its stop)."""
    left = deadline - time.perf_counter() - GRACE_S
    return replace(step, timeout_s=max(10.0, min(step.timeout_s, left)))


def verdict(test: Selftest, outcome: Outcome) -> str | None:
    """Why a step that exited 0 failed all the same, from what it wrote; None when it did not."""
    step = outcome.step
    if step.kind == "run":
        return _run_verdict(test, outcome)
    if step.kind == "check":
        written = _csv_rows(test.exactness_csv) or []
        rows = {r["method"]: r for r in written if r.get("timestamp_utc", "") >= outcome.started_utc}
        problems = [
            f"{m}: no comparison" if m not in rows else f"{m}: {rows[m]['result']} ({first_line(rows[m]['note'])})"
            for m in step.point.methods
            if rows.get(m, {}).get("result") != "exact"
        ]  # an unsupported method exits 0
        return "; ".join(problems) or None
    if step.kind == "benchmark":
        rows = _csv_rows(test.out_dir / BENCHMARK_CSV)
        if rows is None:
            return "no rows written"
        bad = [r for r in rows if r["status"] in KERNEL_FAILURES]
        return "; ".join(f"{r['kernel']} at {r['keys']} keys: {r['status']} ({r['reason']})" for r in bad) or None
    if step.kind == "copy rate":
        rows = _csv_rows(test.out_dir / COPY_RATE_CSV) or []
        kinds = {r.get("host_buffer") for r in rows}
        measured = {(r.get("host_buffer"), r["direction"]) for r in rows}
        complete = len(kinds) == 2 and len(measured) == 4  # both directions from both kinds of buffer
        return None if complete else "no rate for both directions from both kinds of buffer"
    return None


def _run_verdict(test: Selftest, outcome: Outcome) -> str | None:
    """Each of the point's rows this step wrote must be ok; on several ranks, with each rank's peak."""
    point = outcome.step.point
    rows = {_key(r): r for r in _rows(test.runs_csv) if r.get("timestamp_utc", "") >= outcome.started_utc}
    problems = []
    for key in point.keys():
        row = rows.get(key)
        if row is None:
            problems.append(f"{key[2]}: no row")
        elif row["status"] != "ok":
            problems.append(f"{key[2]}: {row['status']} ({first_line(row.get('error'))})")
        elif point.nproc > 1 and not _has_rank_peaks(row, point.nproc):
            problems.append(f"{key[2]}: rank_peak_bytes {row.get('rank_peak_bytes') or ''!r}, not {point.nproc} peaks")
    return "; ".join(problems) or None


def _has_rank_peaks(row: dict, nproc: int) -> bool:
    """rank_peak_bytes holds a peak for each of the nproc ranks (runner/ranks.py merge_rank_rows)."""
    peaks = (row.get("rank_peak_bytes") or "").split(";")
    return len(peaks) == nproc and all(p.strip() for p in peaks)


def _key(row: dict) -> tuple:
    """A row's key as Point.keys() spells it: a full-depth row has no num_layers, gpu no placement,
    one process (nproc 1 or empty: rows older than the column) no (nproc, sp)."""
    placement = row.get("checkpoints") or ""
    num_layers = int(row["num_layers"]) if row.get("num_layers") else None
    full = meta_depth(row["model"])
    nproc, sp = int(row.get("nproc") or 1), int(row.get("sp") or 1)
    return (
        row["model"],
        int(row["seq_len"]),
        row["method"],
        "" if placement == "gpu" else placement,
        None if num_layers == full else num_layers,
        *((nproc, sp) if nproc > 1 else ()),
    )


@functools.lru_cache(maxsize=16)
def meta_depth(model: str) -> int | None:
    """A model's number of layers, None where its config cannot be read here (its rows keep theirs)."""
    try:
        return load_config(model).num_hidden_layers
    except (OSError, ValueError):
        return None


def _rows(path: Path) -> list[dict]:
    return read_rows(path) if path.exists() else []


def prepare(test: Selftest) -> None:
    """The output folder, its .gitignore (the compile cache stays out of commits), a fresh test report."""
    test.out_dir.mkdir(parents=True, exist_ok=True)
    (test.out_dir / ".gitignore").write_text(GITIGNORE)
    test.tests_report.unlink(missing_ok=True)  # this run's test results only


def run_selftest(test: Selftest, *, repository: Path | None, echo=print) -> Selftest:
    """Run the plan of test.kind within test.budget_s; outcomes in order, estimates last."""
    prepare(test)
    deadline = time.perf_counter() + test.budget_s
    if test.kind != "cuda":
        for step in cpu_plan(test):
            test.outcomes.append(run_step(_budget(step, deadline), test.log))
            echo(_line(test.outcomes[-1]))
        return test

    earlier_log = test.log.read_text() if test.log.exists() else ""
    background = Background(test.out_dir / "selftest-estimates.log", deadline)
    test.rates = plan_rates(test, repository)
    for step in with_measured_predictions(gpu_plan(test, repository, test.rates), earlier_log):
        if step.background:
            background.submit(step)
            continue
        if deadline - time.perf_counter() < max(MIN_START_S, step.predicted_s):
            outcome = Outcome(step, NOT_RUN)
        else:
            outcome = run_step(_budget(step, deadline), test.log)
            if outcome.status == "ok" and (why := verdict(test, outcome)):
                outcome.status = f"failed ({why})"
        outcome.cpu_seconds = None  # mixed with the background estimates'
        test.outcomes.append(outcome)
        echo(_line(outcome))
    for outcome in background.finish(test.log):
        test.outcomes.append(outcome)
        echo(_line(outcome))
    return test


def _line(outcome: Outcome) -> str:
    cpu = "" if outcome.cpu_seconds is None else f", {outcome.cpu_seconds:.0f} CPU-s"
    return f"{outcome.step.name}: {outcome.status} ({outcome.seconds:.0f} s{cpu})"


def _provenance(env: Environment) -> str:
    dirty = {"true": " (uncommitted changes)", "false": ""}.get(env.git_dirty, " (dirty: unknown)")
    return (
        f"{env.device_name} ({env.device}) on {env.host}, {env.num_cpus} CPUs; driver {env.driver_version}, "
        f"CUDA {env.cuda_version}, torch {env.torch_version}, transformers {env.transformers_version}, "
        f"Python {env.python_version}; sbpbench {env.sbpbench_version} at {env.git_commit[:12]}{dirty}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Rows with full provenance: runs.csv, "
        "estimates.csv; every command's output: selftest.log."
    )


def _csv_rows(path: Path) -> list[dict] | None:
    """A CSV's rows as dicts of strings; None when it was not written."""
    if not path.exists():
        return None
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_summary(test: Selftest, env: Environment) -> Path:
    """summary.md in test.out_dir, from the outcomes, the CSVs, the timelines and the log."""
    cuda = test.kind == "cuda"
    if cuda:
        points = [key for point in test.points for key in point.keys()]
        title = f"sbp selftest on {env.device_name}"
    else:
        points = [(CPU_POINT["model"], CPU_POINT["seq_len"], m, "", None) for m in ("bp", "ckpt", "streambp")]
        title = f"sbp selftest, CPU subset ({env.device_name})"
    inputs = SummaryInputs(
        measured=[r for r in _rows(test.runs_csv) if _key(r) in points],
        simulated=_rows(test.estimates_csv),
        points=points,
        log_text=test.log.read_text() if test.log.exists() else "",
        tests_report=test.tests_report.read_text() if test.tests_report.exists() else None,
        benchmark=_csv_rows(test.out_dir / BENCHMARK_CSV) if cuda else None,
        copy_rates=_csv_rows(test.out_dir / COPY_RATE_CSV) if cuda else None,
        assumed_copy_bytes_s=Rates().host_copy_bytes_s,
        rates=test.rates.describe() if test.rates is not None else "",
    )
    text = summary_markdown(
        title=title,
        provenance=_provenance(env),
        steps=[(o.step.name, o.status, o.seconds, o.cpu_seconds, o.step.predicted_s) for o in test.outcomes],
        inputs=inputs,
        key=_key,
        gpu=cuda,
    )
    path = test.out_dir / "summary.md"
    path.write_text(text)
    return path
