"""`sbp maxlen`: the search against fake monotone probes (answer, probe count, resume), the
CSV-backed search with fake measurements, and one real search on a tiny model on the CPU."""

from __future__ import annotations

import math
import subprocess

import pytest

from sbpbench.config import MaxlenSpec, Resolution, RunSpec, point_specs
from sbpbench.measure.environment import capture_environment
from sbpbench.records import ResultRow, read_rows
from sbpbench.runner.length_search import search_max_len
from sbpbench.runner.maxlen import ProbeFailed, find_max_len
from sbpbench.workload.rows import spec_fields

from ..cli.test_cli_run import _sbp
from ..conftest import cli_env


class Stop(Exception):
    pass


def _fits_up_to(answer: int, calls: list[int], stop_after: int | None = None):
    def probe(seq_len: int) -> bool:
        if stop_after is not None and len(calls) == stop_after:
            raise Stop
        calls.append(seq_len)
        return seq_len <= answer

    return probe


@pytest.mark.parametrize("answer", [2, 3, 100, 1023, 1024, 1025, 5000, 12_345, 99_999])
def test_search_finds_the_exact_answer_with_a_bounded_number_of_probes(answer):
    """At 1-token resolution the search finds the exact longest fit, within a log-bounded number of distinct probes."""
    calls: list[int] = []
    result = search_max_len(_fits_up_to(answer, calls), start=1024, ceiling=1 << 20, resolution=Resolution(tokens=1))
    assert (result.max_ok, result.min_oom) == (answer, answer + 1)
    # growth (or halving) to the bracket, then one probe per halving of it
    bound = 2 * math.ceil(abs(math.log2(answer / 1024))) + 12
    assert len(calls) <= bound
    assert len(calls) == len(set(calls)) == result.num_run  # nothing probed twice


@pytest.mark.parametrize("answer", [1500, 7777, 110_000])
def test_a_percent_resolution_stops_at_a_bracket_that_narrow(answer):
    """A 1% resolution stops at a bracket of 1% (multiples of 8), with fewer probes than an exact search."""
    calls: list[int] = []
    result = search_max_len(
        _fits_up_to(answer, calls), start=1024, ceiling=1 << 20, resolution=Resolution.parse("1%"), multiple_of=8
    )
    assert result.max_ok <= answer < result.min_oom
    assert result.min_oom - result.max_ok <= max(8, math.ceil(result.max_ok / 100))
    assert all(t % 8 == 0 for t in calls)
    exact = search_max_len(_fits_up_to(answer, []), start=1024, ceiling=1 << 20, resolution=Resolution(tokens=1))
    assert len(calls) < exact.num_run


def test_the_ceiling_bounds_the_search():
    """Everything fits: the answer is the ceiling; nothing fits: no answer and the first OOM is 2."""
    result = search_max_len(lambda t: True, start=1000, ceiling=5000, resolution=Resolution.parse("1%"))
    assert (result.max_ok, result.min_oom) == (5000, None)
    nothing = search_max_len(lambda t: False, start=16, ceiling=5000, resolution=Resolution.parse("1%"))
    assert (nothing.max_ok, nothing.min_oom) == (None, 2)


@pytest.mark.parametrize("stop_after", [1, 3, 7])
def test_an_interrupted_search_resumes_from_its_cached_probes(stop_after):
    """Stopped after k probes, then rerun with those answers cached: the same answer, and the two
    runs together probe exactly what one uninterrupted search does."""
    answer, settings = 20_000, {"start": 1024, "ceiling": 1 << 18, "resolution": Resolution.parse("1%")}
    whole: list[int] = []
    expected = search_max_len(_fits_up_to(answer, whole), **settings)
    first: list[int] = []
    with pytest.raises(Stop):
        search_max_len(_fits_up_to(answer, first, stop_after=stop_after), **settings)
    cached = {t: t <= answer for t in first}
    rest: list[int] = []
    resumed = search_max_len(_fits_up_to(answer, rest), cached=cached, **settings)
    assert (resumed.max_ok, resumed.min_oom) == (expected.max_ok, expected.min_oom)
    assert first + rest == whole


