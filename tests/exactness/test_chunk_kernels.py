"""The kernels for an offset-causal chunk (core/kernels/chunk_kernels.py, split_attention.py) give the
lower-right SDPA path's output and gradients, in fp64 on a CPU, per call and through whole models
in every layout; the CUDA-only calls (cuDNN's aten ops, FlashAttention-3/4) are wired as their
APIs say, checked through stand-ins that compute what the real kernels compute."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from sbpbench.core.attention import lower_right_attention
from sbpbench.core.kernels import kernel_choice
from sbpbench.core.kernels.chunk_kernels import (
    ChunkCall,
    FlashAttention3,
    FlashAttention4,
    FlexKernel,
    SplitKernel,
    cudnn_refuses,
    offset_causal_block_mask,
    offset_causal_mask_mod,
)
from sbpbench.core.kernels.kernel_choice import CHUNK_ATTENTION_CHOICES
from sbpbench.core.kernels.split_attention import CpuFlashOps, CudnnOps, split_attention
from sbpbench.methods import MethodSettings
from sbpbench.methods.exactness import compare_methods
from sbpbench.settings.choices import CHUNK_ATTENTION

from ..conftest import FAMILIES, left_padded_batch, observing_kernels, packed_rows, padded_batch, streamed, tiny_model
from .test_layouts import DOCS, SEQ_LEN, SPANS, assert_same, per_document_step, streamed_step

# (start, end, key_start) of a chunk's queries and the first key they see; windows that cut or not
SHAPES = [(5, 12, 0), (12, 20, 0), (19, 20, 0), (1, 9, 0), (9, 16, 4)]
WINDOWS = [None, 3, 6]


def _call(start, end, key_start, kv_heads, window=None, dtype=torch.float64, scale=None, seed=0):
    torch.manual_seed(seed)
    query = torch.randn(2, 4, end - start, 8, dtype=dtype)
    key = torch.randn(2, kv_heads, end - key_start, 8, dtype=dtype)
    value = torch.randn(2, kv_heads, end - key_start, 8, dtype=dtype)
    cuts = window is not None and end - 1 - key_start >= window
    return ChunkCall(query, key, value, start, key_start, scale, window if cuts else None)


def _outputs(run, call, seed=1):
    """out, dQ, dK, dV of run(call) for one fixed output gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (call.query, call.key, call.value)]
    out = run(call.with_tensors(*leaves))
    grad = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return (out.detach(), *torch.autograd.grad(out, leaves, grad))


def _assert_matches_reference(run, call, tolerance=1e-12):
    names = ("out", "dQ", "dK", "dV")
    for name, ours, reference in zip(names, _outputs(run, call), _outputs(lower_right_attention, call)):
        torch.testing.assert_close(ours, reference, rtol=tolerance, atol=tolerance, msg=name)


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """FlexAttention's dense eager implementation on a CPU: torch refuses its backward there by one
    guard (`_validate_device`); lifted here so the block mask and its gradients are checked exactly."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(FlexKernel, "unavailable", lambda self, device: None)
    with warnings.catch_warnings():  # "called without torch.compile": the dense implementation is the point here
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_split_matches_lower_right(shape, kv_heads):
    """Prefix + diagonal block merged by log-sum-exp (CPU flash kernel halves): out, dQ, dK, dV of
    the lower-right path to 1e-12 in fp64, GQA included, prefixes of one key and more."""
    _assert_matches_reference(SplitKernel().run, _call(*shape, kv_heads))


def test_split_with_a_custom_scale_and_one_query():
    """The scale reaches both halves (a non-default one) and a one-query chunk merges right."""
    _assert_matches_reference(SplitKernel().run, _call(7, 8, 0, 2, scale=0.37))


def test_cudnn_is_asked_about_each_half():
    """On a GPU the split asks torch's cuDNN check about the prefix (not causal) and the diagonal
    block (causal), GQA flagged; a refusal names the half; fp32 is refused before asking."""
    asked = []

    def can_use(params, debug):
        asked.append((params.key.shape[2], params.is_causal, params.enable_gqa))
        return not params.is_causal

    call = _call(5, 12, 0, 2, dtype=torch.bfloat16)
    assert cudnn_refuses(call, can_use) == "cuDNN attention refuses the diagonal half of this shape"
    assert asked == [(5, False, True), (7, True, True)]  # 7 queries over 12 keys: prefix 5, block 7
    assert "bf16/fp16" in cudnn_refuses(_call(5, 12, 0, 2), can_use)


def test_split_refuses_a_window_that_cuts_the_prefix():
    """A sliding window would need a mask on the prefix half: the split says so instead of running."""
    assert SplitKernel().unsupported(_call(9, 16, 4, 2, window=3)) is not None
    assert SplitKernel().unsupported(_call(9, 16, 4, 2, window=None)) is None


@pytest.mark.parametrize(("shape", "kv_heads", "window"), [((5, 12, 0), 2, None), ((9, 16, 4), 1, 3)])
def test_flex_matches_lower_right(flex_on_cpu, shape, kv_heads, window):
    """FlexAttention with the offset-causal block mask (and a window): the reference's values."""
    _assert_matches_reference(FlexKernel().run, _call(*shape, kv_heads, window=window))


