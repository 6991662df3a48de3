"""What measuring costs on a GPU, predicted (simulate/cost.py, runner/pricing.py, `sbp sweep --dry-run`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.config import MaxlenSpec, RunSpec
from sbpbench.config.experiment import load_experiment
from sbpbench.methods import MethodSettings
from sbpbench.records import ResultRow, upsert_rows
from sbpbench.records.reference import load_reference
from sbpbench.runner.pricing import price_experiment
from sbpbench.simulate import cost
from sbpbench.simulate.timing import Rates

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "experiments" / "paper_on_one_gpu.toml"


def _spec(method="streambp", seq_len=65536, **values) -> RunSpec:
    settings = MethodSettings(chunk_size=4096, logits_chunk_size=942) if method == "streambp" else MethodSettings()
    return RunSpec(model="Qwen/Qwen3-8B", method=method, seq_len=seq_len, dtype="bf16", settings=settings, **values)


def test_a_point_costs_its_start_and_each_of_its_steps():
    """warmup + 1 + repeats steps at the time model's step time, plus a start that grows with the
    model's weights; longer sequences cost more; a peer without a time model is priced as ckpt."""
    rates = Rates()
    one = cost.point_cost(_spec(warmup=0, repeats=0), rates)
    three = cost.point_cost(_spec(warmup=1, repeats=1), rates)
    step, _, _ = cost.step_s(_spec(), rates)
    assert one.steps == 1 and three.steps == 3
    assert three.device_s - one.device_s == pytest.approx(2 * step)
    assert one.device_s - step == pytest.approx(cost.start_s(_spec()))
    assert cost.start_s(_spec()) > cost.START_S + 15 * cost.BUILD_S_PER_GIB  # 15.3 GiB of bf16 weights
    assert cost.point_cost(_spec(seq_len=131072), rates).device_s > one.device_s
    peer = cost.point_cost(_spec(method="ckpt-offload", seq_len=8192), rates)
    assert peer.note == "priced as ckpt"
    assert peer.device_s == pytest.approx(cost.point_cost(_spec(method="ckpt", seq_len=8192), rates).device_s)


def test_a_search_costs_its_probes_at_the_predicted_max_t_or_is_unknown():
    """A seeded search: SEEDED_PROBES memory-only points near its max T, plus the seed's host time;
    without a predicted max T its device time is unknown (NaN), and the note says how to learn it."""
    search = MaxlenSpec(base=_spec(seq_len=1024, warmup=0, repeats=0), seq_len_ceiling=262144)
    priced = cost.search_cost(search, Rates(), 100_000, " (predicted)")
    probe = cost.point_cost(search.probe(100_000), Rates())
    assert priced.steps == cost.SEEDED_PROBES and priced.host_s == cost.SEED_S
    assert priced.device_s == pytest.approx(cost.SEEDED_PROBES * probe.device_s)
    assert "at max T 100,000 (predicted)" in priced.note
    unknown = cost.search_cost(search, Rates(), None)
    assert math.isnan(unknown.device_s) and "sbp maxlen --simulate" in unknown.note


def test_max_t_comes_from_simulated_rows_of_the_same_placement_else_the_paper():
    """The latest simulated search of the same model, method, ranks and setting wins; another
    placement's or 8 GPUs sharing the sequence is not it; without one the paper's Figure 3 number;
    without either, None."""
    search = MaxlenSpec(base=_spec(seq_len=1024, repeats=0), seq_len_ceiling=262144)
    row = {"kind": "maxlen", "source": "simulated", "model": "Qwen/Qwen3-8B", "method": "streambp",
           "objective": "sft", "lora_rank": "0", "step": "bp", "dtype": "bf16", "batch_size": "1", "nproc": "1",
           "sp": "1", "max_seq_len": "140288", "checkpoints": "gpu", "timestamp_utc": "2026-11-26T10:00:00"}  # fmt: skip
    newer = {**row, "max_seq_len": "141000", "timestamp_utc": "2026-11-26T11:00:00"}
    offloaded = {**row, "max_seq_len": "300000", "checkpoints": "cpu", "timestamp_utc": "2026-11-26T12:00:00"}
    shared = {**row, "max_seq_len": "1638400", "nproc": "8", "sp": "8", "timestamp_utc": "2026-11-28T12:00:00"}
    assert cost.predicted_max_t(search, [row, newer, offloaded, shared]) == (141000, " (predicted)")
    assert cost.predicted_max_t(search, [offloaded], load_reference()) == (110000, " (the paper's)")
    assert cost.predicted_max_t(search, []) == (None, "")


def test_commands_start_a_new_one_when_a_point_would_not_finish():
    """Packed in order into --budget commands: a point that would not finish in what is left, or
    with under min_start_s left, starts the next command; an unknown cost counts its host time."""
    costs = [cost.Cost(str(s), 1, s) for s in (200.0, 300.0, 100.0, 520.0, 10.0)]
    assert cost.commands(costs, budget_s=540, min_start_s=30) == [1, 1, 2, 3, 4]
    unknown = cost.Cost("search", 0, float("nan"), host_s=60.0)
    assert cost.commands([unknown, costs[0]], budget_s=540) == [1, 1]


