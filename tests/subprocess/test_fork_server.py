"""The fork server (runner/fork_server.py): CPU points forked from one process that has done the
imports give the rows fresh workers give; timeouts, environment changes and the server's death
are handled as with fresh workers."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from sbpbench.config import RunSpec
from sbpbench.measure.environment import capture_environment
from sbpbench.methods import MethodSettings
from sbpbench.runner import fork_server, run_isolated

from .test_runner import _processes

# Each server start imports torch and transformers (about 10 s on a loaded 2-core machine): the
# tests run in this order and start two servers in all.
pytestmark = pytest.mark.slow

# The columns a point measures that do not depend on time or on the process's own memory map.
_MEASURED = ("status", "peak_allocated_bytes", "activation_peak_bytes", "baseline_bytes", "loss", "num_tokens")


def _spec(method: str, **values) -> RunSpec:
    base = {"model": "tiny/qwen3", "seq_len": 96, "warmup": 0, "repeats": 1, "threads": 1}
    return RunSpec(method=method, **(base | values))


def _alive(pid: int) -> bool:
    return pid in _processes()  # live, not a zombie


def test_a_forked_point_equals_a_fresh_one():
    """A point through the server gives a fresh worker's row in every measured column."""
    env = capture_environment("cpu")
    spec = _spec("streambp", settings=MethodSettings(chunk_size=32, logits_chunk_size=16))
    forked = run_isolated(spec, env)
    server = fork_server.shared_server()
    assert server.started >= 1 and server.last_pid and _alive(server.process.pid)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(fork_server.ENABLE_ENV, "0")
        fresh = run_isolated(spec, env)
    assert forked.status == "ok", forked.error
    assert {c: getattr(forked, c) for c in _MEASURED} == {c: getattr(fresh, c) for c in _MEASURED}
    assert forked.num_threads == 1 and forked.cpu_peak_rss_bytes > 0


def test_a_forked_worker_past_its_timeout_is_killed():
    """The timeout kills the forked worker (its own session); the same server forks the next point."""
    server = fork_server.shared_server()
    started = server.started
    row = run_isolated(
        _spec("streambp", seq_len=2048, repeats=1000, settings=MethodSettings(chunk_size=1), timeout_s=3)
    )
    assert row.status == "timeout" and "--timeout" in row.error
    assert server.started == started + 1 and not _alive(server.last_pid)
    assert run_isolated(_spec("bp")).status == "ok" and fork_server.shared_server() is server
    assert server.started == started + 2


def test_a_changed_environment_gets_a_new_server(monkeypatch):
    """A variable a worker might read at import differs from the server's: a new server, the old one exits."""
    old = fork_server.shared_server()
    assert fork_server.shared_server() is old
    monkeypatch.setenv("SBP_TEST_FORK_SERVER_ENV", "1")
    new = fork_server.shared_server()
    assert new is not old and new.process.poll() is None
    assert old.process.wait(timeout=30) == 0  # it exited on its own at EOF, not killed after close's 5 s
    monkeypatch.setenv("RANK", "3")  # read at run time: the same server serves
    assert fork_server.shared_server() is new


def test_a_worker_dies_with_its_server():
    """SIGKILL the server mid-point: its worker goes too (PDEATHSIG), the point is an error row
    saying it was killed, and the dead server serves no more points."""
    server = fork_server.shared_server()
    started = server.started

    def kill_once_forked():
        deadline = time.monotonic() + 60
        while server.started == started and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        os.kill(server.process.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_forked)
    killer.start()
    row = run_isolated(_spec("streambp", seq_len=2048, repeats=1000, settings=MethodSettings(chunk_size=1)))
    killer.join()
    assert row.status == "error" and "SIGKILL" in row.error
    time.sleep(0.5)
    assert not _alive(server.last_pid) and not server.serves(dict(os.environ))
