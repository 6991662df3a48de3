"""Building models: from a named shape with random weights, or from a local checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from .registry import config_dict

_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


def is_local_checkpoint(name: str) -> bool:
    return Path(name).is_dir() and (Path(name) / "config.json").is_file()


def load_config(name: str, **overrides) -> PretrainedConfig:
    if is_local_checkpoint(name):
        config = AutoConfig.from_pretrained(name)
        config.update(overrides)
        return config
    values = config_dict(name, **overrides)
    return AutoConfig.for_model(**values)


def build_model(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    **config_overrides,
) -> torch.nn.Module:
    """A causal LM for `name`: a registry name (random weights, seeded), or a local directory with
    config.json (real weights if it holds *.safetensors / *.bin, otherwise random)."""
    path = Path(name)
    if is_local_checkpoint(name) and not config_overrides and any(next(path.glob(p), None) for p in _WEIGHT_PATTERNS):
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=attn_implementation)
        return model.to(device)
    config = load_config(name, **config_overrides)
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