def test_contradicting_cached_probes_are_refused():
    """Cached probes where a longer length fits and a shorter one does not are refused as not monotone."""
    with pytest.raises(ValueError, match="not monotone"):
        search_max_len(
            lambda t: True, start=8, ceiling=64, resolution=Resolution(tokens=1), cached={32: True, 16: False}
        )


@pytest.mark.parametrize("text", ["0%", "100%", "x", "0", "-5", "1.5"])
def test_a_bad_resolution_says_what_to_write(text):
    """An unreadable resolution is a ValueError that shows the two accepted spellings."""
    with pytest.raises(ValueError, match="1% or a token count"):
        Resolution.parse(text)


def _fake_measure(answer: int, calls: list[int], fail_at: int | None = None):
    def measure(spec: RunSpec, env) -> ResultRow:
        calls.append(spec.seq_len)
        row = ResultRow(**spec_fields(spec))
        row.device_name = env.device_name
        row.status = "error" if spec.seq_len == fail_at else ("ok" if spec.seq_len <= answer else "oom")
        row.peak_allocated_bytes = 1000 * spec.seq_len
        return row

    return measure


def _search(method: str = "bp") -> MaxlenSpec:
    base = RunSpec(model="tiny/qwen3", method=method, seq_len=256, repeats=0, warmup=0, memory_limit=1 << 30)
    return MaxlenSpec(base=base, resolution=Resolution.parse("1%"), seq_len_ceiling=1 << 16)


def test_find_max_len_writes_probes_and_an_answer_row_and_resumes_from_the_csv(tmp_path):
    """Each probe and one answer row are written; a rerun resumes from the CSV, resume=False probes again."""
    out, env, calls = tmp_path / "maxlen.csv", capture_environment("cpu"), []
    answer = find_max_len(_search(), out, measure=_fake_measure(3000, calls), env=env)
    assert (answer.kind, answer.status, answer.max_seq_len, answer.oom_seq_len) == ("maxlen", "ok", 2992, 3008)
    assert answer.seq_len is None and answer.num_probes == len(calls)
    assert answer.peak_allocated_bytes == 2_992_000  # the longest ok probe's
    rows = read_rows(out)
    assert sorted(int(r["seq_len"]) for r in rows if r["kind"] == "point") == sorted(calls)
    assert [r["max_seq_len"] for r in rows if r["kind"] == "maxlen"] == ["2992"]

    again: list[int] = []
    resumed = find_max_len(_search(), out, measure=_fake_measure(3000, again), env=env)
    assert again == [] and resumed.max_seq_len == 2992 and resumed.peak_allocated_bytes == 2_992_000
    assert len(read_rows(out)) == len(rows)  # the answer row replaced, nothing duplicated

    fresh: list[int] = []
    find_max_len(_search(), out, measure=_fake_measure(3000, fresh), env=env, resume=False)
    assert fresh == calls
    other: list[int] = []  # another method's search shares no probe
    find_max_len(_search("ckpt"), out, measure=_fake_measure(3000, other), env=env)
    assert other == calls


def test_a_streambp_search_with_auto_chunks_resumes_at_every_length(tmp_path):
    """Chunk sizes left to the rule ("auto") differ by length (T/3 at short T), so each cached probe
    is matched with its own length's key: a rerun probes nothing again."""
    out, env, calls = tmp_path / "maxlen.csv", capture_environment("cpu"), []
    (base,) = point_specs({"model": "tiny/qwen3", "seq_len": 256, "repeats": 0, "memory_limit": 1 << 30}, ["streambp"])
    search = MaxlenSpec(base=base, resolution=Resolution.parse("1%"), seq_len_ceiling=1 << 16)
    find_max_len(search, out, measure=_fake_measure(3000, calls), env=env)
    assert len({int(r["chunk_size"]) for r in read_rows(out) if r["kind"] == "point"}) > 1
    again: list[int] = []
    assert find_max_len(search, out, measure=_fake_measure(3000, again), env=env).max_seq_len == 2992
    assert again == []


