"""`sbp maxlen`: a simulated search reports as many probes as it made estimates, first pass included;
a measured search given a setting the estimator does not model runs without its seed, said in one
notice line naming the flag before any probe."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import sbpbench.runner.simulated_search as simulated_search
import sbpbench.simulate.depth as depth
from sbpbench.cli import app
from sbpbench.cli.options import refuse_unestimated
from sbpbench.config import RunSpec
from sbpbench.records import read_rows
from sbpbench.settings import SETTINGS
from sbpbench.settings.table import NOT_ESTIMATED

runner = CliRunner()
MEASURED = ["maxlen", "--device", "cpu", "--model", "tiny/qwen3", "--seq", "64", "--memory-limit", "1MB"]


@pytest.mark.slow  # a whole simulated search: about 4 s alone, 14 s beside the slow tier
def test_a_simulated_searchs_probe_count_is_the_estimates_it_made(tmp_path, monkeypatch):
    """`sbp maxlen --simulate` makes its first pass over the shared lengths, then bisects: the probes
    it reports (progress line, table, answer row) are every estimate made, in order, none cached."""
    calls: list[int] = []
    real = depth.estimate_point_by_depth

    def counted(spec, **options):
        calls.append(spec.seq_len)
        return real(spec, **options)

    monkeypatch.setattr(depth, "estimate_point_by_depth", counted)
    out = tmp_path / "estimates.csv"
    args = ["maxlen", "--simulate", "--model", "tiny/qwen3", "--method", "ckpt", "--gpu-memory", "800MiB"]
    result = runner.invoke(app, [*args, "--max-seq", "16384", "--resolution", "2%", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (answer,) = [row for row in read_rows(out) if row["kind"] == "maxlen"]
    assert len(calls) > 2 and int(answer["num_probes"]) == len(calls)
    assert [int(probe.split(":")[0]) for probe in answer["search_probes"].split()] == calls
    assert "(cached)" not in answer["search_probes"]
    assert f"({len(calls)} probes)" in result.output


@pytest.mark.parametrize(
    ("given", "flag", "unseeded"),
    [
        (["--sdpa-backend", "math"], "--sdpa-backend", ["bp", "streambp"]),
        (["--set", "chunk_attention=lower-right"], "--set chunk_attention", ["streambp"]),  # bp reads no such knob
    ],
)
def test_a_setting_the_estimator_does_not_model_skips_the_seed_with_one_notice(
    tmp_path, fake_seeding, given, flag, unseeded
):
    """The searches of the methods it changes run and answer unseeded, said in one notice naming the
    flag before the first probe; their seed is never predicted, a method it does not change is seeded."""
    out = tmp_path / "maxlen.csv"
    result = runner.invoke(app, [*MEASURED, "--method", "bp", "streambp", *given, "--out", str(out)])
    assert result.exit_code == 0, result.output
    notices = [line for line in result.output.splitlines() if "not modelled" in line]
    assert len(notices) == 1 and notices[0].startswith(f"notice: {flag} is not modelled by the estimator (")
    assert notices[0].endswith(f"no seed for {', '.join(unseeded)}; the search grows from T=64")
    assert result.output.index(notices[0]) < result.output.index("probe")
    assert [search.method for search in fake_seeding] == [m for m in ("bp", "streambp") if m not in unseeded]
    answers = {row["method"]: row for row in read_rows(out) if row["kind"] == "maxlen"}
    assert all(answers[method]["seed_seq_len"] == "" and answers[method]["status"] == "ok" for method in unseeded)


def test_without_such_a_setting_the_search_is_seeded_and_no_notice_is_said(tmp_path, fake_seeding):
    """The same search at the estimator's settings: seeded, no notice."""
    result = runner.invoke(app, [*MEASURED, "--method", "bp", "--out", str(tmp_path / "maxlen.csv")])
    assert result.exit_code == 0, result.output
    assert "notice:" not in result.output and len(fake_seeding) == 1


def test_the_seed_skips_every_setting_sbp_estimate_refuses_but_those_it_sets_itself():
    """Each setting `sbp estimate` refuses, given at a value but its default to a method that reads
    it, leaves a search unseeded, unless the seed sets it itself (simulated_search.seed_sets_itself)."""
    checked = []
    for name in NOT_ESTIMATED:
        if simulated_search.seed_sets_itself(name):
            continue
        setting = SETTINGS[name]
        method = setting.read_by[0] if setting.read_by else "bp"
        others = [not setting.default] if setting.kind is bool else [c for c in setting.choices if c != setting.default]
        for value in others:
            knob = {"settings": {name: value}} if setting.read_by else {name: value}
            try:
                spec = _spec(method, **knob)
            except ValueError:  # a value this machine cannot run (a GPU's kernel)
                continue
            with pytest.raises(ValueError, match="is not modelled by the estimator"):
                refuse_unestimated({name: value}, NOT_ESTIMATED)
            assert simulated_search.unmodelled(spec) is not None and simulated_search.unmodelled(spec)[0] == name
            checked.append(name)
            break
    assert {"sdpa_backend", "chunk_attention"} <= set(checked)
    assert simulated_search.unmodelled(_spec("streambp")) is None


def _spec(method: str, settings: dict | None = None, **fields) -> RunSpec:
    from sbpbench.methods import MethodSettings

    return RunSpec(model="tiny/qwen3", method=method, seq_len=64, settings=MethodSettings(**(settings or {})), **fields)
