"""LoRA adapters through peft, set up as in the StreamBP paper's LoRA runs: rank 32, alpha 128,
every linear layer of the decoder, no dropout; only the adapters are trained."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # peft is imported only when LoRA is asked for
    from peft import PeftModel

LORA_B_INIT_STD = 0.02  # small enough to stay near the base model's outputs, large enough for gradients to flow


def apply_lora(
    model: nn.Module,
    *,
    rank: int = 32,
    alpha: int = 128,
    dropout: float = 0.0,
    init_nonzero_seed: int | None = None,
) -> PeftModel:
    """Wrap `model` (a causal LM) in a peft PeftModel with LoRA on all its linear layers except the
    lm_head (peft's "all-linear"); return the PeftModel.

    The model is changed in place: peft replaces its Linear modules by LoRA layers that hold the
    original ones, and freezes every base parameter (requires_grad False), so only lora_A/lora_B
    get gradients. peft's default autocast_adapter_dtype=True is kept: for a bf16/fp16 model the
    adapters are float32 (fp32 master weights, the paper's mixed precision for LoRA) while the
    base weights stay in the model dtype.

    peft initialises every lora_B to zero, so the first step's gradients w.r.t. lora_A are exactly
    zero; init_nonzero_seed, when given, re-initialises every lora_B weight with seeded
    normal(0, 0.02) values so that gradients reach every adapter (exactness tests use it).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be an integer >= 1, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    try:
        import peft
    except ImportError as error:
        raise ImportError("LoRA needs peft: pip install peft") from error

    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing (5.20+)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = peft.get_peft_model(model, config)
    if init_nonzero_seed is not None:
        _reinit_lora_b(peft_model, init_nonzero_seed)
    return peft_model


def _reinit_lora_b(model: nn.Module, seed: int) -> None:
    """Every lora_B weight, in parameter order, from one seeded generator (on CPU, so the values do
    not depend on the device; drawn in float64, so they agree across dtypes to rounding)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float64) * LORA_B_INIT_STD
                param.copy_(values)
