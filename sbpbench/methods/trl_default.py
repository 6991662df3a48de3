"""What a TRL user gets by default: transformers' gradient checkpointing plus TRL's fused LM head.

TRL 1.16's SFT, DPO and GRPO trainers default to `gradient_checkpointing=True` and, whatever the
options, patch the model with `trl.trainer.utils.add_fused_lm_head`: called with
`fused_lm_head=True` it runs the decoder, then projects the last hidden state through the lm_head
in tiles (4096 tokens x 32768 vocabulary entries, an autograd.Function that recomputes each tile in
its backward), keeping per token only the label's log-probability, never the (B, T, V) logits.
The trainers' losses are functions of those log-probs (SFT: their sum over num_items_in_batch),
so this step is the objective's loss from them (`loss_from_logps`), as SFTTrainer.compute_loss,
DPOTrainer._compute_loss and GRPOTrainer._compute_loss compute theirs.

TRL folds each tile in float32 whatever the model dtype, so in a float64 model this step agrees
with bp to float32 rounding only (tests/exactness/test_peers.py). An optional extra (`pip install -e .[trl]`):
without TRL the point is "unsupported", never another computation. The patched forward is the
model's for the step only.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..core.internal import unwrap_model
from ..data import Batch
from .hf_baseline import hf_gradient_checkpointing
from .unsupported import MethodUnsupported


def _add_fused_lm_head():
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError as error:
        raise MethodUnsupported(f"TRL is not installed ({error}); pip install -e .[trl]") from None
    return add_fused_lm_head


@contextmanager
def fused_lm_head(model, temperature: float):
    """TRL's fused head on the causal LM under any adapter wrapper (as its trainers add it), for
    the duration of the block; the model's own forward after, whatever happens."""
    add_fused_lm_head = _add_fused_lm_head()
    causal_lm = unwrap_model(model)
    before = vars(causal_lm).get("forward")  # an instance forward already there (Accelerate's, say)
    add_fused_lm_head(causal_lm, temperature=temperature)
    try:
        yield
    finally:
        if before is None:
            del causal_lm.forward
        else:
            causal_lm.forward = before


def trl_default(model, batch: Batch, settings) -> torch.Tensor:
    objective = batch.objective()
    with hf_gradient_checkpointing(model), fused_lm_head(model, objective.temperature):
        outputs = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            labels=objective.labels,
            fused_lm_head=True,
            use_cache=False,
        )
        logps = F.pad(outputs.log_probs, (0, 1))  # (B, T - 1) for labels[:, 1:] -> (B, T), as objective.targets
        loss = objective.loss_from_logps(logps)
        loss.backward()
    return loss.detach()
