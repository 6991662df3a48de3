"""Peak-memory prediction under fake tensors (sbpbench.simulate, `sbp estimate`)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
import typer
from torch._subclasses.fake_tensor import FakeTensorMode
from typer.testing import CliRunner

from sbpbench.cli.estimate_cmd import estimate as estimate_command
from sbpbench.config import Resolution, RunSpec
from sbpbench.methods import MethodSettings
from sbpbench.records import read_rows
from sbpbench.runner.length_search import search_max_len
from sbpbench.runner.point import measure_point
from sbpbench.simulate import CUDA_CONTEXT_BYTES, FRAGMENTATION_FRACTION, estimate, estimate_point, fake_mode
from sbpbench.simulate.cuda_attention import (
    EFFICIENT,
    FLASH,
    MATH,
    CudaAttention,
    choose_kernel,
    hidden_buffers,
    hidden_bytes,
)
from sbpbench.simulate.depth import estimate_point_by_depth
from sbpbench.simulate.memory_counter import SimulatedMemory
from sbpbench.simulate.paper_baseline import PAPER_METHODS

GIB = 2**30
GPU_80GIB = 80 * GIB


def _spec(model: str, method: str, **values) -> RunSpec:
    base = {
        "seq_len": 64,
        "warmup": 0,
        "repeats": 1,
        "prompt_len": 16,
        "settings": MethodSettings(chunk_size=24, logits_chunk_size=20),
    }
    return RunSpec(model=model, method=method, **(base | values))


def _placed(checkpoints: str) -> MethodSettings:
    return MethodSettings(chunk_size=24, logits_chunk_size=20, checkpoints=checkpoints)


def _slow(*values):
    """A CPU_CASES row that runs in the slow tier only."""
    return pytest.param(*values, marks=pytest.mark.slow)


# Three families, every method, every objective, both protocols, a training step, LoRA and every
# checkpoint placement. The fast tier keeps each method once (one of them a DPO point under the
# first-step protocol) and two placements.
CPU_CASES = [
    _slow("tiny/qwen3", "bp", {}),
    _slow("tiny/qwen3", "ckpt", {}),
    _slow("tiny/qwen3", "streambp", {}),
    _slow("tiny/llama", "bp", {}),
    _slow("tiny/llama", "ckpt", {}),
    _slow("tiny/llama", "streambp", {}),
    _slow("tiny/qwen3", "bp", {"objective": "grpo", "batch_size": 2, "protocol": "first"}),
    _slow("tiny/llama", "streambp", {"objective": "grpo", "batch_size": 2}),
    ("tiny/llama", "ckpt", {"objective": "dpo", "batch_size": 2, "protocol": "first"}),
    _slow("tiny/qwen3", "streambp", {"objective": "dpo", "batch_size": 2, "protocol": "first"}),
    _slow("tiny/qwen3", "ckpt", {"step": "train"}),
    _slow("tiny/llama", "streambp", {"step": "train", "protocol": "first"}),
    _slow("tiny/qwen3", "streambp", {"lora_rank": 4, "step": "train"}),
    # checkpoint placements: on the CPU the host copies are in the tracked memory too
    ("tiny/llama", "streambp", {"settings": _placed("cpu")}),
    ("tiny/qwen3", "streambp", {"settings": _placed("recompute:2")}),
    _slow("tiny/qwen3", "streambp", {"settings": _placed("cpu+recompute:2")}),
    _slow("tiny/gemma3", "streambp", {"settings": _placed("recompute:3")}),
    # mixture of experts (routed buffers, expert weights) in bf16, whose grouped_mm experts take buffers
    # of a size routing does not change; sinks and windows
    ("tiny/qwen3-moe", "streambp", {"dtype": "bf16"}),
    ("tiny/gpt-oss", "streambp", {"dtype": "bf16"}),
    _slow("tiny/qwen3-moe", "bp", {"dtype": "bf16"}),
    _slow("tiny/gpt-oss", "ckpt", {"dtype": "bf16", "settings": _placed("cpu")}),
    _slow("tiny/gpt-oss", "streambp", {"dtype": "bf16", "settings": _placed("cpu")}),
]


@pytest.mark.parametrize(("model", "method", "values"), CPU_CASES)
def test_cpu_target_equals_the_cpu_tracker_to_the_byte(model, method, values):
    """The fake-tensor run of a point reproduces measure_point's CPU peak and baseline exactly."""
    spec = _spec(model, method, **values)
    measured = measure_point(spec)
    assert measured.status == "ok", measured.error
    predicted = estimate(spec, target="cpu")
    assert predicted.peak_allocated_bytes == measured.peak_allocated_bytes, (
        f"{model} {method} {values}: predicted {predicted.peak_allocated_bytes:,} B, "
        f"measured {measured.peak_allocated_bytes:,} B (baseline {predicted.baseline_bytes:,} vs "
        f"{measured.baseline_bytes:,}); peak phase {predicted.peak_phase!r}"
    )
    assert predicted.baseline_bytes == measured.baseline_bytes
    assert predicted.optimizer_state_bytes == measured.optimizer_state_bytes
    assert (predicted.weights_bytes, predicted.grads_bytes) == (measured.weights_bytes, measured.grads_bytes)
    moved = (measured.host_pinned_peak_bytes or 0, measured.transfer_bytes or 0)  # None: no checkpoint store
    assert (predicted.host_pinned_bytes, predicted.transfer_bytes) == moved


