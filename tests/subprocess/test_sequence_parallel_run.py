"""`sbp run --sp P` and `sbp check --nproc N --sp P`: ranks sharing each sequence (Ulysses), for
streambp and the ulysses peer (methods/ulysses.py: DeepSpeed's ALST parts). The spawning tests are
slow-tier, one command each; the rest run in-process (a check's ranks played by a stand-in that
runs the method's step here on the same seeded weights)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.cli.tables import ranks_terms
from sbpbench.config import ConfigError, point_specs
from sbpbench.data import make_sft_batch
from sbpbench.methods import SEQUENCE_PARALLEL_METHODS, method_names
from sbpbench.methods.exactness import step_gradients
from sbpbench.methods.streambp import unpadded_mask
from sbpbench.methods.ulysses import _replaced, local_shard
from sbpbench.records import ResultRow, read_rows
from sbpbench.records.exactness import read_exactness
from sbpbench.runner import rank_gradients
from sbpbench.workload.build import build_model_and_batch

runner = CliRunner()
POINT = {"device": "cpu", "model": "tiny/qwen3", "seq_len": 64}
CHECK_SP2 = ["check", "--nproc", "2", "--sp", "2", "--model", "tiny/qwen3"]
PERTURBED = "model.layers.1.self_attn.k_norm.weight"  # a small tensor, as tests/exactness/test_exactness_fp32.py
# one element of PERTURBED off by this fraction of the tensor's largest gradient: far beyond rounding
# in each dtype (bp's own error on it: ~1e-6 in fp32, ~1e-2 in bf16 at T=64)
WRONG_BY = {"fp32": 1e-4, "bf16": 0.1}


def _one_wrong_element(step, relative: float):
    """(loss, grads) with one element of PERTURBED off by `relative` of its tensor's largest gradient."""
    loss, grads = step
    grads = dict(grads)
    wrong = grads[PERTURBED].clone()
    wrong.view(-1)[3] += relative * wrong.abs().max()
    grads[PERTURBED] = wrong
    return loss, grads


def _in_process_ranks(relative: float = 0.0):
    """A stand-in for ranked_step: the spec's method run here on the weights the ranks would build
    (the same seed, dtype and LoRA options), one element wrong when `relative` is not 0."""

    def ranked_step(spec):
        model, batch = build_model_and_batch(spec, lora_alpha=2 * spec.lora_rank, lora_init_seed=spec.seed)
        step = step_gradients(spec.method, model, batch, spec.settings)
        return _one_wrong_element(step, relative) if relative else step

    return ranked_step


def _judged(result) -> dict[str, str]:
    """{method: the result cell} of a check's table, as printed."""
    cells = ("exact", "DIFFERS", "reference ok", "REFERENCE?")
    rows = [line.split("│") for line in result.output.splitlines() if line.count("│") > 3]
    return {row[1].strip(): row[2].strip() for row in rows if row[2].strip() in cells}


def test_ranks_sharing_a_sequence_default_to_the_methods_that_can():
    """With --sp over 1 no method named means streambp and ulysses, and `all` the same; each spec keeps sp."""
    assert SEQUENCE_PARALLEL_METHODS == ("streambp", "ulysses")
    specs = point_specs({**POINT, "nproc": 4, "sp": 2})
    assert [(s.method, s.nproc, s.sp) for s in specs] == [("streambp", 4, 2), ("ulysses", 4, 2)]
    assert method_names(["all"], 2) == SEQUENCE_PARALLEL_METHODS
    assert method_names(None) == ("bp", "ckpt", "streambp")  # --sp 1: the paper's comparison, as before


def test_ulysses_without_deepspeed_is_one_line_where_named_and_a_row_where_defaulted(monkeypatch):
    """DeepSpeed is an optional extra: `--method ulysses` without it is refused before work, saying to
    install it; as one of the defaults of --sp it is kept (its row says unsupported, streambp still runs)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ConfigError) as error:
        point_specs({**POINT, "nproc": 2, "sp": 2}, ["ulysses"])
    assert "pip install -e '.[deepspeed]'" in error.value.naming("--method")
    assert [s.method for s in point_specs({**POINT, "nproc": 2, "sp": 2})] == ["streambp", "ulysses"]


def test_right_padding_runs_unmasked_and_other_padding_is_kept():
    """Rows padded at their end only need no mask under sequence parallelism; a left-padded row keeps
    its mask (the step then refuses it)."""
    batch = make_sft_batch(batch_size=3, seq_len=40, vocab_size=50, seed=1)
    assert not bool(batch.attention_mask.all()) and unpadded_mask(batch.attention_mask) is None
    left = batch.attention_mask.flip(1)
    assert unpadded_mask(left) is left and unpadded_mask(None) is None


def test_labels_are_shifted_over_the_whole_row_before_the_cut():
    """As UlyssesSPDataLoaderAdapter: each rank's targets are the row's shifted labels cut in P equal
    shares (rank 0's last target is rank 1's first label), with the positions they hold."""
    batch = make_sft_batch(batch_size=2, seq_len=12, vocab_size=50, seed=0, padding=False)
    shares = [local_shard(batch, rank, 3) for rank in range(3)]
    assert torch.equal(torch.cat([ids for ids, _, _ in shares], dim=1), batch.input_ids)
    targets = torch.cat([t for _, _, t in shares], dim=1)
    assert torch.equal(targets[:, :-1], batch.labels[:, 1:]) and bool((targets[:, -1] == -100).all())
    assert shares[1][1][0].tolist() == [4, 5, 6, 7]


def test_a_replaced_transformers_function_is_put_back():
    """ulysses installs DeepSpeed's attention and a no-mask function for the step only: the registry
    reads as before after, whether the function was the global one or a local override."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with _replaced(ALL_ATTENTION_FUNCTIONS, "sdpa", len):
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is len
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before and "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping


