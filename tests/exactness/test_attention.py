"""Offset-causal chunk attention equals the matching rows of full causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from sbpbench.core import StepHooks, attention
from sbpbench.core.attention import offset_causal_attention
from sbpbench.core.internal import SteeredHooks

from ..conftest import streamed


def _full_reference(q, k, v, window):
    """Explicit-mask attention over the whole sequence, GQA by repeating heads (transformers semantics)."""
    seq_len = q.shape[2]
    pos = torch.arange(seq_len)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("window", [None, 3, 8, 100])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("start,end", [(0, 5), (5, 12), (12, 20), (19, 20), (0, 20)])
def test_chunk_rows_match_full_attention(start, end, kv_heads, window):
    """Queries [start, end) over keys [key_start, end) give the same rows as the full computation."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 20, 8, dtype=torch.float64)
    k = torch.randn(2, kv_heads, 20, 8, dtype=torch.float64)
    v = torch.randn(2, kv_heads, 20, 8, dtype=torch.float64)
    key_start = 0 if window is None else max(0, start - window + 1)
    out = offset_causal_attention(
        q[:, :, start:end],
        k[:, :, key_start:end],
        v[:, :, key_start:end],
        query_start=start,
        key_start=key_start,
        scale=None,
        sliding_window=window,
    )
    torch.testing.assert_close(out, _full_reference(q, k, v, window)[:, :, start:end], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("start,end", [(0, 5), (5, 12), (19, 20)])
def test_cuda_branch_lower_right_bias_on_cpu(start, end, kv_heads, dtype):
    """The CUDA branch (causal_lower_right bias; heads repeated for fp32/fp64, native GQA for bf16)
    gives the same rows, run here on the CPU, where the bias is materialised."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 20, 8, dtype=torch.float64)
    k = torch.randn(2, kv_heads, 20, 8, dtype=torch.float64)
    v = torch.randn(2, kv_heads, 20, 8, dtype=torch.float64)
    out = attention.offset_causal_attention(
        q[:, :, start:end].to(dtype),
        k[:, :, :end].to(dtype),
        v[:, :, :end].to(dtype),
        query_start=start,
        key_start=0,
        scale=None,
        sliding_window=None,
        attention=attention.ChunkAttention(hooks=SteeredHooks(cuda_branch=causal_lower_right)),
    )
    tolerance = 1e-12 if dtype == torch.float64 else 3e-2
    expected = _full_reference(q, k, v, None)[:, :, start:end]
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_the_cuda_branch_hook_uses_the_given_bias_only_where_given():
    """SteeredHooks.cuda_branch builds the non-square chunk's bias with the given function; a step
    without it takes the CPU branch, which never calls it."""
    calls = []

    def spy(num_queries, num_keys):
        calls.append((num_queries, num_keys))
        return causal_lower_right(num_queries, num_keys)

    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 7, 8)

    def run(hooks=None):
        return attention.offset_causal_attention(
            q, k, k, query_start=4, key_start=0, scale=None, sliding_window=None,
            attention=attention.ChunkAttention(hooks=hooks or StepHooks()),
        )  # fmt: skip

    run(SteeredHooks(cuda_branch=causal_lower_right))
    assert calls == []
    run(SteeredHooks(cuda_branch=spy))
    assert calls == [(3, 7)]
    run()
    assert calls == [(3, 7)]


@pytest.mark.parametrize("family", ["tiny/qwen3", "tiny/gemma3"])
def test_a_chunk_attends_through_a_view_of_the_buffers_not_a_copy(monkeypatch, family):
    """In the layer backward every chunk with a prefix gets its keys/values as views of the layer's
    whole-sequence buffers (_BufferedPrefix): concatenating would copy the prefix and hold its
    gradient, 4 x h_kv x hd x s bytes per key position."""
    from sbpbench.core import layer_backward
    from sbpbench.data import make_batch

    from ..conftest import tiny_model

    buffers, calls = [], []
    capture = layer_backward._capture_keys_values

    def recording_capture(*args, **kwargs):
        buffer = capture(*args, **kwargs)
        buffers.append(buffer)
        return buffer

    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(query, key, value, **kwargs):
        if torch.is_grad_enabled() and key.shape[2] > query.shape[2]:  # a backward chunk with a prefix
            calls.append((key.untyped_storage().data_ptr(), value.untyped_storage().data_ptr()))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(layer_backward, "_capture_keys_values", recording_capture)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    model = tiny_model(family, torch.float64)
    batch = make_batch("sft", batch_size=1, seq_len=30, vocab_size=model.config.vocab_size)
    streamed(model, batch.input_ids, objective=batch.objective(), chunk_size=7, logits_chunk_size=9)
    storages = {(b.keys.untyped_storage().data_ptr(), b.values.untyped_storage().data_ptr()) for b in buffers}
    assert calls, "no chunk attended to a prefix"
    assert set(calls) <= storages
