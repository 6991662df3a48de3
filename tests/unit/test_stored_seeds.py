"""A search's seed stored in the results file (runner/seeds.py): written as a labelled prediction,
read back by a resumed sweep instead of predicted again, keyed by the GPU memory it was predicted
for, priced as no host time, and never read by the plots or the report. A stand-in simulated
search answers each prediction."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

import sbpbench.runner.simulated_search as simulated_search
from sbpbench.config.experiment import load_experiment
from sbpbench.measure.environment import capture_environment
from sbpbench.records import ResultRow, decode_row, read_rows, upsert_rows
from sbpbench.report.inputs import load_table
from sbpbench.runner.pricing import price_experiment
from sbpbench.runner.sweep import plan, run_sweep
from sbpbench.simulate.cost import SEED_S
from sbpbench.workload.rows import spec_fields

from ..subprocess.test_maxlen import _fake_measure, _search

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "results.csv"


class Predictions:
    """What the stand-in simulated search was asked (method, device_name), and the answer columns
    a test sets for a method (default: max T 296, OOM at 304)."""

    def __init__(self):
        self.asked: list[tuple[str, str]] = []
        self.answers: dict[str, dict] = {}


@pytest.fixture
def predicted(monkeypatch) -> Predictions:
    """The simulated search each seed runs, stood in by one that answers at once."""
    predictions = Predictions()

    def simulated_max_len(search, out, *, probing, **options) -> ResultRow:
        predictions.asked.append((search.method, probing["device_name"]))
        row = ResultRow(**spec_fields(search.base), kind="maxlen", source="simulated")
        row.status, row.max_seq_len, row.oom_seq_len = "ok", 296, 304
        for name, value in predictions.answers.get(search.method, {}).items():
            setattr(row, name, value)
        return row

    monkeypatch.setattr(simulated_search, "simulated_max_len", simulated_max_len)
    return predictions


def _seed(out, *, capacity=None, lines=None):
    return simulated_search.estimate_seed(
        capacity_bytes=capacity, note=(lines if lines is not None else []).append, out=out, target="cuda"
    )


def test_a_predicted_seed_is_stored_as_a_labelled_prediction_and_read_back(tmp_path, predicted):
    """The seed's row is kind seed, source simulated, for the simulated GPU of the search's memory;
    a second command reads it (its line says so) and predicts nothing."""
    out, lines = tmp_path / "e.csv", []
    assert _seed(out, lines=lines)(_search()) == 296 and len(predicted.asked) == 1
    (row,) = read_rows(out)
    assert (row["kind"], row["source"], row["device_name"], row["device"]) == (
        "seed",
        "simulated",
        "simulated GPU",
        "cuda",
    )
    assert (row["seed_seq_len"], row["memory_limit_bytes"], row["status"]) == ("296", str(1 << 30), "ok")
    assert row["search_resolution"] == "1%" and row["seq_len"] == ""
    assert _seed(out, lines=lines)(_search()) == 296 and len(predicted.asked) == 1
    assert lines[-1] == f"bp: seed: predicted max T 296 (stored in {out})"


def test_a_seed_serves_only_the_memory_resolution_and_ceiling_it_was_predicted_for(tmp_path, predicted):
    """Another GPU memory (a capacity under the limit), another resolution, a higher ceiling than
    one the prediction reached, or a failed prediction: predicted again; the same again: read."""
    out = tmp_path / "e.csv"
    _seed(out, capacity=1 << 29)(_search())  # capped at the GPU's 512 MiB
    _seed(out, capacity=1 << 29)(_search())
    assert len(predicted.asked) == 1
    _seed(out, capacity=1 << 31)(_search())  # the limit, 1 GiB
    assert len(predicted.asked) == 2 and len(read_rows(out)) == 2
    finer = replace(_search(), resolution=type(_search().resolution).parse("2%"))
    _seed(out, capacity=1 << 31)(finer)
    assert len(predicted.asked) == 3
    predicted.answers["ckpt"] = {"max_seq_len": 1 << 16, "oom_seq_len": None}  # everything fit, to the ceiling
    _seed(out)(_search("ckpt"))
    _seed(out)(_search("ckpt"))
    assert len(predicted.asked) == 4
    _seed(out)(replace(_search("ckpt"), seq_len_ceiling=1 << 17))
    assert len(predicted.asked) == 5
    predicted.answers["streambp"] = {"status": "error", "error": "boom", "max_seq_len": None}
    assert _seed(out)(_search("streambp")) is None
    assert _seed(out)(_search("streambp")) is None and len(predicted.asked) == 7
    (failed,) = [r for r in read_rows(out) if r["method"] == "streambp"]
    assert failed["status"] == "error" and "boom" in failed["error"] and failed["seed_seq_len"] == ""


class Stop(Exception):
    pass


def test_a_resumed_sweep_starts_its_search_from_the_seed_the_first_one_stored(tmp_path, predicted):
    """A sweep stopped at its search's first probe has stored the seed: the next one predicts
    nothing and probes from the seed, 296 then 296 + 1%."""
    path = tmp_path / "e.toml"
    path.write_text(
        'name = "e"\nkind = "maxlen"\n[defaults]\ndevice = "cpu"\nmodel = "tiny/qwen3"\nmemory_limit = "1GiB"\n'
        'seq_len = 64\nresolution = "1%"\n[[points]]\nmethod = "bp"\n'
    )
    out, env = tmp_path / "e.csv", capture_environment("cpu")
    jobs = plan(load_experiment(path).points, out, device_name=env.device_name)
    seed = simulated_search.estimate_seed(capacity_bytes=None, note=print, out=out)

    def stopped(spec, env):
        raise Stop

    with pytest.raises(Stop):
        run_sweep(jobs, out, measure=stopped, env=env, seed=seed)
    assert len(predicted.asked) == 1 and [r["kind"] for r in read_rows(out)] == ["seed"]
    assert predicted.asked[0][1] == "simulated CPU"  # a CPU search's seed predicts the CPU's tracker
    calls: list[int] = []
    again = simulated_search.estimate_seed(capacity_bytes=None, note=print, out=out)
    (answer,) = run_sweep(jobs, out, measure=_fake_measure(300, calls), env=env, seed=again)
    assert len(predicted.asked) == 1 and calls == [296, 304]
    assert (answer.max_seq_len, answer.seed_seq_len) == (296, 296)


def _experiment(tmp_path) -> Path:
    path = tmp_path / "e.toml"
    path.write_text(
        'name = "e"\nkind = "maxlen"\n[defaults]\nmodel = "tiny/qwen3"\nmemory_limit = "1GiB"\nseq_len = 64\n'
        'resolution = "1%"\n[[points]]\nmethod = ["bp", "streambp", "tiled"]\n'
    )
    return path


def test_a_stored_seed_is_priced_as_no_host_time_and_a_search_without_one_as_none(tmp_path, predicted):
    """--dry-run's host time: SEED_S for each seeded search whose seed is not stored, nothing for a
    stored one (its max T then prices the probes) or for a peer, which has no seed."""
    path, out, results = _experiment(tmp_path), tmp_path / "e.csv", tmp_path / "results"
    before = price_experiment(path, results=results, out=out)
    assert [c.host_s for c in before.costs] == [SEED_S, SEED_S, 0.0]
    seed = _seed(out)
    for search in load_experiment(path, device="cpu", defaults_for="cuda").searches:
        seed(search)
    after = price_experiment(path, results=results, out=out)
    assert [c.host_s for c in after.costs] == [0.0, 0.0, 0.0] and after.host_s == 0
    assert "at max T 296 (its stored seed)" in after.costs[0].note
    other = price_experiment(path, results=results, out=out, capacity_bytes=1 << 29)  # a smaller GPU
    assert [c.host_s for c in other.costs] == [SEED_S, SEED_S, 0.0]


def test_the_report_and_the_plots_never_read_seed_rows(tmp_path, predicted):
    """The table `sbp report` and `sbp plot` read is the same with or without seed rows beside the
    results, and a file of seed rows alone has no results to show."""
    plain, seeded = tmp_path / "plain" / "r.csv", tmp_path / "seeded" / "r.csv"
    for path in (plain, seeded):
        path.parent.mkdir()
        shutil.copy(FIXTURE, path)
    seeds = tmp_path / "seeds.csv"
    _seed(seeds)(_search())
    _seed(seeds)(_search("streambp"))
    upsert_rows(seeded, [decode_row(row) for row in read_rows(seeds)])
    assert sum(r["kind"] == "seed" for r in read_rows(seeded)) == 2
    with_seeds, without = load_table(seeded).drop(columns="source_file"), load_table(plain).drop(columns="source_file")
    assert with_seeds.equals(without)
    with pytest.raises(ValueError, match="no result rows"):
        load_table(seeds)
