"""Building models: random weights (seeded) from a config (a named shape's, a local checkpoint's,
a Hub id's), or real weights from a local checkpoint or the HF cache when asked for."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ..core import UnsupportedModelError
from .registry import MODELS, config_dict, is_registry_name
from .source import checkpoint_weights


def load_config(name: str, **overrides) -> PretrainedConfig:
    values = config_dict(name, **overrides)
    model_type = values.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UnsupportedModelError(
            f"{name} has model_type {model_type!r}, which this transformers does not implement (sbpbench never "
            "runs a repository's own code); pass a decoder-only causal LM that transformers implements"
        )
    return AutoConfig.for_model(**values)


def weights_source(name: str) -> Path:
    """The directory real weights of `name` load from (--weights): a local checkpoint, or the
    cached snapshot of a Hub id (registry names of real models included). Never downloads them."""
    if is_registry_name(name) and MODELS[name].overrides:
        raise ValueError(f"{name} is a shape of this registry with no published weights; drop --weights")
    return checkpoint_weights(name)


def build_model(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    weights: bool = False,
    **config_overrides,
) -> torch.nn.Module:
    """A causal LM for `name` (a registry name, a local checkpoint directory, a Hub id): random
    weights (seeded), or with weights=True the real ones (weights_source)."""
    config = load_config(name, **config_overrides)
    if weights:
        model = AutoModelForCausalLM.from_pretrained(
            weights_source(name), config=config, dtype=dtype, attn_implementation=attn_implementation
        )
        return model.to(device)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise directly on the target device
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model


def count_parameters(name: str, **config_overrides) -> int:
    """Parameter count of a shape without allocating it (meta device)."""
    config = load_config(name, **config_overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
