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
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from ..data import Batch
from .hf_baseline import hf_forward_backward, hf_gradient_checkpointing
from .streambp import current_hooks


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
    hooks = current_hooks()
    shapes = ShapeOnlyCopies() if hooks.shapes_only else None
    if shapes is not None and hooks.on_store is not None:
        hooks.on_store(shapes)
    if library_offload(model) and not enabled and shapes is None:
        with hf_gradient_checkpointing(model, offload=True):
            yield
        return
    with hf_gradient_checkpointing(model):
        pin = _on_accelerator(model)
        device_type = next(model.parameters()).device.type
        for module in model.modules():
            function = vars(module).get("_gradient_checkpointing_func")
            if function is not None:  # restored by hf_gradient_checkpointing on exit
                module._gradient_checkpointing_func = _offloaded(function, pin, device_type, shapes)
        yield


def _offloaded(function, pin_memory: bool, device_type: str, shapes: ShapeOnlyCopies | None):
    @functools.wraps(function)
    def checkpoint(*args, **kwargs):
        saving = save_on_cpu(pin_memory=pin_memory, device_type=device_type) if shapes is None else shapes.hooks()
        with saving:
            return function(*args, **kwargs)

    return checkpoint


@dataclass(frozen=True)
class _HostShape:
    """A host copy made with shapes only: where it came from and what it would hold, not the values."""

    device: torch.device
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int


class ShapeOnlyCopies:
    """The host copies of a step's offloaded checkpoints where SteeredHooks.shapes_only asks for shapes,
    as StreamBP's stores keep them (core/placements/placement.py): the memory simulator's fake
    tensors, whose `.cpu()` is the tensor itself, so save_on_cpu would leave every checkpoint in the
    counted memory. A saved tensor is packed as its shape (the device's tensor is let go), counted
    as host bytes while autograd holds it, and unpacked as an empty device tensor, the copy back.
    Reported through StepHooks.on_store, as a store is: `max_host_bytes`, `transfer_bytes`."""

    def __init__(self):
        self.host_bytes = self.max_host_bytes = 0
        self.transfer_bytes = 0  # copied out and back

    def hooks(self) -> saved_tensors_hooks:
        return saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _HostShape:
        nbytes = tensor.numel() * tensor.element_size()  # save_on_cpu's copy is dense
        packed = _HostShape(tensor.device, tensor.shape, tensor.dtype, nbytes)
        self.host_bytes += nbytes
        self.max_host_bytes = max(self.max_host_bytes, self.host_bytes)
        self.transfer_bytes += nbytes
        weakref.finalize(packed, self._freed, nbytes)
        return packed

    def _unpack(self, packed: _HostShape) -> torch.Tensor:
        self.transfer_bytes += packed.nbytes
        return torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)

    def _freed(self, nbytes: int) -> None:
        self.host_bytes -= nbytes


def ckpt_offload(model, batch: Batch, settings) -> torch.Tensor:
    with offloaded_checkpointing(model):
        return hf_forward_backward(model, batch)
