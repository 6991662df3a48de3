"""`sbp check`: does each method give standard BP's loss and gradients on this model, here?

Builds the named model (random weights, seeded) in fp64 or fp32, one synthetic batch with the
paper's random right padding, and compares every method with `bp` (see methods/exactness.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..data import DEFAULT_PROMPT_LEN, OBJECTIVES, make_batch
from ..methods import METHODS, MethodSettings
from ..methods.exactness import MethodComparison, compare_methods
from ..models import build_model
from .spec import DTYPES


@dataclass(frozen=True, kw_only=True)
class ExactnessSpec:
    model: str
    seq_len: int
    batch_size: int = 2
    objective: str = "sft"
    prompt_len: int = DEFAULT_PROMPT_LEN
    lora_rank: int = 0  # 0: full fine-tuning; else LoRA adapters with seeded non-zero B (gradients everywhere)
    dtype: str = "fp64"
    methods: tuple[str, ...] = ("ckpt", "streambp")
    settings: MethodSettings = field(default_factory=MethodSettings)
    num_layers: int | None = None  # truncate the depth: exactness is per layer, time is not
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"--seq must be at least 2 (one token to predict), got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"--batch must be at least 1, got {self.batch_size}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}; choose from {', '.join(OBJECTIVES)}")
        if self.objective == "dpo" and self.batch_size % 2:
            raise ValueError(f"dpo: --batch counts chosen + rejected rows: give an even number, got {self.batch_size}")
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be >= 0 (0: full fine-tuning), got {self.lora_rank}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"--num-layers must be at least 1, got {self.num_layers}")
        for method in self.methods:
            if method not in METHODS:
                raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")


def check_exactness(spec: ExactnessSpec) -> list[MethodComparison]:
    overrides = {"num_hidden_layers": spec.num_layers} if spec.num_layers else {}
    model = build_model(spec.model, dtype=DTYPES[spec.dtype], device=spec.device, seed=spec.seed, **overrides)
    if spec.lora_rank:
        from ..models.lora import apply_lora

        model = apply_lora(model, rank=spec.lora_rank, alpha=2 * spec.lora_rank, init_nonzero_seed=spec.seed)
    batch = make_batch(
        spec.objective,
        batch_size=spec.batch_size,
        seq_len=spec.seq_len,
        vocab_size=model.config.vocab_size,
        prompt_len=spec.prompt_len,
        seed=spec.seed,
        pad_token_id=model.config.pad_token_id or 0,
        device=spec.device,
    )
    return compare_methods(model, batch, list(spec.methods), spec.settings)
