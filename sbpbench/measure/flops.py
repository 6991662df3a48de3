"""Model FLOPs of one training step (forward + backward), for achieved TFLOP/s.

Following PaLM (Chowdhery et al. 2022, appendix B), per token: 6N for the matmul weights (2 FLOPs
per multiply-add forward, twice that backward) plus 12 * L * H * Q * T for attention (QK^T and AV,
H heads of dimension Q over T keys). Two choices:
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


def chunk_attention_flops(
    batch: int, heads: int, num_queries: int, num_keys: int, head_dim: int, *, backward: bool = False
) -> float:
    """FLOPs of one offset-causal chunk: c queries over n keys ending where they end (row i sees
    n - c + i + 1 keys), QK^T and AV at 2 FLOPs per multiply-add, counted below the diagonal as
    above; a backward 2.5x its forward (dQ, dK, dV and the recomputed QK^T: FlashAttention-2,
    section 3.1), as kernel benchmarks count it."""
    seen = num_queries * (num_keys - num_queries) + num_queries * (num_queries + 1) / 2
    forward = 4 * batch * heads * head_dim * seen
    return 2.5 * forward if backward else forward


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


# Where a step's time goes: FLOPs *executed* per phase (recomputation included, unlike
# training_flops), from the config alone, so any registered shape is priced without building it.
# Same conventions as above: 2 FLOPs per multiply-add, backward = 2x forward (PaLM). Flash-style
# attention kernels recompute QK^T in their backward (2.5x forward, FlashAttention-2 section 3.1);
# that is left out here, so the attention shares are if anything low.
# streambp's phases are those core/phases.py times (a row's phase_*_s columns), so each can show
# its achieved TFLOP/s; its "rebuild" (recompute placements) is added by phase_flops on request.
PHASES = {
    # method -> its phases in order; "layers" counts what each phase runs per decoder layer
    "bp": ("forward", "head", "layer backward"),
    "ckpt": ("forward", "head", "layer backward"),
    "streambp": ("checkpoint pass", "head", "K/V capture", "chunk forward", "chunk backward"),
}


def _layer_shapes(config) -> tuple[int, int, int]:
    """(weights of one decoder layer's matmuls, weights of its K and V projections, heads x head_dim)."""
    d, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    attention = 2 * d * heads * head_dim + 2 * d * kv * head_dim  # q, o; k, v
    # gate, up, down; a config without intermediate_size (GPT-2: n_inner, None for 4 d) priced as 4 d
    mlp = 3 * d * (getattr(config, "intermediate_size", None) or 4 * d)
    return attention + mlp, 2 * d * kv * head_dim, heads * head_dim


def rebuilt_layers(num_layers: int, recompute_every: int) -> list[int]:
    """The layers a recompute:K placement runs again to rebuild inputs: layer l makes X_{l+1}, which
    is rebuilt unless kept (l + 1 a multiple of K) or not a layer input (l + 1 = L)."""
    return [layer for layer in range(num_layers - 1) if (layer + 1) % recompute_every]


def phase_flops(
    config, *, method: str, batch_size: int, seq_len: int, recompute_every: int = 1
) -> dict[str, tuple[float, float]]:
    """phase -> (matmul FLOPs, attention FLOPs) executed by one step of `method` (bp, ckpt,
    streambp; full fine-tuning, SFT). The head is lm_head over every position, forward and both
    gradients. bp and ckpt: layer backward includes what ckpt recomputes (the layers' forward).
    streambp: K/V capture is the k and v projections of every position, chunk forward the layers'
    forward again, chunk backward their backward; with recompute_every K > 1 (a recompute:K
    placement) a "rebuild" phase, the forward of the layers it runs again (rebuilt_layers)."""
    if method not in PHASES:
        raise ValueError(f"no phase model for method {method!r}; choose from {', '.join(PHASES)}")
    tokens = batch_size * seq_len
    layer_weights, kv_weights, width = _layer_shapes(config)
    # per layer, its attention forward: QK^T and AV, 2 FLOPs each per multiply-add, over the keys seen
    attention = [4 * width * mean_attended_keys(seq_len, w) * tokens for w in attention_layer_windows(config)]
    num_layers = config.num_hidden_layers
    forward = (2 * layer_weights * tokens * num_layers, sum(attention))
    backward = (4 * layer_weights * tokens * num_layers, 2 * sum(attention))
    head = (6 * config.hidden_size * config.vocab_size * tokens, 0.0)
    if method != "streambp":
        recompute = forward if method == "ckpt" else (0.0, 0.0)
        return {
            "forward": forward,
            "head": head,
            "layer backward": (backward[0] + recompute[0], backward[1] + recompute[1]),
        }
    phases = {
        "checkpoint pass": forward,
        "head": head,
        "K/V capture": (2 * kv_weights * tokens * num_layers, 0.0),
        "chunk forward": forward,
        "chunk backward": backward,
    }
    if recompute_every > 1:
        rebuilt = rebuilt_layers(num_layers, recompute_every)
        phases["rebuild"] = (2 * layer_weights * tokens * len(rebuilt), sum(attention[layer] for layer in rebuilt))
    return phases


def phase_flops_markdown(config, *, model: str, method: str, batch_size: int, seq_len: int, tflops_per_s: float) -> str:
    """A Markdown table of phase_flops with each phase's share and its time at `tflops_per_s`."""
    phases = phase_flops(config, method=method, batch_size=batch_size, seq_len=seq_len)
    total = sum(m + a for m, a in phases.values())
    lines = [
        (
            f"FLOPs executed by one {method} step, {model}, B={batch_size}, T={seq_len} "
            f"(s: the time at {tflops_per_s:g} TFLOP/s executed):"
        ),
        "",
        "| phase | matmul PFLOP | attention PFLOP | share | s |",
        "|---|---:|---:|---:|---:|",
    ]
    for phase, (matmul, attention) in phases.items():
        lines.append(
            f"| {phase} | {matmul / 1e15:.2f} | {attention / 1e15:.2f} | {(matmul + attention) / total:.0%} "
            f"| {(matmul + attention) / tflops_per_s / 1e12:.0f} |"
        )
    attention_total = sum(a for _, a in phases.values())
    lines.append(
        f"| total | {(total - attention_total) / 1e15:.2f} | {attention_total / 1e15:.2f} | 100% "
        f"| {total / tflops_per_s / 1e12:.0f} |"
    )
    return "\n".join(lines)
