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


def is_verified(config: PretrainedConfig) -> bool:
    """Whether CI verifies StreamBP exact on this config's architecture; else its self-check runs
    before the first step (docs/exactness.md)."""
    from ..core.internal import VERIFIED, architecture_key

    return architecture_key(AutoModelForCausalLM._model_mapping[type(config)], config) in VERIFIED


def admission(config: PretrainedConfig) -> str:
    """One line on whether StreamBP streams this config's architecture: verified by CI, or its
    self-check's verdict (run now unless known; UnsupportedModelError when it is refused)."""
    from ..core import check_model

    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    check = check_model(model_class=model_class, config=config)
    if check is None:
        return f"StreamBP streams {model_class.__name__}: an architecture CI verifies"
    return (
        f"StreamBP streams {model_class.__name__}: its self-check (a small float64 copy) agrees with standard BP "
        f"to {check.error:.1e} ({check.where})"
    )


def implementations(config: PretrainedConfig, dtype: torch.dtype, attn_implementation: str | None = None) -> dict:
    """The attention and experts implementations a model is built with: SDPA where the class has
    it (else its eager attention, as GPT-OSS and Gemma 2 need), unless one is asked for; eager
    experts outside bf16 (the same computation, one expert at a time), where torch's grouped_mm and
    its fake-tensor kernel take bf16 only."""
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    kwargs = {"attn_implementation": attn_implementation or ("sdpa" if model_class._supports_sdpa else "eager")}
    if dtype != torch.bfloat16 and model_class._can_set_experts_implementation():
        kwargs["experts_implementation"] = "eager"
    return kwargs


def build_model(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str | None = None,
    weights: bool = False,
    **config_overrides,
) -> torch.nn.Module:
    """A causal LM for `name` (a registry name, a local checkpoint directory, a Hub id): random
    weights (seeded), or with weights=True the real ones (weights_source). attn_implementation:
    transformers' name; None takes `implementations`' choice."""
    config = load_config(name, **config_overrides)
    kwargs = implementations(config, dtype, attn_implementation)
    if weights:
        model = AutoModelForCausalLM.from_pretrained(weights_source(name), config=config, dtype=dtype, **kwargs)
        return model.to(device)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise directly on the target device
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    return model


def count_parameters(name: str, **config_overrides) -> int:
    """Parameter count of a shape without allocating it (meta device)."""
    config = load_config(name, **config_overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
