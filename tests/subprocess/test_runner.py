"""Measured points: in-process measurement, one process per point, outcome classes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sbpbench.config import RunSpec
from sbpbench.measure.environment import capture_environment
from sbpbench.methods import MethodSettings
from sbpbench.records import PROVENANCE_COLUMNS, read_rows
from sbpbench.runner import fork_server, run_isolated, run_points
from sbpbench.runner.point import measure_point


def _spec(method: str, **values) -> RunSpec:
    base = {"model": "tiny/qwen3", "seq_len": 64, "warmup": 0, "repeats": 1}
    return RunSpec(method=method, **(base | values))


def test_measure_point_fills_memory_time_and_flops():
    """An ok point has the tracker's peak above a baseline of weights + resident grads, times and FLOPs."""
    row = measure_point(_spec("streambp", repeats=2))
    assert row.status == "ok", row.error
    assert row.memory_source == "tensor-tracker" and row.num_layers == 2 and row.num_tokens < 64
    assert row.baseline_bytes >= row.weights_bytes + row.grads_bytes  # steady: gradients resident
    assert row.peak_allocated_bytes == row.baseline_bytes + row.activation_peak_bytes
    assert row.activation_peak_bytes > 0 and row.cpu_peak_rss_bytes > row.weights_bytes
    assert row.time_min_s <= row.time_median_s <= row.time_max_s
    assert row.tokens_per_s == pytest.approx(64 / row.time_median_s)
    assert row.model_flops > 0 and row.loss > 0


def test_first_step_protocol_counts_gradients_in_the_peak():
    """first: gradients are not in the baseline but allocated inside the measured step (all live at its end)."""
    steady = measure_point(_spec("bp"))
    first = measure_point(_spec("bp", protocol="first"))
    assert first.baseline_bytes == steady.baseline_bytes - steady.grads_bytes
    assert first.activation_peak_bytes >= first.grads_bytes
    assert first.peak_allocated_bytes <= steady.peak_allocated_bytes


@pytest.mark.slow
def test_activation_peak_orders_bp_over_ckpt_over_streambp():
    """At a long-enough T the tracked activation peak is bp > ckpt > streambp (measured, deterministic)."""
    peaks = {
        method: measure_point(
            _spec(method, seq_len=1024, settings=MethodSettings(chunk_size=128, logits_chunk_size=128))
        ).activation_peak_bytes
        for method in ("bp", "ckpt", "streambp")
    }
    print(peaks)
    assert peaks["bp"] > peaks["ckpt"] > peaks["streambp"]


def test_memory_limit_below_the_need_is_an_oom_row():
    """A CPU --memory-limit under the tracked need gives status oom, with how far it got."""
    row = measure_point(_spec("bp", memory_limit=1_500_000))
    assert row.status == "oom" and "limit" in row.error
    assert row.peak_allocated_bytes > 1_500_000
    weights_only = measure_point(_spec("bp", memory_limit=1000))
    assert weights_only.status == "oom" and "weights" in weights_only.error


@pytest.mark.slow
def test_run_isolated_returns_a_row_with_provenance_and_oom_is_a_value(tmp_path):
    """In a worker process: an oom point comes back as a row (no exception) with provenance, and the
    caller that writes rows (as a sweep does) sees it in the CSV."""
    out = tmp_path / "r.csv"
    rows = list(run_points([_spec("bp", memory_limit=1_000_000), _spec("streambp")], out))
    assert [r.status for r in rows] == ["oom", "ok"]
    saved = read_rows(out)
    assert [r["status"] for r in saved] == ["oom", "ok"]
    for column in PROVENANCE_COLUMNS:
        assert all(r[column] for r in saved), column


def test_a_point_past_its_timeout_is_a_timeout_row(monkeypatch):
    """A worker still running at its timeout is killed and its point is a timeout row with provenance
    (a fresh worker: starting the fork server costs this tier seconds; tests/subprocess/test_fork_server.py
    times a forked one out)."""
    monkeypatch.setenv(fork_server.ENABLE_ENV, "0")
    row = run_isolated(_spec("bp", timeout_s=0.5, repeats=1000))
    assert row.status == "timeout" and "--timeout" in row.error and row.host
    assert row.timeout_s == 0.5  # the timeout the point ran under


