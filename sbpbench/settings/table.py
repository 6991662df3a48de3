"""Every setting a user can give, declared once: the value it takes, its default, its check, its
choices, its help, its flag, for a method's knob the methods that read it, and whether the
estimator models it. Torch-free, so `sbp --help` needs nothing heavy.

Everything else is derived from this table (docs/settings.md): the CLI's options (cli/options.py,
in the table's order: the point, how it is measured, the methods' knobs, a search's own), what
`sbp estimate` and `sbp plan` refuse, the keys of experiment files (config/experiment.py), the
generic checks and the defaults of the specs (config/run.py RunSpec, config/maxlen.py MaxlenSpec),
MethodSettings' fields and which knobs each method reads (methods/settings.py,
methods/registry.py), the method-setting columns of the results (records/schema.py), and the notice
for a knob given to methods that do not read it (`ignored_knobs`, said by the CLI). Adding a
method's knob is one entry here plus the code that reads it and its test (docs/settings.md walks
through one); a setting the runner reads, not a method, also has its typed field on RunSpec (or
MaxlenSpec) defaulting to `default_of(name)`. tests/unit/test_settings.py checks that the names agree
and that no module outside this package writes a list of setting names by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .choices import (
    CHUNK_ATTENTION,
    DTYPE_NAMES,
    EVERY_METHOD,
    METHOD_NAMES,
    OBJECTIVES,
    PROTOCOLS,
    SDPA_BACKENDS,
    SP_LAYOUTS,
    STEPS,
)
from .errors import ConfigError

AUTO = "auto"  # a chunk setting left to the point's rule (methods/chunk_sizes.py)
DEVICE_KINDS = ("cuda", "cpu")  # what `by_device` and `in_search` are keyed by (config/device.py device_kind)
UNTIMED = "it times no step; leave it out"  # why a prediction has no use for a setting of the timing
# why a method's knob whose entry does not say is refused
UNCHECKED_KNOB = "its entry in the settings table does not say it is; leave the knob out, or measure it with `sbp run`"


@dataclass(frozen=True)
class Setting:
    kind: type | tuple[type, ...]  # the value a TOML key or a CLI flag takes (str: parsed by the config)
    help: str  # what it is and its default, as the CLI and error messages say it (a test checks the default)
    choices: tuple[str, ...] = ()
    # the value when nobody gave it; None: unset (the help says what that means). A method's knob: what
    # a method that reads it uses when it is unset (a library call; a point's chunks default to "auto")
    default: Any = None
    by_device: Mapping[str, Any] = field(default_factory=dict)  # the default per device kind, over `default`
    by_objective: Mapping[str, Any] = field(default_factory=dict)  # the default per objective, over both
    in_search: Mapping[str, Any] = field(default_factory=dict)  # a max-length search's default per device kind
    minimum: int | None = None  # an integer setting's least value (checked by `check`)
    auto: bool = False  # may be "auto": chosen per point (methods/chunk_sizes.py), a point's default
    read_by: tuple[str, ...] = ()  # a method's knob (a MethodSettings field): the methods that read it
    # a knob that is also an axis of the point: its own CLI flag. Every other knob is given on the
    # command line as `--set NAME=VALUE`, so a new knob adds no option to any command
    axis: bool = False
    may_list: bool = False  # a list is a grid axis (experiment files; the CLI's --method takes several)
    flags: tuple[str, ...] = ()  # CLI spellings kept from before; default: --the-name-with-dashes
    metavar: str = ""  # what the CLI's help shows for the value (default: from kind and choices)
    search: bool = False  # a max-length search's own (MaxlenSpec), not a point's (RunSpec)
    # a byte size: typed (CLI, experiment file) as text with its unit, "80GiB"; a bare number is
    # refused, never read as bytes. Python callers give a byte count (an int)
    size: bool = False
    # whether the estimator (`sbp estimate`, `sbp plan`) models it: True, or why not and what to do
    # instead. Unset: a method's knob is not modelled until its entry says True (the fake step runs its
    # code, but its effect may lie beyond fake tensors or the extrapolations); any other setting is.
    # Both commands refuse a setting not modelled at a value other than its default, before any work
    estimator: bool | str | None = None


SETTINGS: dict[str, Setting] = {
    # the point
    "method": Setting(
        str,
        "Methods, several allowed (default: bp ckpt streambp; with --sp: streambp ulysses).",
        (*METHOD_NAMES, EVERY_METHOD),
        default=("bp", "ckpt", "streambp"),  # the paper's comparison; peers by name or `all`
        may_list=True,
    ),
    "model": Setting(
        str,
        "Registry name (`sbp models`), Hub id ORG/NAME (config from the HF cache) or checkpoint directory "
        "(default: Qwen/Qwen3-4B on cuda, small/qwen3 on cpu).",
        # on a GPU the paper's Table 2 point; on a CPU a one-minute comparison (a Qwen3 shape, 4 narrow layers)
        by_device={"cuda": "Qwen/Qwen3-4B", "cpu": "small/qwen3"},
        flags=("--model", "-m"),
        metavar="NAME|DIR",
    ),
    "weights": Setting(
        bool,
        "Real weights from the directory or HF cache (default: random).",
        default=False,
        estimator="memory does not depend on the weights' values; leave it out",
    ),
    "seq_len": Setting(
        int,
        "Tokens per row, prompt included (default: 9000 on cuda, 2048 on cpu).",
        by_device={"cuda": 9000, "cpu": 2048},
        in_search={"cuda": 1024, "cpu": 512},  # a search's first probe
        minimum=2,  # one token to predict
        may_list=True,
        flags=("--seq", "-T"),
    ),
    "batch_size": Setting(
        int,
        "Rows per batch (default: 1; grpo 8, dpo 2).",
        default=1,
        by_objective={"grpo": 8, "dpo": 2},  # the paper's: a GRPO group, a DPO chosen + rejected pair
        minimum=1,
        may_list=True,
        flags=("--batch", "-B"),
    ),
    "objective": Setting(str, "Training objective (default: sft).", OBJECTIVES, default="sft"),
    "prompt_len": Setting(
        int,
        "grpo/dpo: prompt tokens within --seq, at most half of it (default: 1000).",
        default=1000,  # the paper's GRPO and DPO prompt length
        minimum=1,
    ),
    "lora_rank": Setting(int, "LoRA rank (default: 0, full fine-tuning).", default=0, minimum=0),
    "lora_alpha": Setting(int, "LoRA alpha (default: 128).", default=128, minimum=1),
    "step": Setting(str, "bp (default): forward + backward; train: + AdamW.", STEPS, default="bp"),
    "dtype": Setting(
        str, "Dtype (default: bf16 on cuda, fp32 on cpu).", DTYPE_NAMES, by_device={"cuda": "bf16", "cpu": "fp32"}
    ),
    "device": Setting(
        str,
        "auto (default), cpu, cuda or cuda:N.",
        default="auto",
        metavar="DEVICE",
        estimator="it runs on fake tensors; --target says which device it predicts",
    ),
    "num_layers": Setting(int, "Keep the first N layers (default: all).", minimum=1),
    # how it is measured
    "protocol": Setting(
        str,
        "steady (default): gradients resident before the step; first: allocated in it.",
        PROTOCOLS,
        default="steady",
    ),
    # 0 when repeats is 0 (config/run.py point_specs: a memory-only step needs no warm-up)
    "warmup": Setting(
        int,
        "Discarded steps before measuring (default: 1; 0 with --repeats 0).",
        default=1,
        minimum=0,
        estimator=UNTIMED,
    ),
    "repeats": Setting(int, "Timed steps; 0: memory only (default: 3).", default=3, minimum=0, estimator=UNTIMED),
    "memory_limit": Setting(
        (int, str),
        "Memory cap, e.g. 80GiB: CUDA per-process; CPU: tracked tensors (default: none).",
        in_search={"cuda": "80GiB", "cpu": "1GiB"},  # a search: the paper's GPU; on a CPU, minutes per search
        metavar="SIZE",
        size=True,
        estimator="--gpu-memory is the predicted GPU's memory",
    ),
    "timeout_s": Setting(
        (int, float),
        "Seconds per point (default: from its FLOPs).",
        flags=("--timeout",),
        estimator="it runs in this process, with no time limit; leave it out",
    ),
    "seed": Setting(int, "Seed for weights and batch (default: 0).", default=0, minimum=0),
    "threads": Setting(
        int,
        "torch threads per rank (default: OMP_NUM_THREADS, else the cores / CPU ranks).",
        minimum=1,
        estimator=UNTIMED,
    ),
    "nproc": Setting(
        int,
        "Data-parallel ranks (FSDP2): gloo on cpu, a GPU each on cuda (default: 1).",
        default=1,
        minimum=1,
    ),
    # ranks sharing each sequence (Ulysses): nproc / sp data ranks of sp ranks each (runner/ranks.py)
    "sp": Setting(
        int,
        "Ranks sharing each sequence (default: 1).",
        default=1,
        minimum=1,
    ),
    # one SDPA kernel forced for every method (config/sdpa.py); a wrong name's error lists the choices
    "sdpa_backend": Setting(
        str,
        "SDPA kernel for all methods (default: auto).",
        SDPA_BACKENDS,
        default="auto",
        metavar="KERNEL",
        estimator="it predicts the kernel torch's dispatcher picks; measure a forced kernel with `sbp run`",
    ),
    # the methods' knobs, in the results' column order (records/schema.py). `default` is the paper's
    # where it has one; core's DEFAULT_CHUNK_SIZE / DEFAULT_LOGITS_CHUNK_SIZE equal it (a test checks:
    # core is a library of its own and imports nothing of ours)
    "chunk_size": Setting(
        (int, str),
        'StreamBP chunk: N, "T/k" or auto (default).',
        default=500,  # the paper's layer partition for its max-length runs (appendix D)
        minimum=1,
        auto=True,
        read_by=("streambp", "official"),
        axis=True,
        metavar="N|T/k|auto",
        estimator=True,
    ),
    "logits_chunk_size": Setting(
        (int, str),
        "Positions per logits chunk: streambp, ckpt-chunked-ce, tiled (default: auto).",
        default=100,  # the paper's logits partition
        minimum=1,
        auto=True,
        read_by=("streambp", "ckpt-chunked-ce", "tiled", "official"),
        axis=True,
        metavar="N|auto",
        estimator=True,
    ),
    "fp32_grad_accumulation": Setting(
        bool,
        "StreamBP: sum bf16 chunk gradients in fp32 (default: on).",
        default=True,
        read_by=("streambp",),
        estimator=True,
    ),
    "mlp_tile_size": Setting(
        int,
        "tiled: positions per MLP tile (default: 2048).",
        # DeepSpeed's TiledMLP example uses tiles of about hidden_size positions (2560 for Qwen3-4B,
        # 4096 for Qwen3-8B); 2048 is that order
        default=2048,
        minimum=1,
        read_by=("tiled",),
        estimator=True,
    ),
    "offload_checkpoints": Setting(
        bool,
        "tiled, ulysses: layer checkpoints in host memory (default: on).",
        default=True,  # as ALST does
        read_by=("tiled", "ulysses"),
        # a GPU prediction counts the offloaded checkpoints as host bytes (methods/offload.py ShapeOnlyCopies)
        estimator=True,
    ),
    "checkpoints": Setting(
        str,
        "StreamBP: where layer inputs wait for their backward: gpu (default), cpu, recompute:K, "
        "cpu+recompute:K[+spill], stream[:N].",
        default="gpu",
        read_by=("streambp",),
        axis=True,
        metavar="PLACE",
        estimator=True,
    ),  # no `choices`: K is open; RunSpec checks the name (core.placements.placement.Placement.parse)
    "chunk_attention": Setting(
        str,
        "StreamBP attention kernel (default: auto).",  # auto: lower-right, or the GPU's table of measured kernels
        CHUNK_ATTENTION,
        default="auto",
        read_by=("streambp",),
        metavar="KERNEL",
        # simulate/estimate.py: auto is the lower-right path on fake tensors; split, flex, fa3, fa4 are refused there
        estimator="it predicts the lower-right kernel, auto's on fake tensors; leave the knob out, or measure "
        "a kernel with `sbp run`",
    ),  # the choices' meanings: settings/choices.py
    "sp_layout": Setting(
        str,
        "StreamBP across --sp ranks: contiguous (default) or interleaved chunks.",
        SP_LAYOUTS,
        default="contiguous",
        read_by=("streambp",),
        metavar="LAYOUT",
        estimator="it predicts the contiguous layout; measure interleaved with `sbp run`",
    ),  # the choices' meanings: settings/choices.py
    # a max-length search's own (its first probe is seq_len)
    "seq_len_ceiling": Setting(
        int,
        "Longest length tried (default: 262144 cuda, 16384 cpu).",
        by_device={"cuda": 262_144, "cpu": 16_384},
        flags=("--max-seq",),
        search=True,
    ),
    "resolution": Setting(
        str,
        "Stop when the bracket is this narrow: 1% of the answer (default) or tokens (256).",
        default="1%",
        metavar="N%|TOKENS",
        search=True,
    ),
    "multiple_of": Setting(int, "Probe lengths are multiples of this (default: 8).", default=8, minimum=1, search=True),
    "seed_from_estimate": Setting(
        bool,
        "Start at `sbp estimate`'s predicted max T and probe beside it (default: on); --no-seed: double from "
        "--seq, blind.",
        default=True,
        flags=("--seed-from-estimate/--no-seed",),  # --seed is the random seed's
        search=True,
    ),
}

# `sbp check`'s own choice of a point, over the defaults above: a real shape, two layers, fp64
# (exactness is per layer; time is not the point); chunks explicit, as exactness is checked at sizes
# one chooses. Here, not in the command, so that its help says these values without importing torch.
EXACTNESS_DEFAULTS: dict[str, Any] = {
    "model": "Qwen/Qwen3-0.6B",
    "seq_len": 300,
    "batch_size": 2,
    "dtype": "fp64",
    "chunk_size": 128,
    "logits_chunk_size": 100,
    "num_layers": 2,
    "device": "cpu",
}

POINT_SETTINGS = tuple(name for name, setting in SETTINGS.items() if not setting.search)  # RunSpec, MethodSettings
SEARCH_SETTINGS = tuple(name for name, setting in SETTINGS.items() if setting.search)  # MaxlenSpec
METHOD_KNOBS = tuple(name for name, setting in SETTINGS.items() if setting.read_by)  # MethodSettings, in order
CHUNK_SETTINGS = tuple(name for name, setting in SETTINGS.items() if setting.auto)  # the settings that may be AUTO


def not_estimated(name: str) -> str:
    """Why the estimator does not model a setting and what to do instead; "" where it models it."""
    said = SETTINGS[name].estimator
    if said is None:
        return UNCHECKED_KNOB if SETTINGS[name].read_by else ""
    return "" if said is True else said


# what `sbp estimate` and `sbp plan` take but refuse at a value other than its default
NOT_ESTIMATED = tuple(name for name in POINT_SETTINGS if not_estimated(name))


def default_of(name: str, device: str = "cpu", objective: str | None = None, *, search: bool = False) -> Any:
    """A setting's default for a point on a device kind ("cuda" | "cpu"), of an objective, in a
    max-length search or not: the most specific the table declares."""
    setting = SETTINGS[name]
    if search and device in setting.in_search:
        return setting.in_search[device]
    if objective in setting.by_objective:
        return setting.by_objective[objective]
    return setting.by_device.get(device, setting.default)


def device_defaults(device: str, *, search: bool = False) -> dict[str, Any]:
    """The defaults that depend on the device kind: a point's (`by_device`), or a max-length
    search's (its first probe and memory cap, `in_search`, and its own settings')."""
    if search:
        names = [n for n, s in SETTINGS.items() if s.in_search or (s.search and s.by_device)]
    else:
        names = [n for n, s in SETTINGS.items() if s.by_device and not s.search]
    return {name: default_of(name, device, search=search) for name in names}


def has_flag(name: str) -> bool:
    """Whether a setting has a CLI flag of its own: every one but a method's knob that is not an axis
    of the point (`--set NAME=VALUE` gives those)."""
    setting = SETTINGS[name]
    return not setting.read_by or setting.axis


def knobs_read_by(method: str) -> tuple[str, ...]:
    """The method knobs `method` reads (its MethodSettings fields that are set; the rest stay None)."""
    return tuple(name for name in METHOD_KNOBS if method in SETTINGS[name].read_by)


class IgnoredKnob(NamedTuple):
    knob: str  # a method's knob, or a command's own flag that only some methods answer (`sbp run --phases`)
    read_by: tuple[str, ...]  # every method that reads it
    ignored_by: tuple[str, ...]  # the methods to run that do not


def ignored_knobs(
    methods: Iterable[str], given: Iterable[str], readers: Mapping[str, tuple[str, ...]] | None = None
) -> list[IgnoredKnob]:
    """The knobs in `given` (the names a user set) that some of `methods` (those a command will run)
    do not read, each with its readers and the methods that ignore it. A knob's readers are its
    `read_by`, or its entry in `readers` (a command's own flag); any other name is read by every method."""
    read_by = {**{name: SETTINGS[name].read_by for name in METHOD_KNOBS}, **(readers or {})}
    methods, given = tuple(dict.fromkeys(methods)), set(given)
    found = []
    for knob in (name for name in read_by if name in given):  # the table's order, then `readers`'
        ignoring = tuple(method for method in methods if method not in read_by[knob])
        if ignoring:
            found.append(IgnoredKnob(knob, read_by[knob], ignoring))
    return found


def is_int(value) -> bool:
    """An integer, not a bool (True is an int to Python, not to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check(name: str, value: Any) -> None:
    """The checks the table declares, on a value as a spec holds it: its choices, an integer's
    minimum (an unset one, None, passes when the setting has no default of its own or is a
    method's knob; "auto" where allowed), a bool's type. ConfigError naming the setting otherwise."""
    setting = SETTINGS[name]
    if setting.choices:
        if value not in setting.choices and not (value is None and setting.read_by):  # None: a knob left unset
            raise ConfigError(name, f"unknown {{field}} {value!r}; choose from {', '.join(setting.choices)}")
    elif setting.kind is bool:
        if not isinstance(value, bool) and not (value is None and setting.read_by):
            raise ConfigError(name, f"must be true or false, got {value!r}")
    elif setting.minimum is not None:
        # None means "not given", allowed where the table gives no default (the help says what unset means)
        unset = (setting.default is None and not setting.by_device) or bool(setting.read_by)
        if (value is None and unset) or (value == AUTO and setting.auto):
            return
        if not is_int(value) or value < setting.minimum:
            also = ' or "auto"' if setting.auto else " (or unset)" if unset else ""
            if is_int(value) and not also:
                raise ConfigError(name, f"must be at least {setting.minimum}, got {value!r}")
            raise ConfigError(name, f"must be an integer >= {setting.minimum}{also}, got {value!r}")
