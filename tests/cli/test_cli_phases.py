"""Phase times in rows and on screen: a streambp point's row holds the phases of its median timed
step (runner/point.py), other methods' rows none; `sbp run --phases` prints a table per streambp row
with each phase's share, FLOPs and achieved TFLOP/s (cli/phase_table.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import sbpbench.runner as runner_package
from sbpbench.cli import app
from sbpbench.cli.phase_table import PHASE_NAMES, phase_table
from sbpbench.config import RunSpec
from sbpbench.core.phases import PHASES, PhaseTimes
from sbpbench.measure.flops import phase_flops
from sbpbench.measure.timing import TimingStats
from sbpbench.methods import MethodSettings
from sbpbench.models import load_config
from sbpbench.records import ResultRow, upsert_rows
from sbpbench.records.schema import PHASE_COLUMNS, phase_column
from sbpbench.runner.point import measure_point, record_phases
from sbpbench.workload.rows import spec_fields

runner = CliRunner()


def test_the_table_names_the_cores_phases():
    """The CLI's copy of the phase names (its help loads no torch) is core/phases.py's, and each has a column."""
    assert PHASE_NAMES == PHASES
    assert {phase_column(name) for name in (*PHASES, "other")} == set(PHASE_COLUMNS)


def test_a_streambp_point_records_the_phases_of_one_timed_step():
    """A CPU streambp point (recompute:2, 3 layers): every phase it ran has seconds, the rest too,
    and together they are one timed step (within its time, most of it)."""
    settings = MethodSettings(chunk_size=16, logits_chunk_size=32, checkpoints="recompute:2")
    spec = RunSpec(
        method="streambp", model="tiny/qwen3", seq_len=64, warmup=0, repeats=3, num_layers=3, settings=settings
    )
    row = measure_point(spec)
    assert row.status == "ok", row.error
    seconds = {name: getattr(row, phase_column(name)) for name in PHASES}
    assert all(seconds[name] > 0 for name in PHASES if name not in ("host copies", "copy waits"))
    assert seconds["host copies"] == seconds["copy waits"] == 0.0
    step = sum(seconds.values()) + row.phase_other_s
    assert 0.5 * row.time_min_s < step <= row.time_max_s


def test_a_bp_point_records_no_phases():
    """Only streambp times its phases: a bp row leaves every phase column empty."""
    bp = measure_point(RunSpec(method="bp", model="tiny/qwen3", seq_len=64, warmup=0, repeats=1))
    assert bp.status == "ok", bp.error
    assert all(getattr(bp, column) is None for column in PHASE_COLUMNS)


class _Timer:
    def __init__(self, step_s: float):
        self.resolved = 0
        self.times = PhaseTimes(dict.fromkeys(PHASES, step_s / 10), step_s, step_s / 5)

    def resolve(self) -> PhaseTimes:
        self.resolved += 1
        return self.times


@pytest.mark.parametrize(("times", "chosen"), [((3.0, 1.0, 2.0), 2), ((4.0, 1.0, 3.0, 2.0), 3), ((5.0,), 0)])
def test_the_row_takes_the_median_steps_phases_and_reads_no_other(times, chosen):
    """The step whose time is the median (the lower middle of an even count) gives the columns; the
    other timers are never resolved (each resolve synchronises the device). time_median_s is that
    step's time too: one rule for both, never the mean of two steps."""
    timers = [_Timer(t) for t in times]
    row = ResultRow()
    timing = TimingStats(times)
    record_phases(row, timing, timers)
    assert [t.resolved for t in timers] == [int(i == chosen) for i in range(len(times))]
    assert row.phase_head_s == times[chosen] / 10 and row.phase_other_s == times[chosen] / 5
    assert timing.median_s == times[chosen]


def _phased_row(device: str, **values) -> ResultRow:
    settings = MethodSettings(chunk_size=3000, logits_chunk_size=1024, checkpoints="gpu")
    spec = RunSpec(method="streambp", model="Qwen/Qwen3-4B", seq_len=9000, settings=settings)
    row = ResultRow(**spec_fields(spec) | {"device": device}, status="ok", device_name="a GPU")
    row.time_median_s = row.time_min_s = row.time_max_s = 2.0
    for name in PHASES:
        setattr(row, phase_column(name), 0.0)
    computed = {"checkpoint pass": 0.3, "head": 0.1, "K/V capture": 0.05, "chunk forward": 0.3, "chunk backward": 0.7}
    values = computed | values
    for name, seconds in values.items():
        setattr(row, phase_column(name), seconds)
    row.phase_other_s = 0.05
    return row


def test_the_phase_table_shows_shares_flops_and_rates(monkeypatch):
    """Seconds, share of the step (host copies beside it on a GPU), TFLOP executed and TFLOP/s per
    phase, from measure/flops.py's model of the point."""
    row = _phased_row("cuda", **{"host copies": 0.4, "copy waits": 0.05})
    table = phase_table(row)
    cells = {column.header: list(column.cells) for column in table.columns}
    names = cells["phase"]
    assert names == ["checkpoint pass", "head", "K/V capture", "chunk forward", "chunk backward", "host copies",
                     "copy waits", "other", "step"]  # fmt: skip
    assert cells["s"][names.index("step")] == "1.550"  # the compute stream's phases and the rest
    assert cells["share"][names.index("host copies")] == "beside"
    assert cells["share"][names.index("chunk backward")] == f"{0.7 / 1.55:.0%}"
    flops = phase_flops(load_config("Qwen/Qwen3-4B"), method="streambp", batch_size=1, seq_len=9000)
    backward = sum(flops["chunk backward"])
    assert cells["TFLOP"][names.index("chunk backward")] == f"{backward / 1e12:.3g}"
    assert cells["TFLOP/s"][names.index("chunk backward")] == f"{backward / 0.7 / 1e12:.3g}"
    assert cells["TFLOP/s"][names.index("copy waits")] == "-"
    on_cpu = phase_table(_phased_row("cpu", **{"host copies": 0.4}))
    steps = dict(zip(*(list(c.cells) for c in on_cpu.columns[:2])))
    assert steps["step"] == "1.900"  # a CPU's copies are inside the step


def test_sbp_run_phases_prints_a_table_per_streambp_row(tmp_path, monkeypatch):
    """`--phases`: a table for each streambp row with phase times; none for the others; a line when
    no row has them."""

    def run_points(specs, out):
        for spec in specs:
            row = _phased_row("cpu") if spec.method == "streambp" else ResultRow(**spec_fields(spec), status="ok")
            row.device_name = "a CPU"
            upsert_rows(out, [row])
            yield row

    monkeypatch.setattr(runner_package, "run_points", run_points)
    args = ["run", "--model", "tiny/qwen3", "--seq", "16", "--device", "cpu", "--out", str(tmp_path / "r.csv")]
    result = runner.invoke(app, [*args, "--method", "bp", "streambp", "--phases"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert result.output.count("Where the time went") == 1 and "chunk backward" in result.output
    result = runner.invoke(app, [*args, "--method", "bp", "--phases"])
    assert "no phase times" in result.output and "Where the time went" not in result.output