def _meta(*shape, dtype=torch.bfloat16, layout=None):
    """A (B, H, T, d) meta tensor, stored (B, T, H, d) as the projections leave it when layout='bthd'."""
    if layout == "bthd":
        b, h, t, d = shape
        return torch.empty(b, t, h, d, dtype=dtype, device="meta").transpose(1, 2)
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    ("model", "method", "values"),
    [
        (
            "tiny/qwen3",
            "streambp",
            {
                "dtype": "bf16",
                "settings": MethodSettings(chunk_size=24, logits_chunk_size=20, checkpoints="cpu+recompute:2"),
            },
        ),
        ("tiny/llama", "ckpt", {"lora_rank": 4, "step": "train"}),
    ],
)
def test_cheaper_cache_key_changes_no_byte(monkeypatch, model, method, values):
    """fake_mode.CheaperKeyFakeTensorMode predicts exactly what torch's own FakeTensorMode does."""
    spec = _spec(model, method, num_layers=3, **values)
    fast = estimate(spec, target="cuda")
    monkeypatch.setattr(fake_mode, "CheaperKeyFakeTensorMode", FakeTensorMode)
    assert fake_mode.build_fake_step(spec).mode.__class__ is FakeTensorMode
    assert estimate(spec, target="cuda") == fast


def test_kernel_choice_follows_cuda_dispatch():
    """flash for half precision without a mask (GQA with enable_gqa); efficient with a mask, in fp32,
    or for causal attention with more keys than queries; math when neither applies."""
    q, k = _meta(1, 8, 128, 64), _meta(1, 2, 128, 64)
    full_k = _meta(1, 8, 128, 64)
    mask = torch.ones(1, 1, 128, 128, dtype=torch.bool, device="meta")
    assert choose_kernel(q, k, k, None, True, True) == FLASH
    assert choose_kernel(q, full_k, full_k, mask, False, False) == EFFICIENT
    assert choose_kernel(q.float(), full_k.float(), full_k.float(), None, True, False) == EFFICIENT
    assert choose_kernel(q[:, :, :64], full_k, full_k, None, True, False) == EFFICIENT
    assert choose_kernel(q, k, k, mask, False, True) == MATH  # grouped heads with a mask
    wide = _meta(1, 8, 128, 512)
    assert choose_kernel(wide, wide, wide, None, True, False) == EFFICIENT  # head_dim > 256: no flash
    odd = _meta(1, 8, 128, 300)  # over 256 for flash, not a multiple of 8 for the efficient kernel
    assert choose_kernel(odd, odd, odd, None, True, False) == MATH


def test_flash_backward_terms_are_mha_bwd_buffers():
    """Flash backward adds softmax_d and the fp32 dq accumulator (rounded to 128 queries) and, under
    GQA, dK/dV expanded to every query head (flash_api.cpp mha_bwd), each rounded to 512 B."""
    batch, heads, kv_heads, seq, head_dim = 1, 32, 8, 1000, 128
    q = _meta(batch, heads, seq, head_dim, layout="bthd")
    k = _meta(batch, kv_heads, seq, head_dim, layout="bthd")
    args = (q, q, k, k, q)  # grad_out, query, key, value, out
    softmax_d = batch * heads * 1024 * 4
    dq_accum = batch * 1024 * heads * head_dim * 4
    expanded = 2 * batch * seq * heads * head_dim * 2
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    assert hidden_bytes(flash_backward, args) == softmax_d + dq_accum + expanded
    assert hidden_bytes(flash_backward, (q, q, q, q, q)) == softmax_d + dq_accum  # no GQA: dK/dV in place
    assert hidden_bytes(torch.ops.aten.mm.default, (q, q)) == 0