def test_a_probe_that_errors_stops_the_search_and_keeps_what_it_had(tmp_path):
    """An errored probe stops the search with ProbeFailed, keeps the earlier rows, and is probed again on resume."""
    out, env, calls = tmp_path / "maxlen.csv", capture_environment("cpu"), []
    with pytest.raises(ProbeFailed, match="T=2048: error"):
        find_max_len(_search(), out, measure=_fake_measure(3000, calls, fail_at=2048), env=env)
    assert [r["status"] for r in read_rows(out)] == ["ok", "ok", "ok", "error"]
    rest: list[int] = []
    find_max_len(_search(), out, measure=_fake_measure(3000, rest), env=env)
    assert rest[0] == 2048  # the errored length is probed again, the ok ones are not


@pytest.mark.slow
def test_sbp_maxlen_on_a_tiny_model_orders_streambp_over_ckpt_over_bp(tmp_path):
    """A real search (isolated probes, tracked-tensor budget) for each method in one call."""
    out = tmp_path / "maxlen.csv"
    command = [_sbp(), "maxlen", "--model", "tiny/qwen3", "--method", "bp", "ckpt", "streambp"]
    command += ["--memory-limit", "10MB", "--start", "512", "--max-seq", "2048", "--resolution", "50%"]
    done = subprocess.run(
        [*command, "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
        env=cli_env(),
    )
    assert done.returncode == 0, done.stderr
    answers = {r["method"]: r for r in read_rows(out) if r["kind"] == "maxlen"}
    assert set(answers) == {"bp", "ckpt", "streambp"}
    best = {method: int(row["max_seq_len"]) for method, row in answers.items()}
    assert best["streambp"] > best["ckpt"] > best["bp"]
    for row in answers.values():
        assert int(row["memory_limit_bytes"]) == 10**7 and row["search_resolution"] == "50%"
        assert row["oom_seq_len"] == "" or int(row["oom_seq_len"]) > int(row["max_seq_len"])
    for text in ("max T", "x ckpt", "first OOM", "3 max-length answer(s)"):
        assert text in done.stdout
    probes = [r for r in read_rows(out) if r["kind"] == "point"]
    assert {r["status"] for r in probes} == {"ok", "oom"}
    assert all(r["repeats"] == "0" and r["time_median_s"] == "" for r in probes)  # memory only


def test_an_answer_past_the_model_context_is_said_in_one_line():
    """The methods whose max T exceeds max_position_embeddings are named; within it, or with no
    context in the config, nothing is said."""
    from sbpbench.cli.maxlen_cmd import past_context_line

    def answer(method, max_seq_len):
        return ResultRow(kind="maxlen", method=method, max_seq_len=max_seq_len)

    answers = [answer("bp", 4768), answer("ckpt", None), answer("streambp", 144_384)]
    line = past_context_line("Qwen/Qwen3-8B", answers, 40_960)
    assert line.startswith(
        "max T past Qwen/Qwen3-8B's context of 40,960 tokens (max_position_embeddings) for streambp:"
    )
    assert "\n" not in line
    assert past_context_line("m", answers[:2], 40_960) is None
    assert past_context_line("m", answers, None) is None


def test_the_answer_is_the_longest_ok_any_probe_gave_within_the_ceiling():
    """Bisection starts from the bracket every cached (or first-pass) answer makes: a coarse pass's
    ok at 858,000 and OOM at 866,000 already answer a 1% search (a simulated 8B LoRA search had
    reported bisection's own 851,968 and probed 860,160 again)."""

    def probe(seq_len):
        return seq_len <= 858_000

    cached = {1_048_576: False, 524_000: True, 786_000: True, 858_000: True, 866_000: False}
    found = search_max_len(
        probe, start=1_048_576, ceiling=1_048_576, resolution=Resolution.parse("1%"), cached=cached, multiple_of=8
    )
    assert (found.max_ok, found.min_oom) == (858_000, 866_000) and found.num_run == 0
    # a cached ok past the ceiling is not an answer within it
    within = search_max_len(
        lambda t: True, start=64, ceiling=128, resolution=Resolution.parse("1%"), cached={256: True}
    )
    assert (within.max_ok, within.min_oom) == (128, None)
