"""What `sbp run`, `sbp maxlen` and `sbp estimate` share: the options that define a point, and
turning them into RunSpecs. Declared once so the commands cannot drift apart."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..data import OBJECTIVES
from ..measure.units import parse_bytes
from ..methods import METHODS, MethodSettings
from ..runner import PROTOCOLS, RunSpec
from ..runner.spec import resolve_device
from .options import DType

# With no options: a real comparison on a GPU (the paper's Table 2 point), a one-minute one on a CPU.
DEFAULTS = {
    "cuda": {"model": "Qwen/Qwen3-4B", "seq": 9000, "dtype": "bf16"},
    "cpu": {"model": "small/qwen3", "seq": 2048, "dtype": "fp32"},
}
DEFAULT_BATCH = {"sft": 1, "grpo": 8, "dpo": 2}  # the paper's: one sequence, a group of 8, one pair

MethodsOpt = Annotated[
    list[str] | None,
    typer.Option("--method", help=f"Methods: {', '.join(METHODS)}; several allowed (default: all)."),
]
MoreMethodsArg = Annotated[
    list[str] | None,
    typer.Argument(metavar="[METHOD]...", help="More methods after --method: `--method bp ckpt streambp`."),
]
DefaultedModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Registry name (`sbp models`) or a local checkpoint directory "
        "(default: Qwen/Qwen3-4B on cuda, small/qwen3 on cpu).",
    ),
]
DefaultedBatchOpt = Annotated[
    int | None,
    typer.Option("--batch", "-B", min=1, help="Rows per batch (default: sft 1, grpo 8 = a group, dpo 2 = a pair)."),
]
ObjectiveOpt = Annotated[str, typer.Option(help=f"Training objective: {', '.join(OBJECTIVES)}.")]
PromptLenOpt = Annotated[int, typer.Option(min=1, help="grpo/dpo: prompt tokens within --seq (at most half of it).")]
LoraRankOpt = Annotated[int, typer.Option(min=0, help="LoRA rank on all linear layers (peft); 0: full fine-tuning.")]
LoraAlphaOpt = Annotated[int, typer.Option(min=1, help="LoRA alpha.")]
StepOpt = Annotated[
    str, typer.Option(help="bp: forward + backward (the paper's Figure 3); train: + AdamW (its Table 3).")
]
DefaultedDTypeOpt = Annotated[DType | None, typer.Option(help="Model dtype (default: bf16 on cuda, fp32 on cpu).")]
AutoDeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
NumLayersOpt = Annotated[
    int, typer.Option("--num-layers", min=0, help="Keep only the first N decoder layers; 0 keeps all.")
]
ProtocolOpt = Annotated[
    str,
    typer.Option(help="steady: gradient buffers resident before the step (the paper's); first: allocated in it."),
]
MemoryLimitOpt = Annotated[
    str | None,
    typer.Option(help="Cap memory, e.g. 80GiB: CUDA per-process limit; CPU limit on tracked tensors."),
]
TimeoutOpt = Annotated[float, typer.Option(help="Seconds per point before it is recorded as timeout.")]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Results CSV (rows upserted by point).")]


def parse_methods(values: list[str]) -> tuple[str, ...]:
    """`--method bp ckpt`, `--method bp --method ckpt` and `--method bp,ckpt` all mean the same."""
    names = [name for value in values for name in value.replace(",", " ").split()]
    for name in names:
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return tuple(dict.fromkeys(names)) or tuple(METHODS)


def point_specs(
    methods: tuple[str, ...],
    *,
    model: str | None,
    seq: int | None,
    batch: int | None,
    objective: str,
    prompt_len: int,
    lora_rank: int,
    lora_alpha: int,
    step: str,
    dtype: DType | None,
    chunk_size: int,
    logits_chunk_size: int,
    device: str,
    num_layers: int,
    protocol: str,
    memory_limit: str | None,
    seed: int,
    **run_settings,
) -> list[RunSpec]:
    """One RunSpec per method from the shared options (run_settings: warmup, repeats, timeout_s);
    the model is checked before any process starts."""
    from ..models import load_config

    device = resolve_device(device)
    defaults = DEFAULTS["cuda" if device.startswith("cuda") else "cpu"]
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {', '.join(OBJECTIVES)}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")
    specs = [
        RunSpec(
            model=model or defaults["model"],
            method=name,
            seq_len=seq if seq is not None else defaults["seq"],
            batch_size=batch or DEFAULT_BATCH[objective],
            objective=objective,
            prompt_len=prompt_len,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            step=step,
            dtype=dtype.value if dtype else defaults["dtype"],
            device=device,
            settings=MethodSettings(chunk_size=chunk_size, logits_chunk_size=logits_chunk_size),
            num_layers=num_layers or None,
            protocol=protocol,
            memory_limit_bytes=parse_bytes(memory_limit) if memory_limit else None,
            seed=seed,
            **run_settings,
        )
        for name in methods
    ]
    load_config(specs[0].model)  # fail here, before any process starts, on a model that cannot be built
    return specs
