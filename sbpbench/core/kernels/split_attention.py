"""Offset-causal attention as two halves merged by log-sum-exp, so square-causal kernels serve it.

Queries at [s, s + c) over keys at [p, s + c) split into the prefix [p, s), which every query sees
whole (no mask), and the diagonal block [s, s + c), square causal. torch's SDPA sends a lower-right
causal bias only to its flash and memory-efficient kernels; both halves here are shapes cuDNN's
fused attention takes. Each half's kernel returns its output and its log-sum-exp (lse) per row:

    lse = logaddexp(lse_prefix, lse_diag)                         (B, H, c)
    out = exp(lse_prefix - lse) out_prefix + exp(lse_diag - lse) out_diag

The backward calls each half's kernel backward with the merged out and lse. A FlashAttention-style
backward (FlashAttention-2, Algorithm 2; cuDNN's is the same) rebuilds P = exp(S - lse) and
D = rowsum(dout * out): with the merged values P is the whole row's softmax restricted to the half,
so each call returns exactly the half's share of dQ and its own dK, dV. This is how torch's ring
attention merges its blocks (torch.distributed.tensor.experimental._context_parallel).

`FusedOps` is the seam to the kernels: `CudnnOps` calls the aten cuDNN ops on a GPU, `CpuFlashOps`
the CPU flash kernel, which has the same contract (its backward takes out and lse), so the merge
and backward run, and are tested exactly in fp64, on a CPU.
"""

from __future__ import annotations

from typing import Protocol

import torch

aten = torch.ops.aten


class FusedOps(Protocol):
    """A fused attention kernel that returns its log-sum-exp and takes out and lse in backward."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, object]:
        """query (B, H, c, hd), key/value (B, h_kv, n, hd) -> out (B, H, c, hd_v), lse (B, H, c), and
        what its backward needs besides the tensors (RNG state, sequence metadata)."""
        ...

    def backward(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        saved: object,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ, dK, dV of this half, given the merged out and lse (B, H, c)."""
        ...


class CpuFlashOps:
    """torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`): lse (B, H, c) in
    fp32 for bf16/fp16 inputs, in the input dtype otherwise; GQA taken as it is."""

    def forward(self, query, key, value, *, causal, scale):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)
        return out, lse, None

    def backward(self, grad_out, query, key, value, out, lse, saved, *, causal, scale):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse.to(saved_lse_dtype(query)), 0.0, causal, scale=scale
        )


def saved_lse_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype a fused kernel keeps lse in: fp32, or the input's where that is wider (fp64)."""
    return torch.promote_types(query.dtype, torch.float32)


class CudnnOps:
    """cuDNN's fused attention through its aten ops (native_functions.yaml, torch 2.13):

        _scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp,
            dropout_p, is_causal, return_debug_mask, *, scale)
            -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug)
        _scaled_dot_product_cudnn_attention_backward(grad_out, query, key, value, out, logsumexp,
            philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
            is_causal, *, scale) -> (dq, dk, dv)

    logsumexp is (B, H, c, 1) fp32 (torch's meta kernel); the merge works on (B, H, c). `ops` is the
    namespace the ops are looked up in (torch.ops.aten; a recording stand-in in tests)."""

    def __init__(self, ops=aten):
        self.ops = ops

    def forward(self, query, key, value, *, causal, scale):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = self.ops._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, 0.0, causal, False, scale=scale
        )
        return out, lse.squeeze(-1), (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, grad_out, query, key, value, out, lse, saved, *, causal, scale):
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        if grad_out.stride() != out.stride():  # cuDNN's backward reads dO in O's layout
            grad_out = torch.empty_like(out).copy_(grad_out)
        return self.ops._scaled_dot_product_cudnn_attention_backward(
            grad_out,
            query,
            key,
            value,
            out,
            lse.float().unsqueeze(-1).contiguous(),  # (B, H, c, 1), as the forward returned it
            seed,
            offset,
            None,  # attn_bias
            cum_q,
            cum_k,
            max_q,
            max_k,
            0.0,
            causal,
            scale=scale,
        )


class _MergedHalves(torch.autograd.Function):
    """query (B, H, c, hd); key/value (B, h_kv, n, hd) with n = prefix + c -> (B, H, c, hd_v).
    prefix 0: the diagonal block alone. sinks (H,): one more logit per head that every query's
    softmax counts and no value carries (GPT-OSS): a block with lse = sink and out = 0."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, prefix: int, scale: float, ops: FusedOps):
        halves = [
            (h, c) for h, c in ((slice(0, prefix), False), (slice(prefix, key.shape[2]), True)) if h.stop > h.start
        ]
        outs, lses, saved = [], [], []
        for half, causal in halves:
            out, lse, kept = ops.forward(query, key[:, :, half], value[:, :, half], causal=causal, scale=scale)
            outs.append(out)
            lses.append(lse)
            saved.append(kept)
        acc = saved_lse_dtype(query)  # fp32 (fp64 for fp64 inputs): the kernels' own accumulator width
        lses = [lse.to(acc) for lse in lses]
        lse = lses[0] if len(lses) == 1 else torch.logaddexp(lses[0], lses[1])  # (B, H, c)
        if sinks is not None:
            lse = torch.logaddexp(lse, sinks.to(acc)[None, :, None])
        merged = sum(out.to(acc) * torch.exp(part - lse).unsqueeze(-1) for out, part in zip(outs, lses))
        out = torch.empty_like(outs[-1]).copy_(merged)  # the kernel's own output layout, rounded once
        ctx.save_for_backward(query, key, value, out, lse, sinks)
        ctx.halves, ctx.saved, ctx.scale, ctx.ops = halves, saved, scale, ops
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, sinks = ctx.saved_tensors
        grads = [
            ctx.ops.backward(
                grad_out, query, key[:, :, half], value[:, :, half], out, lse, saved, causal=causal, scale=ctx.scale
            )
            for (half, causal), saved in zip(ctx.halves, ctx.saved)
        ]
        acc = saved_lse_dtype(query)
        grad_query = sum(dq.to(acc) for dq, _, _ in grads).to(query.dtype)
        grad_key = torch.cat([dk for _, dk, _ in grads], dim=2)
        grad_value = torch.cat([dv for _, _, dv in grads], dim=2)
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d loss / d sink_h = -sum over rows and queries of p_sink * rowsum(dO * O), p_sink = exp(sink - lse)
            row = (grad_out.to(acc) * out.to(acc)).sum(dim=-1)  # (B, H, c)
            grad_sinks = -(torch.exp(sinks.to(acc)[None, :, None] - lse) * row).sum(dim=(0, 2)).to(sinks.dtype)
        return grad_query, grad_key, grad_value, grad_sinks, None, None, None


def split_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None,
    ops: FusedOps,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Offset-causal attention of query (B, H, c, hd) over key/value (B, h_kv, n, hd), n >= c, keys
    ending where the queries end -> (B, H, c, hd_v): the prefix and the diagonal block, merged, with
    a sink logit per head (H,) where given."""
    num_queries, num_keys = query.shape[2], key.shape[2]
    assert num_keys >= num_queries, "the keys end where the queries end"
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _MergedHalves.apply(query, key, value, sinks, num_keys - num_queries, scale, ops)
