"""`sbp run --nproc N` and `sbp estimate --nproc N`: a point data-parallel on N ranks under FSDP2
(runner/ranks.py, simulate/sharded.py). The spawning test is slow-tier; the rest run in-process."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.config import ConfigError, point_specs
from sbpbench.config.run import check_nproc
from sbpbench.measure.tensor_tracker import LiveTensorTracker
from sbpbench.records import ResultRow
from sbpbench.runner.isolated import run_isolated
from sbpbench.runner.ranks import merge_rank_rows
from sbpbench.simulate import estimate
from sbpbench.simulate.estimate import estimate_point
from sbpbench.simulate.fake_mode import build_fake_step
from sbpbench.simulate.sharded import sharded_terms

runner = CliRunner()
# the paper's logits chunk, as before chunk sizes defaulted to auto: with the head in one chunk (auto's
# 1024 here) the 2-rank streambp estimate comes out 7% under the tracker (issue 26's report)
POINT = {"device": "cpu", "model": "tiny/qwen3", "seq_len": 256, "repeats": 0, "warmup": 0, "threads": 1}
POINT |= {"logits_chunk_size": 100}


def _spec(method: str, **values):
    (spec,) = point_specs({**POINT, **values}, [method])
    return spec


def test_every_placement_is_accepted_sharded():
    """The placements all run on FSDP2 ranks (a segment rebuild gathers each rebuilt layer once)."""
    for placement in ("gpu", "cpu", "recompute:2", "cpu+recompute:2"):
        assert _spec("streambp", nproc=2, checkpoints=placement).settings.checkpoints.name == placement


@pytest.mark.parametrize(
    ("flag", "words"),
    [("0", "--nproc must be at least 1"), ("abc", "--nproc must be an integer"), ("-2", "at least 1")],
)
def test_a_bad_nproc_is_a_one_line_error(flag, words):
    """--nproc 0, -2 or abc: exit 2 with one line naming the flag, before anything runs."""
    result = runner.invoke(app, ["run", "--device", "cpu", "--model", "tiny/qwen3", "--nproc", flag])
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output


def test_more_ranks_than_gpus_names_what_to_do(monkeypatch):
    """On CUDA each rank needs its own GPU: asking for more says how many are visible and what to give."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError) as error:
        check_nproc(4, "cuda:0")
    message = error.value.naming("--nproc")
    assert "--nproc 4 needs 4 GPUs" in message and "give --nproc 2 or fewer" in message and "\n" not in message
    check_nproc(2, "cuda:0")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    check_nproc(8, "cpu")  # a core per gloo rank


def test_a_method_without_a_sharded_path_is_unsupported_not_launched():
    """tiled under --nproc 2 is a row with status unsupported and the reason; no process starts."""
    row = run_isolated(_spec("tiled", nproc=2))
    assert (row.status, row.nproc) == ("unsupported", 2)
    assert "does not run data-parallel" in row.error and "bp, ckpt, streambp" in row.error
    assert estimate_point(_spec("tiled", nproc=2), target="cpu").status == "unsupported"


def test_rank_rows_merge_to_the_max_with_each_rank_peak():
    """Memory and time columns are the max over ranks, rank_peak_bytes lists each, the worst status wins."""
    base = {"method": "bp", "batch_size": 1, "seq_len": 8, "model_flops": 1e9, "nproc": 2}
    rows = [
        ResultRow(**base, status="ok", peak_allocated_bytes=10, baseline_bytes=4, time_median_s=2.0, loss=1.5),
        ResultRow(**base, status="ok", peak_allocated_bytes=12, baseline_bytes=3, time_median_s=3.0, loss=2.5),
    ]
    rows[0].host_register_s, rows[1].host_register_s = 0.5, 0.25
    merged = merge_rank_rows(rows)
    assert (merged.peak_allocated_bytes, merged.baseline_bytes, merged.time_median_s) == (12, 4, 3.0)
    assert merged.host_register_s == 0.5
    assert (merged.rank_peak_bytes, merged.loss, merged.tokens_per_s) == ("10;12", 1.5, 8 / 3.0)
    rows[1].status, rows[1].error = "oom", "tracked live tensors reached 9 B"
    merged = merge_rank_rows(rows)
    assert (merged.status, merged.error) == ("oom", "rank 1: tracked live tensors reached 9 B")


