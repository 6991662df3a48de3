"""Final norm + lm_head + SFT loss, streamed along the sequence (StreamBP paper, Sec. 3.1).

Logits exist for one chunk of positions at a time, (B, c, V), never for the whole sequence. Each
chunk's backward leaves its final-norm and lm_head weight gradients (accumulated across chunks)
and writes dL/dZ for its positions, where Z is the last decoder layer's output.
"""

from __future__ import annotations

import torch

from .adapters import DecoderParts
from .grad_accum import ChunkGradAccumulator
from .sft import IGNORE_INDEX, loss_dtype, sum_cross_entropy


def _chunk_logits(parts: DecoderParts, hidden: torch.Tensor) -> torch.Tensor:
    logits = parts.lm_head(parts.norm(hidden))  # (B, c, V) in the model dtype
    cap = parts.final_logit_softcap
    if cap is not None:  # Gemma-style softcapping, applied before the upcast as transformers does
        logits = torch.tanh(logits / cap) * cap
    return logits


def sft_head_backward(
    parts: DecoderParts,
    last_hidden: torch.Tensor,
    targets: torch.Tensor,
    num_targets: int,
    *,
    chunk_size: int,
    accumulator: ChunkGradAccumulator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """last_hidden (B, T, d): last layer output; targets (B, T): shifted labels.
    Returns (loss, dZ) with dZ (B, T, d) in the hidden dtype. The chunks' norm and lm_head weight
    gradients are collected into `accumulator`; the caller finishes it."""
    seq_len = last_hidden.shape[1]
    grad_hidden = torch.zeros_like(last_hidden)
    loss = torch.zeros((), dtype=loss_dtype(last_hidden.dtype), device=last_hidden.device)
    for start in range(0, seq_len, chunk_size):
        end = min(start + chunk_size, seq_len)
        chunk_targets = targets[:, start:end]
        if bool((chunk_targets == IGNORE_INDEX).all()):
            continue  # no counted token: zero gradient, zero loss
        hidden = last_hidden[:, start:end].detach().requires_grad_()
        with torch.enable_grad():
            part = sum_cross_entropy(_chunk_logits(parts, hidden), chunk_targets) / num_targets
        part.backward()
        grad_hidden[:, start:end] = hidden.grad
        loss += part.detach()
        accumulator.collect()
    return loss, grad_hidden
