"""The measured step: backpropagation only (`bp`, the paper's Figure 3 protocol) or a full training
step (`train`: backpropagation, then AdamW, as in the paper's Table 3).

AdamW runs in the dtype of the trainable parameters, which makes it the paper's two setups:
full fine-tuning of a bf16 model is pure bf16 AdamW (bf16 moments), and LoRA keeps fp32 adapters
over a frozen bf16 base (peft's default), so its moments and updates are fp32 (mixed precision).
"""

from __future__ import annotations

import torch

from ..data import Batch
from .registry import run_method
from .settings import MethodSettings

LEARNING_RATE = 1e-5  # value irrelevant to memory and time; small so repeated steps stay sane


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(trainable_parameters(model), lr=LEARNING_RATE)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the moments as the first real step would (steady-state protocol: they are resident
    before the measured step). A step on zero gradients leaves Adam's moments at zero."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    tensors = [getattr(t, "_local_tensor", t) for t in optimizer_state_tensors(optimizer)]  # FSDP2: the shard
    return sum(t.untyped_storage().nbytes() for t in tensors)


def run_step(
    method: str, model, batch: Batch, settings: MethodSettings, optimizer: torch.optim.Optimizer | None = None
) -> torch.Tensor:
    """One measured step: the method's forward+backward, then optimizer.step() if one is given."""
    loss = run_method(method, model, batch, settings)
    if optimizer is not None:
        optimizer.step()
    return loss
