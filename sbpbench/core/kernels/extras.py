"""Offset-causal attention with what a fused SDPA kernel does not take: logit soft-capping (Gemma 2)
and learnable sinks (GPT-OSS).

A sink is one more logit per head in every query's softmax, attached to no value: the output is
the attention's own times p = exp(lse - logaddexp(lse, sink)). With lse from a fused kernel, that is
one more log-sum-exp term of the split's merge (split_attention.py), whose backward is the fused
kernels' own plus the sink's gradient: so a chunk with sinks and no window runs on the CPU flash
kernel, or on cuDNN for bf16/fp16 on a GPU, and never builds a (c, n) matrix. Soft-capping changes
every score, tanh(s / cap) x cap, which only an explicit computation (or a compiled score_mod)
expresses: `explicit_attention` builds the (B, H, c, n) scores of one call, as transformers' eager
attention does, and windowed sinks take it too (a window keeps n <= c + window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .split_attention import CpuFlashOps, CudnnOps, split_attention

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionExtras:
    """What the layer's attention adds to softmax(q k^T x scale) v: a cap on the scores, a sink
    logit per query head (H,)."""

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def heads(self, group: slice) -> AttentionExtras:
        """The extras of a group of query heads (one call of a chunk's attention)."""
        return self if self.sinks is None else AttentionExtras(self.softcap, self.sinks[group])


def extras_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    query_start: int,
    key_start: int,
    scale: float | None,
    window: int | None,
    extras: AttentionExtras,
) -> torch.Tensor:
    """query (B, H, c, hd) at [query_start, query_start + c) over key/value (B, h_kv, n, hd) at
    [key_start, query_start + c), causal (lower-right), cut by `window` where it hides keys ->
    (B, H, c, hd_v)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if extras.softcap is None and window is None:
        ops = _fused_ops(query)
        if ops is not None:
            return split_attention(query, key, value, scale=scale, ops=ops, sinks=extras.sinks)
    return explicit_attention(
        query, key, value, query_start=query_start, key_start=key_start, scale=scale, window=window, extras=extras
    )


def _fused_ops(query: torch.Tensor):
    """A fused kernel that returns its log-sum-exp for these inputs, or None."""
    if query.device.type == "cpu":
        return CpuFlashOps()
    if query.device.type == "cuda" and query.dtype in _LOW_PRECISION and torch.backends.cuda.cudnn_sdp_enabled():
        return CudnnOps()
    return None


def explicit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    query_start: int,
    key_start: int,
    scale: float,
    window: int | None,
    extras: AttentionExtras,
) -> torch.Tensor:
    """The scores of one call, (B, H, c, n), capped, masked, softmaxed with the sinks: as
    transformers' eager attention computes them (scores and softmax in the input dtype, fp32 for
    bf16/fp16 inputs)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads:  # the same head order as transformers' repeat_kv
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    wide = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query, key.transpose(2, 3)).to(wide) * scale  # (B, H, c, n)
    if extras.softcap is not None:
        scores = torch.tanh(scores / extras.softcap) * extras.softcap
    num_queries, num_keys = query.shape[2], key.shape[2]
    query_pos = torch.arange(query_start, query_start + num_queries, device=query.device)[:, None]
    key_pos = torch.arange(key_start, key_start + num_keys, device=query.device)[None, :]
    visible = key_pos <= query_pos  # (c, n)
    if window is not None:
        visible = visible & (key_pos > query_pos - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    if extras.sinks is not None:
        sinks = extras.sinks.to(wide).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(value.dtype), value)
