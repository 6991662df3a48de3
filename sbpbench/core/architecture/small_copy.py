"""A small copy of a model's architecture: the self-check's model (self_check.py).

The copy keeps everything that selects code (the class, booleans, strings, which values are set
and which are None, the pattern of layer types) and makes the sizes small: 64 hidden units, 4 query
heads of 16 dims with the key/value heads in the same relation (one, as many, or fewer), 4 experts
with top-2, windows of 8 positions, a 512-token vocabulary. Its depth is the shortest prefix of the
model's layers in which every kind of layer appears (read off the full-depth copy built on the meta
device: its module classes, per-layer config values and attention attributes), and at least 2.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from .parts import find_decoder

# Values set to a fixed small size where the config has them (None stays None).
_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "ffn_hidden_size": 128,
    "moe_intermediate_size": 32,
    "intermediate_size_mlp": 128,
    "expert_ffn_hidden_size": 32,
    "lru_width": 64,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "vocab_size": 512,
    "num_attention_heads": 4,
    "head_dim": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "n_group": 1,
    "topk_group": 1,
}
# Counts that keep their relation to a fixed small size: at most this many.
_AT_MOST = {
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "sliding_window": 8,
    "attention_chunk_size": 8,
    "attention_window_size": 8,
    "zero_expert_num": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "mamba_n_heads": 4,
    "mamba_d_head": 8,
    "mamba_head_dim": 8,
    "mamba_d_state": 8,
    "ssm_state_size": 8,
    "mamba_n_groups": 1,
    "n_groups": 1,
}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# attributes of a layer's modules that make two layers of one class compute differently
_LAYER_ATTRIBUTES = ("sliding_window", "attention_type", "layer_type", "use_rope", "is_sliding", "is_causal")


def small_config(config: PretrainedConfig) -> PretrainedConfig:
    """The small copy's config (module docstring); the same class as `config`."""
    values = _small_values(config)
    full = type(config).from_dict(values)
    depth = _covering_depth(full)
    values = _cut_to_depth(values, depth, config.num_hidden_layers)
    values["num_hidden_layers"] = depth
    small = type(config).from_dict(values)
    small._attn_implementation = None  # the class's default: sdpa where it has it, else eager
    return small


def _small_values(config: PretrainedConfig) -> dict:
    values = config.to_dict()
    old_heads = values.get("num_attention_heads")
    old_head_dim = values.get("head_dim") or (
        values["hidden_size"] // old_heads if values.get("hidden_size") and old_heads else None
    )
    for key, size in _SIZES.items():
        if values.get(key) is not None or (key == "head_dim" and key in values):  # head_dim None: derived
            values[key] = size
    for key, most in _AT_MOST.items():
        value = values.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > most:
            values[key] = most
    kv_heads = values.get("num_key_value_heads")
    if isinstance(kv_heads, int) and old_heads:  # MHA stays MHA, MQA stays MQA, GQA becomes 2 of 4
        values["num_key_value_heads"] = 4 if kv_heads == old_heads else 1 if kv_heads == 1 else 2
    if config.to_dict().get("head_dim") is not None and config.to_dict().get("head_dim") == getattr(
        config, "qk_rope_head_dim", None
    ):  # MLA's config derives head_dim from the rotary part of the keys
        values["head_dim"] = values["qk_rope_head_dim"]
    if values.get("v_head_dim") is not None:  # MLA: value dims differ from key dims where they did
        old_key = (config.qk_nope_head_dim or 0) + (config.qk_rope_head_dim or 0)
        values["v_head_dim"] = 16 if config.v_head_dim == old_key else 8
    rotary = values.get("rotary_dim")
    if isinstance(rotary, int) and old_head_dim:  # absolute rotary dims keep their share of the head
        values["rotary_dim"] = max(2, 2 * round(rotary * 16 / old_head_dim / 2))
    heads, expand = values.get("mamba_n_heads"), values.get("mamba_expand")
    if heads and expand and values.get("mamba_d_head"):  # Mamba-2: heads x head dim = expand x hidden
        values["mamba_d_head"] = expand * values["hidden_size"] // heads
    _small_rope(values)
    for key in _TOKEN_IDS:
        token = values.get(key)
        if isinstance(token, int) and token >= 512:
            values[key] = 511
        elif isinstance(token, list):
            values[key] = [min(t, 511) for t in token]
    values.pop("transformers_version", None)
    return values


def _small_rope(values: dict) -> None:
    """RoPE factors per frequency (LongRoPE's long_factor, short_factor) cut to the small head's
    rotary frequencies, evenly spaced: the same code path on fewer frequencies; a pretraining
    context of 16 positions, so that the self-check's sequence takes the long-context path."""
    if values.get("original_max_position_embeddings"):
        values["original_max_position_embeddings"] = 16
    for key in ("rope_parameters", "rope_scaling"):
        rope = values.get(key)
        if not isinstance(rope, dict):
            continue
        partial = rope.get("partial_rotary_factor", values.get("partial_rotary_factor")) or 1.0
        frequencies = max(1, int(values.get("head_dim") or 16) * partial) // 2
        if rope.get("original_max_position_embeddings"):  # T = 41 past it: the long-context factors run
            rope["original_max_position_embeddings"] = 16
        for name, factors in list(rope.items()):
            if isinstance(factors, list) and len(factors) > frequencies:
                step = len(factors) / frequencies
                rope[name] = [factors[int(i * step)] for i in range(int(frequencies))]


def _index_list(value) -> bool:
    """A list of layer indices (moe_layers, mlp_only_layers), not one value per layer."""
    return (
        isinstance(value, list)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and (len(set(value)) == len(value))
    )


def _per_layer(value, num_layers: int) -> bool:
    return isinstance(value, list) and len(value) == num_layers > 1 and not _index_list(value)


def _cut_to_depth(values: dict, depth: int, num_layers: int) -> dict:
    """Per-layer lists (one value per layer) cut to the first `depth` layers; lists of layer
    indices keep the indices below `depth`."""
    cut = {}
    for key, value in values.items():
        if _per_layer(value, num_layers):
            value = value[:depth]
        elif _index_list(value) and value and max(value) >= depth and key.endswith("layers"):
            value = [index for index in value if index < depth]
        cut[key] = value
    return cut


def _covering_depth(config: PretrainedConfig) -> int:
    """The shortest prefix of layers holding every kind of layer (module docstring), at least 2."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = find_decoder(model).layers
    per_layer = [value for value in config.to_dict().values() if _per_layer(value, len(layers))]
    seen, depth = set(), 2
    for index, layer in enumerate(layers):
        kind = (
            tuple((name, type(m).__name__, *(repr(getattr(m, a, None)) for a in _LAYER_ATTRIBUTES))
                  for name, m in layer.named_modules()),
            tuple(repr(values[index]) for values in per_layer),
        )  # fmt: skip
        if kind not in seen:
            seen.add(kind)
            depth = max(depth, index + 1)
    return min(depth, len(layers))