def test_hidden_terms_raise_the_simulated_peak_during_the_kernel():
    """A bf16 GQA attention forward+backward on fake tensors peaks in flash backward, higher by
    exactly that op's in-kernel buffers when they are counted."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:  # (B, T, heads, d) storage seen as (B, heads, T, d), as the q/k/v projections leave it
        leaves = [torch.empty(1, 256, h, 64, dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2)]
    peaks = []
    for hidden in (None, hidden_buffers):
        counter = SimulatedMemory(512, hidden=hidden)
        with CudaAttention() as attention, mode, counter:
            q, k, v = (t.transpose(1, 2) for t in leaves)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.sum().backward()  # grad_out: an expanded scalar, copied to contiguous by the kernel
        for t in leaves:
            t.grad = None
        peaks.append(counter.peak_bytes)
        assert attention.kernel_names() == FLASH
    softmax_d, dq_accum, expanded, grad_out = 8 * 256 * 4, 256 * 8 * 64 * 4, 2 * 256 * 8 * 64 * 2, 256 * 8 * 64 * 2
    assert peaks[1] - peaks[0] == softmax_d + dq_accum + expanded + grad_out


@pytest.mark.slow
def test_cuda_target_rounds_picks_kernels_and_states_a_margin():
    """cuda: every count in 512 B blocks; StreamBP's attention on flash, the padded-mask HF path on
    the efficient kernel; the margin is context + a fraction of the activations, outside the peak."""
    stream = estimate(_spec("tiny/qwen3", "streambp", dtype="bf16"), target="cuda")
    hf = estimate(_spec("tiny/qwen3", "bp", dtype="bf16"), target="cuda")
    assert stream.attention_kernel == FLASH
    assert hf.attention_kernel == EFFICIENT
    for result in (stream, hf):
        assert result.baseline_bytes % 512 == 0 and result.activation_peak_bytes % 512 == 0
        assert result.margin_bytes == CUDA_CONTEXT_BYTES + round(FRAGMENTATION_FRACTION * result.activation_peak_bytes)
        assert result.peak_phase.split()[0] in ("forward", "embedding", "head", "backward", "optimizer")
    cpu = estimate(_spec("tiny/qwen3", "streambp", dtype="bf16"), target="cpu")
    assert cpu.attention_kernel == "" and cpu.margin_bytes == 0


@pytest.mark.slow
def test_estimate_point_is_a_simulated_row_and_oom_is_a_value():
    """The row says simulated / fake-tensor / simulated GPU, and a GPU too small is status oom."""
    spec = _spec("tiny/qwen3", "streambp", dtype="bf16")
    row = estimate_point(spec, gpu_memory_bytes=GPU_80GIB)
    assert (row.status, row.source, row.memory_source, row.device, row.device_name) == (
        "ok",
        "simulated",
        "fake-tensor",
        "cuda",
        "simulated GPU",
    )
    assert row.attn_implementation == "sbp_stream" and row.attention_kernel == FLASH
    assert row.peak_allocated_bytes == row.baseline_bytes + row.activation_peak_bytes
    assert row.device_total_memory_bytes == GPU_80GIB and row.torch_version and row.git_commit
    small = estimate_point(spec, gpu_memory_bytes=2**20)
    assert small.status == "oom" and "GiB" in small.error


def test_estimate_command_prints_a_table_and_writes_rows(tmp_path):
    """`sbp estimate` shows one row per method with the fit verdict and upserts them to --out."""
    app = typer.Typer()
    app.command()(estimate_command)
    out = tmp_path / "estimates.csv"
    args = ["--model", "tiny/llama", "--seq", "64", "--method", "bp", "streambp", "--gpu-memory", "1MiB"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "predicted peak memory" in result.output and "fits 0.00098 GiB" in result.output
    rows = read_rows(out)
    assert [(r["method"], r["status"], r["source"]) for r in rows] == [
        ("bp", "oom", "simulated"),
        ("streambp", "oom", "simulated"),
    ]
    bad = CliRunner().invoke(app, ["--model", "tiny/llama", "--target", "tpu"])
    assert bad.exit_code == 2 and "target" in bad.output


@pytest.mark.slow
@pytest.mark.parametrize(("model", "weights_and_grads_gib"), [("Qwen/Qwen3-8B", 30.5), ("Qwen/Qwen3-14B", 55.0)])
def test_weights_and_grads_match_figure3(model, weights_and_grads_gib):
    """bf16 weights + resident bf16 gradients: the paper's Figure 3 baselines, to 0.1 GiB."""
    result = estimate(RunSpec(model=model, method="bp", seq_len=128, dtype="bf16", repeats=1), target="cuda")
    assert abs((result.weights_bytes + result.grads_bytes) / GIB - weights_and_grads_gib) <= 0.1


