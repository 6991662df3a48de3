"""The compared methods, one registry (registry.py): each is (model, batch, settings) -> loss, one
forward and backward step; training.py adds the optimizer step, exactness.py compares methods."""

from __future__ import annotations

from ..settings import STEPS
from .registry import (
    DEFAULT_METHODS,
    METHODS,
    SEQUENCE_PARALLEL_METHODS,
    Method,
    MethodFn,
    data_parallel_unsupported,
    get_method,
    method_names,
    method_unavailable,
    run_method,
    sequence_parallel_refusal,
    sequence_parallel_unsupported,
)
from .settings import MethodSettings
from .training import make_optimizer, run_step
from .unsupported import MethodUnsupported

__all__ = [
    "DEFAULT_METHODS",
    "METHODS",
    "SEQUENCE_PARALLEL_METHODS",
    "STEPS",
    "Method",
    "MethodFn",
    "MethodSettings",
    "MethodUnsupported",
    "data_parallel_unsupported",
    "get_method",
    "make_optimizer",
    "method_names",
    "method_unavailable",
    "run_method",
    "run_step",
    "sequence_parallel_refusal",
    "sequence_parallel_unsupported",
]
