"""--budget (runner/budget.py): a sweep or a max-length search stops cleanly before a wall-clock
limit, keeps every finished point, drops the one it cut, and the same command resumes. A fake
clock and fake measurements stand in for time and points."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import sbpbench.runner.budget as budget_module
import sbpbench.runner.isolated as isolated_module
from sbpbench.cli import app
from sbpbench.config import RunSpec
from sbpbench.config.experiment import load_experiment
from sbpbench.measure.environment import capture_environment
from sbpbench.measure.units import parse_seconds
from sbpbench.records import ResultRow, read_rows
from sbpbench.runner.budget import Budget, BudgetSpent, NotStarted, within
from sbpbench.runner.maxlen import find_max_len
from sbpbench.runner.sweep import plan, run_sweep
from sbpbench.workload.rows import spec_fields

from .test_maxlen import _search

runner = CliRunner()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _timed(clock: Clock, cost_s: dict[int, float], calls: list):
    """A measurement taking cost_s[T] seconds of the fake clock; past the spec's timeout it is cut
    there and gives a timeout row, as run_isolated does."""

    def measure(spec, env) -> ResultRow:
        calls.append((spec.seq_len, spec.timeout_s))
        row = ResultRow(**spec_fields(spec))
        row.device_name = env.device_name
        cost = cost_s[spec.seq_len]
        if spec.timeout_s is not None and cost > spec.timeout_s:
            clock.now += spec.timeout_s
            row.status, row.timeout_s = "timeout", spec.timeout_s
        else:
            clock.now += cost
            row.status, row.timeout_s = "ok", spec.timeout_s
        return row

    return measure


def _specs() -> list[RunSpec]:
    return [RunSpec(model="tiny/qwen3", method="bp", seq_len=t, timeout_s=100) for t in (64, 128, 256, 512)]


def _experiment(tmp_path: Path):
    path = tmp_path / "exp.toml"
    path.write_text(
        'name = "exp"\n[defaults]\nmodel = "tiny/qwen3"\ndevice = "cpu"\nmethod = "bp"\ntimeout_s = 100\n'
        "[[points]]\nseq_len = [64, 128, 256, 512]\n"
    )
    return path


@pytest.mark.parametrize(
    ("text", "seconds"), [("540", 540.0), ("9m", 540.0), ("9min", 540.0), ("90s", 90.0), ("1.5h", 5400.0)]
)
def test_a_duration_reads_in_seconds(text, seconds):
    assert parse_seconds(text) == seconds


@pytest.mark.parametrize("text", ["nine", "9 days", "0", "-5m", ""])
def test_a_bad_duration_says_what_to_write(text):
    with pytest.raises(ValueError, match="write e.g. 9m, 540s"):
        parse_seconds(text)


def test_a_point_runs_under_its_own_timeout_while_the_budget_holds_it_and_under_what_is_left_after():
    """Left >= the point's timeout: the spec as given. Less: its timeout is cut to what is left, and a
    point that finishes in it is kept. Under MIN_START_S left: not started."""
    clock, calls = Clock(), []
    budget = Budget(250, clock=clock)
    measure = within(_timed(clock, {64: 80, 128: 80, 256: 80, 512: 80}, calls), budget)
    env, specs = capture_environment("cpu"), _specs()
    assert measure(specs[0], env).status == "ok" and calls[-1] == (64, 100)  # 250 left
    assert measure(specs[1], env).status == "ok" and calls[-1] == (128, 100)  # 170 left
    row = measure(specs[2], env)  # 90 left: cut to 90, finishes in 80
    assert calls[-1] == (256, 90) and row.status == "ok" and row.timeout_s == 90
    with pytest.raises(BudgetSpent, match="not started"):  # 10 left
        measure(specs[3], env)
    assert len(calls) == 3


def test_a_timeout_under_the_points_own_limit_is_a_row_but_one_the_budget_cut_is_not():
    clock, calls, env = Clock(), [], capture_environment("cpu")
    specs = _specs()
    roomy = within(_timed(clock, {64: 150}, calls), Budget(1000, clock=clock))
    assert roomy(specs[0], env).status == "timeout"  # its own 100 s: a result, as without a budget
    tight = within(_timed(clock, {128: 150}, calls), Budget(60, clock=clock))
    with pytest.raises(BudgetSpent, match="cut after 60 s"):
        tight(specs[1], env)


def test_a_sweep_stopped_by_the_budget_keeps_what_finished_and_resumes_with_the_rest(tmp_path):
    experiment = load_experiment(_experiment(tmp_path))
    out, env, clock, calls = tmp_path / "exp.csv", capture_environment("cpu"), Clock(), []
    costs = {64: 80, 128: 80, 256: 95, 512: 10}  # 256 needs 95 s of its 100: cut at the 90 left, not kept
    jobs = plan(experiment.points, out, device_name=env.device_name)
    with pytest.raises(BudgetSpent, match="cut after 90 s"):
        run_sweep(jobs, out, measure=within(_timed(clock, costs, calls), Budget(250, clock=clock)), env=env)
    assert sorted(int(r["seq_len"]) for r in read_rows(out)) == [64, 128]
    assert [t for t, _ in calls] == [64, 128, 256]

    resumed = plan(experiment.points, out, device_name=env.device_name)
    assert [j.spec.seq_len for j in resumed if not j.done] == [256, 512]
    again: list = []
    run_sweep(resumed, out, measure=within(_timed(clock, costs, again), Budget(1000, clock=clock)), env=env)
    assert [t for t, _ in again] == [256, 512]  # the cut was no timeout: 512 is not skipped as certain to time out
    assert {int(r["seq_len"]): r["status"] for r in read_rows(out)} == {64: "ok", 128: "ok", 256: "ok", 512: "ok"}


def test_a_search_stopped_by_the_budget_resumes_from_its_probes(tmp_path):
    out, env, clock = tmp_path / "maxlen.csv", capture_environment("cpu"), Clock()

    def probes(calls: list):
        def measure(spec, env) -> ResultRow:
            calls.append(spec.seq_len)
            clock.now += 100
            row = ResultRow(**spec_fields(spec))
            row.device_name, row.status = env.device_name, "ok" if spec.seq_len <= 3000 else "oom"
            row.peak_allocated_bytes = 1000 * spec.seq_len
            return row

        return measure

    first: list[int] = []
    with pytest.raises(BudgetSpent):
        find_max_len(_search(), out, measure=within(probes(first), Budget(350, clock=clock)), env=env)
    assert len(first) == 4 and not [r for r in read_rows(out) if r["kind"] == "maxlen"]
    rest: list[int] = []
    answer = find_max_len(_search(), out, measure=probes(rest), env=env)
    assert answer.max_seq_len == 2992 and not set(rest) & set(first)  # no probe of the first pass again


@pytest.fixture
def fake_points(monkeypatch):
    """`sbp sweep` and `sbp maxlen` with fake points, each 80 s of a fake clock."""
    clock = Clock()

    class FakeClockBudget(Budget):
        def __init__(self, seconds):
            super().__init__(seconds, clock=clock)

    def measure(spec, env) -> ResultRow:
        cut = spec.timeout_s is not None and spec.timeout_s < 80
        clock.now += spec.timeout_s if cut else 80
        row = ResultRow(**spec_fields(spec))
        row.device_name, row.status = env.device_name, "timeout" if cut else ("ok" if spec.seq_len <= 300 else "oom")
        row.timeout_s = spec.timeout_s
        return row

    monkeypatch.setattr(budget_module, "Budget", FakeClockBudget)
    monkeypatch.setattr(isolated_module, "run_isolated", measure)
    return clock


def test_sweep_budget_prints_what_ran_says_how_to_resume_and_exits_3(tmp_path, fake_points):
    out = tmp_path / "exp.csv"
    result = runner.invoke(app, ["sweep", str(_experiment(tmp_path)), "--out", str(out), "--budget", "3m"])
    assert result.exit_code == 3, result.output
    assert "--budget 3m spent at tiny/qwen3, bp, T=256" in result.output
    assert "2 of 4 point(s) left" in result.output and "run the same command to resume" in result.output
    assert "2 row(s) written to" in result.output
    assert len(read_rows(out)) == 2
    again = runner.invoke(app, ["sweep", str(_experiment(tmp_path)), "--out", str(out), "--budget", "1h"])
    assert again.exit_code == 0, again.output
    assert "2 already in" in again.output and len(read_rows(out)) == 4


def test_maxlen_budget_exits_3_and_the_same_command_finishes_the_search(tmp_path, fake_points):
    out = tmp_path / "maxlen.csv"
    # blind: a seed's budget is tests/unit/test_seeded_search.py's
    args = ["maxlen", "--device", "cpu", "--model", "tiny/qwen3", "--method", "bp", "--seq", "64", "--no-seed"]
    args += ["--out", str(out)]
    result = runner.invoke(app, [*args, "--budget", "200s"])
    assert result.exit_code == 3, result.output
    assert "bp's search" in result.output and "1 of 1 search(es) left" in result.output
    probes = len(read_rows(out))
    assert probes == 2  # 64 and 128 in 160 s; 40 s left: 256 cut, not kept
    again = runner.invoke(app, [*args, "--budget", "1h"])
    assert again.exit_code == 0, again.output
    answer = [r for r in read_rows(out) if r["kind"] == "maxlen"]
    assert len(answer) == 1 and 256 <= int(answer[0]["max_seq_len"]) <= 300


def test_sweep_and_maxlen_count_the_rows_they_wrote_probes_included(tmp_path, fake_points):
    """The closing line's count is what went into --out: a sweep's points and its search's answer,
    and each search's probes, said apart (the probes are rows too)."""
    path = tmp_path / "exp.toml"
    path.write_text(
        'name = "exp"\n[defaults]\nmodel = "tiny/qwen3"\ndevice = "cpu"\nmethod = "bp"\ntimeout_s = 100\n'
        '[[points]]\nseq_len = [64, 96]\n[[points]]\nkind = "maxlen"\nseq_len = 100\nseed_from_estimate = false\n'
    )
    out = tmp_path / "exp.csv"
    result = runner.invoke(app, ["sweep", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = read_rows(out)
    probes = sum(r["kind"] == "point" for r in rows) - 2
    assert (
        probes > 0
        and f"{len(rows)} row(s) written to {out}: 3 point(s) and answer(s), {probes} probe(s)"
        in " ".join(result.output.split())
    )
    out = tmp_path / "maxlen.csv"
    args = ["maxlen", "--device", "cpu", "--model", "tiny/qwen3", "--method", "bp", "--seq", "64", "--no-seed"]
    result = runner.invoke(app, [*args, "--out", str(out)])
    rows = read_rows(out)
    assert f"{len(rows)} row(s) written to {out}: 1 max-length answer(s), {len(rows) - 1} probe(s)" in " ".join(
        result.output.split()
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sweep", "experiments/smoke_cpu.toml", "--budget", "soon"], "cannot read the duration 'soon'"),
        (["maxlen", "--simulate", "--budget", "9m"], "--budget stops measured probes"),
        (["selftest", "--budget", "10s"], "--budget 10s is under 30 s"),
    ],
)
def test_a_bad_budget_is_one_line_that_says_what_to_do(args, message, tmp_path):
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_point_predicted_past_what_is_left_is_not_started():
    """With a cost model, a point predicted to need more than is left raises NotStarted before it
    runs; one predicted to fit runs; an unknown prediction (NaN) starts as without a model."""
    clock, calls, env = Clock(), [], capture_environment("cpu")
    predicted = {64: 100.0, 128: 500.0, 256: float("nan")}
    measure = within(
        _timed(clock, {64: 80, 128: 80, 256: 80}, calls), Budget(300, clock=clock), cost=lambda s: predicted[s.seq_len]
    )
    specs = _specs()
    assert measure(specs[0], env).status == "ok"  # 100 of 300
    with pytest.raises(NotStarted, match="predicted to need 500 s, 220 s left"):
        measure(specs[1], env)
    assert measure(specs[2], env).status == "ok"
    assert [t for t, _ in calls] == [64, 256]


class Lines:
    def __init__(self):
        self.lines: list[str] = []

    def start(self, text: str) -> None:
        pass

    def note(self, line: str) -> None:
        self.lines.append(line)

    def advance(self, text: str) -> None:
        self.lines.append(text)


def test_a_sweep_puts_off_a_point_predicted_past_the_budget_and_runs_the_ones_that_fit(tmp_path, fake_points):
    """Points of 80 s each under 300 s, the cost model predicting T=256 at 400 s: 64, 128 and 512 run,
    256 is not started (no row), the command exits 3 saying so, and the next one runs 256."""
    from sbpbench.cli.outcomes import BUDGET_SPENT, exit_code
    from sbpbench.runner.experiment import plan_experiment, run_experiment

    experiment, out, steps = load_experiment(_experiment(tmp_path)), tmp_path / "exp.csv", Lines()
    predicted = {64: 80.0, 128: 80.0, 256: 400.0, 512: 80.0}
    sweep = plan_experiment(experiment, out, resume=True)
    outcome = run_experiment(sweep, steps=steps, budget_s=300, budget="5m", cost=lambda spec: predicted[spec.seq_len])
    assert sorted(int(r["seq_len"]) for r in read_rows(out)) == [64, 128, 512]
    assert exit_code(outcome) == BUDGET_SPENT and "1 of 4 point(s) not started" in outcome.stopped
    assert "run the same command to resume" in outcome.stopped
    assert any("T=256" in line and "not started (predicted to need 400 s, 140 s left)" in line for line in steps.lines)
    resumed = plan_experiment(experiment, out, resume=True)
    assert [job.spec.seq_len for job in resumed.todo] == [256]
    assert run_experiment(resumed, steps=steps, budget_s=1000, cost=lambda spec: 400.0).stopped == ""
    assert len(read_rows(out)) == 4
