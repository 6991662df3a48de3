"""`--gpus N` and `--sp P` of the predicting commands (`sbp estimate`, `sbp plan`, `sbp maxlen
--simulate`): N GPUs, P of them sharing each sequence, read the same way by each (options.with_gpus)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.cli.options import with_gpus
from sbpbench.records import ResultRow
from sbpbench.settings import default_of

runner = CliRunner()


@pytest.mark.parametrize(
    ("given", "gpus", "methods", "expected"),
    [
        ({}, "8", (), ({"nproc": 8, "sp": 8}, ("streambp",))),  # every GPU shares each sequence
        ({"sp": 4}, "8", ("streambp",), ({"nproc": 8, "sp": 4}, ("streambp",))),  # 2 groups of 4
        ({}, "4", ("streambp", "ulysses"), ({"nproc": 4, "sp": 4}, ("streambp", "ulysses"))),  # the ALST peer beside
        ({"sp": 1}, "8", ("bp", "ckpt"), ({"nproc": 8, "sp": 1}, ("bp", "ckpt"))),  # data parallel: any method
        ({"nproc": 4, "sp": 2}, None, (), ({"nproc": 4, "sp": 2}, ("streambp",))),  # `sbp run`'s spelling
        ({}, "1", ("bp",), ({"nproc": 1, "sp": 1}, ("bp",))),
        ({}, None, ("bp",), ({}, ("bp",))),
    ],
)
def test_gpus_and_sp_make_the_ranks(given, gpus, methods, expected):
    assert with_gpus(given, methods, gpus) == expected


@pytest.mark.parametrize(
    ("given", "gpus", "methods", "error"),
    [
        ({"sp": 2}, None, (), "--sp 2 shares each sequence over GPUs: give --gpus N too, N a multiple of 2"),
        ({"sp": 4}, "6", (), "--sp 4 does not divide --gpus 6"),
        ({"nproc": 6, "sp": 4}, None, (), "--sp 4 does not divide --nproc 6"),
        ({"nproc": 4}, "2", (), "--gpus 2 sets the ranks (--nproc 2); leave --nproc out"),
        ({"sp": 2}, "4", ("streambp", "bp"), "predicted for streambp and ulysses; bp is not modelled so"),
        ({}, "two", (), "--gpus takes a number of GPUs, at least 1, got 'two'"),
    ],
)
def test_a_layout_that_cannot_be_is_one_line(given, gpus, methods, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        with_gpus(given, methods, gpus)


def test_a_simulated_search_on_gpus_probes_their_layout_up_to_p_times_the_ceiling(tmp_path, fake_seeding):
    """`sbp maxlen --simulate --gpus 4 --sp 2`: the search's point is 4 ranks, 2 per sequence, and its
    default ceiling twice one GPU's; --max-seq given is kept; without --simulate, --gpus is refused."""
    searched = fake_seeding  # the searches the (fake) simulated search was asked for
    args = ["maxlen", "--simulate", "--model", "tiny/qwen3", "--gpus", "4", "--sp", "2", "--out"]
    result = runner.invoke(app, [*args, str(tmp_path / "a.csv")])
    assert result.exit_code == 0, result.output
    (search,) = searched
    assert (search.method, search.base.nproc, search.base.sp) == ("streambp", 4, 2)
    assert search.seq_len_ceiling == 2 * default_of("seq_len_ceiling", "cuda", search=True)
    result = runner.invoke(app, [*args, str(tmp_path / "b.csv"), "--max-seq", "9000"])
    assert result.exit_code == 0 and searched[-1].seq_len_ceiling == 9000, result.output
    measured = runner.invoke(app, ["maxlen", "--model", "tiny/qwen3", "--gpus", "4", "--device", "cpu"])
    assert measured.exit_code == 2 and "add --simulate, or measure --nproc N --sp P" in measured.output


def test_the_paper_column_is_for_one_gpu_only():
    """A max-length row of several GPUs has no paper number beside it (the paper's are one GPU's)."""
    from sbpbench.cli.tables import paper_max_len

    row = ResultRow(model="Qwen/Qwen3-8B", method="streambp", step="bp", dtype="bf16", batch_size=1, objective="sft")
    row.kind, row.lora_rank = "maxlen", 0
    one = paper_max_len(row)
    row.nproc, row.sp = 4, 4
    assert one is not None and paper_max_len(row) is None


def test_a_measured_search_on_ranks_sharing_a_sequence_keeps_its_seed():
    """The estimator models `--nproc N --sp P` (each rank's peak to the byte on gloo ranks), so a
    measured search there starts from its seed; a setting it does not model still drops the seed."""
    from sbpbench.config import point_specs
    from sbpbench.runner.simulated_search import unmodelled

    point = {"device": "cpu", "model": "tiny/qwen3", "seq_len": 512, "nproc": 4, "sp": 2}
    (spec,) = point_specs(point, ["streambp"])
    assert unmodelled(spec) is None
    (forced,) = point_specs({**point, "sdpa_backend": "math"}, ["streambp"])
    assert unmodelled(forced) == ("sdpa_backend", "math")
