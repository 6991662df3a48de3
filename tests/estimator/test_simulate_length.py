"""Length extrapolation (simulate/length.py): the peak at T predicted from short sample lengths equals
the full fake run at T to the byte, for every method and checkpoint placement, across remainders of T
by each chunk size; refused (and then run in full) where the peak's phase moves between the samples."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.config import MaxlenSpec, RunSpec
from sbpbench.core import Placement
from sbpbench.core.attention import ChunkState, KVBuffer
from sbpbench.methods import MethodSettings
from sbpbench.records import decode_row, read_rows, upsert_rows
from sbpbench.simulate import estimate, estimate_point
from sbpbench.simulate.depth import estimate_point_by_depth
from sbpbench.simulate.instants import FIRST, chunk_of
from sbpbench.simulate.length import (
    _extrapolate,
    estimate_by_length,
    period,
    predict,
    sample_lengths,
    shared_multiple,
)

CHUNKS = {"chunk_size": 48, "logits_chunk_size": 32, "mlp_tile_size": 32}  # period 48 for streambp


def _spec(model: str, method: str, seq_len: int, **values) -> RunSpec:
    settings = MethodSettings(**{**CHUNKS, **values.pop("settings", {})})
    base = {"dtype": "bf16", "num_layers": 2, "repeats": 0, "warmup": 0, "prompt_len": 40}
    return RunSpec(model=model, method=method, seq_len=seq_len, settings=settings, **(base | values))


def _assert_extrapolated_equals_full(spec: RunSpec, target: str = "cuda") -> None:
    notes: list[str] = []
    extrapolated = estimate_by_length(spec, target=target, note=notes.append)
    assert extrapolated is not None, notes
    full = estimate(spec, target=target)
    # a stream placement's head copies only the chunks with a counted target, whose share follows the
    # batch's random padding at each length, not T: its transfer_bytes are a fit, not exact
    streamed = spec.settings.checkpoints is not None and Placement.parse(spec.settings.checkpoints).stream
    differing = {
        name: (getattr(full, name), getattr(extrapolated, name))
        for name in full.__dataclass_fields__
        if getattr(full, name) != getattr(extrapolated, name) and not (streamed and name == "transfer_bytes")
    }
    assert not differing, f"T={spec.seq_len} from {sample_lengths(spec)}: (full, extrapolated) {differing}"


def test_a_chunk_is_named_from_the_end_of_the_sequence():
    """The first chunk is "first"; any other by its distance to the end, whatever the length."""
    keys = torch.zeros(1, 1, 100, 4)
    capture = KVBuffer(seq_len=100, attend=False, start=0)
    assert chunk_of(capture) == ("capture", FIRST)
    assert chunk_of(replace(capture, start=96)) == ("capture", 4)
    assert chunk_of(KVBuffer(seq_len=1000, attend=True, start=996)) == ("attend", 4)
    grad = ChunkState(64, 0, KVBuffer(seq_len=100, attend=False, keys=keys), keys, keys)
    assert chunk_of(grad) == ("grad", 36)
    assert chunk_of(None) is None


def test_newton_differences_give_the_polynomial_exactly():
    """Two values fix a line and three a parabola; evaluated far away with integer arithmetic."""
    assert _extrapolate([5, 8], 1000) == 5 + 3 * 1000
    square = [3 * t * t + 7 * t + 11 for t in (10, 11, 12)]  # at t = 10 + k
    assert _extrapolate(square, 10**6) == 3 * (10**6 + 10) ** 2 + 7 * (10**6 + 10) + 11


def test_sample_lengths_share_the_remainder_and_end_in_four_chunks():
    """Samples are shorter than T, of its remainder by the layer chunk (and the mask alignment), with
    four layer chunks at least; two for streambp (linear), three for HF's quadratic mask; none when short."""
    stream = _spec("tiny/qwen3", "streambp", 10_001)
    assert period(stream) == 48
    lengths = sample_lengths(stream)
    assert len(lengths) == 2 and lengths[0] > 3 * 48 and lengths[-1] < 10_001
    assert all((10_001 - t) % 48 == 0 for t in lengths)
    bp = _spec("tiny/qwen3", "bp", 10_001)
    assert period(bp) == 128 and len(sample_lengths(bp)) == 3
    assert all((10_001 - t) % 128 == 0 for t in sample_lengths(bp))
    assert sample_lengths(_spec("tiny/qwen3", "streambp", 200)) is None  # samples no shorter than T
    grpo = _spec("tiny/qwen3", "streambp", 10_001, objective="grpo", batch_size=2)
    assert sample_lengths(grpo)[0] > 2 * 40  # the prompt whole (it is capped at T // 2)


