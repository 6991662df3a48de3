"""What one measured point is: a typed, validated spec that travels to the worker process as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import torch

from ..data import DEFAULT_PROMPT_LEN, OBJECTIVES
from ..methods import METHODS, STEPS, MethodSettings

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}

# steady: gradient buffers are resident before the step, as in every training step after the
#         first (the paper's Figure 3 curves); the peak above them is activations.
# first:  gradients are None before the step and allocated during it (a run's first step).
PROTOCOLS = ("steady", "first")

DEFAULT_TIMEOUT_S = 3600.0


def resolve_device(device: str) -> str:
    """ "auto": cuda if a GPU is visible, else cpu; anything else as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def check_model_settings(spec) -> None:
    """What `sbp run` points and `sbp check` share: sequence, batch, objective, LoRA rank, dtype,
    depth and device (spec: any object with those attributes)."""
    if spec.seq_len < 2:
        raise ValueError(f"--seq must be at least 2 (one token to predict), got {spec.seq_len}")
    if spec.batch_size < 1:
        raise ValueError(f"--batch must be at least 1, got {spec.batch_size}")
    if spec.objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {spec.objective!r}; choose from {', '.join(OBJECTIVES)}")
    if spec.objective == "dpo" and spec.batch_size % 2:
        raise ValueError(f"dpo: --batch counts chosen + rejected rows: give an even number, got {spec.batch_size}")
    if spec.lora_rank < 0:
        raise ValueError(f"--lora-rank must be >= 0 (0: full fine-tuning), got {spec.lora_rank}")
    if spec.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {spec.dtype!r}; choose from {', '.join(DTYPES)}")
    if spec.num_layers is not None and spec.num_layers < 1:
        raise ValueError(f"--num-layers must be at least 1, got {spec.num_layers}")
    if not (spec.device == "cpu" or spec.device == "cuda" or spec.device.startswith("cuda:")):
        raise ValueError(f"unknown device {spec.device!r}; use cpu, cuda or cuda:N")
    if spec.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")


def build_model_and_batch(spec, *, lora_alpha: int, lora_init_seed: int | None = None):
    """The model (random weights, seeded; truncated depth; LoRA adapters if lora_rank) and the
    objective's synthetic batch for it, on spec.device. spec as in check_model_settings, plus
    model, seed and prompt_len."""
    from ..models import build_model

    overrides = {"num_hidden_layers": spec.num_layers} if spec.num_layers else {}
    model = build_model(spec.model, dtype=DTYPES[spec.dtype], device=spec.device, seed=spec.seed, **overrides)
    if spec.lora_rank:
        from ..models.lora import apply_lora

        model = apply_lora(model, rank=spec.lora_rank, alpha=lora_alpha, init_nonzero_seed=lora_init_seed)
    batch = make_spec_batch(spec, model.config, device=spec.device)
    return model, batch


def make_spec_batch(spec, config, *, device: str = "cpu"):
    """The objective's synthetic batch for a model of this config (spec as in
    build_model_and_batch). Real tensors: the simulated step builds the same batch."""
    from ..data import make_batch

    return make_batch(
        spec.objective,
        batch_size=spec.batch_size,
        seq_len=spec.seq_len,
        vocab_size=config.vocab_size,
        prompt_len=spec.prompt_len,
        seed=spec.seed,
        pad_token_id=config.pad_token_id or 0,
        device=device,
    )


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    model: str
    method: str
    seq_len: int
    batch_size: int = 1  # rows: a GRPO group; DPO chosen + rejected rows
    objective: str = "sft"
    prompt_len: int = DEFAULT_PROMPT_LEN  # grpo / dpo (capped at seq_len // 2)
    lora_rank: int = 0  # 0: full fine-tuning; else LoRA on all linear layers (peft)
    lora_alpha: int = 128
    step: str = "bp"  # bp: forward + backward; train: + AdamW
    dtype: str = "fp32"
    device: str = "cpu"
    settings: MethodSettings = field(default_factory=MethodSettings)
    num_layers: int | None = None  # keep the first N decoder layers (None: the model's depth)
    protocol: str = "steady"
    warmup: int = 1  # steps run and discarded before the measured ones
    repeats: int = 3  # timed steps (0: memory only, as a max-length probe)
    memory_limit_bytes: int | None = None  # CUDA: per-process cap; CPU: cap on tracked bytes
    seed: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        check_model_settings(self)
        if self.step not in STEPS:
            raise ValueError(f"unknown step {self.step!r}; choose from {', '.join(STEPS)}")
        if self.lora_alpha <= 0 or self.prompt_len < 1:
            raise ValueError("need --lora-alpha > 0 and --prompt-len >= 1")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {self.protocol!r}; choose from {', '.join(PROTOCOLS)}")
        if self.warmup < 0 or self.repeats < 0:
            raise ValueError(f"need --warmup >= 0 and --repeats >= 0, got {self.warmup} and {self.repeats}")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ValueError(f"--memory-limit must be positive, got {self.memory_limit_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout_s}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def with_method(self, method: str) -> RunSpec:
        return replace(self, method=method)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        values = json.loads(text)
        values["settings"] = MethodSettings(**values["settings"])
        return cls(**values)
