"""StreamBP from sbpbench.core, behind the common method signature.

`reporting_progress(callback)` hands core's per-layer progress callback (core/stream.py
LayerProgress) to every StreamBP step run inside it: a measuring caller (the worker) sets it
around its steps without the registry's (model, batch, settings) signature growing an argument
that no other method reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..core import LayerProgress, stream_backward
from ..data import Batch

_PROGRESS: ContextVar[LayerProgress | None] = ContextVar("streambp_progress", default=None)


@contextmanager
def reporting_progress(callback: LayerProgress | None) -> Iterator[None]:
    """StreamBP steps run inside call `callback(done, num_layers)` per layer of their backward."""
    token = _PROGRESS.set(callback)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def streambp(model, batch: Batch, settings) -> torch.Tensor:
    return stream_backward(
        model,
        batch.input_ids,
        objective=batch.objective(),
        attention_mask=batch.attention_mask,
        chunk_size=settings.chunk_size,
        logits_chunk_size=settings.logits_chunk_size,
        fp32_grad_accumulation=settings.fp32_grad_accumulation,
        progress=_PROGRESS.get(),
        checkpoints=settings.checkpoints,
    )
