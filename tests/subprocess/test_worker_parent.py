"""A point's worker never outlives the process that started it (runner/isolated.py, runner/worker.py):
a SIGTERM to a parent that has no handler of its own (a test process) kills its workers on the way
out, and a worker whose parent died while it was still importing exits before it measures, even
where a subreaper, not init, adopts it. Real processes, so slow."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
# the parent: a tiny CPU point whose worker runs long enough to be stopped, its pid printed on start
PARENT = textwrap.dedent(
    """
    import os, sys
    from sbpbench.config import point_specs
    from sbpbench.runner import isolated

    (spec,) = point_specs({"device": "cpu", "model": "tiny/qwen3", "seq_len": 4096, "warmup": 0,
                           "repeats": 200}, ["bp"])
    started = isolated._start_worker

    def announced(*args, **kwargs):
        worker = started(*args, **kwargs)
        print(worker.pid, flush=True)
        if sys.argv[1] == "die":  # the parent gone at once, while its worker imports
            os._exit(0)
        return worker

    isolated._start_worker = announced
    isolated.run_isolated(spec)
    """
)
# a subreaper that adopts the parent's orphans (as container inits and service managers do)
SUBREAPER = "import ctypes, subprocess, sys, time; ctypes.CDLL(None).prctl(36, 1); subprocess.run(sys.argv[1:]); time.sleep(120)"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPOSITORY), "SBP_FORK_SERVER": "0", "OMP_NUM_THREADS": "1"}


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/stat")
    try:
        return status.read_text().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_sigterm_to_the_parent_ends_its_worker():
    """SIGTERM to a parent without a handler of its own, while its worker runs: the parent exits
    143 (the SIGTERM became an exit that killed the workers' group) and the worker is gone."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, "wait"], stdout=subprocess.PIPE, text=True, env=_env(), cwd=REPOSITORY
    )
    try:
        worker = int(parent.stdout.readline())
        time.sleep(1.0)  # inside its imports or its step: either way it must go
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == 143
        assert _gone_within(worker, 10), f"worker {worker} outlived its SIGTERMed parent"
    finally:
        parent.kill()


@pytest.mark.slow
def test_a_worker_whose_parent_died_while_it_imported_exits_under_a_subreaper(tmp_path):
    """The parent exits as soon as its worker starts (as a SIGKILL would end it); the orphan is
    adopted by a subreaper, not init, so only the parent's pid it was given tells it the parent is
    gone: it exits without measuring (no result written)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG and subreapers are Linux's")
    reaper = subprocess.Popen(
        [sys.executable, "-c", SUBREAPER, sys.executable, "-c", PARENT, "die"],
        stdout=subprocess.PIPE,
        text=True,
        env={**_env(), "TMPDIR": str(tmp_path)},
        cwd=REPOSITORY,
    )
    try:
        worker = int(reaper.stdout.readline())
        assert _gone_within(worker, 60), f"worker {worker} kept running after its parent died"
        assert not list(tmp_path.rglob("result.json")), "the orphaned worker measured its point"
    finally:
        reaper.kill()
        reaper.wait()
