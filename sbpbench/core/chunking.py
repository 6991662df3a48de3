"""How StreamBP cuts a sequence into chunks: the positions, and a decoder layer's arguments.

One rule for every phase (core/README.md): the checkpoint pass and the layer backward cut
[0, T) into chunks of `chunk_size`, the head into chunks of `logits_chunk_size`. The last chunk
is shorter when chunk_size does not divide T; chunk_size >= T gives a single chunk. A layer run
on a chunk gets the arguments the model passed it (checkpoints.py records them) sliced to the
chunk's positions.
"""

from __future__ import annotations

import torch


def chunk_bounds(seq_len: int, chunk_size: int) -> list[tuple[int, int]]:
    """[(start, end), ...] covering [0, seq_len) in order, each end - start <= chunk_size."""
    return [(start, min(start + chunk_size, seq_len)) for start in range(0, seq_len, chunk_size)]


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
