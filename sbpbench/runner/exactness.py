"""`sbp check`: does each method give standard BP's loss and gradients on this model, here?

Builds the named model (random weights, seeded) in fp64 or fp32, one synthetic batch with the
paper's random right padding, and compares every method with `bp` (see methods/exactness.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..data import DEFAULT_PROMPT_LEN
from ..methods import METHODS, MethodSettings
from ..methods.exactness import MethodComparison, compare_methods
from .spec import build_model_and_batch, check_model_settings


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
        check_model_settings(self)
        for method in self.methods:
            if method not in METHODS:
                raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def check_exactness(spec: ExactnessSpec) -> list[MethodComparison]:
    # LoRA B matrices start at zero, which would make every A gradient zero: seeded non-zero B
    model, batch = build_model_and_batch(spec, lora_alpha=2 * spec.lora_rank, lora_init_seed=spec.seed)
    return compare_methods(model, batch, list(spec.methods), spec.settings)