FIGURE3 = [  # (model, method, the paper's longest T on one 80 GB GPU)
    ("Qwen/Qwen3-8B", "bp", 4700),
    ("Qwen/Qwen3-8B", "ckpt", 20000),
    ("Qwen/Qwen3-14B", "bp", 1700),
    ("Qwen/Qwen3-14B", "ckpt", 9000),
]


def _paper_baseline_fits(model: str, method: str, seq_len: int) -> bool:
    """Whether the paper's baseline fits 80 GiB, predicted from two shallow models as `sbp estimate`
    does (simulate/depth.py: exact for uniform layers, tests/estimator/test_simulate_depth.py)."""
    spec = RunSpec(model=model, method=method, seq_len=seq_len, dtype="bf16", repeats=1)
    row = estimate_point_by_depth(spec, target="cuda", gpu_memory_bytes=GPU_80GIB, method=PAPER_METHODS[method])
    assert row.status in ("ok", "oom"), row.error
    return row.status == "ok"


@pytest.mark.slow
@pytest.mark.parametrize(("model", "method", "paper"), FIGURE3)
def test_predicted_max_len_matches_figure3(model, method, paper):
    """bf16 BP with resident gradients, the paper's HF baseline (paper_baseline.py), 80 GiB: the
    longest predicted T is within 10% of the paper's (a search between 0.9x and 1.1x its value)."""

    def fits(seq_len: int) -> bool:
        return _paper_baseline_fits(model, method, seq_len)

    found = search_max_len(
        fits, start=int(0.9 * paper), ceiling=int(1.1 * paper), resolution=Resolution.parse("5%"), multiple_of=8
    )
    print(f"{model} {method}: predicted max T in [{found.max_ok}, {found.min_oom}), paper {paper}")
    assert found.max_ok is not None and found.max_ok >= 0.9 * paper, found.probes
    assert found.min_oom is not None and found.min_oom <= 1.1 * paper, found.probes


@pytest.mark.slow
def test_estimate_qwen3_8b_at_20k_orders_the_methods_as_the_paper(tmp_path):
    """`sbp estimate` of Qwen3-8B at T=20k (all methods, through the CLI): bp does not fit 80 GiB,
    ckpt and StreamBP do, StreamBP with the lowest peak (the paper's Figure 3 at 20k). Its time is
    printed for the log only: speed is a benchmark's business, not a test's."""
    app = typer.Typer()
    app.command()(estimate_command)
    start = time.perf_counter()
    result = CliRunner().invoke(
        app, ["--model", "Qwen/Qwen3-8B", "--seq", "20000", "--out", str(tmp_path / "e.csv")], env={"COLUMNS": "200"}
    )
    print(result.output)
    print(f"sbp estimate Qwen/Qwen3-8B T=20000 bp ckpt streambp: {time.perf_counter() - start:.1f} s")
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row for row in read_rows(tmp_path / "e.csv")}
    assert {m: rows[m]["status"] for m in rows} == {"bp": "oom", "ckpt": "ok", "streambp": "ok"}
    peak = {m: int(rows[m]["peak_allocated_bytes"]) for m in rows}
    assert peak["streambp"] < peak["ckpt"] < peak["bp"]


@pytest.mark.slow
def test_fp32_streambp_on_the_cuda_target_takes_the_efficient_backward():
    """A fp32 offset-causal chunk runs on the efficient kernel on a GPU, whose backward torch's meta
    function may not take as the op's schema gives it: the estimate still runs and models that kernel."""
    settings = MethodSettings(chunk_size=32, logits_chunk_size=32)
    spec = RunSpec(model="tiny/qwen3", method="streambp", seq_len=96, dtype="fp32", repeats=1, settings=settings)
    result = estimate(spec, target="cuda")
    assert EFFICIENT in result.attention_kernel.split("+")
    assert result.activation_peak_bytes > 0 and result.activation_peak_bytes % 512 == 0
