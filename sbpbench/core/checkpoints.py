"""The checkpoint pass: the model's own forward without an autograd graph, keeping each decoder
layer's input X_l (B, T, d) and the keyword arguments the model passed to it.

Forward pre-hooks record what every layer received (its hidden states, position embeddings,
position ids, ...) and add the StreamBP attention state, so the re-forward of a chunk later calls
the same layer with the same arguments, sliced to the chunk's positions. Nothing family-specific:
Gemma-3's per-layer-type RoPE or embedding scale are whatever the model itself computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .adapters import DecoderParts
from .attention import STATE_KWARG, ForwardState


@dataclass
class Checkpoints:
    layer_inputs: list[torch.Tensor | None]  # X_l, (B, T, d) each
    layer_kwargs: list[dict] = field(default_factory=list)
    last_hidden: torch.Tensor | None = None  # last layer output, input of the final norm


def forward_checkpoints(parts: DecoderParts, input_ids: torch.Tensor, chunk_size: int) -> Checkpoints:
    num_layers = len(parts.layers)
    saved = Checkpoints(layer_inputs=[None] * num_layers, layer_kwargs=[{}] * num_layers)
    forward_state = ForwardState(chunk_size=chunk_size)

    def layer_hook(index):
        def hook(module, args, kwargs):
            kwargs = dict(kwargs)
            hidden = args[0] if args else kwargs.pop("hidden_states")
            saved.layer_inputs[index] = hidden
            saved.layer_kwargs[index] = kwargs
            return (hidden, *args[1:]), {**kwargs, STATE_KWARG: forward_state}

        return hook

    def norm_hook(module, args):
        saved.last_hidden = args[0]

    handles = [layer.register_forward_pre_hook(layer_hook(i), with_kwargs=True) for i, layer in enumerate(parts.layers)]
    handles.append(parts.norm.register_forward_pre_hook(norm_hook))
    try:
        with torch.no_grad():
            parts.decoder(input_ids=input_ids, use_cache=False)  # its normed output is not needed
    finally:
        for handle in handles:
            handle.remove()
    if saved.last_hidden is None or any(x is None for x in saved.layer_inputs):
        raise RuntimeError("the model's forward did not call every decoder layer and the final norm")
    return saved


def chunk_kwargs(kwargs: dict, start: int, end: int) -> dict:
    """Slice a layer's per-position arguments to positions [start, end)."""
    sliced = {}
    for name, value in kwargs.items():
        if name.startswith("position_embeddings"):  # (cos, sin), each (B or 1, T, head_dim)
            value = tuple(t[:, start:end] for t in value) if isinstance(value, tuple) else value[:, start:end]
        elif name == "position_ids":  # (B or 1, T)
            value = value[..., start:end]
        elif name == "cache_position":  # (T,)
            value = value[start:end]
        elif isinstance(value, torch.Tensor):
            raise NotImplementedError(
                f"StreamBP does not know how to slice the decoder-layer argument {name!r} along the sequence"
            )
        sliced[name] = value
    return sliced
