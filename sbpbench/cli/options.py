"""Every command-line option, made from the settings table (sbpbench/settings); commands pick
theirs by setting name.

An option is named after the setting it sets, so a flag, an experiment-file key and a Python
keyword are one name, and a ConfigError about a setting is shown with the user's flag (flags.py).
Defaults live in the config: an option left out is None here and filled there.

Typer reads a command's parameters from its signature. `point_command` gives a command the
options of the settings it takes by building that signature (Python's `__signature__`, which
`inspect.signature` returns) out of `typer.Option` / `typer.Argument` annotations; nothing of
Typer's own objects is read back.
"""

from __future__ import annotations

import functools
import inspect
import sys
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from ..measure.units import parse_bytes
from ..settings import POINT_SETTINGS, SETTINGS, ConfigError, IgnoredKnob, default_of
from ..settings.model_names import check_model_name
from ..settings.table import NOT_ESTIMATED, has_flag, not_estimated
from .errors import user_errors
from .flags import FLAGS, flags_of
from .outcomes import OK

NUMERIC = (int, float, (int, float))  # kinds read as text and parsed here: `--seq abc` is a one-line error
CHOICES_IN_METAVAR = 24  # a longer [a|b|...] overflows the help's 30-column option field: named in the help instead


# The knobs' own flags from before `--set`: still read, hidden from the help, for one release.
FORMER_KNOB_FLAGS = ("fp32_grad_accumulation", "mlp_tile_size", "offload_checkpoints", "chunk_attention")
BOOLEAN_WORDS = {
    "true": True,
    "on": True,
    "yes": True,
    "1": True,
    "false": False,
    "off": False,
    "no": False,
    "0": False,
}
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="KNOB=VALUE",
        help="Another method knob, repeatable, e.g. --set mlp_tile_size=1024 (--set help: every knob).",
    ),
]


def option(name: str, *, help: str | None = None, aliases: tuple[str, ...] = (), hidden: bool = False) -> Any:
    """The annotation of a setting's option: its flags (and `aliases`), its help (or `help`), left
    out of the help where `hidden`. Its value is checked by the config (a bad one is a one-line
    error, not Typer's box), so choices are named, not enforced by Typer."""
    setting = SETTINGS[name]
    text = help or setting.help
    extra: dict[str, Any] = {}
    choices = "|".join(setting.choices)
    if setting.metavar:
        extra["metavar"] = setting.metavar
    elif choices and len(choices) <= CHOICES_IN_METAVAR:
        extra["metavar"] = f"[{choices}]"
    elif choices:
        extra["metavar"] = "NAME"
        text += f" One of: {', '.join(setting.choices)}."
    elif setting.kind in NUMERIC:
        extra["metavar"] = "INT" if setting.kind is int else "NUMBER"
    if setting.may_list and name == "method":
        kind = list[str]  # the CLI's only list: `--method bp ckpt` (a grid's axes are experiment files')
    elif setting.kind is bool:
        kind, extra = bool, {"show_default": False}
    else:
        kind = str  # numbers parsed by `point_command`; sizes ("80GiB", "T/3") and choices by the config
    hidden = hidden or not has_flag(name)  # or a former knob flag (FORMER_KNOB_FLAGS)
    return Annotated[kind | None, typer.Option(*flags_of(name), *aliases, help=text, hidden=hidden, **extra)]


MoreMethodsArg = Annotated[
    list[str] | None,
    typer.Argument(metavar="METHOD", help="More methods after --method (see --method).", hidden=True),
]


# Options several commands share, declared once here.
def out_option(default: str, what: str = "Results CSV, rows upserted by point") -> Any:
    """--out of a command that writes rows: `what`, and its default path (a command's own)."""
    return Annotated[Path | None, typer.Option("--out", "-o", metavar="CSV", help=f"{what} (default: {default}).")]


