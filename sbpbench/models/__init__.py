"""Model shapes and how to build them: shipped configs, local checkpoints, any Hub id (its config.json from the HF cache)."""

from ..core import UnsupportedModelError  # what building or running an unsupported family raises
from .build import build_model, count_parameters, load_config, weights_source
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
    "apply_lora",
    "build_model",
    "config_dict",
    "count_parameters",
    "full_depth",
    "get_spec",
    "is_local_checkpoint",
    "load_config",
    "weights_source",
]
