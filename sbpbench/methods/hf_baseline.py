"""The paper's baselines: transformers' own forward with full logits and its own loss, with and
without its gradient checkpointing (non-reentrant, every decoder layer)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..core import SFT
from ..data import Batch


def hf_forward_backward(model, batch: Batch) -> torch.Tensor:
    """The objective from transformers' full (B, T, V) logits, then `.backward()`, with no KV cache
    (a training step, as the HF Trainer runs it). SFT is `model(..., labels=labels).loss`, the
    paper's baseline; transformers computes that loss in float32 even for a float64 model, so a
    float64 model gets the same formula on its float64 logits. GRPO and DPO compute their
    per-token log-probs from the full logits, as TRL's trainers do. A mixture-of-experts model that
    returns its load-balancing loss (config.output_router_logits) adds it, times its coefficient, to
    every objective, as transformers adds it to its `labels=` loss and TRL's trainers to theirs."""
    objective = batch.objective()
    if isinstance(objective, SFT) and next(model.parameters()).dtype != torch.float64:
        loss = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels, use_cache=False
        ).loss
    else:
        output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        loss = objective.full_loss(output.logits) + router_loss(model, output)
    loss.backward()
    return loss.detach()


def router_loss(model, output) -> torch.Tensor | float:
    """coef x the load-balancing loss the model's forward returned (`aux_loss`), else 0."""
    aux = getattr(output, "aux_loss", None)
    if aux is None:
        return 0.0
    base = getattr(model, "get_base_model", lambda: model)()
    return getattr(base, "router_aux_loss_coef", base.config.router_aux_loss_coef) * aux


def _enable_checkpointing(model, offload: bool = False) -> None:
    """Non-reentrant checkpointing of every decoder layer. transformers >= 5.20 renamed
    gradient_checkpointing_* to activation_checkpointing_* (the old names warn); 5.17 has only the
    old. offload: transformers' own `offload=True` (the checkpoints in pinned host memory); the
    caller checks that this transformers has it (offload.library_offload)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        extra = {"offload": True} if offload else {}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **extra)
    else:
        assert not offload, "transformers' offload kwarg needs activation_checkpointing_enable"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _disable_checkpointing(model) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


# Instance attributes transformers sets when checkpointing is enabled and leaves behind when it is
# disabled (flags, the checkpoint function, the input-grad hook handles).
_CHECKPOINTING_ATTRS = (
    "gradient_checkpointing",
    "_gradient_checkpointing_func",
    "_require_grads_hooks",
    "_require_grads_hook",
)


@contextmanager
def hf_gradient_checkpointing(model, *, offload: bool = False):
    """Enable transformers' gradient checkpointing (training mode, which it requires) and leave the
    model as found: checkpointing state and attributes, input-grad hooks, per-module training flags.
    offload: with transformers' `offload=True` (pinned host memory for the checkpoints)."""
    modes = {module: module.training for module in model.modules()}
    attrs = {
        module: {a: vars(module)[a] for a in _CHECKPOINTING_ATTRS if a in vars(module)} for module in model.modules()
    }
    enabled_before = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    input_grad_hooks_before = bool(getattr(model, "_require_grads_hooks", None))
    assert not (offload and enabled_before), "offload through transformers only where checkpointing was off"
    if not enabled_before:
        _enable_checkpointing(model, offload)
    model.train()
    try:
        yield
    finally:
        if not enabled_before:
            _disable_checkpointing(model)
            if not input_grad_hooks_before:  # enabling added a forward hook on the embeddings; disabling keeps it
                model.disable_input_require_grads()
        for module, saved in attrs.items():
            for name in _CHECKPOINTING_ATTRS:
                if name in saved:
                    setattr(module, name, saved[name])
                elif name in vars(module):
                    delattr(module, name)
        for module, training in modes.items():
            module.training = training


def bp(model, batch: Batch, settings) -> torch.Tensor:
    return hf_forward_backward(model, batch)


def ckpt(model, batch: Batch, settings) -> torch.Tensor:
    with hf_gradient_checkpointing(model):
        return hf_forward_backward(model, batch)
