"""StreamBP from sbpbench.core, behind the common method signature."""

from __future__ import annotations

import torch

from ..core import stream_backward
from ..core.placement import observe_stores  # noqa: F401 (for the runner, which does not import core)
from ..data import Batch


def streambp(model, batch: Batch, settings) -> torch.Tensor:
    return stream_backward(
        model,
        batch.input_ids,
        objective=batch.objective(),
        attention_mask=batch.attention_mask,
        chunk_size=settings.chunk_size,
        logits_chunk_size=settings.logits_chunk_size,
        fp32_grad_accumulation=settings.fp32_grad_accumulation,
        checkpoints=settings.checkpoints,
    )
