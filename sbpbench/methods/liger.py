"""Liger's fused linear + cross-entropy (liger-kernel, `LigerFusedLinearCrossEntropyLoss`), as its
users run it: transformers' decoder with its gradient checkpointing, then Liger's Triton kernel on
the last hidden state and the lm_head weight, never materialising the (B, T, V) logits (it
computes the head's gradients chunk by chunk during the forward).

An optional extra (`pip install -e .[peers]`). Refused with status "unsupported", never replaced
by another computation, where it cannot run as users run it: liger-kernel not installed, no CUDA
device (Triton), an objective other than SFT (Liger's GRPO/DPO losses are separate trainers with
their own definitions), or an lm_head that is not a plain Linear (LoRA on it).
"""

from __future__ import annotations

import torch

from ..core import IGNORE_INDEX, SFT
from ..core.internal import resolve_parts
from ..data import Batch
from .hf_baseline import hf_gradient_checkpointing
from .unsupported import MethodUnsupported


def _liger_loss_class():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as error:
        raise MethodUnsupported(f"liger-kernel is not installed ({error}); pip install -e .[peers]") from None
    return LigerFusedLinearCrossEntropyLoss


def liger(model, batch: Batch, settings) -> torch.Tensor:
    device = batch.input_ids.device
    if device.type != "cuda":
        raise MethodUnsupported(f"liger-kernel's Triton kernels need a CUDA GPU; this point runs on {device.type}")
    objective = batch.objective()
    if not isinstance(objective, SFT):
        raise MethodUnsupported(f"liger here implements the SFT loss only, not {objective.name}")
    loss_class = _liger_loss_class()
    parts = resolve_parts(model)
    head = parts.lm_head
    loss_fn = loss_class(ignore_index=IGNORE_INDEX, reduction="mean", softcap=parts.final_logit_softcap)
    with hf_gradient_checkpointing(model):
        hidden = parts.decoder(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
        ).last_hidden_state  # (B, T, d), after the final norm
        d = hidden.shape[-1]
        loss = loss_fn(head.weight, hidden.reshape(-1, d), objective.targets.reshape(-1), head.bias)
        loss.backward()
    return loss.detach()
