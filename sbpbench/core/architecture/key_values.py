"""The keys and values of a layer without the rest of it: step 1 of the layer backward
(core/README.md, "Layer backward").

The layer backward needs each position's keys/values (post-norm, post-RoPE, before GQA repetition),
not its queries. Run through the whole layer until its attention function stores them
(`KVCaptured`), a chunk would also pay the q projection (as many weights as k and v together under
4:1 GQA) and, where the family has one, q_norm and the queries' RoPE. The projection here runs only
input_layernorm, k_proj, v_proj, k_norm and the keys' RoPE, each module called as the layer calls
it (its hooks, a LoRA wrapper, autocast apply alike), with the modeling file's own
`apply_rotary_pos_emb`.

No list of families says where it applies. A layer built the standard way (self_attn with k_proj,
v_proj and head_dim, an input_layernorm, RoPE from its modeling file) gets a candidate, and the
candidate is used only once it has given, on one chunk, bitwise the keys, values and sliding window
the whole-layer path gives (`verified`; tests/exactness/test_kv_capture.py). Where it does not (a
family whose attention is built otherwise, a patched forward, a hook on the layer or its attention
that the whole-layer path would run), the caller takes the whole-layer path.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable

import torch
from torch import nn

# (layer input chunk (B, c, d), the layer's arguments sliced to the chunk) -> (keys, values, sliding window);
# normed=True: the chunk is input_layernorm's output already (sequence parallel's K/V backward)
Projection = Callable[..., tuple[torch.Tensor, torch.Tensor, int | None]]

# layer -> {(dtype, device type, k_norm order): the window its keys were verified with, or _FAILED}
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FAILED = "failed"
# where k_norm runs: on the (B, c, h_kv, hd) view before the transpose (Qwen3) or on (B, h_kv, c, hd) after (Gemma-3)
_KEY_NORM_ORDERS = ("before transpose", "after transpose")


class LayerKeyValues:
    """The keys/values of one layer's chunks: by the projection alone where it reproduces the
    layer's on the first chunk it is asked for (verified once per layer, dtype and device), else by
    `whole_layer`. call: what runs the layer (the layer, or its hook-free forward under a sharded
    engine); whole_layer: a chunk's keys/values by running the layer up to its attention call."""

    def __init__(self, layer: nn.Module, call, kwargs: dict, whole_layer: Projection):
        self.layer, self.whole_layer = layer, whole_layer
        parts = _standard_parts(layer, call) if isinstance(kwargs.get("position_embeddings"), tuple) else None
        self._parts = parts
        self.projection: Projection | None = None  # the verified projection, once chosen
        self._chosen: Projection | None = None if parts is not None else whole_layer

    def __call__(self, hidden: torch.Tensor, chunk_kwargs: dict):
        """hidden (B, c, d) -> keys, values (B, h_kv, c, hd) and the layer's sliding window."""
        if self._chosen is None:
            self.projection = _verified(self.layer, self._parts, self.whole_layer, hidden, chunk_kwargs)
            self._chosen = self.projection or self.whole_layer
        return self._chosen(hidden, chunk_kwargs)


def _verified(layer, parts, whole_layer: Projection, sample: torch.Tensor, sample_kwargs: dict) -> Projection | None:
    """The candidate (with each k_norm order the layer may use) that gives the whole-layer path's
    keys, values and window bitwise on the sample chunk, or None."""
    verdicts = _VERDICTS.setdefault(layer, {})
    for order in _KEY_NORM_ORDERS if parts[2] is not None else (None,):
        key = (sample.dtype, sample.device.type, order)
        if key not in verdicts:
            verdicts[key] = _verify(_candidate(*parts, order), whole_layer, sample, sample_kwargs)
        if verdicts[key] != _FAILED:
            return _candidate(*parts, order, window=verdicts[key])
    return None


def _standard_parts(layer: nn.Module, call):
    """(input_layernorm, self_attn, k_norm or None, the modeling file's RoPE) of a layer built the
    standard way and run as its class runs it, else None."""
    attention = getattr(layer, "self_attn", None)
    norm = getattr(layer, "input_layernorm", None)
    if attention is None or norm is None or not all(hasattr(attention, n) for n in ("k_proj", "v_proj", "head_dim")):
        return None
    rope = getattr(sys.modules.get(_home(attention)), "apply_rotary_pos_emb", None)
    if rope is None or not (_stock(layer, call) and _stock(attention, attention)):
        return None
    return norm, attention, getattr(attention, "k_norm", None), rope


def _candidate(norm, attention, key_norm, rope, order, window=None) -> Projection:
    def project(hidden: torch.Tensor, chunk_kwargs: dict, normed: bool = False):
        hidden = hidden if normed else norm(hidden)  # (B, c, d); normed: input_layernorm already applied
        shape = (*hidden.shape[:-1], -1, attention.head_dim)  # (B, c, h_kv, hd)
        key = attention.k_proj(hidden).view(shape)
        if order == "before transpose":
            key = key_norm(key)
        key = key.transpose(1, 2)  # (B, h_kv, c, hd)
        if order == "after transpose":
            key = key_norm(key)
        value = attention.v_proj(hidden).view(shape).transpose(1, 2)
        cos, sin = chunk_kwargs["position_embeddings"]
        # the family's own RoPE on the keys, with no query heads: (B, 0, c, hd) costs nothing
        _, key = rope(key[:, :0], key, cos, sin)
        return key, value, window

    return project


def _verify(candidate: Projection, whole_layer: Projection, sample: torch.Tensor, sample_kwargs: dict):
    """The window the whole-layer path reports, if the candidate gives its keys and values
    bitwise on the sample chunk; else _FAILED. A fake tensor (the memory simulator) has no values:
    its candidate is taken as the real run's would be."""
    try:
        with torch.no_grad():
            key, value, _ = candidate(sample, sample_kwargs)
            want_key, want_value, window = whole_layer(sample, sample_kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError):  # a layer this candidate does not fit
        return _FAILED
    if _is_fake(key):
        return window
    same = (
        key.shape == want_key.shape
        and value.shape == want_value.shape
        and torch.equal(key, want_key)
        and torch.equal(value, want_value)
    )
    return window if same else _FAILED


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


def _home(module: nn.Module) -> str:
    """The module that defines the forward `module` runs (a class FSDP2 derives keeps its base's)."""
    return getattr(type(module).forward, "__module__", None) or ""


def _stock(module: nn.Module, call) -> bool:
    """The module runs its class's forward from a transformers modeling file, and calling it as
    `call` runs no pre-hook the projection would skip (the whole-layer path runs them, and a
    pre-hook may change the input)."""
    if not _home(module).startswith("transformers.models.") or "forward" in module.__dict__:
        return False
    if call is module:  # called as a module: its pre-hooks would run
        return not (module._forward_pre_hooks or nn.modules.module._global_forward_pre_hooks)
    return getattr(call, "__self__", None) is module and getattr(call, "__func__", None) is type(module).forward
