"""Every command-line option, declared once; commands pick theirs from OPTIONS.

An option is named after the config field it sets (sbpbench.config: RunSpec, MethodSettings,
MaxlenSpec), so a flag, an experiment-file key and a Python keyword are one name, and a
ConfigError about a field is shown with the user's flag (FLAGS). Defaults live in the config:
an option left out is None here and filled there.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from ..config import DTYPES, METHODS, OBJECTIVES, PROTOCOLS, STEPS


def _choices(name: str, values) -> type[Enum]:
    return Enum(name, {value: value for value in values}, type=str)


# Fixed choices come from the registries, so a new method or dtype needs no CLI edit.
Method = _choices("Method", METHODS)
DType = _choices("DType", DTYPES)
Objective = _choices("Objective", OBJECTIVES)
Step = _choices("Step", STEPS)
Protocol = _choices("Protocol", PROTOCOLS)


def _option(kind, *flags: str, help: str, **limits) -> Any:
    """An option whose value the config checks (so a bad one is a one-line error, not Typer's
    box); an Enum kind only names the choices in the help."""
    if isinstance(kind, type) and issubclass(kind, Enum):
        limits["metavar"] = "[" + "|".join(member.value for member in kind) + "]"
        kind = str
    return Annotated[kind | None, typer.Option(*flags, help=help, **limits)]


# field -> its option. A command changes only the help (see `point_command`), never the flag.
OPTIONS: dict[str, Any] = {
    "method": _option(list[str], "--method", help=f"Methods: {', '.join(METHODS)}; several allowed (default: all)."),
    "model": _option(
        str,
        "--model",
        "-m",
        help="Registry name (`sbp models`) or a local checkpoint directory "
        "(default: Qwen/Qwen3-4B on cuda, small/qwen3 on cpu).",
    ),
    "seq_len": _option(
        int, "--seq", "-T", help="Tokens per row, prompt included (default: 9000 on cuda, 2048 on cpu)."
    ),
    "batch_size": _option(
        int, "--batch", "-B", help="Rows per batch (default: sft 1, grpo 8 = a group, dpo 2 = a pair)."
    ),
    "objective": _option(Objective, "--objective", help="Training objective (default: sft)."),
    "prompt_len": _option(
        int, "--prompt-len", help="grpo/dpo: prompt tokens within --seq, at most half of it (default: 1000)."
    ),
    "lora_rank": _option(
        int, "--lora-rank", help="LoRA rank on all linear layers (peft); 0: full fine-tuning (default)."
    ),
    "lora_alpha": _option(int, "--lora-alpha", help="LoRA alpha (default: 128)."),
    "step": _option(
        Step, "--step", help="bp: forward + backward (the paper's Figure 3, default); train: + AdamW (its Table 3)."
    ),
    "dtype": _option(DType, "--dtype", help="Model dtype (default: bf16 on cuda, fp32 on cpu)."),
    "device": _option(str, "--device", help="auto (default), cpu, cuda or cuda:N."),
    "num_layers": _option(int, "--num-layers", help="Keep only the first N decoder layers (default: all)."),
    "protocol": _option(
        Protocol,
        "--protocol",
        help="steady (default): gradient buffers resident before the step (the paper's); first: allocated in it.",
    ),
    "warmup": _option(int, "--warmup", help="Discarded steps before measuring (default: 1)."),
    "repeats": _option(int, "--repeats", help="Timed steps (median, min, max); 0: memory only (default: 3)."),
    "memory_limit": _option(
        str, "--memory-limit", help="Cap memory, e.g. 80GiB: CUDA per-process limit; CPU limit on tracked tensors."
    ),
    "seed": _option(int, "--seed", help="Seed for weights and batch (default: 0)."),
    "timeout_s": _option(
        float, "--timeout", help="Seconds per point before it is recorded as timeout (default: 3600)."
    ),
    "chunk_size": _option(
        str, "--chunk-size", help='StreamBP positions per layer chunk: tokens, or "T/k" for seq/k (default: 500).'
    ),
    "logits_chunk_size": _option(
        int, "--logits-chunk-size", help="StreamBP positions per logits chunk (default: 100)."
    ),
    "fp32_grad_accumulation": Annotated[
        bool | None,
        typer.Option(
            "--fp32-grad-accumulation/--no-fp32-grad-accumulation",
            help="StreamBP: sum bf16 chunk gradients in fp32 (default: on).",
            show_default=False,
        ),
    ],
    # a max-length search's own settings (MaxlenSpec)
    "seq_len_ceiling": _option(int, "--max-seq", help="Longest length tried (default: 262144 cuda, 16384 cpu)."),
    "resolution": _option(
        str,
        "--resolution",
        help="Stop when the bracket is this narrow: a percentage (1%) or tokens (256) (default: 1%).",
    ),
    "multiple_of": _option(int, "--multiple-of", help="Probe lengths are multiples of this (default: 8)."),
}
# field -> the flag a user typed, for messages (in Annotated, typer.Option's first flag is its `default`)
FLAGS: dict[str, str] = {name: a.__metadata__[0].default.split("/")[0] for name, a in OPTIONS.items()}

MoreMethodsArg = Annotated[
    list[str] | None,
    typer.Argument(metavar="[METHOD]...", help="More methods after --method: `--method bp ckpt streambp`."),
]
OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Results CSV (rows upserted by point).")]
# `sbp plot` and `sbp report`
ResultsArg = Annotated[
    Path, typer.Argument(help="Results CSV, or a directory whose CSVs are read together (written by `sbp run --out`).")
]
ReferenceOpt = Annotated[
    Path | None,
    typer.Option(
        "--reference", help="The paper's numbers (default: experiments/reference/streambp_paper.csv in the repository)."
    ),
]


# The point settings of `sbp run`; the other point commands take these but for what they fix.
RUN_FIELDS = (
    "method",
    "model",
    "seq_len",
    "batch_size",
    "objective",
    "prompt_len",
    "lora_rank",
    "lora_alpha",
    "step",
    "dtype",
    "chunk_size",
    "logits_chunk_size",
    "fp32_grad_accumulation",
    "device",
    "num_layers",
    "protocol",
    "warmup",
    "repeats",
    "memory_limit",
    "timeout_s",
    "seed",
)


def run_fields_but(*fixed: str) -> tuple[str, ...]:
    return tuple(name for name in RUN_FIELDS if name not in fixed)


def parse_methods(words: list[str]) -> tuple[str, ...]:
    """`--method bp ckpt`, `--method bp --method ckpt` and `--method bp,ckpt` all mean the same;
    () when none is named (the config then takes every method)."""
    return tuple(dict.fromkeys(name for word in words for name in word.replace(",", " ").split()))


def point_command(
    fields: tuple[str, ...], *, helps: dict[str, str] | None = None, aliases: dict[str, tuple[str, ...]] | None = None
) -> Callable:
    """Give a command the options of `fields` (OPTIONS' keys) before its own parameters, with
    its own help text (helps) or extra flag names (aliases) for some. The command receives them
    as `settings`: a dict of the ones the user gave (Enums as their values), and `methods`: the
    methods named by --method and the positional words after it."""
    helps, aliases = helps or {}, aliases or {}

    def decorate(command: Callable) -> Callable:
        own = [p for name, p in inspect.signature(command).parameters.items() if name not in ("settings", "methods")]
        shared = []
        for name in fields:
            annotation = OPTIONS[name]
            if name in helps or name in aliases:
                kind, option = annotation.__origin__, annotation.__metadata__[0]
                # in Annotated, typer.Option's first flag sits in `default` (see typer.utils)
                flags = (option.default, *(option.param_decls or ()), *aliases.get(name, ()))
                annotation = Annotated[kind, typer.Option(*flags, help=helps.get(name, option.help))]
            shared.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=None))
        if "method" in fields:
            shared.append(
                inspect.Parameter(
                    "more_methods", inspect.Parameter.KEYWORD_ONLY, annotation=MoreMethodsArg, default=None
                )
            )

        @functools.wraps(command)
        def wrapper(**values):
            words = [*(values.pop("method", None) or []), *(values.pop("more_methods", None) or [])]
            methods = parse_methods(words)
            settings = {name: values.pop(name) for name in fields if name != "method"}
            return command(settings={k: v for k, v in settings.items() if v is not None}, methods=methods, **values)

        wrapper.__signature__ = inspect.Signature(
            [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in shared + own]
        )
        del wrapper.__wrapped__  # Typer must read the signature above, not the command's own
        return wrapper

    return decorate