OutOpt = out_option("results/runs.csv")  # `sbp run`, `sbp estimate` (results/estimates.csv: its docstring)
DEFAULT_GPU_MEMORY = "80GiB"  # the paper's GPU
GpuMemoryOpt = Annotated[
    str | None,
    typer.Option(
        metavar="SIZE", help="The predicted GPU's memory, e.g. 80GiB (default: 80GiB; maxlen: --memory-limit if given)."
    ),
]
HostMemoryOpt = Annotated[
    str | None,
    typer.Option(
        metavar="SIZE",
        help="Predicted host memory for checkpoints kept there, e.g. 100GiB (default: this machine's RAM).",
    ),
]
ExactOpt = Annotated[
    bool,
    typer.Option("--exact", help="Predict at the point's own depth and length, not from shorter runs (slow)."),
]
# `sbp estimate` and `sbp plan`: P GPUs of one node sharing each sequence (simulate/sequence_parallel.py)
GpusOpt = Annotated[
    str | None,
    typer.Option(
        metavar="P",
        help="P GPUs of one node (`sbp run --nproc P`), all sharing each sequence (Ulysses) unless --sp says how "
        "many do, FSDP2 FULL_SHARD over all P: GPU memory per GPU, host memory per node (default: 1, one GPU).",
    ),
]
InterconnectOpt = Annotated[
    str | None,
    typer.Option(
        metavar="RATE",
        help="GPU-to-GPU bandwidth each way with --gpus, e.g. 450GB/s (default: 450GB/s, NVLink 4 of an H100 SXM).",
    ),
]
# `sbp check` (here: a point command's own options resolve in this module)
ExactnessOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        metavar="CSV",
        help="Append the comparison to this exactness CSV (read by `sbp report --exactness`).",
    ),
]
# `sbp plot` and `sbp report`
ResultsArg = Annotated[
    Path,
    typer.Argument(
        metavar="RESULTS", help="Results CSV, or a directory whose CSVs are read together (written by `sbp run --out`)."
    ),
]
ReferenceOpt = Annotated[
    Path | None,
    typer.Option(
        "--reference",
        metavar="CSV",
        help="The paper's numbers (default: experiments/reference/streambp_paper.csv in the repository).",
    ),
]


# `sbp sweep` and `sbp maxlen` (runner/budget.py); outcomes.BUDGET_SPENT (3) when it stops them
BudgetOpt = Annotated[
    str | None,
    typer.Option(
        metavar="DURATION",
        help="The time this command may take, e.g. 9m: it stops "
        "cleanly within it (no point starts with under 30 s left, one it cuts is not kept); exit 3, and the "
        "same command resumes.",
    ),
]


# What `sbp estimate` and `sbp plan` fix in the point they predict: fake CPU tensors (fake CUDA
# tensors abort a CPU-only torch build), no warm-up or timing.
PREDICTED_POINT = {"device": "cpu", "warmup": 0, "repeats": 0}


def predicted_gpu_point_helps() -> dict[str, str]:
    """The help of the settings whose default is a GPU point's even on a CPU (`sbp estimate`,
    `sbp plan` predict a CUDA run): the table's cuda defaults."""
    return {
        "model": "Registry name (`sbp models`), a Hub id ORG/NAME or a local checkpoint directory (its config only; "
        f"default: {default_of('model', 'cuda')}).",
        "seq_len": f"Tokens per row, prompt included (default: {default_of('seq_len', 'cuda')}).",
        "dtype": f"Model dtype (default: {default_of('dtype', 'cuda')}).",
        "sp": "Of the --gpus P GPUs, how many share each sequence (default: all P).",
    }


def examples(lines: tuple[str, ...]) -> str:
    """A command's help epilog: its example command lines, kept as written (a paragraph that
    starts with \\b is not rewrapped in Typer's plain help)."""
    return "\b\nExamples:\n" + "".join(f"  {line}\n" for line in lines)


# `sbp run` takes every point setting, in the table's order; the other point commands all but what they fix
RUN_FIELDS = POINT_SETTINGS


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


def parse_knobs(words: list[str], knobs: tuple[str, ...]) -> dict[str, Any]:
    """`--set NAME=VALUE` words as {knob: value}, each value as its setting's kind (the config checks
    the rest); a name that is not one of `knobs`, or a word without "=", is a one-line error."""
    values = {}
    for word in words:
        given, equals, text = word.partition("=")
        name, text = given.strip().replace("-", "_"), text.strip()
        if name not in knobs:
            raise ValueError(f"--set: unknown knob {given!r}; this command takes {', '.join(knobs)}")
        if not equals:
            raise ValueError(f"--set takes KNOB=VALUE, e.g. --set {name}=..., got {word!r}")
        kind = SETTINGS[name].kind
        if kind is bool:
            if text.lower() not in BOOLEAN_WORDS:
                raise ConfigError(name, f"must be true or false, got {text!r}")
            values[name] = BOOLEAN_WORDS[text.lower()]
        elif kind is int or (kind == (int, str) and text.isdigit()):
            values[name] = parse_number(name, text) if kind is int else int(text)
        else:
            values[name] = text  # a size ("T/3", "auto") or a name: checked by the config
    return values


