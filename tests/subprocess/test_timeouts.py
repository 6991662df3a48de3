"""Timeouts that fit the point: predicted from the FLOP model unless given, recorded in the row; a
timed-out point skips the longer points of its series in a sweep; long points take one memory step
and one timed step by default."""

from __future__ import annotations

import pytest

from sbpbench.config import MaxlenSpec, RunSpec, point_specs
from sbpbench.config.long_context import LONG_CONTEXT_SEQ_LEN
from sbpbench.measure.environment import capture_environment
from sbpbench.methods import MethodSettings
from sbpbench.records import ResultRow, read_rows, upsert_rows
from sbpbench.records.select import is_oom
from sbpbench.runner.maxlen import ProbeFailed, find_max_len
from sbpbench.runner.sweep import plan, run_sweep
from sbpbench.runner.timeout import START_S, point_timeout_s, predicted_timeout_s, step_flops
from sbpbench.workload.rows import spec_fields

from .test_sweep import _experiment


def _spec(**values) -> RunSpec:
    return RunSpec(**{"model": "tiny/qwen3", "method": "streambp", "seq_len": 64, **values})


def test_the_timeout_is_predicted_from_the_points_flops_unless_given():
    """Start-up floor plus 2 x steps x executed FLOPs / the assumed rate: more steps, longer T or a
    recompute placement take longer; a given timeout is used as is."""
    tiny = _spec()
    assert START_S < predicted_timeout_s(tiny) < START_S + 60
    assert point_timeout_s(_spec(timeout_s=5.0)) == 5.0
    longer = _spec(seq_len=8192)
    assert predicted_timeout_s(longer) > predicted_timeout_s(tiny)
    assert predicted_timeout_s(_spec(seq_len=8192, repeats=10)) > predicted_timeout_s(longer)
    assert step_flops(_spec(settings=MethodSettings(checkpoints="recompute:2"))) > step_flops(tiny)
    long_point = RunSpec(model="Qwen/Qwen3-8B", method="streambp", seq_len=1_048_576, lora_rank=64, dtype="bf16")
    assert predicted_timeout_s(long_point) > 3 * 3600  # a 1M step is hours, not the old 3600 s for all


def test_cpu_points_keep_a_generous_timeout_on_a_loaded_machine():
    """The CPU rate is 2 GFLOP/s, 30-40x below the 58-85 measured on 2 idle cores: sbp run's CPU
    default (small/qwen3, T = 2048, 5 steps) gets over 20 minutes, against about 10 s of work."""
    (default,) = point_specs({"device": "cpu", "threads": 2}, ["streambp"])
    assert predicted_timeout_s(default) > 20 * 60


def test_long_points_default_to_one_memory_step_and_one_timed_step():
    """From LONG_CONTEXT_SEQ_LEN on, warm-up 0 and repeats 1 unless given; shorter points keep 1 and 3."""
    (long_point,) = point_specs({"device": "cpu", "model": "tiny/qwen3", "seq_len": LONG_CONTEXT_SEQ_LEN}, ["bp"])
    assert (long_point.warmup, long_point.repeats) == (0, 1)
    (given,) = point_specs({"device": "cpu", "model": "tiny/qwen3", "seq_len": 40960, "repeats": 3}, ["bp"])
    assert (given.warmup, given.repeats) == (0, 3)
    (short,) = point_specs({"device": "cpu", "model": "tiny/qwen3", "seq_len": LONG_CONTEXT_SEQ_LEN - 8}, ["bp"])
    assert (short.warmup, short.repeats) == (1, 3)


def _timing_out(calls: list, timeout_from: int):
    def measure(spec, env) -> ResultRow:
        calls.append((spec.seq_len, spec.batch_size))
        row = ResultRow(**spec_fields(spec))
        row.device_name = env.device_name
        row.status = "timeout" if spec.seq_len * spec.batch_size >= timeout_from else "ok"
        row.timeout_s = point_timeout_s(spec)
        return row

    return measure


def test_a_timed_out_point_skips_the_longer_points_of_its_series(tmp_path):
    """After a timeout the longer (and larger) points of the same settings are skipped with the reason
    in the row, not run for their own timeouts; plots and reports do not draw them as OOM."""
    experiment = _experiment(tmp_path, '[[points]]\nmethod = "bp"\nseq_len = [64, 128, 256]\nbatch_size = [1, 2]\n')
    out, env, calls = tmp_path / "exp.csv", capture_environment("cpu"), []
    rows = run_sweep(
        plan(experiment.points, out, device_name=env.device_name), out, measure=_timing_out(calls, 128), env=env
    )
    status = {(r.seq_len, r.batch_size): (r.status, r.error) for r in rows}
    assert status[(128, 1)][0] == "timeout" and status[(256, 1)][0] == "skipped"
    assert status[(256, 1)][1] == "certain timeout: T=128, batch 1 timed out; not run"
    assert (256, 1) not in calls and (128, 2) not in calls
    assert not any(is_oom(row) for row in read_rows(out))


def test_a_timeout_stops_a_max_length_search_and_a_certain_timeout_is_no_answer(tmp_path):
    """A probe that times out stops the search (a time limit is no memory answer) with what to do;
    a sweep's row skipped as a certain timeout is not read as an OOM probe on resume."""
    out, env, calls = tmp_path / "maxlen.csv", capture_environment("cpu"), []
    base = RunSpec(model="tiny/qwen3", method="bp", seq_len=256, repeats=0, warmup=0)
    search = MaxlenSpec(base=base, seq_len_ceiling=1 << 14)
    with pytest.raises(ProbeFailed, match="timeout.*rerun with a larger --timeout"):
        find_max_len(search, out, measure=_timing_out(calls, 1024), env=env)
    assert calls == [(256, 1), (512, 1), (1024, 1)]
    skipped = ResultRow(**spec_fields(search.probe(768)), status="skipped", device_name=env.device_name)
    skipped.error = "certain timeout: T=512, batch 1 timed out; not run"
    upsert_rows(out, [skipped])
    again: list = []
    with pytest.raises(ProbeFailed):
        find_max_len(search, out, measure=_timing_out(again, 1024), env=env)
    assert again == [(1024, 1)]  # read as an OOM at 768, the cached rows would have answered without probing
