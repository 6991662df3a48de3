"""Named model shapes: real configs (verbatim config.json files from the Hugging Face Hub, shipped
in configs/) and tiny test shapes of each family derived from them; any other name is a local
checkpoint directory or a Hub id (source.py). Building a model from a shape gives random weights:
memory and time do not depend on weight values. A multimodal config.json (Llama 4) is shipped
whole, and the causal LM is built from the text_config it nests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

from ..settings.model_names import LOCAL_NAMESPACES, MODEL_NAMES, registry_typo
from .source import checkpoint_config, is_local_checkpoint

# Hub id -> file in configs/ (one per model, copied verbatim from the model repository): the
# registry's names outside its own namespaces.
REAL_MODELS = tuple(name for name in MODEL_NAMES if not name.startswith(LOCAL_NAMESPACES))

# Small enough for CPU tests in float64, big enough to have GQA, several heads and two layers.
# Special-token ids are dropped: the real ones lie outside the tiny vocabulary.
_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 512,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    base: str  # the real model whose config.json this shape starts from
    overrides: dict = field(default_factory=dict)


TINY_MODELS = {
    "tiny/qwen3": ModelSpec("tiny/qwen3", "Qwen/Qwen3-0.6B", {**_TINY, "num_key_value_heads": 2, "head_dim": 16}),
    "tiny/qwen2": ModelSpec("tiny/qwen2", "Qwen/Qwen2.5-7B", {**_TINY, "num_key_value_heads": 2}),
    "tiny/llama": ModelSpec(
        "tiny/llama", "meta-llama/Llama-3.2-1B", {**_TINY, "num_key_value_heads": 1, "head_dim": 16}
    ),
    "tiny/mistral": ModelSpec(
        "tiny/mistral", "mistralai/Mistral-7B-v0.3", {**_TINY, "num_key_value_heads": 4, "head_dim": 16}
    ),
    "tiny/gemma3": ModelSpec(
        "tiny/gemma3",
        "google/gemma-3-1b-pt",
        {
            **_TINY,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # families beyond the five: mixture-of-experts, sinks and windows, MLA, chunked attention
    "tiny/qwen3-moe": ModelSpec(
        "tiny/qwen3-moe",
        "Qwen/Qwen3-30B-A3B",
        {
            **_TINY,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "tiny/gpt-oss": ModelSpec(
        "tiny/gpt-oss",
        "openai/gpt-oss-20b",
        {
            **_TINY,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
        },
    ),
    "tiny/mixtral": ModelSpec(
        "tiny/mixtral",
        "mistralai/Mixtral-8x7B-v0.1",
        {**_TINY, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "tiny/deepseek-v3": ModelSpec(
        "tiny/deepseek-v3",
        "deepseek-ai/DeepSeek-V3",
        {
            **_TINY,
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 24,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "head_dim": 8,
            "qk_head_dim": 16,
        },
    ),
    "tiny/llama4": ModelSpec(
        "tiny/llama4",
        "meta-llama/Llama-4-Scout-17B-16E-Instruct",
        {
            **_TINY,
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size_mlp": 128,
            "num_local_experts": 4,
            "attention_chunk_size": 8,
            "no_rope_layers": [1, 1, 1, 0],
            "moe_layers": [0, 1, 2, 3],
        },
    ),
}

# Shapes for measurements on a CPU: a real vocabulary (full logits are what standard BP pays for)
# on a few narrow layers, so a step at T = 2048 takes about a second on 2 cores. `sbp run`'s default
# on a machine without a GPU.
SMALL_MODELS = {
    "small/qwen3": ModelSpec(
        "small/qwen3",
        "Qwen/Qwen3-0.6B",
        {
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "vocab_size": 32000,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
        },
    ),
}

MODELS: dict[str, ModelSpec] = {name: ModelSpec(name, name) for name in REAL_MODELS} | SMALL_MODELS | TINY_MODELS


def config_file_name(hub_id: str) -> str:
    return hub_id.replace("/", "__") + ".json"


@cache
def _real_config_dict(hub_id: str) -> dict:
    text = resources.files(__package__).joinpath("configs", config_file_name(hub_id)).read_text()
    return json.loads(text)


def causal_lm_values(values: dict) -> dict:
    """The values a causal LM is built from: a config.json's own, or the text_config of a multimodal
    one (its vision tower and projector are not built), which names its own model_type."""
    return dict(values.get("text_config", values))


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; known models: {', '.join(MODELS)} (or a Hub id, or a local checkpoint directory)"
        ) from None


def is_registry_name(name: str) -> bool:
    """A name the registry builds (a local checkpoint directory of the same name comes first)."""
    return name in MODELS and not is_local_checkpoint(name)


def config_dict(name: str, *, download: bool = True, **overrides) -> dict:
    """The config.json values of a model, with overrides applied: a named shape's, else a local
    checkpoint directory's or a Hub id's (models/source.py; download: fetch a config.json the HF
    cache lacks unless HF_HUB_OFFLINE is set)."""
    typo = None if is_local_checkpoint(name) else registry_typo(name, tuple(MODELS))
    if typo:  # "tiny/qwen9": a typo of ours, never a Hub id, so no cache or Hub lookup
        raise ValueError(typo)
    if is_registry_name(name):
        spec = MODELS[name]
        values = causal_lm_values(_real_config_dict(spec.base))
        merged = {**spec.overrides, **overrides}
    else:
        values, merged = checkpoint_config(name, download=download, known=tuple(MODELS)), overrides
    if "num_hidden_layers" in merged and "layer_types" not in merged:
        values.pop("layer_types", None)  # recomputed by the config class for the new depth
    values.update(merged)
    return values


@cache
def full_depth(name: str) -> int | None:
    """Decoder layers of a model (None where its config cannot be read without the network): what
    a row built with `--num-layers` is compared with to call it truncated (records.select.with_full_depth)."""
    try:
        return config_dict(name, download=False).get("num_hidden_layers")
    except (OSError, ValueError):
        return None
