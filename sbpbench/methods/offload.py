"""Gradient checkpointing with the checkpoints in host memory: transformers'
`activation_checkpointing_enable(offload=True)`, which wraps each checkpointed layer call in
torch's `save_on_cpu(pin_memory=True)` (TRL's activation offloading does the same).

What moves: the tensors the checkpoint saves for its recompute, i.e. each decoder layer's inputs
(hidden states, L x B x T x d in all); they go to the host in the forward and come back for that
layer's recompute in the backward. Everything else, the full (B, T, V) logits included, is as in
`ckpt`. The same operations on the same values: gradients identical to `ckpt`'s.

Where transformers has no `offload` (before 5.20), pinned memory cannot exist (no accelerator,
as on a CPU-only machine, where transformers' own path fails) or the caller enabled checkpointing
already, the same wrap is installed here:
each module's checkpoint function inside `save_on_cpu(pin_memory=<accelerator present>)`. On a CPU
the "host copy" is another tensor in the same memory: the live-tensor tracker counts it, so a CPU
row shows what the copies cost, not what they save.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.autograd.graph import save_on_cpu

from ..data import Batch
from .hf_baseline import hf_forward_backward, hf_gradient_checkpointing

# The saved-tensor hooks (pack, unpack) an offloaded checkpoint runs under: None, torch's
# save_on_cpu; the memory simulator's (simulate/host_copies.py), which keep a fake copy on a host it
# counts apart, as a GPU run's device memory does not hold it
_HOST_HOOKS: ContextVar[tuple | None] = ContextVar("host_hooks", default=None)


@contextmanager
def host_copies_by(pack, unpack):
    """Offloaded checkpoints made in the block pack and unpack with these hooks, not save_on_cpu."""
    token = _HOST_HOOKS.set((pack, unpack))
    try:
        yield
    finally:
        _HOST_HOOKS.reset(token)


def _on_accelerator(model) -> bool:
    return next(model.parameters()).device.type != "cpu"


def library_offload(model) -> bool:
    """Whether transformers' own offload path applies: the installed version has the kwarg and the
    model is on an accelerator (pinned host memory exists)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    return enable is not None and "offload" in inspect.signature(enable).parameters and _on_accelerator(model)


@contextmanager
def offloaded_checkpointing(model):
    """hf_gradient_checkpointing with every checkpoint's saved tensors in host memory. Where the
    caller already enabled checkpointing, re-enabling it through transformers would add a second
    input-grad hook, so the same wrap is installed over the caller's checkpoint function instead."""
    enabled = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    if library_offload(model) and not enabled:
        with hf_gradient_checkpointing(model, offload=True):
            yield
        return
    with hf_gradient_checkpointing(model):
        pin = _on_accelerator(model)
        device_type = next(model.parameters()).device.type
        for module in model.modules():
            function = vars(module).get("_gradient_checkpointing_func")
            if function is not None:  # restored by hf_gradient_checkpointing on exit
                module._gradient_checkpointing_func = _offloaded(function, pin, device_type)
        yield


def _offloaded(function, pin_memory: bool, device_type: str):
    @functools.wraps(function)
    def checkpoint(*args, **kwargs):
        hooks = _HOST_HOOKS.get()
        if hooks is not None:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                return function(*args, **kwargs)
        with save_on_cpu(pin_memory=pin_memory, device_type=device_type):
            return function(*args, **kwargs)

    return checkpoint


def ckpt_offload(model, batch: Batch, settings) -> torch.Tensor:
    with offloaded_checkpointing(model):
        return hf_forward_backward(model, batch)