@pytest.mark.slow
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_flex_matches_lower_right_every_shape(flex_on_cpu, shape, kv_heads, window):
    """The same over every shape, GQA ratio and window (each new shape is a new graph: slow)."""
    _assert_matches_reference(FlexKernel().run, _call(*shape, kv_heads, window=window))


@pytest.mark.parametrize("window", [None, 1, 3, 7, 20])
def test_flex_block_mask_is_torchs_own(window):
    """The block mask built from the tile pattern (no (c, n) mask) lists the same partial and full
    tiles as torch's create_block_mask, which evaluates every position: tiles of 4, every offset."""
    from torch.nn.attention.flex_attention import create_block_mask

    def tiles(mask, full):
        counts = mask.full_kv_num_blocks if full else mask.kv_num_blocks
        indices = mask.full_kv_indices if full else mask.kv_indices
        return [sorted(indices[0, 0, q, : counts[0, 0, q]].tolist()) for q in range(counts.shape[-1])]

    for num_queries in (1, 4, 5, 13):
        for num_keys in range(num_queries + 1, num_queries + 30, 3):
            ours = offset_causal_block_mask(num_queries, num_keys, window, torch.device("cpu"), block_size=4)
            mask_mod = offset_causal_mask_mod(num_keys - num_queries, window)
            torchs = create_block_mask(mask_mod, None, None, num_queries, num_keys, device="cpu", BLOCK_SIZE=4)
            for full in (False, True):
                assert tiles(ours, full) == tiles(torchs, full), (num_queries, num_keys, full)


def test_flex_mask_is_lower_right_causal_within_the_window():
    """Row i of a chunk sees column j iff j <= i + (n - c) and, with a window, i + (n - c) - j < window."""
    rows, cols = torch.arange(4)[:, None], torch.arange(7)[None, :]
    causal = offset_causal_mask_mod(3, None)(0, 0, rows, cols)
    assert causal.tolist() == [[j <= i + 3 for j in range(7)] for i in range(4)]
    windowed = offset_causal_mask_mod(3, 2)(0, 0, rows, cols)
    assert windowed.tolist() == [[i + 3 - 1 <= j <= i + 3 for j in range(7)] for i in range(4)]


