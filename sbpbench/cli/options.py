"""Every command-line option, declared once; commands pick theirs from OPTIONS.

An option is named after the config field it sets (sbpbench.config: RunSpec, MethodSettings,
MaxlenSpec), so a flag, an experiment-file key and a Python keyword are one name, and a
ConfigError about a field is shown with the user's flag (FLAGS). Defaults live in the config:
an option left out is None here and filled there.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from ..config import ConfigError
from ..config.fields import SETTINGS, Setting

# Flags that keep an older spelling; every other setting's flag is its name with dashes.
FLAG_NAMES: dict[str, tuple[str, ...]] = {
    "model": ("--model", "-m"),
    "seq_len": ("--seq", "-T"),
    "batch_size": ("--batch", "-B"),
    "timeout_s": ("--timeout",),
    "seq_len_ceiling": ("--max-seq",),
    "fp32_grad_accumulation": ("--fp32-grad-accumulation/--no-fp32-grad-accumulation",),
    "offload_checkpoints": ("--offload-checkpoints/--no-offload-checkpoints",),
}


def _option(name: str, setting: Setting) -> Any:
    """The option of a setting. Its value is checked by the config (a bad one is a one-line error,
    not Typer's box), so choices are named in the help, not enforced by Typer."""
    flags = FLAG_NAMES.get(name, ("--" + name.replace("_", "-"),))
    extra: dict[str, Any] = {"metavar": "[" + "|".join(setting.choices) + "]"} if setting.choices else {}
    if setting.may_list and name == "method":
        kind = list[str]
    elif setting.kind is bool:
        kind, extra = bool, {"show_default": False}
    elif setting.kind in (int, float, (int, float)):
        # read as text and parsed in point_command, so `--seq abc` is a one-line error like the rest
        kind, extra = str, {"metavar": "<int>" if setting.kind is int else "<float>"}
    else:
        kind = str  # sizes ("80GiB", "T/3") and choices, parsed by the config
    return Annotated[kind | None, typer.Option(*flags, help=setting.help, **extra)]


# setting -> its option; a command may change the help (see `point_command`), never the flag
OPTIONS: dict[str, Any] = {name: _option(name, setting) for name, setting in SETTINGS.items()}
# setting -> the flag a user typed, for messages (in Annotated, typer.Option's first flag is its `default`)
FLAGS: dict[str, str] = {name: a.__metadata__[0].default.split("/")[0] for name, a in OPTIONS.items()}

MoreMethodsArg = Annotated[
    list[str] | None,
    typer.Argument(metavar="[METHOD]...", help="More methods after --method: `--method bp ckpt streambp`."),
]
OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Results CSV (rows upserted by point).")]
# `sbp check` (here: a point command's own options resolve in this module)
ExactnessOutOpt = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Append the comparison to this exactness CSV (read by `sbp report --exactness`)."),
]
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
    "weights",
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
    "mlp_tile_size",
    "offload_checkpoints",
    "checkpoints",
    "device",
    "num_layers",
    "protocol",
    "warmup",
    "repeats",
    "memory_limit",
    "timeout_s",
    "seed",
    "threads",
    "nproc",
    "sdpa_backend",
)


def run_fields_but(*fixed: str) -> tuple[str, ...]:
    return tuple(name for name in RUN_FIELDS if name not in fixed)


def parse_methods(words: list[str]) -> tuple[str, ...]:
    """`--method bp ckpt`, `--method bp --method ckpt` and `--method bp,ckpt` all mean the same;
    () when none is named (the config then takes every method)."""
    return tuple(dict.fromkeys(name for word in words for name in word.replace(",", " ").split()))


def parse_number(name: str, value: str) -> int | float:
    """A numeric option's text as its setting's type; ConfigError (one line) if it is not one."""
    kind = SETTINGS[name].kind
    try:
        return int(value) if kind is int else float(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(name, f"must be {what}, got {value!r}") from None


def point_command(
    fields: tuple[str, ...], *, helps: dict[str, str] | None = None, aliases: dict[str, tuple[str, ...]] | None = None
) -> Callable:
    """Give a command the options of `fields` (OPTIONS' keys) before its own parameters, with
    its own help text (helps) or extra flag names (aliases) for some. The command receives them
    as `settings`: a dict of the ones the user gave, and `methods`: the
    methods named by --method and the positional words after it."""
    helps, aliases = helps or {}, aliases or {}

    def decorate(command: Callable) -> Callable:
        hints = typing.get_type_hints(command, include_extras=True)  # a module's string annotations, resolved
        own = [
            p.replace(annotation=hints.get(name, p.annotation))
            for name, p in inspect.signature(command).parameters.items()
            if name not in ("settings", "methods")
        ]
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
            numeric = [
                n for n, v in settings.items() if isinstance(v, str) and SETTINGS[n].kind in (int, float, (int, float))
            ]
            if numeric:
                from .errors import user_errors  # errors.py imports this module's FLAGS

                with user_errors():
                    settings |= {name: parse_number(name, settings[name]) for name in numeric}
            return command(settings={k: v for k, v in settings.items() if v is not None}, methods=methods, **values)

        wrapper.__signature__ = inspect.Signature(
            [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in shared + own]
        )
        del wrapper.__wrapped__  # Typer must read the signature above, not the command's own
        return wrapper

    return decorate
