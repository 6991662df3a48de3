"""A max-length search seeded with the estimator's predicted max T (runner/length_search.py): probe
counts against fake monotone probes when the prediction is right, 10% or 50% wrong, past the
ceiling or below the shortest length; resume; the seed and probes in the answer row; the seed's
own rules (runner/simulated_search.py); and a real seeded search on the CPU (slow)."""

from __future__ import annotations

import math
import subprocess
from dataclasses import replace

import pytest
from typer.testing import CliRunner

import sbpbench.runner.simulated_search as simulated_search
from sbpbench.cli import app
from sbpbench.config import MaxlenSpec, Resolution
from sbpbench.config.experiment import load_experiment
from sbpbench.config.maxlen import MIN_SEQ_LEN
from sbpbench.measure.environment import capture_environment
from sbpbench.records import ResultRow, read_rows
from sbpbench.runner.budget import Budget, BudgetSpent
from sbpbench.runner.length_search import Probe, answered, search_max_len
from sbpbench.runner.maxlen import find_max_len, probe_record
from sbpbench.runner.sweep import plan, run_sweep
from sbpbench.workload.rows import spec_fields

from ..cli.test_cli_run import _sbp
from ..conftest import cli_env
from ..subprocess.test_maxlen import Stop, _fake_measure, _fits_up_to, _search

runner = CliRunner()
CEILING = 262_144
ANSWERS = (4736, 22_800, 143_500)  # Qwen3-8B's bp, ckpt and streambp max T on 80 GiB, about


def _blind(answer: int, resolution: Resolution):
    return search_max_len(lambda t: t <= answer, start=1024, ceiling=CEILING, resolution=resolution, multiple_of=8)


def _seeded(answer: int, resolution: Resolution, seed: int, calls: list[int] | None = None, **options):
    probe = _fits_up_to(answer, [] if calls is None else calls)
    return search_max_len(
        probe, start=1024, ceiling=CEILING, resolution=resolution, multiple_of=8, seed=seed, **options
    )


def _assert_the_true_answer(result, answer: int, resolution: Resolution, blind) -> None:
    """The bracket holds the answer, is no wider than the resolution, and agrees with the blind
    search's to the resolution."""
    width = max(8, resolution.width(result.max_ok))
    assert result.max_ok <= answer < result.min_oom
    assert result.min_oom - result.max_ok <= width
    assert abs(result.max_ok - blind.max_ok) <= width


