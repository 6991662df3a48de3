"""The registry of compared methods by name, and `run_method`, the one entry every step goes through.

Each method is (model, batch, settings) -> loss: one forward and backward step that leaves .grad on
the trainable parameters (accumulating, like backward) and returns the detached loss. The names are
what the CLI and the results files use.

Adding a method: a module with its step function, and one `Method` entry below naming the
settings it reads (methods/settings.py); the CLI, experiment files, runner and results key follow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..core.attention import ATTENTION_NAME
from ..core.labels import count_targets, shift_labels
from ..data import Batch
from .hf_baseline import bp, ckpt
from .settings import SETTING_NAMES, MethodSettings
from .streambp import streambp

MethodFn = Callable[[torch.nn.Module, Batch, MethodSettings], torch.Tensor]


class Method(NamedTuple):
    fn: MethodFn
    uses: tuple[str, ...]  # MethodSettings fields it reads; the rest stay None in its spec and row
    summary: str
    attn_implementation: str = "sdpa"  # what its rows record: transformers' name for the attention it runs


METHODS: dict[str, Method] = {
    "bp": Method(bp, (), "standard backpropagation: HF forward with full logits, no checkpointing"),
    "ckpt": Method(ckpt, (), "the same with HF gradient checkpointing of every decoder layer"),
    "streambp": Method(streambp, SETTING_NAMES, "exact StreamBP (sbpbench.core)", ATTENTION_NAME),
}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}") from None


def run_method(name: str, model, batch: Batch, settings: MethodSettings | None = None) -> torch.Tensor:
    """Validate the batch the same way for every method, then run one step with the settings it
    reads (unset ones at their defaults)."""
    method = get_method(name)
    count_targets(shift_labels(batch.labels))  # every method refuses a batch with nothing to predict
    return method.fn(model, batch, (settings or MethodSettings()).for_method(method.uses))
