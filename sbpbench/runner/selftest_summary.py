"""The selftest's Markdown summary: what ran, each failure with its message, the measured points
(their phases), measured vs estimated peaks, the attention kernels, the host copy rate. Pure functions of the selftest's outcomes, rows, logs and files, so every GPU-only line
of it is tested on a CPU with stand-in rows."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..measure.units import GIB
from ..records.schema import PHASE_COLUMNS

# measured on one H100, the estimator was within about 1% of the measured peaks
GOOD_ESTIMATE = 0.05
# tests/conftest.py writes one JSON line per test event to the file this variable names
TEST_REPORT_ENV = "SBP_TEST_REPORT"
MESSAGE_LINES = 8  # of a failed test's message, or a failed step's output, in the summary
NOT_RUN = "not run (budget)"  # a step the budget left no time for: not a failure
KERNEL_FAILURES = ("wrong", "error", "oom")  # a benchmark row's statuses that are failures

# (model, seq_len, method, checkpoints ("" = gpu), num_layers (None = all)), then (nproc, sp) for a
# point on several ranks
Key = tuple


def ranks_label(nproc: int, sp: int) -> str:
    """How a point's ranks hold it: "2 GPUs, 2 per sequence"; "" in one process."""
    if nproc <= 1:
        return ""
    return f"{nproc} GPUs" + (f", {sp} per sequence" if sp > 1 else "")


@dataclass(frozen=True)
class PointError:
    model: str
    seq_len: int
    method: str
    chunk_size: str
    measured_status: str
    measured_bytes: int | None
    estimated_status: str
    estimated_bytes: int | None
    checkpoints: str = ""  # streambp's placement when not the default gpu
    num_layers: int | None = None  # the first N layers; None: all
    nproc: int = 1  # ranks, one GPU each; the peaks are the largest rank's
    sp: int = 1  # of them, sharing each sequence

    @property
    def label(self) -> str:
        label = f"{self.method} ({self.checkpoints})" if self.checkpoints else self.method
        label += f", {self.num_layers} layers" if self.num_layers else ""
        return label + (f", {ranks_label(self.nproc, self.sp)}" if self.nproc > 1 else "")

    @property
    def error(self) -> float | None:
        """(estimate - measured) / measured of the peak allocated bytes; None unless both exist."""
        if not self.measured_bytes or self.estimated_bytes is None or self.measured_status != "ok":
            return None
        return (self.estimated_bytes - self.measured_bytes) / self.measured_bytes


def _int(value) -> int | None:
    return None if value in (None, "") else int(float(value))


def _float(value) -> float | None:
    return None if value in (None, "") else float(value)


def first_line(text: str | None, max_chars: int = 200) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0][:max_chars] if lines else ""


def estimate_errors(measured: list[dict], simulated: list[dict], points: list[Key], key: Callable) -> list[PointError]:
    """One PointError per point key, from measured rows (sbp run) and simulated ones (sbp estimate),
    each row's key by `key(row)`: the last row of each point wins, as in an upserted CSV."""
    ours = {key(r): r for r in measured if r.get("kind", "point") == "point" and r.get("seq_len")}
    theirs = {key(r): r for r in simulated if r.get("seq_len")}
    errors = []
    for point in points:
        model, seq_len, method, checkpoints, num_layers, *ranks = point
        m, s = ours.get(point, {}), theirs.get(point, {})
        nproc, sp = ranks or (1, 1)
        errors.append(
            PointError(
                model, seq_len, method,
                checkpoints=checkpoints, num_layers=num_layers, nproc=nproc, sp=sp,
                chunk_size=m.get("chunk_size") or s.get("chunk_size") or "",
                measured_status=m.get("status", "missing"), measured_bytes=_int(m.get("peak_allocated_bytes")),
                estimated_status=s.get("status", "missing"), estimated_bytes=_int(s.get("peak_allocated_bytes")),
            )
        )  # fmt: skip
    return errors


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f}"


