"""Model FLOPs of one training step (forward + backward), for achieved TFLOP/s.

Following PaLM (Chowdhery et al. 2022, appendix B), per token: 6N for the matmul weights (2 FLOPs
per multiply-add forward, twice that backward) plus 12 * L * H * Q * T for attention (QK^T and AV,
H heads of dimension Q over T keys). Two choices, as the brief asks:
- causal attention is counted as computed only below the diagonal: query i attends to min(i+1, w)
  keys (w the sliding window, or T), so the full-attention term becomes about half of PaLM's;
- N counts the weights of every matmul, the lm_head included and the embedding lookup excluded;
- 6N is 2N forward + 2N for the input gradients + 2N for the weight gradients, and the last
  term counts only trainable weights: a LoRA step is 4N + 2 N_adapters.
These are *model* FLOPs: recomputation (checkpointing, StreamBP's second forward) is not counted,
so TFLOP/s compares methods on the work the step must do, as MFU does.
"""

from __future__ import annotations

import torch


def matmul_parameters(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Weights that take part in a matmul: every nn.Linear (lm_head included, tied or not)."""
    linears = (m for m in model.modules() if isinstance(m, torch.nn.Linear))
    return sum(m.weight.numel() for m in linears if m.weight.requires_grad or not trainable_only)


def mean_attended_keys(seq_len: int, window: int | None = None) -> float:
    """Average over query positions of the keys a causal (optionally windowed) query sees."""
    w = seq_len if window is None or window >= seq_len else window
    # positions 0..w-1 see 1..w keys; the remaining T-w see w each
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def attention_layer_windows(config) -> list[int | None]:
    """Per decoder layer: the sliding window, or None for full attention."""
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    window = getattr(config, "sliding_window", None)
    return [window if kind == "sliding_attention" else None for kind in layer_types[:num_layers]]


def training_flops(model: torch.nn.Module, *, batch_size: int, seq_len: int) -> float:
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    tokens = batch_size * seq_len
    dense = (4 * matmul_parameters(model) + 2 * matmul_parameters(model, trainable_only=True)) * tokens
    # forward per token per layer: 2 FLOPs x (QK^T + AV) x heads x head_dim x keys seen; backward 2x
    attention = sum(
        3 * 4 * heads * head_dim * mean_attended_keys(seq_len, w) * tokens for w in attention_layer_windows(config)
    )
    return float(dense + attention)
