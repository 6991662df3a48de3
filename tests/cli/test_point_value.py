"""A point is a value: RunSpec is made, checked and resolved once (config/run.py), and the worker
rebuilds it from JSON as it was, so nothing parses or checks it again."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.config import ConfigError, RunSpec, point_specs
from sbpbench.core.placements.placement import Placement
from sbpbench.runner import isolated
from sbpbench.runner.point import measure_point


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """Every text Placement.parse is called on, in order."""
    calls: list[str] = []
    parse = Placement.parse.__func__

    def counted(cls, text):
        calls.append(str(text))
        return parse(cls, text)

    monkeypatch.setattr(Placement, "parse", classmethod(counted))
    return calls


def test_a_run_parses_the_placement_once_in_its_parent_and_never_in_its_worker(parses, monkeypatch, tmp_path):
    """`sbp run --method streambp --checkpoints cpu+recompute:2`, the worker's part run in process
    from the JSON the parent sends: one parse in the parent, none in the worker or its steps."""
    seen = {}

    def in_process(spec, tmp, timeline_dir=None, trace_dir=None):
        seen["parent"] = list(parses)
        parses.clear()
        row = measure_point(RunSpec.from_json(spec.to_json()))  # what runner/worker.py runs
        seen["worker"] = list(parses)
        return row, ""

    monkeypatch.setattr(isolated, "_run_workers", in_process)
    argv = ["run", "--device", "cpu", "--model", "tiny/qwen3", "--seq", "64", "--method", "streambp"]
    argv += [
        "--checkpoints",
        "cpu+recompute:2",
        "--threads",
        "1",
        "--repeats",
        "1",
        "--out",
        str(tmp_path / "runs.csv"),
    ]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert seen == {"parent": ["cpu+recompute:2"], "worker": []} and parses == []
    assert "cpu+recompute:2" in (tmp_path / "runs.csv").read_text()


def test_the_worker_rebuilds_the_spec_without_checking_it(monkeypatch):
    """from_json gives back the same resolved spec (a Placement, integer chunks, their record) and
    runs none of the checks: a spec that could not be built passes through as it is."""
    (spec,) = point_specs({"device": "cpu", "model": "tiny/qwen3", "seq_len": 64, "checkpoints": "cpu"}, ["streambp"])
    again = RunSpec.from_json(spec.to_json())
    assert again == spec and again.settings.checkpoints == Placement(offload=True)
    assert isinstance(again.settings.chunk_size, int) and again.auto_settings == spec.auto_settings
    monkeypatch.setattr(RunSpec, "__post_init__", lambda self: pytest.fail("the worker checked the spec again"))
    odd = json.loads(spec.to_json()) | {"seq_len": 1}  # a value the checks refuse
    assert RunSpec.from_json(json.dumps(odd)).seq_len == 1


def test_chunk_sizes_are_numbers_with_a_record_of_the_rules_choice():
    """ "auto" and "T/k" become numbers when the spec is made; auto_settings names the rule's; a knob
    given later (with_settings) is no longer the rule's; a bad size is one ConfigError."""
    values = {"device": "cpu", "model": "tiny/qwen3", "seq_len": 90, "chunk_size": "T/3"}
    (spec,) = point_specs(values, ["streambp"])
    assert spec.settings.chunk_size == 30 and spec.auto_settings == ("logits_chunk_size",)
    assert replace(spec, seq_len=120).settings.chunk_size == 30  # the number, not "T/3" again
    assert spec.with_settings(logits_chunk_size=7).auto_settings == ()
    with pytest.raises(ConfigError, match="chunk_size 'T/x' is not a size"):
        point_specs({**values, "chunk_size": "T/x"}, ["streambp"])
