"""The selftest's Markdown summary: what ran, each failed test with its message, measured vs
estimated peaks, the long point, and where a long step's time goes. Pure functions of the
selftest's outcomes, rows, log and test report, so every GPU-only line of it is tested on a CPU
with stand-in rows."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..measure.flops import phase_flops_markdown
from ..measure.progress import PROGRESS_PREFIX
from ..measure.units import GIB

# measured on one H100, the estimator was within about 1% of the measured peaks
GOOD_ESTIMATE = 0.05
# tests/conftest.py writes one JSON line per test event to the file this variable names
TEST_REPORT_ENV = "SBP_TEST_REPORT"
MESSAGE_LINES = 8  # of a failed test's message, or a failed step's output, in the summary
NOT_RUN = "not run (budget)"  # a step the budget left no time for: not a failure


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

    @property
    def label(self) -> str:
        return f"{self.method} ({self.checkpoints})" if self.checkpoints else self.method

    @property
    def error(self) -> float | None:
        """(estimate - measured) / measured of the peak allocated bytes; None unless both exist."""
        if not self.measured_bytes or self.estimated_bytes is None or self.measured_status != "ok":
            return None
        return (self.estimated_bytes - self.measured_bytes) / self.measured_bytes


def _int(value) -> int | None:
    return None if value in (None, "") else int(float(value))


Point = tuple  # (model, seq_len, method) or (model, seq_len, method, checkpoints placement)


def _point(row: dict) -> tuple[str, int, str, str]:
    placement = row.get("checkpoints") or ""
    return row["model"], int(row["seq_len"]), row["method"], "" if placement == "gpu" else placement


def estimate_errors(measured: list[dict], simulated: list[dict], points: list[Point]) -> list[PointError]:
    """One PointError per (model, seq_len, method[, placement]) in `points`, from measured rows
    (sbp run) and simulated ones (sbp estimate): the last row of each point wins, as in an upserted
    CSV. A placement left out (or gpu) is StreamBP's default."""
    ours = {_point(r): r for r in measured if r.get("kind", "point") == "point" and r.get("seq_len")}
    theirs = {_point(r): r for r in simulated if r.get("seq_len")}
    errors = []
    for point in points:
        model, seq_len, method, placement = (*point, "")[:4]
        key = (model, seq_len, method, "" if placement == "gpu" else placement)
        m, s = ours.get(key, {}), theirs.get(key, {})
        errors.append(
            PointError(
                model,
                seq_len,
                method,
                checkpoints=key[3],
                chunk_size=m.get("chunk_size") or s.get("chunk_size") or "",
                measured_status=m.get("status", "missing"),
                measured_bytes=_int(m.get("peak_allocated_bytes")),
                estimated_status=s.get("status", "missing"),
                estimated_bytes=_int(s.get("peak_allocated_bytes")),
            )
        )
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


_PROGRESS_LINE = re.compile(re.escape(PROGRESS_PREFIX) + r" (?P<label>.*?): (?P<what>.*), (?P<seconds>[0-9.]+) s$")


def progress_seconds(log_text: str, label: str) -> float | None:
    """The elapsed time of the last progress line of `label` in a log: a long step's duration
    when it ran to its last layer (measure/progress.py prints from the 5th second on)."""
    seconds = None
    for line in log_text.splitlines():
        match = _PROGRESS_LINE.match(line.strip())
        if match and match["label"] == label:
            seconds = float(match["seconds"])
    return seconds


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
    start = log_text.rfind(f"===== {name}: python -m ")
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
    return lines


def summary_markdown(
    *,
    title: str,
    provenance: str,
    steps: list[tuple],
    errors: list[PointError],
    pytest: dict[str, int] | None,
    long_point: str | None,
    flops: tuple | None,
    tests: TestReport | None = None,
    log_text: str = "",
) -> str:
    """steps: (name, status, wall seconds, CPU seconds or None, predicted wall seconds or None), a
    failed one shown with its last lines in log_text (the selftest log); pytest: counts from `pytest -v`
    lines, used where `tests` (the per-test report) is None; flops: (config, model, method,
    seq_len, tflops_per_s, a line saying where that rate comes from) of the breakdown, or None."""
    lines = [
        f"# {title}",
        "",
        provenance,
        "",
        "## Steps",
        "",
        "| step | result | wall s | predicted s | CPU s |",
        "|---|---|---:|---:|---:|",
    ]
    lines += [
        f"| {name} | {status} | {seconds:.0f} | {'-' if not predicted else f'{predicted:.0f}'} "
        f"| {'-' if cpu is None else f'{cpu:.0f}'} |"
        for name, status, seconds, cpu, predicted in steps
    ]
    if any(predicted for *_, predicted in steps):
        lines += [
            "",
            "predicted s: the plan's expectation, a prediction: this device's wall time in an earlier "
            "selftest.log, else one H100's; the long point's from its FLOPs at the default run's speed.",
        ]
    counts = tests.counts() if tests is not None and (tests.collected or tests.results) else pytest
    if counts is not None:
        counted = ", ".join(f"{n} {word.lower()}" for word, n in sorted(counts.items())) or "no test result lines"
        lines += ["", f"gpu-marked tests: {counted} (details in selftest.log)."]
        if tests is not None:
            lines += _test_lines(tests)
    for name, status, *_ in steps:
        if status not in ("ok", NOT_RUN) and log_text:
            tail = step_output_tail(log_text, name) or ["(no output)"]
            lines += ["", f"`{name}`: {status}; its last lines in selftest.log:", "", "```", *tail, "```"]
    lines += [
        "",
        "## Peak memory: measured vs `sbp estimate`",
        "",
        "Peak = max allocated (GiB = 2^30 B), steady protocol; error = (estimate - measured) / measured.",
        "",
        *estimate_table(errors),
    ]
    if long_point:
        lines += ["", "## The long point", "", long_point]
    if flops is not None:
        config, model, method, seq_len, rate, note = flops
        lines += [
            "",
            "## Where a long step's time goes",
            "",
            phase_flops_markdown(config, model=model, method=method, batch_size=1, seq_len=seq_len, tflops_per_s=rate),
            "",
            note,
        ]
    return "\n".join(lines) + "\n"