class CudnnStandIn:
    """torch.ops.aten as CudnnOps uses it, on a CPU: the two cuDNN ops, computed by the CPU flash
    kernel, with cuDNN's conventions (lse (B, H, c, 1) fp32, no cum_seq tensors, RNG state tensors)
    and checks that each argument arrives where the schema puts it."""

    def __init__(self):
        self.rng_state: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.calls: list[str] = []

    def _scaled_dot_product_cudnn_attention(
        self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
        return_debug_mask=False, *, scale=None,
    ):  # fmt: skip
        assert attn_bias is None and compute_log_sumexp is True and dropout_p == 0.0 and return_debug_mask is False
        assert scale is not None, "the scale must be passed: cuDNN's default would be 1/sqrt(hd)"
        out, lse = CpuFlashOps().forward(query, key, value, causal=is_causal, scale=scale)[:2]
        seed, offset = torch.tensor(len(self.rng_state)), torch.tensor(0)
        self.rng_state.append((seed, offset))
        self.calls.append(f"forward causal={is_causal}")
        lse = lse.float().unsqueeze(-1)  # (B, H, c, 1) fp32
        return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, None

    def _scaled_dot_product_cudnn_attention_backward(
        self, grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
        cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None,
    ):  # fmt: skip
        batch, heads, num_queries, _ = query.shape
        assert logsumexp.shape == (batch, heads, num_queries, 1) and logsumexp.dtype == torch.float32
        assert logsumexp.is_contiguous()
        assert any(philox_seed is s and philox_offset is o for s, o in self.rng_state), "not the forward's RNG state"
        assert attn_bias is None and cum_seq_q is None and cum_seq_k is None and dropout_p == 0.0
        assert (max_q, max_k) == (num_queries, key.shape[2])
        assert grad_out.stride() == out.stride(), "dO must come in O's layout"
        assert scale is not None
        self.calls.append(f"backward causal={is_causal}")
        lse = logsumexp.squeeze(-1).to(torch.promote_types(query.dtype, torch.float32))
        return CpuFlashOps().backward(grad_out, query, key, value, out, lse, None, causal=is_causal, scale=scale)


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_cudnn_ops_are_called_as_their_schema_says(kv_heads):
    """The split's cuDNN branch through a stand-in of torch.ops.aten: argument order, scale,
    is_causal per half (prefix False, diagonal True), lse (B, H, c, 1) fp32 given back to the
    backward with the forward's RNG state; fp32 result of the reference to 1e-5."""
    aten = CudnnStandIn()
    call = _call(5, 12, 0, kv_heads, dtype=torch.float32, scale=0.3)
    run = SplitKernel(cuda_ops=CudnnOps(aten)).cuda_ops
    ours = _outputs(lambda c: split_attention(c.query, c.key, c.value, scale=c.scale, ops=run), call)
    for name, got, want in zip(("out", "dQ", "dK", "dV"), ours, _outputs(lower_right_attention, call)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
    halves = ["causal=False", "causal=True"]
    assert aten.calls == [f"forward {h}" for h in halves] + [f"backward {h}" for h in halves]


def _flash_attn_standin(returns_lse: bool, no_window):
    """A FlashAttention package's flash_attn_func on a CPU: (B, S, H, hd) tensors, causal aligned to
    the lower right, window (left, right) around that diagonal, GQA from fewer key heads."""

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=no_window, **unused):
        assert q.dim() == 4 and q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3], "not (B, S, H, hd)"
        assert causal is True
        seq_q, seq_k = q.shape[1], k.shape[1]
        rows, cols = torch.arange(seq_q)[:, None], torch.arange(seq_k)[None, :]
        diagonal = rows + seq_k - seq_q
        mask = cols <= diagonal
        left = window_size[0]
        if left is not None and left >= 0:
            mask &= cols >= diagonal - left
        query, key, value = (t.transpose(1, 2) for t in (q, k, v))
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=softmax_scale).transpose(1, 2)
        return (out, None) if returns_lse else out

    return types.SimpleNamespace(flash_attn_func=flash_attn_func)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(
    "kernel",
    [
        FlashAttention3(module=_flash_attn_standin(False, (-1, -1))),
        FlashAttention4(module=_flash_attn_standin(True, (None, None))),
    ],
    ids=["fa3", "fa4"],
)
def test_flash_attention_packages_are_called_as_their_apis_say(kernel, window):
    """FA3/FA4 through stand-ins of their flash_attn_func: (B, S, H, hd) views, causal (lower right),
    the window as (window - 1, 0), GQA heads as they are, the scale: the reference's values."""
    _assert_matches_reference(kernel.run, _call(9, 16, 4, 2, window=window, scale=0.41))