def test_the_tracker_counts_storages_resized_in_place():
    """FSDP2 frees and re-allocates gathered parameters with storage.resize_(), which no op shows."""
    with LiveTensorTracker() as tracker:
        t = torch.empty(256)
    storage = t.untyped_storage()
    assert tracker.live_bytes == 1024
    storage.resize_(0)
    tracker.resized(storage)
    assert tracker.live_bytes == 0
    storage.resize_(2048)
    tracker.resized(storage)
    assert (tracker.live_bytes, tracker.peak_bytes) == (2048, 2048)


def test_one_rank_is_exactly_the_one_gpu_estimate():
    """nproc 1 takes today's path unchanged, and the sharded terms at N = 1 reproduce its resident bytes."""
    spec = _spec("streambp")
    assert spec.nproc == 1
    one = estimate(spec, target="cuda")
    assert estimate(spec, target="cuda") == one  # deterministic: the comparison below means something
    terms = sharded_terms(build_fake_step(spec).step, 1, granularity=512)
    assert (terms.baseline_bytes, terms.weights_bytes, terms.grads_bytes) == (
        one.baseline_bytes,
        one.weights_bytes,
        one.grads_bytes,
    )


def test_two_ranks_shard_the_resident_bytes_and_add_the_gathered_units():
    """--nproc 2: weights and gradients halve (tiny/qwen3's rows split evenly), the peak adds the root
    unit and one layer (bp's peak is in the head)."""
    one, two = estimate(_spec("bp"), target="cpu"), estimate(_spec("bp", nproc=2), target="cpu")
    assert two.weights_bytes * 2 == one.weights_bytes and two.grads_bytes * 2 == one.grads_bytes
    assert two.peak_phase == one.peak_phase == "head"
    gathered = two.activation_peak_bytes - one.activation_peak_bytes
    assert gathered == 131_328 + 148_096  # root (tied embedding + final norm) + one decoder layer, fp32


# Measured per-rank peaks (2 gloo ranks, tensor tracker) against the estimate for the same point with
# --target cpu: bp exact, streambp +1.1% (cpu+recompute:2 too), ckpt +3.1% when written
# (simulate/sharded.py says why).
AGREEMENT = {
    ("bp", "gpu"): 0.005,
    ("ckpt", "gpu"): 0.04,
    ("streambp", "gpu"): 0.02,
    ("streambp", "cpu+recompute:2"): 0.02,
}


@pytest.mark.slow
def test_two_cpu_ranks_run_and_the_estimate_agrees_with_the_tracker():
    """bp, ckpt and streambp (two placements) on 2 gloo ranks: ok rows with nproc 2 and both ranks' peaks; each
    estimate (--target cpu) is at or above the measured per-rank peak, within AGREEMENT."""
    for (method, placement), tolerance in AGREEMENT.items():
        spec = _spec(method, nproc=2, **({"checkpoints": placement} if method == "streambp" else {}))
        row = run_isolated(spec)
        assert (row.status, row.nproc, row.error) == ("ok", 2, ""), row.error
        peaks = [int(p) for p in row.rank_peak_bytes.split(";")]
        assert len(peaks) == 2 and max(peaks) == row.peak_allocated_bytes
        predicted = estimate(spec, target="cpu").peak_allocated_bytes
        error = predicted / row.peak_allocated_bytes - 1
        print(
            f"{method} {placement}: measured {row.peak_allocated_bytes:,} B, estimated {predicted:,} B ({error:+.2%})"
        )
        assert 0 <= error <= tolerance, f"{method}: estimate {error:+.2%} off the measured per-rank peak"