@pytest.mark.slow
def test_a_failing_method_is_an_error_row(tmp_path):
    """streambp on a family it does not support fails in the worker: status error with its reason."""
    checkpoint = tmp_path / "gpt2"
    checkpoint.mkdir()
    config = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 64}
    (checkpoint / "config.json").write_text(json.dumps(config))
    env = capture_environment("cpu")
    row = run_isolated(_spec("streambp", model=str(checkpoint), seq_len=16), env)
    assert row.status == "error" and "UnsupportedModelError" in row.error and "GPT2LMHeadModel" in row.error
    assert run_isolated(_spec("bp", model=str(checkpoint), seq_len=16), env).status == "ok"


def test_spec_round_trips_through_json():
    """RunSpec -> JSON -> RunSpec is the identity (settings and memory limit included)."""
    spec = _spec("streambp", settings=MethodSettings(chunk_size=7), memory_limit=123)
    assert RunSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"seq_len": 1}, "at least 2"),
        ({"seq_len": 0}, "at least 2"),
        ({"method": "nope"}, "unknown method"),
        ({"protocol": "warm"}, "unknown protocol"),
        ({"device": "tpu"}, "unknown device"),
        ({"repeats": -1}, "^repeats must be at least 0"),
    ],
)
def test_bad_specs_say_what_is_allowed(values, message):
    """Each invalid RunSpec field is a ValueError naming the field's rule."""
    with pytest.raises(ValueError, match=message):
        _spec(values.pop("method", "bp"), **values)


INTERRUPTED_PARENT = """
import signal
from sbpbench.config import RunSpec
from sbpbench.runner import run_isolated
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises, even if started with SIGINT ignored
spec = RunSpec(model="tiny/qwen3", method="streambp", seq_len=2048, repeats=1000, warmup=0,
               settings=__import__("sbpbench.methods", fromlist=["MethodSettings"]).MethodSettings(chunk_size=1))
print("started", flush=True)
run_isolated(spec)
"""


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line) of the live (not zombie) processes on the machine (-ww: whole
    command lines, which ps otherwise cuts to the terminal width)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,stat,args"], capture_output=True, text=True, check=True).stdout
    table = {}
    for line in out.splitlines()[1:]:
        pid, ppid, stat, args = line.split(None, 3)
        if "Z" not in stat:
            table[int(pid)] = (int(ppid), args)
    return table


def _workers(parent: int | None = None, *, servers: bool = False) -> set[int]:
    """pids of the live point workers on the machine, fresh (`-m sbpbench.runner.worker`) or forked
    by a fork server (the child of a process running runner/fork_server.py's `serve`); with
    servers, the fork servers too; with parent, only those descending from it."""
    table = _processes()

    def descends(pid: int) -> bool:
        while pid in table and pid != parent:
            pid = table[pid][0]
        return pid == parent

    def server(pid: int) -> bool:
        return pid in table and "sbpbench.runner.fork_server" in table[pid][1]

    return {
        pid
        for pid, (ppid, args) in table.items()
        if ("sbpbench.runner.worker" in args or (server(pid) and (servers or server(ppid))))
        and (parent is None or descends(pid))
    }


@pytest.mark.slow
def test_ctrl_c_in_the_parent_kills_the_worker():
    """SIGINT to the process running a point: it exits and its worker process (and the fork server
    that forked it) is gone with it."""
    parent = subprocess.Popen([sys.executable, "-c", INTERRUPTED_PARENT], stdout=subprocess.PIPE, text=True)
    mine: set[int] = set()
    try:
        assert parent.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 60
        # only this parent's worker is watched: other test runs on the same machine start workers too
        while not (mine := _workers(parent.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mine, "the worker never started"
        mine |= _workers(parent.pid, servers=True)
        parent.send_signal(signal.SIGINT)
        parent.wait(timeout=60)
        time.sleep(0.5)
        assert not (mine & _workers(servers=True))
    finally:  # a failed run leaves no process behind (a worker leads its own process group)
        parent.kill()
        parent.wait()
        for pid in mine & _workers(servers=True):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_long_cuda_points_run_with_expandable_segments_unless_the_user_set_the_allocator():
    """A CUDA point of T >= 32k gets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in its worker's
    environment; shorter ones, CPU points and a user's own setting (either variable) are left alone;
    the row records what the worker ran with."""
    from sbpbench.runner.allocator import allocator_setting, worker_environment

    base = {"PATH": "/bin"}
    long_env = worker_environment("cuda:0", 65536, base)
    assert long_env == {"PATH": "/bin", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert worker_environment("cuda:0", 9000, base) is base and worker_environment("cpu", 65536, base) is base
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        own = {**base, name: "max_split_size_mb:128"}
        assert worker_environment("cuda:0", 65536, own) is own
    assert allocator_setting(long_env) == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert allocator_setting(base) == ""
