"""A rank's worker (runner/worker.py) leaves its process group only after a step that ran: one that
failed may have left its peers in a collective, where nccl's destroy_process_group could wait with
them. The result is written first either way, and the process exits at once."""

from __future__ import annotations

import pytest

from sbpbench.config import RunSpec
from sbpbench.records import ResultRow
from sbpbench.runner import worker


class _Exited(BaseException):
    pass


@pytest.mark.parametrize(("status", "left"), [("ok", 1), ("oom", 0), ("error", 0)])
def test_a_rank_leaves_its_group_only_after_a_step_that_ran(tmp_path, monkeypatch, status, left):
    spec = RunSpec(model="tiny/qwen3", method="streambp", seq_len=64, device="cpu", nproc=2)
    calls = []

    def exit_now(code):
        raise _Exited(code)

    monkeypatch.setattr(worker, "measure_point", lambda spec, timeline_dir: ResultRow(status=status))
    monkeypatch.setattr(worker.ranks, "leave", lambda: calls.append("leave"))
    monkeypatch.setattr(worker.os, "_exit", exit_now)
    monkeypatch.setattr(worker, "die_with_parent", lambda: None)
    with pytest.raises(_Exited):
        worker.run_point(spec.to_json(), tmp_path / "row.json")
    assert (tmp_path / "row.json").exists() and len(calls) == left