@pytest.mark.slow  # over 3 s on 2 cores
def test_streambp_peak_at_t_from_two_short_runs_equals_the_full_run():
    """tiny/qwen3 StreamBP on a GPU at T = 401 from T = 209 and 305: every column to the byte."""
    _assert_extrapolated_equals_full(_spec("tiny/qwen3", "streambp", 401))


@pytest.mark.slow
def test_stream_peak_at_t_from_two_short_runs_equals_the_full_run(monkeypatch):
    """tiny/qwen3 stream:2 at T = 961, its attention in one call per K/V head at T and two heads per
    call at its samples' own lengths: the samples run T's calls, every column to the byte."""
    from sbpbench.core import attention

    spec = _spec("tiny/qwen3", "streambp", 961, settings={"checkpoints": "stream:2"})
    per_key = 2 * 16 * 2 * (1 + 4 // 2)  # one K/V head (dim 16, bf16): keys, values, the query heads' copies
    monkeypatch.setattr(attention, "ATTENTION_BACKWARD_BYTES", 2 * per_key * 480)  # both heads: up to 480 keys
    assert attention.kv_heads_per_call(1, 4, 2, 16, 2, 961) == 1
    assert all(attention.kv_heads_per_call(1, 4, 2, 16, 2, t) == 2 for t in sample_lengths(spec))
    _assert_extrapolated_equals_full(spec)


def test_bp_peak_at_t_from_three_short_runs_equals_the_full_run():
    """HF's BP (its (T, T) padded mask, quadratic) at T = 1001 from three runs of a few hundred tokens."""
    _assert_extrapolated_equals_full(_spec("tiny/llama", "bp", 1001))


# Remainders of T by the layer chunk (48) and the logits chunk (32): 0 by both, 1 by both, 47 and 31
# (last chunks one short of full).
LENGTHS = (960, 961, 1151)
CASES = [  # (model, method, target, depth, spec values)
    ("tiny/qwen3", "streambp", "cuda", 2, {}),
    ("tiny/llama", "streambp", "cuda", 2, {"settings": {"checkpoints": "cpu"}}),
    ("tiny/qwen3", "streambp", "cuda", 3, {"settings": {"checkpoints": "recompute:2"}}),
    ("tiny/llama", "streambp", "cuda", 5, {"settings": {"checkpoints": "cpu+recompute:2"}}),
    ("tiny/qwen3", "streambp", "cuda", 5, {"settings": {"checkpoints": "cpu+recompute:4+spill"}}),
    ("tiny/qwen3", "streambp", "cuda", 2, {"settings": {"checkpoints": "stream"}}),
    (
        "tiny/llama",
        "streambp",
        "cuda",
        3,
        {"settings": {"checkpoints": "stream:2"}, "objective": "dpo", "batch_size": 2},
    ),
    ("tiny/qwen3", "streambp", "cpu", 2, {"dtype": "fp32"}),
    ("tiny/qwen3", "streambp", "cuda", 2, {"lora_rank": 4, "step": "train"}),
    ("tiny/llama", "streambp", "cuda", 2, {"step": "train", "protocol": "first"}),
    ("tiny/qwen3", "streambp", "cuda", 2, {"objective": "grpo", "batch_size": 2}),
    ("tiny/qwen3", "streambp", "cuda", 2, {"objective": "dpo", "batch_size": 2}),
    ("tiny/qwen3", "streambp", "cuda", 2, {"nproc": 2}),
    ("tiny/qwen3", "bp", "cuda", 2, {}),
    ("tiny/llama", "ckpt", "cuda", 2, {"lora_rank": 4}),
    ("tiny/qwen3", "bp", "cpu", 2, {"dtype": "fp32", "objective": "dpo", "batch_size": 2, "protocol": "first"}),
    ("tiny/qwen3", "ckpt", "cuda", 2, {"nproc": 2}),
    ("tiny/qwen3", "ckpt-offload", "cuda", 2, {}),
]


# Each case at one of the lengths, in turn: six cases meet each remainder kind. All three lengths
# for every case would cost the slow tier about 8 minutes of its 2 cores for little more.
GRID = [(*case, LENGTHS[index % len(LENGTHS)]) for index, case in enumerate(CASES)]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "method", "target", "depth", "values", "seq_len"), GRID)
def test_extrapolated_peak_equals_the_full_run_over_a_grid_of_lengths(model, method, target, depth, values, seq_len):
    """Every method and placement, at lengths with every remainder kind by each chunk size: the
    Estimate predicted from short samples equals the full fake run's, every column to the byte."""
    _assert_extrapolated_equals_full(_spec(model, method, seq_len, num_layers=depth, **values), target)


