"""The StreamBP paper's bp / ckpt baselines as its script ran them, where that differs in memory
from ours (methods/hf_baseline.py).

The paper measured BP memory with the official scripts/test_bp.py (github Ledzy/StreamBP, pinned to
torch 2.6.0 and transformers 4.51.3):

    output = model(input_ids=..., attention_mask=..., labels=labels, use_cache=False, ...)
    output.loss.backward()

`output` holds the full (B, T, V) logits in the model dtype, so they stay allocated through the
whole backward: 2·B·T·V bytes in bf16 (5.7 GiB for Qwen3-8B at T = 20k). Ours takes `.loss` and
drops the output, so autograd frees those logits once the float32 copy for the loss exists. This
is the one difference the Figure 3 check needs (it moves the predicted ckpt limit for Qwen3-8B
from about 23k to the paper's 20k); `paper_bp` / `paper_ckpt` reproduce it.

Other differences between transformers 4.51.3 and ours, not modelled (each well under 1% of the
Figure 3 limits), for the record:
- the loss is the same (ForCausalLMLoss: logits.float(), labels padded and shifted, mean CE);
- the padding mask: 4.51 builds an additive (B, 1, T, T) mask in the model dtype (2·T² bytes
  in bf16, built through a few transient T² copies, plus `_unmask_unattended` on CUDA); 5.x
  builds a boolean one (T² bytes) that SDPA converts to the model dtype at every layer call
  (a per-layer 2·T² copy that 4.51 makes only when T is not a multiple of 8, the efficient
  kernel's bias alignment). At the head-phase peak of ckpt at 20k: +0.37 GiB in 4.51;
- 4.51's sdpa path always repeats K/V to all heads and calls .contiguous() on q, k, v; 5.x
  repeats them too whenever a mask is given (our padded batches), so the saved tensors match;
- 4.51's gradient checkpointing defaults to use_reentrant=True, ours is non-reentrant; both keep
  each layer's inputs and recompute one layer at a time.
"""

from __future__ import annotations

import torch

from ..data import Batch
from ..methods.hf_baseline import hf_gradient_checkpointing


def paper_bp(model, batch: Batch, settings) -> torch.Tensor:
    """HF forward with labels, backward with the output (and its logits) still referenced."""
    output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels, use_cache=False)
    output.loss.backward()
    loss = output.loss.detach()
    del output  # only now: the logits lived through the backward, as in the paper's script
    return loss


def paper_ckpt(model, batch: Batch, settings) -> torch.Tensor:
    with hf_gradient_checkpointing(model):
        return paper_bp(model, batch, settings)


PAPER_METHODS = {"bp": paper_bp, "ckpt": paper_ckpt}
