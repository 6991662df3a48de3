"""Model shapes and how to build them: shipped configs, local checkpoints, any Hub id (its config.json from the HF cache)."""

from ..core import UnsupportedModelError  # what building or running an unsupported family raises
from .build import admission, build_model, count_parameters, implementations, is_verified, load_config, weights_source
from .lora import apply_lora
from .registry import MODELS, REAL_MODELS, SMALL_MODELS, TINY_MODELS, ModelSpec, config_dict, full_depth, get_spec
from .source import is_local_checkpoint

__all__ = [
    "MODELS",
    "REAL_MODELS",
    "SMALL_MODELS",
    "TINY_MODELS",
    "ModelSpec",
    "UnsupportedModelError",
    "admission",
    "apply_lora",
    "build_model",
    "config_dict",
    "count_parameters",
    "full_depth",
    "get_spec",
    "implementations",
    "is_local_checkpoint",
    "is_verified",
    "load_config",
    "weights_source",
]