@pytest.mark.parametrize("method", ["ckpt-chunked-ce", "tiled"])
def test_peers_that_loop_over_chunks_are_run_in_full(method):
    """A chunked head or a tiled MLP numbers its ops through a loop as long as T: not extrapolated
    (its instants are not named alike at two lengths), so `predict` is the full run."""
    spec = _spec("tiny/qwen3", method, 400)
    assert estimate_by_length(spec) is None
    assert predict(spec) == estimate(spec)


# tiny/llama, one AdamW step under protocol first: the peak is in layer 0's backward at T = 476 and in
# layer 1's at T = 604, the sample lengths of T = 1500 with layer chunks of 128.
MOVING = _spec(
    "tiny/llama",
    "streambp",
    1500,
    step="train",
    protocol="first",
    settings={"chunk_size": 128, "logits_chunk_size": 32},
)


@pytest.mark.slow
def test_refused_where_the_peak_moves_between_the_samples_and_run_in_full():
    """The samples straddle a change of the peak's phase: no extrapolation (the note says why), and
    `predict` falls back to the full run at T."""
    notes: list[str] = []
    assert sample_lengths(MOVING) == [476, 604]
    assert estimate_by_length(MOVING, note=notes.append) is None
    assert "moves between" in notes[-1]
    assert predict(MOVING) == estimate(MOVING)


@pytest.mark.slow
def test_depth_of_length_extrapolated_rows_equals_the_full_run():
    """estimate_point_by_depth over length-extrapolated shallow rows (Qwen3-0.6B's real shape, 28
    layers, bp at T = 2049) equals the full fake run's row; exact=True is that full run."""
    spec = RunSpec(model="Qwen/Qwen3-0.6B", method="bp", seq_len=2049, dtype="bf16", repeats=0, warmup=0)
    full = estimate_point(spec, gpu_memory_bytes=80 << 30)
    for exact in (False, True):
        row = estimate_point_by_depth(spec, gpu_memory_bytes=80 << 30, exact=exact)
        for column in ("peak_allocated_bytes", "baseline_bytes", "margin_bytes", "peak_phase", "num_tokens"):
            assert getattr(row, column) == getattr(full, column), (exact, column)