def test_flash_attention_packages_report_why_they_cannot_run(monkeypatch):
    """Not a GPU, another GPU generation, not installed (tried once), fp64: a reason each, never an
    import error at the call (torch.cuda's capability query stood in for)."""
    missing = FlashAttention4()
    missing.module_name = "sbp_no_such_flash_attention_module"
    assert "CUDA" in missing.unavailable(torch.device("cpu"))
    capability = [(8, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert "sm9x or sm10x" in missing.unavailable(torch.device("cuda"))
    capability[0] = (9, 0)
    assert "not installed" in missing.unavailable(torch.device("cuda")) and missing._missing
    assert FlashAttention3(module=_flash_attn_standin(False, (-1, -1))).unavailable(torch.device("cuda")) is None
    assert "bf16" in FlashAttention3().unsupported(_call(5, 12, 0, 2))


@pytest.mark.parametrize(
    "error", [RuntimeError("CUDA driver too old"), OSError("undefined symbol: _ZN3c10"), ValueError()]
)
def test_a_flash_attention_package_that_fails_to_load_is_unavailable(monkeypatch, error):
    """Any error while importing the package (not only ImportError: a built extension raises what it
    likes) makes the kernel unavailable with the error named, tried once, never an error at the step."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    tries = []

    def failing_import(name):
        tries.append(name)
        raise error

    monkeypatch.setattr("importlib.import_module", failing_import)
    kernel = FlashAttention3()
    reason = kernel.unavailable(torch.device("cuda"))
    assert "does not load" in reason and type(error).__name__ in reason
    assert kernel.unavailable(torch.device("cuda")) == reason and len(tries) == 1


def test_the_settings_choices_are_cores():
    """The CLI's choices (torch-free) name exactly core's kernels."""
    assert CHUNK_ATTENTION == CHUNK_ATTENTION_CHOICES
    assert set(kernel_choice.KERNELS) == set(CHUNK_ATTENTION) - {"auto", "lower-right"}


# Whole models: every layout with the kernel forced, against BP.

CASES = {  # name -> (batch size, T, real lengths per row, chunk, logits chunk, config overrides)
    "right_padding": (2, 23, [23, 17], 5, 7, {}),
    "chunk_ge_T": (1, 12, None, 64, 64, {}),
    "gqa_ratio_4": (2, 19, [19, 11], 4, 6, {"num_key_value_heads": 1}),
}


def _assert_forced_matches_bp(model, batch, chunk, logits_chunk, kernel="split"):
    settings = MethodSettings(chunk_size=chunk, logits_chunk_size=logits_chunk, chunk_attention=kernel)
    with observing_kernels() as seen:
        (result,) = compare_methods(model, batch, ["streambp"], settings)
    assert result.ok, f"streambp with {kernel} differs from bp:\n" + "\n".join(d.describe() for d in result.failures())
    return seen


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_forced_split_matches_bp(family, case):
    """Every family, right padding, GQA 4:1, a chunk that does not divide T, and one chunk (no
    prefix, so no split call): bp's loss and every gradient to 1e-10 in fp64."""
    batch_size, seq_len, lengths, chunk, logits_chunk, overrides = CASES[case]
    model = tiny_model(family, **overrides)
    batch = padded_batch(model, batch_size=batch_size, seq_len=seq_len, lengths=lengths)
    seen = _assert_forced_matches_bp(model, batch, chunk, logits_chunk)
    windowed = {"lower-right"} if family == "tiny/gemma3" else set()  # its sliding-window layers
    assert seen == (set() if case == "chunk_ge_T" else {"split"} | windowed)


def test_forced_split_left_padding_and_packed_documents():
    """Left-padded rows equal bp; packed documents equal BP per document; both run the split."""
    model = tiny_model("tiny/qwen3")
    batch = left_padded_batch(model, seq_len=SEQ_LEN, spans=SPANS)
    assert _assert_forced_matches_bp(model, batch, 4, 5) == {"split"}
    input_ids, labels, position_ids = packed_rows(model, doc_lengths=DOCS)
    with observing_kernels() as seen:
        ours = streamed_step(
            model, input_ids, labels, position_ids=position_ids, chunk_size=5, logits_chunk_size=4,
            chunk_attention="split",
        )  # fmt: skip
    assert_same(model, ours, per_document_step(model, input_ids, labels, position_ids), "split, packed")
    assert seen == {"split"}


@pytest.mark.parametrize(("family", "window"), [("tiny/mistral", 6), ("tiny/gemma3", 5)])
def test_forced_split_with_sliding_windows(family, window):
    """Chunks a window cuts run the lower-right path (the split cannot mask its prefix), the others
    the split: still exact."""
    model = tiny_model(family, sliding_window=window)
    batch = padded_batch(model, batch_size=2, seq_len=33, lengths=[33, 27])
    assert _assert_forced_matches_bp(model, batch, 4, 6) == {"split", "lower-right"}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_forced_flex_matches_bp(flex_on_cpu, family, case):
    """FlexAttention forced through whole models (its dense CPU implementation): bp's gradients."""
    batch_size, seq_len, lengths, chunk, logits_chunk, overrides = CASES[case]
    model = tiny_model(family, **overrides)
    batch = padded_batch(model, batch_size=batch_size, seq_len=seq_len, lengths=lengths)
    _assert_forced_matches_bp(model, batch, chunk, logits_chunk, kernel="flex")


@pytest.mark.slow
def test_forced_flex_windows_and_layouts(flex_on_cpu):
    """Flex with a window (it masks the band itself), left padding and packed documents."""
    model = tiny_model("tiny/mistral", sliding_window=6)
    batch = padded_batch(model, batch_size=2, seq_len=33, lengths=[33, 27])
    assert _assert_forced_matches_bp(model, batch, 4, 6, kernel="flex") == {"flex"}
    model = tiny_model("tiny/qwen3")
    _assert_forced_matches_bp(model, left_padded_batch(model, seq_len=SEQ_LEN, spans=SPANS), 4, 5, kernel="flex")
    input_ids, labels, position_ids = packed_rows(model, doc_lengths=DOCS)
    ours = streamed_step(
        model, input_ids, labels, position_ids=position_ids, chunk_size=5, logits_chunk_size=4, chunk_attention="flex"
    )
    assert_same(model, ours, per_document_step(model, input_ids, labels, position_ids), "flex, packed")


def test_a_kernel_the_device_lacks_is_refused_before_any_work():
    """fa3 on a CPU, or a name that is no kernel: a ValueError that says what to use instead."""
    model = tiny_model("tiny/qwen3")
    batch = padded_batch(model, batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="fa3 cannot run on cpu.*use auto or lower-right"):
        streamed(model, batch.input_ids, batch.labels, chunk_attention="fa3")
    with pytest.raises(ValueError, match="unknown chunk_attention 'fast'"):
        streamed(model, batch.input_ids, batch.labels, chunk_attention="fast")
    assert all(p.grad is None for p in model.parameters())
