"""`sbp sweep`: planning and certain-OOM skips with fake measurements, then the CPU smoke
experiment end to end, killed with SIGKILL mid-sweep and resumed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.config.experiment import load_experiment
from sbpbench.measure.environment import capture_environment
from sbpbench.records import COLUMNS, ResultRow, read_rows, row_key
from sbpbench.runner.sweep import plan, run_sweep
from sbpbench.workload.rows import spec_fields

from ..cli.test_cli_run import _sbp
from ..conftest import cli_env

SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "smoke_cpu.toml"
runner = CliRunner()


def _experiment(tmp_path, body: str):
    path = tmp_path / "exp.toml"
    path.write_text('name = "exp"\n[defaults]\nmodel = "tiny/qwen3"\ndevice = "cpu"\n' + body)
    return load_experiment(path)


def _fake(calls: list, oom_from: int):
    def measure(spec, env) -> ResultRow:
        calls.append((spec.method, spec.seq_len, spec.batch_size))
        row = ResultRow(**spec_fields(spec))
        row.device_name = env.device_name
        row.status = "oom" if spec.seq_len * spec.batch_size >= oom_from else "ok"
        return row

    return measure


def test_longer_and_larger_points_after_an_oom_are_skipped_as_certain_oom(tmp_path):
    """After an OOM, longer or larger points are skipped as certain OOM, not run; a rerun has nothing left."""
    experiment = _experiment(
        tmp_path, '[[points]]\nmethod = ["bp", "streambp"]\nseq_len = [64, 128, 256]\nbatch_size = [1, 2]\n'
    )
    out, env, calls = tmp_path / "exp.csv", capture_environment("cpu"), []
    jobs = plan(experiment.points, out, device_name=env.device_name)
    rows = run_sweep(jobs, out, measure=_fake(calls, oom_from=128), env=env)
    assert len(rows) == 12 and len(read_rows(out)) == 12
    status = {(r.method, r.seq_len, r.batch_size): r.status for r in rows}
    assert status[("bp", 128, 1)] == "oom" and status[("bp", 256, 1)] == "skipped"
    assert status[("bp", 64, 2)] == "oom" and status[("bp", 128, 2)] == "skipped"  # batch 2 at 64 is 128 tokens
    assert ("bp", 256, 1) not in calls and ("streambp", 128, 2) not in calls
    skipped = [r for r in rows if r.status == "skipped"]
    assert all("certain OOM" in r.error and r.peak_allocated_bytes is None for r in skipped)
    assert len(calls) == 12 - len(skipped)

    again: list = []
    jobs = plan(experiment.points, out, device_name=env.device_name)
    assert all(job.done for job in jobs)
    assert run_sweep(jobs, out, measure=_fake(again, oom_from=128), env=env) == [] and again == []
    redo = plan(experiment.points, out, device_name=env.device_name, resume=False)
    assert not any(job.done for job in redo)
    calls.clear()  # --no-resume: every point is measured again, its own old OOM row proves nothing
    rerun = run_sweep(redo, out, measure=_fake(calls, oom_from=128), env=env)
    assert ("bp", 128, 1) in calls and ("bp", 256, 1) not in calls  # 256: proven by the new 128 OOM
    assert {(r.method, r.seq_len, r.batch_size): r.status for r in rerun} == status


def test_errored_points_are_retried_and_duplicates_run_once(tmp_path):
    """A duplicated point is planned once, and an errored point is planned again on the next run."""
    experiment = _experiment(
        tmp_path,
        '[[points]]\nmethod = ["bp"]\nseq_len = [64, 64, 128]\n[[points]]\nmethod = ["bp"]\nseq_len = [128]\n',
    )
    out, env = tmp_path / "exp.csv", capture_environment("cpu")
    jobs = plan(experiment.points, out, device_name=env.device_name)
    assert [job.spec.seq_len for job in jobs] == [64, 128]
    calls: list = []

    def failing(spec, env):
        row = _fake(calls, oom_from=10**9)(spec, env)
        row.status = "error" if spec.seq_len == 128 else row.status
        return row

    run_sweep(jobs, out, measure=failing, env=env)
    jobs = plan(experiment.points, out, device_name=env.device_name)
    assert [job.done for job in jobs] == [True, False]


def test_a_search_stopped_at_its_ceiling_runs_again_under_a_higher_one(tmp_path):
    """A max-T answer "at least the ceiling" is done only for that ceiling: raising the ceiling in the
    file re-plans it (its probes are cached), while an answer bracketed by an OOM stays done."""
    search = '[[points]]\nkind = "maxlen"\nmethod = ["bp", "streambp"]\nseq_len = 64\nseq_len_ceiling = {}\n'
    out, env, calls = tmp_path / "exp.csv", capture_environment("cpu"), []
    low = _experiment(tmp_path, search.format(256))

    def measure(spec, env):  # bp runs out of memory from 200 tokens, streambp never
        return _fake(calls, oom_from=200 if spec.method == "bp" else 10**9)(spec, env)

    run_sweep(plan(low.points, out, device_name=env.device_name), out, measure=measure, env=env)
    answers = {r["method"]: r for r in read_rows(out) if r["kind"] == "maxlen"}
    assert answers["bp"]["oom_seq_len"] and not answers["streambp"]["oom_seq_len"]  # streambp: no OOM by 256
    assert all(job.done for job in plan(low.points, out, device_name=env.device_name))
    high = _experiment(tmp_path, search.format(1024))
    assert [job.done for job in plan(high.points, out, device_name=env.device_name)] == [True, False]
    calls.clear()
    run_sweep(plan(high.points, out, device_name=env.device_name), out, measure=measure, env=env)
    assert calls == [("streambp", 512, 1), ("streambp", 1024, 1)]  # 64..256 came from the cache


def test_a_bad_experiment_file_is_one_line_and_exit_2(tmp_path):
    """`sbp sweep` on a bad experiment file: exit 2, a one-line message naming file, table and key, no CSV."""
    path = tmp_path / "bad.toml"
    path.write_text('[[points]]\nmodel = "tiny/qwen3"\nseq_lenz = [64]\n')
    result = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "x.csv")])
    assert result.exit_code == 2
    assert "bad.toml: [[points]] #1: unknown key 'seq_lenz'" in " ".join(result.output.split())
    assert not (tmp_path / "x.csv").exists()


# experiments/smoke_cpu.toml in miniature (same model, methods and kinds of point; T and the cap
# scaled down 4x and memory only, no timed step, so the slow tier stays within CI's budget): under
# 300 MiB of tracked tensors bp fits at T=256 only, ckpt to 512, streambp to the 1024 ceiling.
MINI_SMOKE = (
    SMOKE.read_text()
    .replace('name = "smoke_cpu"', 'name = "mini_smoke"')
    .replace("warmup = 1", "warmup = 0")
    .replace("repeats = 2", "repeats = 0")
)
MINI_SMOKE = MINI_SMOKE.replace('memory_limit = "1GiB"', 'memory_limit = "300MiB"').replace(
    "chunk_size = 500", "chunk_size = 128"
)
MINI_SMOKE = MINI_SMOKE.replace("[1024, 2048, 4096]", "[256, 512, 1024]").replace("seq_len = [1024]", "seq_len = [256]")
MINI_SMOKE = MINI_SMOKE.replace("seq_len = 1024\nseq_len_ceiling = 4096", "seq_len = 256\nseq_len_ceiling = 1024")


def _sweep(experiment: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [_sbp(), "sweep", str(experiment), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=cli_env(),
    )


@pytest.mark.slow
def test_smoke_sweep_killed_mid_way_then_resumed_has_every_point_once(tmp_path):
    """The acceptance run: SIGKILL the sweep (its whole process group) once three rows are in,
    check the CSV is whole, resume, and find every point of the experiment exactly once."""
    experiment, out = tmp_path / "mini_smoke.toml", tmp_path / "smoke.csv"
    experiment.write_text(MINI_SMOKE)
    assert "1024, 2048" not in MINI_SMOKE and "300MiB" in MINI_SMOKE and "seq_len_ceiling = 1024" in MINI_SMOKE
    assert "repeats = 0" in MINI_SMOKE and "warmup = 0" in MINI_SMOKE
    started = time.monotonic()
    first = _sweep(experiment, out)
    while len(read_rows(out)) < 3:
        assert first.poll() is None, first.communicate()
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed = read_rows(out)
    assert len(killed) >= 3 and all(set(row) == set(COLUMNS) for row in killed)
    assert all(row["status"] for row in killed)

    second = _sweep(experiment, out)
    stdout, stderr = second.communicate(timeout=900)
    assert second.returncode == 0, stderr
    print(f"smoke sweep, killed and resumed: {time.monotonic() - started:.0f} s")
    assert f"{len(killed)} already in" in " ".join(stdout.split())  # none of the killed run's points rerun
    rows = read_rows(out)
    keys = [row_key(row) for row in rows]
    assert len(keys) == len(set(keys))  # no duplicate
    points = [r for r in rows if r["kind"] == "point"]
    grid = {(r["method"], r["seq_len"], r["batch_size"]) for r in points}
    for method in ("bp", "ckpt", "streambp"):
        assert {(method, t, "1") for t in ("256", "512", "1024")} <= grid
    assert {("ckpt", "256", "2"), ("streambp", "256", "2")} <= grid
    status = {(r["method"], r["seq_len"], r["batch_size"]): r["status"] for r in points}
    assert status[("bp", "512", "1")] == "oom" and status[("bp", "1024", "1")] == "skipped"
    assert status[("streambp", "1024", "1")] == "ok"
    answers = {r["method"]: r for r in rows if r["kind"] == "maxlen"}
    assert set(answers) == {"bp", "ckpt", "streambp"}
    best = {m: int(r["max_seq_len"]) for m, r in answers.items()}
    assert best["streambp"] > best["ckpt"] > best["bp"]
    assert "every point" in stdout and "max sequence length" in stdout


def test_a_failed_search_is_an_error_row_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """A probe that errors in the first search: its answer row says error with the probe's message,
    the next search and the grid point still run, the exit code is 1, and a rerun retries the search."""
    import sbpbench.runner.isolated as isolated_module

    path = tmp_path / "exp.toml"
    path.write_text(
        'name = "exp"\n[defaults]\nmodel = "tiny/qwen3"\ndevice = "cpu"\nseed_from_estimate = false\n'
        '[[points]]\nkind = "maxlen"\nmethod = ["bp", "ckpt"]\nseq_len = 64\nseq_len_ceiling = 1024\n'
        '[[points]]\nmethod = "bp"\nseq_len = 64\n'
    )
    calls: list = []

    def measure(spec, env) -> ResultRow:
        row = _fake(calls, oom_from=300)(spec, env)
        if (spec.method, spec.seq_len) == ("bp", 128):
            row.status, row.error = "error", "CUDA error: an illegal memory access"
        return row

    monkeypatch.setattr(isolated_module, "run_isolated", measure)
    out = tmp_path / "exp.csv"
    result = runner.invoke(app, ["sweep", str(path), "--out", str(out)])
    assert result.exit_code == 1, result.output
    answers = {r["method"]: r for r in read_rows(out) if r["kind"] == "maxlen"}
    assert answers["bp"]["status"] == "error" and "bp at T=128: error: CUDA error" in answers["bp"]["error"]
    assert answers["ckpt"]["status"] == "ok" and answers["ckpt"]["max_seq_len"]
    assert ("bp", 64, 1) in calls[-1:]  # the grid point ran last
    jobs = plan(load_experiment(path).points, out, device_name=capture_environment("cpu").device_name)
    assert [job.done for job in jobs] == [False, True, True]


def test_seeds_only_stores_each_seed_and_the_sweep_and_dry_run_use_them(tmp_path, monkeypatch):
    """`--seeds-only` predicts each seed for the GPU --dry-run prices (a stand-in prediction here)
    and measures nothing; --dry-run then prices no host time; a GPU's sweep (its seeds' target
    stood in as cuda, its probes measured on the CPU) predicts none and probes from each seed; a
    CPU sweep predicts its own."""
    import sbpbench.runner.isolated as isolated_module
    import sbpbench.runner.simulated_search as simulated_search

    asked: list = []

    def simulated_max_len(search, out, *, probing, **options) -> ResultRow:
        asked.append(search.method)
        row = ResultRow(**spec_fields(search.base), kind="maxlen", source="simulated")
        row.status, row.max_seq_len, row.oom_seq_len = "ok", 296, 304
        return row

    calls: list = []
    monkeypatch.setattr(simulated_search, "simulated_max_len", simulated_max_len)
    monkeypatch.setattr(isolated_module, "run_isolated", _fake(calls, oom_from=300))
    path, out = tmp_path / "exp.toml", tmp_path / "exp.csv"
    path.write_text(
        'name = "exp"\nkind = "maxlen"\n[defaults]\nmodel = "tiny/qwen3"\nmemory_limit = "1GiB"\nseq_len = 64\n'
        'resolution = "1%"\n[[points]]\nmethod = ["bp", "streambp"]\n'
    )
    seeded = runner.invoke(app, ["sweep", str(path), "--seeds-only", "--out", str(out)])
    assert seeded.exit_code == 0, seeded.output
    assert asked == ["bp", "streambp"] and calls == []
    said = " ".join(seeded.output.split())
    assert "bp: seed: predicted max T 296" in said and f"2 row(s) written to {out}" in said
    assert [(r["kind"], r["source"]) for r in read_rows(out)] == [("seed", "simulated")] * 2
    priced = runner.invoke(app, ["sweep", str(path), "--dry-run", "--out", str(out)])
    assert priced.exit_code == 0 and "│      0.0 │" in priced.output, priced.output

    searches = load_experiment(path, device="cpu", defaults_for="cuda").searches  # a GPU's searches
    lines: list[str] = []
    seed = simulated_search.estimate_seed(capacity_bytes=80 * 2**30, note=lines.append, out=out, target="cuda")
    env = capture_environment("cpu")
    run_sweep(
        plan(searches, out, device_name=env.device_name), out, measure=_fake(calls, oom_from=300), env=env, seed=seed
    )
    assert len(asked) == 2 and [t for _, t, _ in calls[:2]] == [296, 304]
    assert lines[0] == f"bp: seed: predicted max T 296 (stored in {out})"

    swept = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "cpu.csv"), "--device", "cpu"])
    assert swept.exit_code == 0 and len(asked) == 4, swept.output
    assert "2 point(s) and answer(s)" in " ".join(swept.output.split()) and "2 seed(s)" in swept.output


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--seeds-only", "--dry-run"], "give one of them"), (["--seeds-only", "--device", "cpu"], "leave out --device")],
)
def test_seeds_only_with_a_dry_run_or_a_cpu_is_one_line_and_exit_2(tmp_path, args, message):
    """--seeds-only predicts a GPU's seeds and runs nothing: with --dry-run or --device cpu it is a
    one-line error before any work, and no results file is written."""
    out = tmp_path / "x.csv"
    result = runner.invoke(app, ["sweep", "experiments/smoke_cpu.toml", *args, "--out", str(out)])
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()