def estimate_table(errors: list[PointError]) -> list[str]:
    lines = [
        "| model | T | method | chunk | measured GiB | estimated GiB | estimate error | note |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for e in errors:
        error = "-" if e.error is None else f"{e.error:+.1%}"
        notes = []
        if e.measured_status != "ok":
            notes.append(f"measured: {e.measured_status}")
        if e.estimated_status not in ("ok",):
            notes.append(f"estimate: {e.estimated_status}")
        if e.error is not None and abs(e.error) > GOOD_ESTIMATE:
            notes.append(f"off by more than {GOOD_ESTIMATE:.0%}")
        lines.append(
            f"| {e.model} | {e.seq_len} | {e.label} | {e.chunk_size or '-'} | {_gib(e.measured_bytes)} "
            f"| {_gib(e.estimated_bytes)} | {error} | {'; '.join(notes)} |"
        )
    return lines


def _label(row: dict) -> str:
    placement = row.get("checkpoints") or ""
    label = f"{row['model']} T={row['seq_len']} {row['method']}"
    label += f" ({placement})" if placement and placement != "gpu" else ""
    ranks = ranks_label(_int(row.get("nproc")) or 1, _int(row.get("sp")) or 1)
    return label + (f", {ranks}" if ranks else "")


def _cell(value, digits: str = ".2f") -> str:
    number = _float(value)
    return "-" if number is None else format(number, digits)


def points_table(rows: list[dict]) -> list[str]:
    """Each measured row: status, peak, step time, rate, the pass that built the table's attention
    kernels before its timed steps (tuning_s), the kernels its memory step and its timed steps ran,
    and an error's first line."""
    lines = [
        "| point | layers | status | peak GiB | step s | TFLOP/s | kernel builds s | kernels (memory / timed) | error |",
        "|---|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        peak = _int(row.get("peak_allocated_bytes"))
        lines.append(
            f"| {_label(row)} | {row.get('num_layers') or '-'} | {row['status']} | {_gib(peak)} "
            f"| {_cell(row.get('time_median_s'))} | {_cell(row.get('tflops_per_s'), '.3g')} "
            f"| {_cell(row.get('tuning_s'), '.1f')} "
            f"| {row.get('attention_kernel') or '-'} / {row.get('timed_attention_kernel') or '-'} "
            f"| {first_line(row.get('error'), 120)} |"
        )
    return lines


def rank_peak_lines(rows: list[dict]) -> list[str]:
    """Each rank's peak of the rows measured on several ranks (their table's peak is the largest)."""
    lines = []
    for row in (r for r in rows if (_int(r.get("nproc")) or 1) > 1):
        peaks = [_int(p) for p in (row.get("rank_peak_bytes") or "").split(";")]
        shown = f"{', '.join(map(_gib, peaks))} GiB" if any(p is not None for p in peaks) else "none recorded"
        lines.append(f"- {_label(row)}: peak per rank {shown}.")
    return lines


def _phase_name(column: str) -> str:
    return column.removeprefix("phase_").removesuffix("_s").replace("_", " ")


def phases_table(rows: list[dict]) -> list[str]:
    """Seconds per phase of each timed streambp row (core/phases.py; on CUDA the host copies run on a
    side stream, beside the others), beside its step's median time; [] when none has phases."""
    timed = [r for r in rows if r["method"] == "streambp" and any(r.get(c) for c in PHASE_COLUMNS)]
    if not timed:
        return []
    lines = ["| phase | " + " | ".join(_label(r) for r in timed) + " |", "|---|" + "---:|" * len(timed)]
    for column in PHASE_COLUMNS:
        lines.append(f"| {_phase_name(column)} | " + " | ".join(_cell(r.get(column), ".3f") for r in timed) + " |")
    lines.append("| the step (median) | " + " | ".join(_cell(r.get("time_median_s"), ".3f") for r in timed) + " |")
    return lines


def benchmark_table(rows: list[dict]) -> list[str]:
    """The attention benchmark's rows (benchmarks/attention_kernels.py): each kernel on each shape
    class of the step it recorded, its class's largest call; the table's kernel marked."""
    lines = [
        "| kernel | queries | keys | status | forward TFLOP/s | fwd+bwd TFLOP/s | build s | error / allowed | reason |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        chosen = " (table)" if r.get("chosen") == "True" else ""
        lines.append(
            f"| {r['kernel']}{chosen} | {r['queries']} | {r['keys']} | {r['status']} "
            f"| {_cell(r.get('forward_tflops'), '.0f')} | {_cell(r.get('train_tflops'), '.0f')} "
            f"| {_cell(r.get('build_s'), '.2f')} | {_cell(r.get('error_ratio'), '.2f')} | {first_line(r.get('reason'), 100)} |"
        )
    return lines


def copy_rate_lines(rows: list[dict], assumed_bytes_s: float) -> list[str]:
    """Each direction's measured rate (measure/copy_rate.py) beside the planner's assumed one."""
    lines = [
        "| direction | host buffer | MiB per copy | GB/s (median) | s (min - max) | measured / assumed |",
        "|---|---|---:|---:|---|---:|",
    ]
    for r in rows:
        rate = float(r["gb_per_s"])
        lines.append(
            f"| {r['direction']} | {r.get('host_buffer') or '-'} | {int(r['num_bytes']) / 2**20:.0f} | {rate:.1f} "
            f"| {float(r['seconds_min']):.4f} - {float(r['seconds_max']):.4f} | {rate * 1e9 / assumed_bytes_s:.2f} |"
        )
    lines += [
        "",
        f"The planner assumes {assumed_bytes_s / 1e9:g} GB/s for both directions together "
        "(simulate/timing.py `host_copy_bytes_s`); GB = 10^9 B. The stores copy from cudaHostRegister'd "
        "buffers (core/host_pool.py).",
    ]
    return lines


def pytest_counts(log_text: str) -> dict[str, int]:
    """PASSED / FAILED / SKIPPED / ERROR counts from `pytest -v` lines (read even when a timeout
    killed pytest before its own summary)."""
    counts: dict[str, int] = {}
    for word in re.findall(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", log_text):
        counts[word] = counts.get(word, 0) + 1
    return counts


@dataclass
class TestReport:
    """What tests/conftest.py recorded of one pytest run, read back even when the run was killed."""

    collected: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    results: dict[str, dict] = field(default_factory=dict)  # test id -> its worst result record

    @property
    def running(self) -> str | None:
        """The test that had started but not finished: the one in flight when the run was cut."""
        unfinished = [t for t in self.started if t not in self.results]
        return unfinished[-1] if unfinished else None

    @property
    def not_reached(self) -> list[str]:
        return [t for t in self.collected if t not in self.started]

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for record in self.results.values():
            word = "ERROR" if record["when"] != "call" and record["outcome"] == "failed" else record["outcome"].upper()
            counts[word] = counts.get(word, 0) + 1
        return counts

    def failed(self) -> list[dict]:
        return [r for r in self.results.values() if r["outcome"] == "failed"]

    def skipped(self) -> list[dict]:
        return [r for r in self.results.values() if r["outcome"] == "skipped"]


_WORSE = {"passed": 0, "skipped": 1, "failed": 2}


def read_test_report(text: str) -> TestReport:
    """The JSON lines tests/conftest.py wrote (TEST_REPORT_ENV); a torn last line is skipped. A test
    keeps its worst result (a pass in the call, then a failing teardown, is a failure)."""
    report = TestReport()
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "collected":
            report.collected = list(record["tests"])
        elif record.get("event") == "start":
            report.started.append(record["test"])
        elif record.get("event") == "result":
            old = report.results.get(record["test"])
            if old is None or _WORSE[record["outcome"]] > _WORSE[old["outcome"]]:
                report.results[record["test"]] = record
    return report


def message_excerpt(message: str, max_lines: int = MESSAGE_LINES) -> list[str]:
    """The first lines of a failure's message: pytest's `E` lines (what was asserted and how it
    failed), else the message's last lines (the end of a traceback)."""
    lines = [line.rstrip() for line in message.splitlines() if line.strip()]
    errors = [re.sub(r"^E {0,3}", "", line) for line in lines if line.startswith("E ")]
    return errors[:max_lines] if errors else lines[-max_lines:]


def step_output_tail(log_text: str, name: str, max_lines: int = MESSAGE_LINES) -> list[str]:
    """The last lines a step wrote to the selftest log (its last run there): why it failed, or
    where it was when its time limit cut it."""
    start = log_text.rfind(f"===== {name}: python ")
    if start < 0:
        return []
    section = log_text[start:].split("\n", 1)[-1]
    # its end line; a killed step's last output may lack a newline, so the marker can end a line
    section = section.split(f"===== {name}: ", 1)[0]
    return [line.rstrip() for line in section.splitlines() if line.strip()][-max_lines:]


def _test_lines(report: TestReport) -> list[str]:
    lines = []
    if report.running:
        lines += ["", f"Cut while running: `{report.running}`."]
    if report.not_reached:
        lines += ["", f"Not reached: {len(report.not_reached)} ({', '.join(f'`{t}`' for t in report.not_reached)})."]
    for record in report.failed():
        where = "" if record["when"] == "call" else f", in {record['when']}"
        lines += ["", f"Failed: `{record['test']}` ({record['seconds']:.0f} s{where}):", "", "```"]
        lines += message_excerpt(record["message"]) or ["(no message)"]
        lines += ["```"]
    skipped = [f"`{r['test']}` ({first_line(r.get('message'), 150) or 'no reason'})" for r in report.skipped()]
    if skipped:
        lines += ["", f"Skipped: {'; '.join(skipped)}."]
    return lines


@dataclass(frozen=True)
class SummaryInputs:
    """What the summary reads besides the step outcomes. measured, simulated: rows of runs.csv and
    estimates.csv; points: the keys of the estimate table; benchmark, copy_rates: the CSVs' rows
    (None: not a GPU run, or not written); rates: the line saying what the run steps were priced at."""

    measured: list[dict]
    simulated: list[dict]
    points: list[Key]
    log_text: str = ""
    tests_report: str | None = None
    benchmark: list[dict] | None = None
    copy_rates: list[dict] | None = None
    assumed_copy_bytes_s: float = 64e9
    rates: str = ""


def _steps_lines(steps: list[tuple], rates: str) -> list[str]:
    lines = ["## Steps", "", "| step | result | wall s | predicted s | CPU s |", "|---|---|---:|---:|---:|"]
    lines += [
        f"| {name} | {status} | {seconds:.0f} | {'-' if not predicted else f'{predicted:.0f}'} "
        f"| {'-' if cpu is None else f'{cpu:.0f}'} |"
        for name, status, seconds, cpu, predicted in steps
    ]
    if any(predicted for *_, predicted in steps):
        lines += [
            "",
            "predicted s: a prediction, the step's wall time in this device's earlier selftest.log, else its "
            "price, the sum of the work it counts (runner/selftest_prices.py; `sbp selftest --dry-run` "
            "lists it)." + (f" Rates: {rates}." if rates else ""),
        ]
    return lines


def summary_markdown(
    *, title: str, provenance: str, steps: list[tuple], inputs: SummaryInputs, key: Callable, gpu: bool
) -> str:
    """steps: (name, status, wall seconds, CPU seconds or None, predicted wall seconds or None), a
    failed one shown with its last lines in the log; key(row): a row's point key (inputs.points')."""
    lines = [f"# {title}", "", provenance, "", *_steps_lines(steps, inputs.rates)]
    report = read_test_report(inputs.tests_report) if inputs.tests_report is not None else None
    counts = report.counts() if report is not None and (report.collected or report.results) else None
    if gpu:
        counts = counts if counts is not None else pytest_counts(inputs.log_text)
        counted = ", ".join(f"{n} {word.lower()}" for word, n in sorted(counts.items())) or "no test result lines"
        lines += ["", f"gpu-marked tests: {counted} (details in selftest.log)."]
        if report is not None:
            lines += _test_lines(report)
    for name, status, *_ in steps:
        if status not in ("ok", NOT_RUN):
            tail = step_output_tail(inputs.log_text, name) or ["(no output)"]
            lines += ["", f"`{name}`: {status}; its last lines in selftest.log:", "", "```", *tail, "```"]
    if inputs.measured:
        lines += [
            "",
            "## Measured points",
            "",
            "GiB = 2^30 B; peak: max allocated.",
            "",
            *points_table(inputs.measured),
        ]
        ranked = rank_peak_lines(inputs.measured)
        lines += ["", *ranked] if ranked else []
    phases = phases_table(inputs.measured)
    if phases:
        lines += ["", "## Where StreamBP's step time went (s)", "", *phases]
    lines += [
        "",
        "## Peak memory: measured vs `sbp estimate`",
        "",
        "Peak = max allocated (GiB = 2^30 B), steady protocol; error = (estimate - measured) / measured.",
        "",
        *estimate_table(estimate_errors(inputs.measured, inputs.simulated, inputs.points, key)),
    ]
    if gpu:
        lines += ["", "## Attention kernels", ""]
        lines += benchmark_table(inputs.benchmark) if inputs.benchmark else ["Not measured (see Steps)."]
        lines += ["", "## Host copies", ""]
        lines += (
            copy_rate_lines(inputs.copy_rates, inputs.assumed_copy_bytes_s)
            if inputs.copy_rates
            else ["Not measured (see Steps)."]
        )
    return "\n".join(lines) + "\n"