@pytest.mark.parametrize("resolution", ["2%", "1%"])
@pytest.mark.parametrize("answer", ANSWERS)
def test_a_right_prediction_is_confirmed_by_two_probes(answer, resolution):
    """A seed whose next resolution step runs out of memory (the estimator's own answer when it is
    right) costs two probes, the seed and one step above, against the blind search's 10 or more."""
    resolution = Resolution.parse(resolution)
    blind = _blind(answer, resolution)
    assert blind.num_run >= 10
    width = resolution.width(blind.max_ok)
    for seed in (blind.max_ok, answer, answer - width // 2):  # anywhere in (answer - width, answer]
        calls: list[int] = []
        result = _seeded(answer, resolution, seed, calls)
        assert len(calls) == result.num_run == 2, (seed, calls)
        assert calls[0] == seed // 8 * 8
        _assert_the_true_answer(result, answer, resolution, blind)


@pytest.mark.parametrize("resolution", ["2%", "1%"])
@pytest.mark.parametrize("error", [0.1, -0.1, 0.5, -0.5])
@pytest.mark.parametrize("answer", ANSWERS)
def test_a_wrong_prediction_still_finds_the_true_answer(answer, error, resolution):
    """A seed 10% or 50% too long or too short gives the blind search's answer (to the resolution),
    in at most 2 + 2 log2(error / resolution) probes: fewer than the blind search at 10%, about
    as many at 50%; nothing is probed twice."""
    percent = Resolution.parse(resolution).percent
    resolution = Resolution.parse(resolution)
    blind = _blind(answer, resolution)
    calls: list[int] = []
    result = _seeded(answer, resolution, round(answer * (1 + error)), calls)
    _assert_the_true_answer(result, answer, resolution, blind)
    assert len(calls) == len(set(calls)) == result.num_run
    assert result.num_run <= 2 + 2 * math.ceil(math.log2(abs(error) * 100 / percent))
    if abs(error) == 0.1:
        assert result.num_run < blind.num_run


def test_a_seed_at_or_past_the_ceiling_probes_the_ceiling_first():
    """A prediction at or past the ceiling: one probe when the ceiling fits (the answer ">= ceiling"),
    else the ceiling's OOM and a walk down to the true answer."""
    resolution = Resolution.parse("2%")
    for seed in (CEILING, 2 * CEILING):
        calls: list[int] = []
        result = _seeded(CEILING + 1, resolution, seed, calls)
        assert calls == [CEILING] and (result.max_ok, result.min_oom) == (CEILING, None)
    calls = []
    result = _seeded(143_500, resolution, 2 * CEILING, calls)
    assert calls[0] == CEILING
    _assert_the_true_answer(result, 143_500, resolution, _blind(143_500, resolution))


def test_a_seed_below_the_shortest_length_probes_the_shortest_first():
    """A prediction that nothing fits (seed 0): one probe when that is so, else the true answer."""
    resolution = Resolution.parse("2%")
    calls: list[int] = []
    result = _seeded(1, resolution, 0, calls)
    assert calls == [MIN_SEQ_LEN] and (result.max_ok, result.min_oom) == (None, MIN_SEQ_LEN)
    calls = []
    result = _seeded(4736, resolution, 0, calls)
    assert calls[0] == MIN_SEQ_LEN
    _assert_the_true_answer(result, 4736, resolution, _blind(4736, resolution))


@pytest.mark.parametrize("stop_after", [1, 2, 4])
def test_an_interrupted_seeded_search_resumes_without_probing_anything_twice(stop_after):
    """Stopped after k probes and rerun with those answers cached: the same seed replays the same
    walk (the two runs together probe what one does); a changed seed probes nothing answered."""
    resolution, answer, seed = Resolution.parse("1%"), 143_500, 160_000
    whole: list[int] = []
    expected = _seeded(answer, resolution, seed, whole)
    first: list[int] = []
    with pytest.raises(Stop):
        search_max_len(
            _fits_up_to(answer, first, stop_after=stop_after),
            start=1024,
            ceiling=CEILING,
            resolution=resolution,
            multiple_of=8,
            seed=seed,
        )
    cached = {t: t <= answer for t in first}
    rest: list[int] = []
    resumed = _seeded(answer, resolution, seed, rest, cached=cached)
    assert (resumed.max_ok, resumed.min_oom) == (expected.max_ok, expected.min_oom)
    assert first + rest == whole
    other: list[int] = []
    moved = _seeded(answer, resolution, 120_000, other, cached=cached)
    assert not set(other) & set(first)
    _assert_the_true_answer(moved, answer, resolution, _blind(answer, resolution))


def test_cached_answers_that_answer_the_search_need_no_probe_and_no_seed():
    """A bracket within the resolution, a ceiling that fit or a shortest length that did not answer
    the search: no probe runs, and the answer uses only the bracket's two answers."""
    resolution = Resolution.parse("1%")
    closed = {143_360: True, 144_384: False, 1024: True}
    assert answered(closed, ceiling=CEILING, resolution=resolution, multiple_of=8)
    assert answered({CEILING: True}, ceiling=CEILING, resolution=resolution)
    assert answered({MIN_SEQ_LEN: False}, ceiling=CEILING, resolution=resolution)
    assert not answered({143_360: True, 147_456: False}, ceiling=CEILING, resolution=resolution, multiple_of=8)
    assert not answered({143_360: True}, ceiling=CEILING, resolution=resolution)
    result = search_max_len(
        lambda t: pytest.fail("probed"), start=1024, ceiling=CEILING, resolution=resolution, cached=closed, seed=1
    )
    assert (result.max_ok, result.min_oom) == (143_360, 144_384)
    assert result.probes == [Probe(143_360, True, False), Probe(144_384, False, False)]


def test_the_probe_record_names_each_answer_in_order_and_marks_what_did_not_run():
    """search_probes: "T:ok" or "T:oom" per answer used, "(cached)" after one no probe of this run gave."""
    probes = [Probe(61_440, True, True), Probe(62_464, False, True), Probe(60_416, True, False)]
    assert probe_record(probes) == "61440:ok 62464:oom 60416:ok(cached)"
    assert probe_record([]) == ""


def test_a_seeded_search_writes_its_seed_and_probes_and_a_rerun_asks_no_seed(tmp_path):
    """The seed is asked once, two probes answer the search, and the answer row records the seed
    and the probes; a rerun from the CSV asks neither the seed nor a probe."""
    out, env, calls, asked = tmp_path / "maxlen.csv", capture_environment("cpu"), [], []

    def seed(search: MaxlenSpec) -> int:
        asked.append(search.method)
        return 2992

    answer = find_max_len(_search(), out, measure=_fake_measure(3000, calls), env=env, seed=seed)
    assert asked == ["bp"] and calls == [2992, 3016]  # 3016: 2992 + 1%, down to a multiple of 8
    assert (answer.max_seq_len, answer.oom_seq_len, answer.num_probes) == (2992, 3016, 2)
    assert (answer.seed_seq_len, answer.search_probes) == (2992, "2992:ok 3016:oom")
    (row,) = [r for r in read_rows(out) if r["kind"] == "maxlen"]
    assert (row["seed_seq_len"], row["search_probes"]) == ("2992", "2992:ok 3016:oom")
    again: list[int] = []
    rerun = find_max_len(_search(), out, measure=_fake_measure(3000, again), env=env, seed=seed)
    assert asked == ["bp"] and again == [] and rerun.max_seq_len == 2992
    assert rerun.seed_seq_len is None and rerun.search_probes == "2992:ok(cached) 3016:oom(cached)"


def test_no_seed_keeps_the_blind_search(tmp_path):
    """seed_from_estimate false: the seed is never asked and the probes are the blind search's."""
    env, blind, seeded = capture_environment("cpu"), [], []
    find_max_len(_search(), tmp_path / "a.csv", measure=_fake_measure(3000, blind), env=env)
    answer = find_max_len(
        replace(_search(), seed_from_estimate=False),
        tmp_path / "b.csv",
        measure=_fake_measure(3000, seeded),
        env=env,
        seed=lambda search: pytest.fail("asked for a seed"),
    )
    assert seeded == blind and answer.seed_seq_len is None and len(blind) > 2


def _experiment(tmp_path, extra: str = "") -> str:
    path = tmp_path / "e.toml"
    path.write_text(
        'name = "e"\nkind = "maxlen"\n[defaults]\ndevice = "cpu"\nmodel = "tiny/qwen3"\nmemory_limit = "1GiB"\n'
        f'seq_len = 64\nresolution = "1%"\n{extra}[[points]]\nmethod = "bp"\n'
    )
    return path


def test_an_experiment_files_searches_are_seeded_unless_it_says_otherwise(tmp_path):
    """A maxlen point is seeded by default and `seed_from_estimate = false` keeps it blind; a sweep
    passes its seed to each search that is."""
    (search,) = load_experiment(_experiment(tmp_path)).searches
    assert search.seed_from_estimate
    (blind,) = load_experiment(_experiment(tmp_path, "seed_from_estimate = false\n")).searches
    assert not blind.seed_from_estimate
    out, env, calls = tmp_path / "e.csv", capture_environment("cpu"), []
    jobs = plan([search], out, device_name=env.device_name)
    (row,) = run_sweep(jobs, out, measure=_fake_measure(300, calls), env=env, seed=lambda s: 296)
    assert calls == [296, 304] and (row.max_seq_len, row.seed_seq_len) == (296, 296)


def test_sbp_maxlen_seeds_each_search_and_says_what_the_seed_cost(tmp_path, fake_seeding):
    """The seed line names the predicted max T and its cost; the prediction is of the probes' own
    point on fake CPU tensors; the answer row and the table show the seed; a peer grows blind, and
    --no-seed asks for no seed."""
    out = tmp_path / "maxlen.csv"
    args = ["maxlen", "--device", "cpu", "--model", "tiny/qwen3", "--seq", "64", "--out", str(out)]
    result = runner.invoke(app, [*args, "--method", "bp", "tiled", "--memory-limit", "1MB"])
    assert result.exit_code == 0, result.output
    assert "bp: seed: predicted max T 296 (0 s)" in result.output
    assert "tiled: no seed (the estimator runs tiled in full at each length): growing from T=64" in result.output
    (predicted,) = fake_seeding
    assert (predicted.base.device, predicted.base.memory_limit, predicted.method) == ("cpu", 10**6, "bp")
    answers = {r["method"]: r for r in read_rows(out) if r["kind"] == "maxlen"}
    assert (answers["bp"]["seed_seq_len"], answers["bp"]["search_probes"]) == ("296", "296:ok 304:oom")
    assert answers["tiled"]["seed_seq_len"] == "" and int(answers["tiled"]["num_probes"]) > 2
    split = ["--method", "streambp", "--chunk-attention", "split"]
    forced = runner.invoke(app, [*args[:-1], str(tmp_path / "f.csv"), *split])
    assert forced.exit_code == 0, forced.output
    assert "notice: --set chunk_attention is not modelled by the estimator" in forced.output
    assert "no seed for streambp" in forced.output and len(fake_seeding) == 1
    fresh = tmp_path / "blind.csv"
    blind = runner.invoke(app, [*args[:-1], str(fresh), "--method", "bp", "--no-seed"])
    assert blind.exit_code == 0 and "seed:" not in blind.output and len(fake_seeding) == 1
    legend = "seed: the predicted max T the search started from"  # the table's seed column
    assert legend in " ".join(result.output.split()) and legend not in " ".join(blind.output.split())


def test_a_seed_under_a_spent_budget_stops_the_search_cleanly(monkeypatch):
    """The seed's predicted probes start only while a measured probe could: with less than that
    left, its first one raises BudgetSpent, which stops the command as a probe's would."""

    def simulated_max_len(search, out, *, probing, **options):
        probing["measure"](search.probe(search.start), None)  # the first predicted probe
        pytest.fail("a predicted probe started with 10 s left")

    monkeypatch.setattr(simulated_search, "simulated_max_len", simulated_max_len)
    seed = simulated_search.estimate_seed(capacity_bytes=1 << 30, budget=Budget(10.0), note=print)
    with pytest.raises(BudgetSpent, match="a predicted probe of the seed not started"):
        seed(_search())


def test_a_gpu_searchs_seed_is_the_cuda_prediction_on_fake_cpu_tensors(monkeypatch):
    """A CUDA search (a stand-in: its spec's device set to cuda:0 here) is seeded by the cuda
    target's prediction on fake CPU tensors, against its memory limit capped by the device's
    capacity (the capacity where it has none), with this machine's RAM as the host."""
    from sbpbench.measure.host_memory import total_ram_bytes

    made: list[dict] = []
    real_probing = simulated_search.simulated_probing

    def probing(**options) -> dict:
        made.append(options)
        return real_probing(**options)

    def simulated_max_len(search, out, *, probing, **options) -> ResultRow:
        made[-1] |= {"device": search.base.device, "device_name": probing["device_name"]}
        row = ResultRow(**spec_fields(search.base))
        row.status, row.max_seq_len, row.oom_seq_len = "ok", 4096, 4160
        return row

    monkeypatch.setattr(simulated_search, "simulated_probing", probing)
    monkeypatch.setattr(simulated_search, "simulated_max_len", simulated_max_len)
    capacity = 79 * 2**30
    seed = simulated_search.estimate_seed(capacity_bytes=capacity, note=lambda line: None)
    for limit, expected in ((80 * 2**30, capacity), (2**30, 2**30), (None, capacity)):
        search = _search()
        object.__setattr__(search.base, "device", "cuda:0")
        object.__setattr__(search.base, "memory_limit", limit)
        assert seed(search) == 4096
        assert made[-1]["target"] == "cuda" and made[-1]["memory_bytes"] == expected
        assert made[-1]["host_memory_bytes"] == total_ram_bytes()
        assert (made[-1]["device"], made[-1]["device_name"]) == ("cpu", "simulated GPU")


def test_a_prediction_that_nothing_fits_seeds_the_shortest_length_and_a_failed_one_none(monkeypatch):
    """The simulated search's "even T=2 does not fit" is seed 0 (the search then probes the
    shortest length first); an unsupported or failed prediction is no seed, said in one line."""
    outcome: dict = {}

    def simulated_max_len(search, out, *, probing, **options) -> ResultRow:
        return ResultRow(**spec_fields(search.base), **outcome)

    monkeypatch.setattr(simulated_search, "simulated_max_len", simulated_max_len)
    lines: list[str] = []
    seed = simulated_search.estimate_seed(capacity_bytes=1 << 30, note=lines.append)
    outcome.update(status="oom", max_seq_len=None, oom_seq_len=MIN_SEQ_LEN)
    assert seed(_search()) == 0 and lines[-1].startswith("bp: seed: predicted that not even T=2 fits")
    outcome.update(status="unsupported", oom_seq_len=None)
    assert seed(_search()) is None and lines[-1] == "bp: no seed (the prediction is unsupported): growing from T=256"


@pytest.mark.parametrize("flag", ["--no-seed", "--seed-from-estimate"])
def test_a_seed_option_with_simulate_is_refused_in_one_line(flag):
    """--simulate's probes are the estimate: a seed option there is a one-line error, not ignored."""
    result = runner.invoke(app, ["maxlen", "--simulate", "--model", "tiny/qwen3", flag])
    assert result.exit_code == 2 and "are for measured searches" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_real_cpu_search_is_confirmed_by_two_probes_and_agrees_with_the_blind_one(tmp_path):
    """`sbp maxlen --device cpu` seeded with the CPU target's prediction (the tracker's own count):
    two isolated probes per method, and the blind search's answer."""
    answers = {}
    for mode in ("--seed-from-estimate", "--no-seed"):
        out = tmp_path / f"{mode}.csv"
        command = [_sbp(), "maxlen", "--device", "cpu", "--model", "tiny/qwen3", "--method", "bp", "ckpt"]
        command += ["--memory-limit", "2MB", "--start", "64", "--resolution", "2%", mode, "--out", str(out)]
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=900, env=cli_env())
        assert done.returncode == 0, done.stdout + done.stderr
        answers[mode] = {r["method"]: r for r in read_rows(out) if r["kind"] == "maxlen"}
    for method in ("bp", "ckpt"):
        seeded, blind = answers["--seed-from-estimate"][method], answers["--no-seed"][method]
        assert int(seeded["num_probes"]) == 2 < int(blind["num_probes"])
        assert seeded["max_seq_len"] == seeded["seed_seq_len"] == blind["max_seq_len"]
