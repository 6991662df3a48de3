"""The peers give standard BP's loss and every gradient, to rounding, and do what they
claim: no (B, T, V) logits, tiled MLPs, offloaded checkpoints; liger refuses a CPU point."""

from __future__ import annotations

import pytest
import torch

from sbpbench.config import RunSpec
from sbpbench.data import make_batch
from sbpbench.measure.tensor_tracker import LiveTensorTracker
from sbpbench.methods import MethodSettings, MethodUnsupported, offload, run_method, tiled
from sbpbench.methods.exactness import compare_methods, compare_step, step_gradients
from sbpbench.runner.point import measure_point

from ..conftest import FAMILIES, needs_trl, padded_batch, tiny_model

PEERS = ["ckpt-offload", "ckpt-chunked-ce", "tiled"]  # the ones that run on a CPU
# logits chunks and MLP tiles that do not divide T, and ones >= T
SETTINGS = {
    "uneven": MethodSettings(logits_chunk_size=7, mlp_tile_size=5),
    "one_chunk": MethodSettings(logits_chunk_size=64, mlp_tile_size=64),
}


def _assert_exact(model, batch, settings, methods=PEERS):
    for result in compare_methods(model, batch, methods, settings):
        assert result.ok, f"{result.method} differs from bp:\n" + "\n".join(d.describe() for d in result.failures())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("chunks", list(SETTINGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_peers_match_bp(family, chunks, dtype):
    """SFT, batch 3 with uneven right padding: every CPU peer equals bp (fp64 1e-10, fp32 1e-5)."""
    model = tiny_model(family, dtype)
    batch = padded_batch(model, batch_size=3, seq_len=37, lengths=[37, 30, 21])
    _assert_exact(model, batch, SETTINGS[chunks])


@pytest.mark.parametrize("objective", ["grpo", "dpo"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_peers_match_bp_on_grpo_and_dpo(objective, lora):
    """The chunked head runs every objective through its per-token log-probs (DPO after a sums
    pass), with and without LoRA adapters: exact in fp64."""
    from sbpbench.models.lora import apply_lora

    model = tiny_model("tiny/llama")
    if lora:
        model = apply_lora(model, rank=4, alpha=8, init_nonzero_seed=0)
    batch = make_batch(objective, batch_size=4, seq_len=30, vocab_size=model.config.vocab_size, prompt_len=8)
    _assert_exact(model, batch, SETTINGS["uneven"])


@needs_trl
@pytest.mark.parametrize("objective", ["sft", "grpo", "dpo"])
@pytest.mark.parametrize("family", FAMILIES)
def test_trl_default_matches_bp_to_float32_rounding(family, objective):
    """trl-default (ckpt + TRL's fused LM head) equals bp in fp32 (1e-5). In fp64 TRL folds its logit
    tiles in fp32 whatever the model dtype: to fp32 rounding only (above 1e-10) in plain steps, and
    to 1e-10 when both steps run their float32 computations in float64 (compare_methods)."""
    for dtype in (torch.float32, torch.float64):
        model = tiny_model(family, dtype)
        if objective == "sft":
            batch = padded_batch(model, batch_size=3, seq_len=37, lengths=[37, 30, 21])
        else:
            batch = make_batch(objective, batch_size=4, seq_len=30, vocab_size=model.config.vocab_size, prompt_len=8)
        (result,) = compare_methods(model, batch, ["trl-default"], MethodSettings())
        assert result.ok, "\n".join(d.describe() for d in result.failures())
        if dtype is torch.float64:
            ours, ref = (step_gradients(m, model, batch, MethodSettings()) for m in ("trl-default", "bp"))
            grads = max(d.rel_error for d in compare_step("trl-default", "bp", model, ours, ref).grads)
            assert 1e-10 < grads < 1e-5, f"fp64: worst gradient error {grads:.3e}, expected fp32 rounding"


@needs_trl
def test_trl_default_with_lora_matches_bp():
    """With LoRA adapters (TRL patches the base model under the PEFT wrapper), trl-default equals bp
    in fp32 and leaves no patched forward behind."""
    from sbpbench.models.lora import apply_lora

    model = apply_lora(tiny_model("tiny/llama", torch.float32), rank=4, alpha=8, init_nonzero_seed=0)
    batch = padded_batch(model, batch_size=2, seq_len=20, lengths=[20, 13])
    (result,) = compare_methods(model, batch, ["trl-default"], MethodSettings())
    assert result.ok, "\n".join(d.describe() for d in result.failures())
    assert "forward" not in vars(model.get_base_model())


def test_trl_default_without_trl_is_unsupported(monkeypatch):
    """Without TRL, trl-default raises MethodUnsupported saying how to install it, and the worker
    records the point as status unsupported."""
    import sys

    monkeypatch.setitem(sys.modules, "trl.trainer.utils", None)  # `from trl.trainer.utils import ...` fails
    model = tiny_model("tiny/qwen3")
    with pytest.raises(MethodUnsupported, match=r"pip install -e \.\[trl\]"):
        run_method("trl-default", model, padded_batch(model, batch_size=1, seq_len=8), MethodSettings())
    row = measure_point(RunSpec(model="tiny/qwen3", method="trl-default", seq_len=16, repeats=0, warmup=0))
    assert row.status == "unsupported" and "TRL is not installed" in row.error


def test_tied_embeddings_get_both_contributions():
    """A tied lm_head / embedding weight gets the head's and the embedding's gradients summed."""
    model = tiny_model("tiny/qwen3", tie_word_embeddings=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    batch = padded_batch(model, batch_size=2, seq_len=21, lengths=[21, 15])
    _assert_exact(model, batch, SETTINGS["uneven"])


def _activation_peak(method, model, batch, settings) -> int:
    model.zero_grad(set_to_none=True)
    with LiveTensorTracker() as tracker:
        run_method(method, model, batch, settings)
    return tracker.peak_bytes


def test_chunked_head_never_holds_the_full_logits():
    """With a vocabulary much wider than the model, ckpt-chunked-ce's peak is below one float32
    copy of the (B, T, V) logits, which ckpt's peak exceeds."""
    model = tiny_model("tiny/qwen3", dtype=torch.float32, vocab_size=4096)
    batch = padded_batch(model, batch_size=1, seq_len=256)
    logits_bytes = 256 * 4096 * 4
    settings = MethodSettings(logits_chunk_size=16)
    assert _activation_peak("ckpt", model, batch, settings) > logits_bytes
    assert _activation_peak("ckpt-chunked-ce", model, batch, settings) < logits_bytes


def test_tiled_runs_every_mlp_in_tiles(monkeypatch):
    """tiled runs each decoder MLP through TiledMLP with ceil(T / tile) tiles per pass, and leaves
    no tiled forward behind."""
    model = tiny_model("tiny/llama")
    batch = padded_batch(model, batch_size=2, seq_len=23)
    widths = []
    real = tiled._tiles

    def spy(seq_len, tile_size):
        widths.append(seq_len)
        return real(seq_len, tile_size)

    monkeypatch.setattr(tiled, "_tiles", spy)
    run_method("tiled", model, batch, MethodSettings(mlp_tile_size=5))
    num_layers = model.config.num_hidden_layers
    # each layer: forward, checkpoint recompute, backward
    assert widths == [23] * (3 * num_layers)
    assert all("forward" not in vars(layer.mlp) for layer in model.model.layers)


def test_offload_wraps_every_checkpoint(monkeypatch):
    """ckpt-offload runs every checkpointed decoder layer inside save_on_cpu (here without
    pinning: no accelerator), and the model's checkpoint functions are restored after."""
    entered = []
    real = offload.save_on_cpu

    def spy(pin_memory, device_type):
        entered.append((pin_memory, device_type))
        return real(pin_memory=pin_memory, device_type=device_type)

    monkeypatch.setattr(offload, "save_on_cpu", spy)
    model = tiny_model("tiny/qwen3")
    assert not offload.library_offload(model)  # on a CPU transformers' own path would need pinned memory
    run_method("ckpt-offload", model, padded_batch(model, batch_size=1, seq_len=12), MethodSettings())
    assert entered == [(False, "cpu")] * model.config.num_hidden_layers
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_liger_is_unsupported_on_cpu():
    """liger on a CPU raises MethodUnsupported naming the reason, and the worker records the point
    as status unsupported with that reason (not an error, not another method)."""
    model = tiny_model("tiny/qwen3")
    with pytest.raises(MethodUnsupported, match="CUDA"):
        run_method("liger", model, padded_batch(model, batch_size=1, seq_len=8), MethodSettings())
    row = measure_point(RunSpec(model="tiny/qwen3", method="liger", seq_len=16, repeats=0, warmup=0))
    assert row.status == "unsupported" and "Triton kernels need a CUDA GPU" in row.error


def test_official_without_its_virtualenv_is_unsupported(tmp_path, monkeypatch):
    """With no official virtualenv, an `official` point is a row with status unsupported that says
    how to create it; in this process the method refuses to run."""
    from sbpbench.config import point_specs
    from sbpbench.runner.isolated import run_isolated

    monkeypatch.setenv("SBP_OFFICIAL_VENV", str(tmp_path / "none"))
    (spec,) = point_specs({"device": "cpu", "model": "tiny/qwen3", "seq_len": 16, "repeats": 0}, ["official"])
    row = run_isolated(spec)
    assert row.status == "unsupported" and "sbp peers setup official" in row.error
    model = tiny_model("tiny/qwen3")
    with pytest.raises(MethodUnsupported, match="external worker"):
        run_method("official", model, padded_batch(model, batch_size=1, seq_len=8))


def _peer_rows():
    from sbpbench.records import ResultRow

    common = {"model": "small/qwen3", "num_layers": 4, "objective": "sft", "step": "bp", "lora_rank": 0,
              "dtype": "fp32", "protocol": "steady", "device": "cpu", "device_name": "AMD EPYC", "batch_size": 1,
              "memory_limit_bytes": 2**30, "source": "measured", "git_commit": "test"}  # fmt: skip
    rows = []
    for i, (method, time_s, max_t, oom_t) in enumerate(
        [("ckpt", 4.0, 2048, 2560), ("streambp", 4.5, 4096, None), ("tiled", 5.0, 3072, 3840)]
    ):
        stamp = f"2026-01-01T00:00:{i:02d}+00:00"
        rows.append(
            ResultRow(
                **common,
                method=method,
                kind="point",
                seq_len=1024,
                status="ok",
                time_median_s=time_s,
                timestamp_utc=stamp,
            )
        )
        rows.append(ResultRow(**common, method=method, kind="maxlen", status="ok", max_seq_len=max_t, oom_seq_len=oom_t, timestamp_utc=stamp))  # fmt: skip
    rows.append(ResultRow(**common, method="liger", kind="point", seq_len=1024, status="unsupported",
                          error="liger-kernel's Triton kernels need a CUDA GPU; this point runs on cpu"))  # fmt: skip
    return rows


def test_plot_draws_max_len_vs_time_per_token(tmp_path):
    """`sbp plot` draws one "max T vs time per token" figure per model and setting that has both
    max-length answers and timed points."""
    from sbpbench.plot import max_len_vs_time_per_token
    from sbpbench.records import load_results, upsert_rows

    upsert_rows(tmp_path / "r.csv", _peer_rows())
    paths = max_len_vs_time_per_token(load_results(tmp_path / "r.csv"), tmp_path / "plots", formats=("png",))
    assert [p.name for p in paths] == ["max_len_vs_time_per_token__small-qwen3__fp32__AMD-EPYC-limit1GiB__steady.png"]


def test_max_len_vs_time_per_token_ranks_nothing_from_unreliable_times(tmp_path):
    """Where the times at the reference T had no warm-up step and one timed step (a smoke run's), the
    max T vs time per token figure says the times are unreliable and no ranking, and draws its
    markers hollow; times with a warm-up and repeats are drawn filled, without the caveat."""
    from dataclasses import replace

    from sbpbench.plot import max_len_vs_time_per_token
    from sbpbench.records import load_results, upsert_rows

    svg = {}
    for warmup, repeats in ((0, 1), (1, 3)):
        csv = tmp_path / f"w{warmup}.csv"
        upsert_rows(csv, [replace(r, warmup_steps=warmup, repeats=repeats) for r in _peer_rows()])
        (path,) = max_len_vs_time_per_token(load_results(csv), tmp_path / csv.stem, formats=("svg",))
        svg[warmup] = path.read_text()
    assert "times unreliable (warm-up 0, 1 repeat): not a ranking of the methods" in svg[0]
    assert "unreliable" not in svg[1]
    assert svg[0].count("fill: none") > svg[1].count("fill: none")  # hollow markers


def test_a_max_length_search_of_an_unsupported_method_answers_unsupported(tmp_path):
    """A search whose first probe is unsupported stops there: its answer row is kind maxlen, status
    unsupported, with the probe's reason (no error, no guessed length)."""
    from sbpbench.config import MaxlenSpec, Resolution
    from sbpbench.measure.environment import capture_environment
    from sbpbench.records import ResultRow, read_rows
    from sbpbench.runner.maxlen import find_max_len
    from sbpbench.workload.rows import spec_fields

    calls = []

    def measure(spec, env):
        calls.append(spec.seq_len)
        return ResultRow(
            **spec_fields(spec), status="unsupported", error="needs a CUDA GPU", device_name=env.device_name
        )

    base = RunSpec(model="tiny/qwen3", method="liger", seq_len=256, repeats=0, warmup=0)
    search = MaxlenSpec(base=base, resolution=Resolution.parse("1%"), seq_len_ceiling=1 << 12)
    answer = find_max_len(search, tmp_path / "m.csv", measure=measure, env=capture_environment("cpu"))
    assert calls == [256]
    assert (answer.kind, answer.status, answer.error, answer.max_seq_len) == (
        "maxlen",
        "unsupported",
        "needs a CUDA GPU",
        None,
    )
    assert [r["status"] for r in read_rows(tmp_path / "m.csv")] == ["unsupported", "unsupported"]
    # The summary table and the sweep's progress line name the status (they crashed on the missing length).
    from sbpbench.cli.tables import maxlen_table
    from sbpbench.runner.experiment import _ended

    maxlen_table([answer])
    assert _ended(answer) == "unsupported: needs a CUDA GPU"