def refuse_unestimated(settings: dict[str, Any], names: tuple[str, ...]) -> None:
    """ValueError (one line) for the first of `names`, settings the estimator does not model, given
    at a value other than its default: which, why, and what to do instead (the table's `estimator`)."""
    for name in names:
        value = settings.get(name)
        if value is not None and value != SETTINGS[name].default:
            raise ValueError(f"{FLAGS[name]} is not modelled by the estimator: {not_estimated(name)}")


def say_ignored(found: list[IgnoredKnob], names: Mapping[str, str] = FLAGS, where: str = "") -> None:
    """One notice line on stderr per knob given that some of the methods to run do not read
    (settings.ignored_knobs), named as the user wrote it (`names`: flags; an experiment file's keys are
    its names) after `where`: "notice: --checkpoints is read only by streambp; bp ignores it"."""
    for knob in found:
        ignore = "ignores" if len(knob.ignored_by) == 1 else "ignore"
        print(
            f"notice: {where}{names.get(knob.knob, knob.knob)} is read only by {', '.join(knob.read_by)}; "
            f"{', '.join(knob.ignored_by)} {ignore} it",
            file=sys.stderr,
            flush=True,
        )


# the methods a prediction on GPUs sharing each sequence runs (the others cannot share one)
SHARING_PREDICTED = ("streambp", "ulysses")


def with_gpus(settings: dict[str, Any], methods: tuple[str, ...], gpus: str | None):
    """(settings, methods) of a predicted point on several GPUs: --gpus N sets N ranks (--nproc N),
    all of them sharing each sequence unless --sp S says how many do; `--nproc N --sp S` is the same.
    Where ranks share a sequence the methods are streambp (the default) and ulysses, which the
    estimator models. ValueError (one line) for a count that is not a whole number of
    GPUs, --gpus with a different --nproc, an --sp that does not divide them, or another method."""
    if gpus is not None:
        if not gpus.isdigit() or int(gpus) < 1:
            raise ValueError(f"--gpus takes a number of GPUs, at least 1, got {gpus!r}")
        if settings.get("nproc") not in (None, int(gpus)):
            raise ValueError(f"--gpus {gpus} sets the ranks (--nproc {gpus}); leave --nproc out")
        settings = {**settings, "nproc": int(gpus), "sp": settings.get("sp", int(gpus))}
    nproc, sp = settings.get("nproc", 1), settings.get("sp", 1)
    if sp == 1:
        return settings, methods
    if nproc == 1:
        raise ValueError(f"--sp {sp} shares each sequence over GPUs: give --gpus N too, N a multiple of {sp}")
    if nproc % sp:
        given = f"--gpus {gpus}" if gpus is not None else f"--nproc {nproc}"
        raise ValueError(f"--sp {sp} does not divide {given}: each sequence is shared by --sp of the GPUs")
    others = [m for m in methods if m not in SHARING_PREDICTED]
    if others:
        predicted = " and ".join(SHARING_PREDICTED)
        raise ValueError(
            f"GPUs sharing each sequence are predicted for {predicted}; {', '.join(others)} is not modelled so"
        )
    return settings, methods or ("streambp",)


def interconnect_bytes_s(text: str | None) -> float | None:
    """--interconnect as bytes per second ("450GB/s"; the "/s" may be left out), None when not given;
    one that is not a positive rate with its unit is a one-line error that speaks of rates."""
    if text is None:
        return None
    try:
        return float(parse_bytes(text.strip().removesuffix("/s"), what="--interconnect"))
    except ValueError:
        raise ValueError(
            f"--interconnect {text!r} is not a rate: give a positive number of bytes per second with its unit, "
            "e.g. 450GB/s (NVLink 4) or 64GB/s (PCIe 5 x16)"
        ) from None


def check_sizes(sizes: dict[str, str | None]) -> None:
    """Size options ({flag: text}) read now, before the command loads torch: one without its unit is
    a one-line error that says which to add (measure/units.py)."""
    with user_errors():
        for flag, text in sizes.items():
            if text:
                parse_bytes(text, what=flag)