@pytest.fixture
def tiled_loss_case(monkeypatch):
    """(DeepSpeed's ulysses_sp, a float64 head (8 -> 20), hidden (1, 12, 8), targets, a summed
    cross-entropy shard function) for TiledFusedLogitsLoss in 3 shards."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ulysses_sp = pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 20, bias=False).double()
    hidden = torch.randn(1, 12, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 20, (1, 12))

    def summed(module, x, y):
        return torch.nn.functional.cross_entropy(module(x), y, reduction="sum")

    return ulysses_sp, head, hidden, targets, summed


def test_deepspeeds_tiled_loss_drops_a_scale_applied_after_it(tiled_loss_case):
    """Why ulysses normalises inside the tiled loss: DeepSpeed's TiledFusedLogitsLoss runs its
    parameters' backward in its forward with a gradient of 1, so a scale after it (ArcticTraining
    divides by the counted tokens) reaches the input's gradient but not lm_head's."""
    ulysses_sp, head, hidden, targets, summed = tiled_loss_case
    (ulysses_sp.TiledFusedLogitsLoss.apply(summed, head, hidden, targets, None, 3, [], "sum") * 0.25).backward()
    tiled = (head.weight.grad.clone(), hidden.grad.clone())
    head.weight.grad, hidden.grad = None, None
    (summed(head, hidden.view(-1, 8), targets.view(-1)) * 0.25).backward()
    assert torch.allclose(tiled[1], hidden.grad)
    assert torch.allclose(tiled[0] * 0.25, head.weight.grad)  # unscaled


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_the_branch_free_tiled_loss_gives_deepspeeds_gradients(tiled_loss_case, scale):
    """ulysses' TiledFusedLogitsLoss subclass (no branch on the incoming gradient, so fake tensors run
    it) gives DeepSpeed's loss and gradients bit for bit, at an incoming gradient of 1 and of another."""
    from sbpbench.methods.ulysses import branch_free

    ulysses_sp, head, hidden, targets, summed = tiled_loss_case
    results = []
    for tiled in (ulysses_sp.TiledFusedLogitsLoss, branch_free(ulysses_sp)):
        head.weight.grad, hidden.grad = None, None
        loss = tiled.apply(summed, head, hidden, targets, None, 3, [], "sum")
        (loss * scale).backward()
        results.append((loss.detach(), head.weight.grad.clone(), hidden.grad.clone()))
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(*results))
    assert branch_free(ulysses_sp) is branch_free(ulysses_sp)  # one subclass per process


def test_a_sequence_parallel_row_says_its_groups_and_shared_cores():
    """The run table's title and caption: ranks per sequence, data groups, and oversubscribed CPUs."""
    row = ResultRow(method="streambp", nproc=4, sp=2, num_threads=1, num_cpus=2)
    ranks, note = ranks_terms(row)
    assert ranks == "4 ranks, 2 per sequence"
    assert "2 data-parallel group(s) (FSDP2) of 2 ranks sharing each sequence" in note
    assert note.endswith("times of 2 oversubscribed CPU(s)")
    assert "oversubscribed" not in ranks_terms(ResultRow(method="bp", nproc=2, sp=1, num_threads=1, num_cpus=2))[1]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_check_on_ranks_judges_fp32_and_bf16_by_bps_own_error(monkeypatch, dtype):
    """--dtype fp32 and bf16 on ranks: the ranks' step is judged against bp's fp64 step by bp's own
    error in that dtype, as in one process (stand-in ranks); one element of a small tensor off fails."""
    monkeypatch.setenv("COLUMNS", "160")
    args = [*CHECK_SP2, "--seq", "32", "--method", "streambp", "--dtype", dtype]
    monkeypatch.setattr(rank_gradients, "ranked_step", _in_process_ranks())
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert _judged(result) == {"bp": "reference ok", "streambp": "exact"}, result.output
    assert "on 2 ranks, 2 per sequence, vs bp fp64 in one process" in result.output
    monkeypatch.setattr(rank_gradients, "ranked_step", _in_process_ranks(WRONG_BY[dtype]))
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and _judged(result) == {"bp": "reference ok", "streambp": "DIFFERS"}, result.output
    assert f"{PERTURBED}: rel error" in result.output, result.output


