"""The registry of compared methods by name, and `run_method`, the one entry every step goes through.

Each method is (model, batch, settings) -> loss: one forward and backward step that leaves .grad on
the trainable parameters (accumulating, like backward) and returns the detached loss. The names are
what the CLI and the results files use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.sft import count_targets, shift_labels
from ..data import Batch
from .hf_baseline import bp, ckpt
from .settings import MethodSettings
from .streambp import streambp

MethodFn = Callable[[torch.nn.Module, Batch, MethodSettings], torch.Tensor]

METHODS: dict[str, MethodFn] = {
    "bp": bp,  # standard backpropagation: HF forward with full logits, no checkpointing
    "ckpt": ckpt,  # the same with HF gradient checkpointing of every decoder layer
    "streambp": streambp,  # exact StreamBP (sbpbench.core)
}


def get_method(name: str) -> MethodFn:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}") from None


def run_method(name: str, model, batch: Batch, settings: MethodSettings | None = None) -> torch.Tensor:
    """Validate the batch the same way for every method, then run one step."""
    method = get_method(name)
    count_targets(shift_labels(batch.labels))  # every method refuses a batch with nothing to predict
    return method(model, batch, settings or MethodSettings())