def knob_lines(knobs: tuple[str, ...], refused: tuple[str, ...] = ()) -> str:
    """What `--set help` prints: each knob, its value and its help, from the settings table; a knob
    in `refused` says so."""
    values = {name: SETTINGS[name].metavar or ("true|false" if SETTINGS[name].kind is bool else "N") for name in knobs}
    width = max(len(f"{name}={value}") for name, value in values.items())
    note = dict.fromkeys(refused, " Not modelled by the estimator: default only.")
    return "\n".join(
        f"{f'{name}={value}':<{width}}  {SETTINGS[name].help}{note.get(name, '')}" for name, value in values.items()
    )


def point_command(
    fields: tuple[str, ...],
    *,
    helps: dict[str, str] | None = None,
    aliases: dict[str, tuple[str, ...]] | None = None,
    predicted: bool = False,
) -> Callable:
    """Give a command the options of `fields` (setting names) before its own parameters, with
    its own help text (helps) or extra flag names (aliases) for some. The command receives them
    as `settings`: a dict of the ones the user gave, and `methods`: the methods named by --method
    and the positional words after it. A `predicted` command (`sbp estimate`, `sbp plan`) keeps the
    settings the estimator does not model out of its help and refuses them at any value but their
    default (refuse_unestimated), before it runs."""
    helps, aliases = helps or {}, aliases or {}
    flagged = tuple(name for name in fields if has_flag(name) or name in FORMER_KNOB_FLAGS)
    knobs = tuple(name for name in fields if SETTINGS[name].read_by)  # what --set takes
    refused = tuple(name for name in fields if name in NOT_ESTIMATED) if predicted else ()

    def decorate(command: Callable) -> Callable:
        @functools.wraps(command)
        def with_options(**values):
            words = [*(values.pop("method", None) or []), *(values.pop("more_methods", None) or [])]
            settings = given_settings(values, flagged, knobs, refused)
            return command(settings=settings, methods=parse_methods(words), **values)

        # what Typer reads: this signature (inspect.signature returns __signature__) and its annotations
        parameters = _parameters(command, fields, flagged, knobs, helps, aliases, refused)
        with_options.__signature__ = inspect.Signature(parameters)
        with_options.__annotations__ = {p.name: p.annotation for p in parameters}
        return with_options

    return decorate


def _parameters(command: Callable, fields, flagged, knobs, helps, aliases, hidden) -> list[inspect.Parameter]:
    """The command's signature as Typer reads it: the settings' options (those in `hidden` out of
    its help), --set, the extra methods, then the command's own parameters."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    hints = typing.get_type_hints(command, include_extras=True)  # a module's string annotations, resolved
    parameters = []
    for name in flagged:
        annotation = option(name, help=helps.get(name), aliases=aliases.get(name, ()), hidden=name in hidden)
        parameters.append(inspect.Parameter(name, keyword, default=None, annotation=annotation))
    if knobs:
        parameters.append(inspect.Parameter("set_knobs", keyword, default=None, annotation=SetOpt))
    if "method" in fields:
        parameters.append(inspect.Parameter("more_methods", keyword, default=None, annotation=MoreMethodsArg))
    return parameters + [
        p.replace(kind=keyword, annotation=hints.get(name, p.annotation))
        for name, p in inspect.signature(command).parameters.items()
        if name not in ("settings", "methods")
    ]


def given_settings(
    values: dict, flagged: tuple[str, ...], knobs: tuple[str, ...], refused: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The settings given, taken out of `values` (the parsed options): numbers parsed, --set's knobs
    added; one of `refused` at a value but its default, a size without a unit and a model name that
    is a typo of a registry name are refused here, before torch loads (the command imports it);
    `--set help` prints the knobs and exits."""
    set_words = values.pop("set_knobs", None) or []
    if "help" in set_words:
        print(knob_lines(knobs, refused))
        raise typer.Exit(OK)
    settings = {name: values.pop(name) for name in flagged if name != "method"}
    with user_errors():
        numeric = [n for n, v in settings.items() if isinstance(v, str) and SETTINGS[n].kind in NUMERIC]
        settings |= {name: parse_number(name, settings[name]) for name in numeric}
        for name, value in parse_knobs(set_words, knobs).items():
            if settings.get(name) is not None:
                raise ValueError(f"{FLAGS[name]} given twice: by {flags_of(name)[0]} and by --set")
            settings[name] = value
        refuse_unestimated(settings, refused)
        for name in (n for n, v in settings.items() if SETTINGS[n].size and isinstance(v, str)):
            parse_bytes(settings[name], what=FLAGS[name])  # read again by the config; a bare number is refused now
        if settings.get("model") is not None:
            check_model_name(settings["model"])
    return {k: v for k, v in settings.items() if v is not None}
