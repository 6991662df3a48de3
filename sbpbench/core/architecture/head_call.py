"""The logits of a chunk of positions by the model's own causal-LM forward.

What a family does after its last decoder layer (Gemma's final softcapping, Cohere's logit scale,
Granite's logits scaling, a multiplier) lives in its `XForCausalLM.forward`, after its decoder
returns. StreamBP runs that forward itself, on one chunk of positions at a time: for the duration
of the call the decoder is a stand-in that returns the final norm of the chunk's hidden states,
and the lm_head is the one the step calls (a sharded engine's hook-free forward). So the head is
the model's, whatever it is, and no list of families says what it does. A head that mixed
positions would fail the self-check (self_check.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn
from transformers.modeling_outputs import MoeModelOutputWithPast

from .parts import DecoderParts, UnsupportedModelError


class _DecoderStandIn(nn.Module):
    """Returns the chunk's normed hidden states as the decoder's output; any other attribute the
    head reads of its decoder (a multiplier, the config) is the real decoder's."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        object.__setattr__(self, "_decoder", decoder)  # not a submodule: its parameters stay where they are
        object.__setattr__(self, "hidden", None)

    def forward(self, *args, **kwargs) -> MoeModelOutputWithPast:
        return MoeModelOutputWithPast(last_hidden_state=self.hidden)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_decoder"), name)


class _LmHeadStandIn(nn.Module):
    """The lm_head as the step calls it; its weight and bias are the real lm_head's."""

    def __init__(self, lm_head: nn.Linear, run: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        object.__setattr__(self, "_lm_head", lm_head)
        object.__setattr__(self, "_run", run)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._run(hidden)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_lm_head"), name)


def _child_name(parent: nn.Module, child: nn.Module) -> str:
    for name, module in parent.named_children():
        if module is child:
            return name
    raise UnsupportedModelError(
        f"{type(child).__name__} is not a direct attribute of {type(parent).__name__}: StreamBP runs the "
        "model's own head on a stand-in decoder, which it could not put in place"
    )


class ModelHead:
    """logits(hidden) for hidden (B, c, d), the last decoder layer's output at c positions:
    (B, c, V), as the model's forward computes them from those positions. call(module): what runs
    the final norm and the lm_head (the module, or a sharded unit's hook-free forward)."""

    def __init__(self, parts: DecoderParts, call: Callable[[nn.Module], Callable] = lambda module: module):
        self.parts, self.call = parts, call
        model = parts.model
        self._decoder_name = _child_name(model, parts.decoder)
        self._head_name = _child_name(model, parts.lm_head)
        self._forward = type(model).forward  # unbound: the model's own hooks (a sharded root's) do not run per chunk
        accepted = inspect.signature(self._forward).parameters
        self._extra = {"output_router_logits": False} if "output_router_logits" in accepted else {}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.call(self.parts.norm)(hidden)  # (B, c, d)
        with self._stand_ins() as decoder:
            decoder.hidden = normed
            ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)  # never read: (B, c)
            out = self._forward(self.parts.model, input_ids=ids, use_cache=False, **self._extra)
            decoder.hidden = None
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits

    @contextmanager
    def _stand_ins(self):
        model, parts = self.parts.model, self.parts
        decoder = _DecoderStandIn(parts.decoder)
        head = _LmHeadStandIn(parts.lm_head, self.call(parts.lm_head))
        modules = model._modules
        modules[self._decoder_name], modules[self._head_name] = decoder, head
        try:
            yield decoder
        finally:
            modules[self._decoder_name], modules[self._head_name] = parts.decoder, parts.lm_head