@pytest.mark.slow
def test_sbp_run_on_two_ranks_sharing_each_sequence(tmp_path):
    """`sbp run --device cpu --nproc 2 --sp 2 --model tiny/qwen3 --seq 256`: streambp and ulysses, ok
    rows with sp 2 and both ranks' peaks, the same loss (fp32)."""
    pytest.importorskip("deepspeed", reason="ulysses is an optional extra: pip install -e '.[deepspeed]'")
    out = tmp_path / "runs.csv"
    args = ["run", "--device", "cpu", "--nproc", "2", "--sp", "2", "--model", "tiny/qwen3", "--seq", "256"]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 ranks, 2 per sequence" in " ".join(result.output.split())
    rows = read_rows(out)
    assert [(r["method"], r["status"], r["nproc"], r["sp"]) for r in rows] == [
        ("streambp", "ok", "2", "2"),
        ("ulysses", "ok", "2", "2"),
    ]
    for row in rows:
        peaks = [int(p) for p in row["rank_peak_bytes"].split(";")]
        assert len(peaks) == 2 and max(peaks) == int(row["peak_allocated_bytes"]) and row["num_cpus"]
    losses = [float(r["loss"]) for r in rows]
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0]), losses


@pytest.mark.slow
def test_sbp_check_judges_ranks_sharing_a_sequence_against_one_process(tmp_path):
    """`sbp check --nproc 2 --sp 2 --method streambp`: streambp on 2 ranks gives one-process bp's loss
    and every gradient to the fp64 tolerance (1e-10); the rows say how it ran. (ulysses in fp64: the
    test below; both in fp32: the one after.)"""
    out = tmp_path / "exactness.csv"
    args = ["check", "--nproc", "2", "--sp", "2", "--model", "tiny/qwen3", "--seq", "64", "--method", "streambp"]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "on 2 ranks, 2 per sequence, vs bp in one process" in " ".join(result.output.split())
    rows = read_exactness(out)
    assert [(r["method"], r["result"]) for r in rows] == [("streambp", "exact")]
    assert all(float(r["tolerance"]) == 1e-10 and "2 sharing each sequence" in r["note"] for r in rows)


@pytest.mark.slow
def test_the_ulysses_peer_is_exact_across_heads_ranks_and_adapters():
    """ulysses in fp64 against one-process bp, to 1e-10: an untied lm_head on 2 data x 2 sequence ranks
    (gloo subgroups; DeepSpeed's tiled loss would get the head's gradient wrong, see above), and LoRA on
    a model with one key/value head over 2 ranks (DeepSpeed repeats it)."""
    pytest.importorskip("deepspeed", reason="ulysses is an optional extra: pip install -e '.[deepspeed]'")
    cases = [
        ["--model", "tiny/qwen2", "--nproc", "4", "--sp", "2"],
        ["--model", "tiny/llama", "--nproc", "2", "--sp", "2", "--lora-rank", "4"],
    ]
    for case in cases:
        result = runner.invoke(app, ["check", "--method", "ulysses", "--seq", "64", *case])
        assert result.exit_code == 0 and "exact" in result.output and "DIFFERS" not in result.output, result.output


@pytest.mark.slow
def test_sbp_check_on_ranks_in_fp32_is_judged_by_bps_own_fp32_error(tmp_path, monkeypatch):
    """`sbp check --nproc 2 --sp 2 --dtype fp32`: streambp and ulysses in fp32 on 2 ranks are within a
    small factor of one-process bp's own fp32 error from bp's fp64 step; the same rank gradients with
    one element of a small tensor 1e-4 off fail (replayed, no second spawn)."""
    pytest.importorskip("deepspeed", reason="ulysses is an optional extra: pip install -e '.[deepspeed]'")
    monkeypatch.setenv("COLUMNS", "160")
    real, seen = rank_gradients.ranked_step, {}

    def recorded(spec):
        seen[spec.method] = real(spec)
        return seen[spec.method]

    monkeypatch.setattr(rank_gradients, "ranked_step", recorded)
    out = tmp_path / "exactness.csv"
    args = [*CHECK_SP2, "--seq", "64", "--dtype", "fp32"]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert _judged(result) == {"bp": "reference ok", "streambp": "exact", "ulysses": "exact"}, result.output
    assert "ulysses: error / bp's error over" in result.output
    rows = read_exactness(out)
    assert [(r["method"], r["result"], r["dtype"], r["reference"]) for r in rows] == [
        ("streambp", "exact", "fp32", "bp fp64"),
        ("ulysses", "exact", "fp32", "bp fp64"),
    ]
    assert all(float(r["tolerance"]) > 1e-10 and "2 sharing each sequence" in r["note"] for r in rows)
    wrong = {method: _one_wrong_element(step, WRONG_BY["fp32"]) for method, step in seen.items()}
    monkeypatch.setattr(rank_gradients, "ranked_step", lambda spec: wrong[spec.method])
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert _judged(result) == {"bp": "reference ok", "streambp": "DIFFERS", "ulysses": "DIFFERS"}, result.output