@pytest.mark.slow  # over 3 s on 2 cores
def test_exact_runs_the_full_step_without_extrapolating(monkeypatch):
    """estimate_point_by_depth(exact=True) never extrapolates in length (nor in depth): the full run's row."""
    from sbpbench.simulate import length

    def refused(*args, **kwargs):
        raise AssertionError("extrapolated")

    monkeypatch.setattr(length, "estimate_by_length", refused)
    spec = _spec("tiny/qwen3", "streambp", 401)
    row = estimate_point_by_depth(spec, gpu_memory_bytes=80 << 30, exact=True)
    assert row.peak_allocated_bytes == estimate_point(spec, gpu_memory_bytes=80 << 30).peak_allocated_bytes


def test_a_search_probes_lengths_that_share_samples_first():
    """The simulated max-length search's first pass probes multiples of the layer chunk (and of its
    multiple_of) taken at the chunk sizes its longest probe runs with."""
    search = MaxlenSpec(base=_spec("tiny/qwen3", "streambp", 64), seq_len_ceiling=4096, multiple_of=8)
    assert shared_multiple(search) == 48
    bp = MaxlenSpec(base=_spec("tiny/qwen3", "bp", 64), seq_len_ceiling=4096, multiple_of=8)
    assert shared_multiple(bp) == 128


@pytest.mark.slow
def test_simulated_max_length_is_bracketed_by_full_runs(tmp_path):
    """`sbp maxlen --simulate` (extrapolated probes) on tiny/qwen3 StreamBP: its longest fitting T
    fits and its first OOM does not, each checked by the full fake run at that length."""
    out = tmp_path / "maxlen.csv"
    args = ["maxlen", "--simulate", "--model", "tiny/qwen3", "--method", "streambp", "--num-layers", "2"]
    args += ["--chunk-size", "48", "--logits-chunk-size", "32", "--dtype", "bf16", "--gpu-memory", "772.5MiB"]
    result = CliRunner().invoke(app, [*args, "--start", "256", "--max-seq", "8192", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (answer,) = [row for row in read_rows(out) if row["kind"] == "maxlen"]
    fits, oom = int(answer["max_seq_len"]), int(answer["oom_seq_len"])
    assert fits < oom <= 8192 and "sample T=" in result.output
    budget = int(772.5 * 2**20)  # about T = 2900: the CUDA context's 0.75 GiB and a few MiB
    for seq_len, status in ((fits, "ok"), (oom, "oom")):
        spec = _spec("tiny/qwen3", "streambp", seq_len)
        assert estimate_point(spec, gpu_memory_bytes=budget).status == status, seq_len


@pytest.mark.slow
def test_a_simulated_search_without_resume_ignores_stale_probes_in_its_csv(tmp_path):
    """`sbp maxlen --simulate --no-resume` on a CSV holding another run's contradicting probe (an
    OOM below the answer) searches from its own probes only: its second pass reuses the first
    pass's probes, not the file's (it stopped with "cached probes are not monotone")."""
    out = tmp_path / "maxlen.csv"
    args = ["maxlen", "--simulate", "--model", "tiny/qwen3", "--method", "streambp", "--num-layers", "2"]
    args += ["--chunk-size", "48", "--logits-chunk-size", "32", "--dtype", "bf16", "--gpu-memory", "772.5MiB"]
    args += ["--start", "256", "--max-seq", "8192", "--resolution", "10%", "--out", str(out)]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    (answer,) = [row for row in read_rows(out) if row["kind"] == "maxlen"]
    fits = int(answer["max_seq_len"])
    # a stale probe from another code version: the shortest length above 256 of the search's grid, oom
    rows = read_rows(out)
    stale = next(r for r in rows if r["kind"] == "point" and r["status"] == "ok" and 256 < int(r["seq_len"]) < fits)
    stale |= {"status": "oom", "seq_len": str(int(stale["seq_len"]) - 8)}
    upsert_rows(out, [decode_row(stale)])
    again = CliRunner().invoke(app, [*args, "--no-resume"])
    assert again.exit_code == 0, again.output
    (answer,) = [row for row in read_rows(out) if row["kind"] == "maxlen"]
    assert int(answer["max_seq_len"]) == fits
