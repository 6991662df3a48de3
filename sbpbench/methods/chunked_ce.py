"""Gradient checkpointing plus a chunked linear + loss head that never holds (B, T, V) logits.

The peer users reach for instead of StreamBP's head: Liger's fused linear cross-entropy, Apple's
cut-cross-entropy, ALST's TiledFusedLogitsLoss (arXiv 2506.13996, Sec. 3.1). Here in plain
PyTorch, as ALST does it: one autograd.Function whose forward computes the loss chunk by chunk
without a graph and whose backward recomputes each chunk's logits with one, so at most one
(B, c, V) block of logits (and its gradient) exists at a time, in the forward and in the backward.

The decoder runs as transformers runs it (its own forward, its gradient checkpointing); the head
is the model's own (its lm_head and what its forward adds: a softcap, a logit scale) applied to the
decoder's last hidden state, and the
loss is the objective's (core/objectives.py), computed in float32 or wider as transformers does.
Every objective works: per-token ones (SFT, GRPO) chunk by chunk; DPO and GSPO, functions of
whole-sequence sums, after a no-grad pass for those sums (the objective's streaming protocol).
"""

from __future__ import annotations

import sys

import torch

from ..core.internal import (
    DeviceSequence,
    ModelHead,
    counted_chunks,
    loss_dtype,
    resolve_parts,
    sequence_sums,
    trainable,
)
from ..data import Batch
from .hf_baseline import hf_gradient_checkpointing


class ChunkedHeadLoss(torch.autograd.Function):
    """loss = objective(head(hidden)) with head = lm_head (+ softcap), chunked along T.

    forward(hidden (B, T, d), head, objective, chunk_size, *params) -> 0-dim loss in loss_dtype.
    `params` are the head's trainable parameters, passed as inputs so that autograd routes their
    gradients (a tied lm_head / embedding weight sums both contributions as usual)."""

    @staticmethod
    def forward(ctx, hidden, head, objective, chunk_size, *params):
        ctx.head, ctx.objective, ctx.chunk_size = head, objective, chunk_size
        ctx.save_for_backward(hidden)
        seq_len = hidden.shape[1]
        total = torch.zeros((), dtype=loss_dtype(hidden.dtype), device=hidden.device)
        if objective.needs_sequence_sums:  # DPO, GSPO: the sums first; the loss comes from them alone
            counted = counted_chunks(seq_len, chunk_size, objective)
            objective.prepare(sequence_sums(objective, head, counted, DeviceSequence(hidden), hidden.dtype))
            return objective.streamed_loss(total)
        for start, end in counted_chunks(seq_len, chunk_size, objective):
            total += objective.chunk_loss(head(hidden[:, start:end]), start, end)
        return objective.streamed_loss(total)

    @staticmethod
    def backward(ctx, grad_loss):
        (hidden,) = ctx.saved_tensors
        head, objective = ctx.head, ctx.objective
        weights = trainable(head)  # the forward's *params, in the same order
        # per-chunk parameter gradients summed in float32 or wider, rounded once at the end
        sums = [torch.zeros_like(p, dtype=loss_dtype(p.dtype)) for p in weights]
        grad_hidden = torch.zeros_like(hidden)
        for start, end in counted_chunks(hidden.shape[1], ctx.chunk_size, objective):
            chunk = hidden[:, start:end].detach().requires_grad_(ctx.needs_input_grad[0])
            with torch.enable_grad():
                part = objective.chunk_loss(head(chunk), start, end)  # (B, c, V) logits live here only
            inputs = ([chunk] if chunk.requires_grad else []) + weights
            grads = torch.autograd.grad(part, inputs, grad_outputs=grad_loss.to(part.dtype), allow_unused=True)
            if chunk.requires_grad:
                grad_hidden[:, start:end] = grads[0]
                grads = grads[1:]
            for acc, grad in zip(sums, grads):
                if grad is not None:
                    acc += grad
        ctx.head = ctx.objective = None
        grad_hidden = grad_hidden if ctx.needs_input_grad[0] else None
        return (grad_hidden, None, None, None, *(s.to(p.dtype) for s, p in zip(sums, weights)))


class _Head(torch.nn.Module):
    """The model's own head on normed hidden states (core's ModelHead: the lm_head and whatever the
    causal LM's forward does after it, a softcap or a logit scale); its parameters are the lm_head's."""

    def __init__(self, parts):
        super().__init__()
        self.lm_head = parts.lm_head
        normed = lambda hidden: hidden  # the decoder's output is normed already
        self._logits = ModelHead(parts, lambda module: normed if module is parts.norm else module).logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits(hidden)  # (B, c, V)


def chunked_head_loss(model, batch: Batch, logits_chunk_size: int) -> torch.Tensor:
    """Decoder forward (transformers', whatever checkpointing the model has on), then the chunked
    head and loss; returns the loss with its graph (the caller calls backward)."""
    parts = resolve_parts(model)
    head = _Head(parts)
    output = parts.decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    hidden = output.last_hidden_state  # (B, T, d), after the final norm
    loss = ChunkedHeadLoss.apply(hidden, head, batch.objective(), logits_chunk_size, *trainable(head))
    return loss + _balance_loss(parts.model, output, batch.attention_mask)


def _balance_loss(model, output, attention_mask) -> torch.Tensor | float:
    """A mixture-of-experts model's load-balancing term, by its modeling file's own function on the
    router logits its decoder returned (config.output_router_logits), as its forward adds it."""
    router_logits = getattr(output, "router_logits", None)
    loss_func = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if not router_logits or loss_func is None:
        return 0.0
    aux = loss_func(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)
    return model.router_aux_loss_coef * aux


def ckpt_chunked_ce(model, batch: Batch, settings) -> torch.Tensor:
    with hf_gradient_checkpointing(model):
        loss = chunked_head_loss(model, batch, settings.logits_chunk_size)
        loss.backward()
    return loss.detach()
