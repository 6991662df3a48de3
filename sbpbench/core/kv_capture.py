"""The keys and values of a layer without the rest of it: step 1 of the layer backward
(core/README.md, "Layer backward").

The layer backward needs each position's keys/values (post-norm, post-RoPE, before GQA repetition),
not its queries. Run through the whole layer until its attention function stores them
(`KVCaptured`), a chunk would also pay the q projection (as many weights as k and v together under
4:1 GQA) and, in Qwen3 and Gemma-3, q_norm and the queries' RoPE. With the family's
`KeyValueRecipe` (adapters.py) only input_layernorm, k_proj, v_proj, k_norm and the keys' RoPE run,
each module called as the layer calls it (its hooks, a LoRA wrapper, autocast apply alike), in the
modeling file's own order and layouts, with its own `apply_rotary_pos_emb`: bitwise the tensors the
layer would hand its attention function (tests/exactness/test_kv_capture.py, every family, fp64 and fp32, LoRA).

`key_value_projection` says whether the recipe applies to a layer as it is called here; where it does
not (a family without a recipe, a patched forward, a hook on the layer or its attention that the
whole-layer path would run), the caller takes the whole-layer path.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from .adapters import KeyValueRecipe

# (layer input chunk (B, c, d), the layer's arguments sliced to the chunk) -> (keys, values, sliding window);
# normed=True: the chunk is input_layernorm's output already (sequence parallel's K/V backward)
Projection = Callable[..., tuple[torch.Tensor, torch.Tensor, int | None]]


def key_value_projection(layer: nn.Module, call, kwargs: dict, recipe: KeyValueRecipe | None) -> Projection | None:
    """The keys/values of `layer` by its family's recipe, or None where the recipe does not apply.
    call: what runs the layer (the layer, or its hook-free forward under a sharded engine)."""
    if recipe is None or not isinstance(kwargs.get("position_embeddings"), tuple):
        return None
    attention = getattr(layer, "self_attn", None)
    norm = getattr(layer, "input_layernorm", None)
    if attention is None or norm is None or not all(hasattr(attention, n) for n in ("k_proj", "v_proj", "head_dim")):
        return None
    if recipe.key_norm is not None and not hasattr(attention, "k_norm"):
        return None
    rope = getattr(sys.modules.get(_home(attention)), "apply_rotary_pos_emb", None)
    if rope is None or not (_stock(layer, call) and _stock(attention, attention)):
        return None
    window = getattr(attention.config, "sliding_window", None) if recipe.window_from_config else None
    if not recipe.window_from_config:
        window = getattr(attention, "sliding_window", None)

    def project(hidden: torch.Tensor, chunk_kwargs: dict, normed: bool = False):
        hidden = hidden if normed else norm(hidden)  # (B, c, d); normed: input_layernorm already applied
        shape = (*hidden.shape[:-1], -1, attention.head_dim)  # (B, c, h_kv, hd)
        key = attention.k_proj(hidden).view(shape)
        if recipe.key_norm == "before transpose":
            key = attention.k_norm(key)
        key = key.transpose(1, 2)  # (B, h_kv, c, hd)
        if recipe.key_norm == "after transpose":
            key = attention.k_norm(key)
        value = attention.v_proj(hidden).view(shape).transpose(1, 2)
        cos, sin = chunk_kwargs["position_embeddings"]
        # the family's own RoPE on the keys, with no query heads: (B, 0, c, hd) costs nothing
        _, key = rope(key[:, :0], key, cos, sin)
        return key, value, window

    return project


def _home(module: nn.Module) -> str:
    """The module that defines the forward `module` runs (a class FSDP2 derives keeps its base's)."""
    return getattr(type(module).forward, "__module__", None) or ""


def _stock(module: nn.Module, call) -> bool:
    """The module runs its class's forward from a transformers modeling file, and calling it as
    `call` runs no pre-hook the recipe would skip (the whole-layer path runs them, and a pre-hook
    may change the input)."""
    if not _home(module).startswith("transformers.models.") or "forward" in module.__dict__:
        return False
    if call is module:  # called as a module: its pre-hooks would run
        return not (module._forward_pre_hooks or nn.modules.module._global_forward_pre_hooks)
    return getattr(call, "__self__", None) is module and getattr(call, "__func__", None) is type(module).forward
