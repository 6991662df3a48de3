"""`sbp check`: does each method give standard BP's loss and gradients on this model, here?

Builds the named model (random weights, seeded) in fp64 or fp32, one synthetic batch with the
paper's random right padding, and compares every method with `bp` (see methods/exactness.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..data import make_sft_batch
from ..methods import METHODS, MethodSettings
from ..methods.exactness import MethodComparison, compare_methods
from ..models import build_model
from .spec import DTYPES


@dataclass(frozen=True, kw_only=True)
class ExactnessSpec:
    model: str
    seq_len: int
    batch_size: int = 2
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
    batch = make_sft_batch(
        batch_size=spec.batch_size,
        seq_len=spec.seq_len,
        vocab_size=model.config.vocab_size,
        seed=spec.seed,
        pad_token_id=model.config.pad_token_id or 0,
        device=spec.device,
    )
    return compare_methods(model, batch, list(spec.methods), spec.settings)