@pytest.mark.filterwarnings("ignore::sbpbench.config.run.BeyondContextWarning")  # 262k is past Qwen3-8B's context
def test_the_paper_experiment_is_in_the_order_of_value():
    """paper_on_one_gpu.toml: Figure 3's Qwen3-8B searches at 2% first, then the 64k placements, Table 1
    (ckpt and streambp, 6k-27k, 1 warm-up and 3 timed steps), Table 2's batches, Qwen3-14B's searches,
    one memory step at 262,144 each with checkpoints in host memory and streamed through 7 host
    buffers, and the peers at 9k and 24k."""
    loaded = load_experiment(PAPER, device="cpu", defaults_for="cuda")
    titles = list(dict.fromkeys(loaded.titles))
    assert titles == ["Fig. 3 max T, Qwen3-8B", "64k: gpu, cpu, recompute:4", "Table 1, Qwen3-4B", "Table 2, Qwen3-4B at 9k",
                      "Fig. 3 max T, Qwen3-14B", "Qwen3-8B 262k, cpu", "Qwen3-8B 262k, stream:7",
                      "peers at 9k and 24k"]  # fmt: skip
    by_title = {t: [p for p, title in zip(loaded.points, loaded.titles) if title == t] for t in titles}
    fig3 = by_title["Fig. 3 max T, Qwen3-8B"]
    assert [s.method for s in fig3] == ["bp", "ckpt", "streambp"] and {str(s.resolution) for s in fig3} == {"2%"}
    assert {str(p.settings.checkpoints) for p in by_title["64k: gpu, cpu, recompute:4"]} == {
        "gpu",
        "cpu",
        "recompute:4",
    }
    table1 = by_title["Table 1, Qwen3-4B"]
    assert {p.method for p in table1} == {"ckpt", "streambp"} and {(p.warmup, p.repeats) for p in table1} == {(1, 3)}
    assert sorted({p.seq_len for p in table1}) == list(range(6000, 27001, 3000))
    assert sorted({p.batch_size for p in by_title["Table 2, Qwen3-4B at 9k"]}) == [1, 2, 4, 16]
    (long,) = by_title["Qwen3-8B 262k, cpu"]
    assert (long.seq_len, str(long.settings.checkpoints), long.repeats) == (262144, "cpu", 0)
    (streamed,) = by_title["Qwen3-8B 262k, stream:7"]
    assert (streamed.seq_len, str(streamed.settings.checkpoints), streamed.repeats) == (262144, "stream:7", 0)
    assert {p.seq_len for p in by_title["peers at 9k and 24k"]} == {9000, 24000}


@pytest.mark.slow  # prices a sweep's searches from simulated runs: 10-13 s on 2 busy cores
@pytest.mark.filterwarnings("ignore::sbpbench.config.run.BeyondContextWarning")
def test_pricing_leaves_out_what_the_results_csv_already_holds(tmp_path):
    """A point already in the results CSV (its row key, on the priced GPU) costs nothing and counts
    as done; the others are priced as before."""
    from sbpbench.workload.rows import spec_fields

    whole = price_experiment(PAPER, results=ROOT / "results")
    first = load_experiment(PAPER, device="cpu", defaults_for="cuda").grid[0]  # the 64k gpu point
    row = ResultRow(**spec_fields(first), kind="point", source="measured", device_name=whole.device, status="ok")
    out = tmp_path / "paper.csv"
    upsert_rows(out, [row])
    resumed = price_experiment(PAPER, results=ROOT / "results", out=out)
    assert (whole.done, resumed.done) == (0, 1)
    assert [c.label for c in resumed.costs] == [c.label for c in whole.costs if c.label != whole.costs[3].label]
    assert whole.costs[3].label == "Qwen/Qwen3-8B streambp T=65536"


def test_dry_run_prints_the_entries_and_runs_nothing(tmp_path):
    """`sbp sweep FILE --dry-run`: the entries left with predicted minutes and commands, the GPU and
    rates priced with, labelled a prediction; no results file is written."""
    out = tmp_path / "paper.csv"
    result = CliRunner().invoke(app, ["sweep", str(PAPER), "--dry-run", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "Fig. 3 max T, Qwen3-8B" in result.output and "Table 1, Qwen3-4B" in result.output
    assert "not measured" in result.output and "NVIDIA H100 80GB HBM3" in result.output
    assert not out.exists()


@pytest.mark.slow  # prices a sweep's searches from simulated runs: 9-13 s on 2 busy cores
@pytest.mark.filterwarnings("ignore::sbpbench.config.run.BeyondContextWarning")
def test_a_sweeps_budget_weighs_a_point_at_the_dry_runs_price():
    """The seconds --budget weighs before starting a point (pricing.py point_seconds) are the ones
    --dry-run prints for it, on the same GPU."""
    from sbpbench.runner.pricing import point_seconds

    whole = price_experiment(PAPER, results=ROOT / "results")
    first = load_experiment(PAPER, device="cpu", defaults_for="cuda").grid[0]  # the 64k gpu point
    seconds = point_seconds(whole.device, ROOT / "results")(first)
    assert seconds == whole.costs[3].device_s and 60 < seconds < 3600
