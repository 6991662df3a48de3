"""One measured point: a typed RunSpec, its defaults and checks those the settings table declares.

The CLI (`sbp run`, `maxlen`, `estimate`, `check`), experiment files and Python callers all build
it through `point_specs`, with the same defaults and the same messages. A bad value raises
ConfigError naming the field; each front end shows the name its user typed (a CLI flag, a TOML
key). The spec travels to the worker process as JSON.

Each field's default and generic check (choices, an integer's minimum, a bool) is the settings
table's (sbpbench/settings/table.py); the field says only what the spec stores, which is not always
what a user types (bytes for "80GiB", a resolved device, the method's knobs in one MethodSettings).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cache
from typing import Any

import torch

from ..core import Placement, UnsupportedModelError
from ..measure.threads import available_cpus, default_threads
from ..measure.units import parse_bytes
from ..methods import (
    METHODS,
    MethodSettings,
    method_names,
    method_unavailable,
    sequence_parallel_refusal,
    sequence_parallel_unsupported,
)
from ..methods.chunk_sizes import ChunkSizes, auto_chunk_sizes
from ..settings import (
    AUTO,
    CHUNK_SETTINGS,
    METHOD_KNOBS,
    POINT_SETTINGS,
    ConfigError,
    SettingChanged,
    check,
    default_of,
    device_defaults,
    knobs_read_by,
)
from ..settings.table import DEVICE_KINDS, is_int
from .device import device_kind, resolve_device
from .long_context import long_context_defaults
from .sdpa import check_chunk_attention, check_sdpa_backend

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}  # keys: settings DTYPE_NAMES

# What a setting defaults to when nobody gave it, by the kind of device the point runs on (the
# table's `by_device`): on a GPU the paper's Table 2 point; on a CPU a one-minute comparison.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {kind: device_defaults(kind) for kind in DEVICE_KINDS}


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """A point; a field left out takes the settings table's default for a CPU point (`default_of`)."""

    model: str  # registry name (`sbp models`), a Hub id ORG/NAME or a local checkpoint directory
    method: str
    seq_len: int  # tokens per row, prompt included
    batch_size: int = default_of("batch_size")  # rows: a GRPO group; DPO chosen + rejected rows
    objective: str = default_of("objective")
    prompt_len: int = default_of("prompt_len")  # grpo / dpo (capped at seq_len // 2)
    lora_rank: int = default_of("lora_rank")  # 0: full fine-tuning; else LoRA on all linear layers (peft)
    lora_alpha: int = default_of("lora_alpha")
    step: str = default_of("step")  # bp: forward + backward; train: + AdamW
    dtype: str = default_of("dtype")
    # auto | cpu | cuda | cuda:N, stored resolved (cpu or cuda:N). A spec built directly is a CPU
    # point (the table's default, auto, is point_specs'): its other defaults are the CPU's
    device: str = "cpu"
    settings: MethodSettings = field(default_factory=MethodSettings)  # only what `method` reads is set
    num_layers: int | None = default_of("num_layers")  # keep the first N decoder layers (None: the model's depth)
    protocol: str = default_of("protocol")
    warmup: int = default_of("warmup")  # steps run and discarded before the measured ones
    repeats: int = default_of("repeats")  # timed steps (0: memory only, as a max-length probe)
    memory_limit: int | None = default_of("memory_limit")  # bytes; CUDA: per-process cap; CPU: on tracked bytes
    seed: int = default_of("seed")
    timeout_s: float | None = default_of("timeout_s")  # None: predicted from the FLOP model (runner/timeout.py)
    # torch intra-op threads in the worker (None: OMP_NUM_THREADS if set, else the physical cores this
    # process may use). Not part of a row's key: it changes time, not memory or the work done, like
    # the host's load; each row records it (num_threads), and a rerun with another count replaces
    # the point's row.
    threads: int | None = default_of("threads")
    # data-parallel processes (ranks) the step runs on, the model sharded with FSDP2 (FULL_SHARD, one
    # unit per decoder layer plus the root); each rank its own batch of batch_size rows. On CUDA
    # rank r uses the device's index + r. Part of a row's key: it changes the per-GPU memory.
    nproc: int = default_of("nproc")
    # of those ranks, how many share each sequence (Ulysses; nproc / sp data ranks, runner/ranks.py):
    # only the methods that run sequence-parallel take it (methods/registry.py). Part of a row's key.
    sp: int = default_of("sp")
    # the model's real weights (a local checkpoint's, or a Hub id's from the HF cache) instead of
    # random ones. Not part of a row's key: memory and time do not depend on weight values (the loss
    # does); each row records which it had (weights: real | random).
    weights: bool = default_of("weights")
    # scaled-dot-product-attention kernel forced on every method (config/sdpa.py); auto: torch's choice.
    # Part of a row's key: it changes time, and memory (math keeps the scores).
    sdpa_backend: str = default_of("sdpa_backend")
    # the chunk settings the point's rule chose (methods/chunk_sizes.py), in the table's order: the
    # row's auto_settings column. Their numbers are in `settings`; `at_length` chooses them afresh.
    auto_settings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError("method", f"unknown {{field}} {self.method!r}; choose from {', '.join(METHODS)}")
        for name in SPEC_CHECKED:  # the table's checks: choices, integer minimums, bools
            check(name, getattr(self, name))
        knobs = {name: getattr(self.settings, name) for name in METHOD_KNOBS}
        for name in CHUNK_SETTINGS:  # "T/k" as the number it means at this T
            knobs[name] = chunk_size_for(knobs[name], self.seq_len, name)
        for name, value in knobs.items():
            check(name, value)
        if self.objective == "dpo" and self.batch_size % 2:
            raise ConfigError(
                "batch_size", f"counts chosen + rejected rows for dpo: give an even number, got {self.batch_size}"
            )
        if self.memory_limit is not None and (not is_int(self.memory_limit) or self.memory_limit <= 0):
            raise ConfigError("memory_limit", f"must be a positive number of bytes, got {self.memory_limit!r}")
        timeout = self.timeout_s
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
            raise ConfigError(
                "timeout_s", f"must be a positive number of seconds (or unset to predict it), got {timeout!r}"
            )
        if isinstance(knobs["checkpoints"], str):  # the one parse: "recompute:2+cpu" is cpu+recompute:2's Placement
            try:
                knobs["checkpoints"] = Placement.parse(knobs["checkpoints"])
            except ValueError as error:
                raise ConfigError("checkpoints", str(error).removeprefix("checkpoints ")) from None
        # one resolution, here: every later torch.cuda call gets an indexed device
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.threads is None:  # several CPU ranks share the cores
            per_rank = 1 if self.device.startswith("cuda") else self.nproc
            object.__setattr__(self, "threads", max(1, default_threads() // per_rank))
        check_sequence_parallel(self.method, self.nproc, self.sp, self.seq_len)
        check_sdpa_backend(self.sdpa_backend, self.device)
        if self.nproc > 1 and self.device.startswith("cuda"):  # a CPU spec may be a simulation's (check_measurable)
            check_nproc(self.nproc, self.device)
        settings = MethodSettings(**knobs).for_method(knobs_read_by(self.method))
        chosen = tuple(name for name in CHUNK_SETTINGS if getattr(settings, name) == AUTO)
        if chosen:  # the rule's numbers for this point (methods/chunk_sizes.py), recorded as its choice
            sizes = self.auto_chunk_sizes()
            settings = replace(settings, **{name: getattr(sizes, name) for name in chosen})
        object.__setattr__(self, "settings", settings)
        check_chunk_attention(settings.chunk_attention, self.device, self.sdpa_backend)
        if self.sp == 1 and settings.sp_layout not in (None, default_of("sp_layout")):
            raise ConfigError(
                "sp_layout", f"{{field}} {settings.sp_layout} lays a sequence over ranks: add --sp 2 or more"
            )
        kept = [name for name in self.auto_settings if isinstance(getattr(settings, name), int)]
        object.__setattr__(self, "auto_settings", tuple(n for n in CHUNK_SETTINGS if n in chosen or n in kept))

    def auto_chunk_sizes(self) -> ChunkSizes:
        """The rule's chunk sizes for this point (memory budget: its memory limit, else the rule's
        default; the model's depth does not enter)."""
        return auto_chunk_sizes(
            _config(self.model),
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            dtype_bytes=DTYPES[self.dtype].itemsize,
            memory_bytes=self.memory_limit,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def with_settings(self, **knobs: Any) -> RunSpec:
        """The point with these knobs given: no longer the rule's choice where they were."""
        return replace(
            self,
            settings=replace(self.settings, **knobs),
            auto_settings=tuple(name for name in self.auto_settings if name not in knobs),
        )

    def at_length(self, seq_len: int) -> RunSpec:
        """The point at another T, its chunk sizes chosen afresh where the rule chose them (a
        max-length probe); replace(spec, seq_len=...) keeps the numbers instead."""
        again = dict.fromkeys(self.auto_settings, AUTO)
        return replace(self, seq_len=seq_len, settings=replace(self.settings, **again))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        """The spec to_json wrote, as it was: the worker trusts it, so nothing is checked or parsed
        again (the placement comes back from its fields, not its name)."""
        values = json.loads(text)
        knobs = values.pop("settings")
        if knobs["checkpoints"] is not None:
            knobs["checkpoints"] = Placement(**knobs["checkpoints"])
        values.update(settings=MethodSettings(**knobs), auto_settings=tuple(values["auto_settings"]))
        spec = object.__new__(cls)
        for name, value in values.items():
            object.__setattr__(spec, name, value)
        return spec


@cache
def _config(model: str):
    from ..models import load_config

    return load_config(model)


# The names a point's settings go by everywhere (CLI option names, experiment-file keys): the
# table's point settings, which are RunSpec's fields with MethodSettings' in place of `settings`
# (tests/unit/test_settings.py checks); the table checks those it declares a check for.
FIELD_NAMES: tuple[str, ...] = POINT_SETTINGS
SPEC_CHECKED = tuple(f.name for f in fields(RunSpec) if f.name in POINT_SETTINGS and f.name != "method")


def check_nproc(nproc: int, device: str) -> None:
    """Refuse an nproc this machine cannot run: on CUDA each rank needs a GPU of its own. On a CPU
    more gloo ranks than cores run, sharing them (64 ranks on 2 cores took a load of 60 and two
    minutes for a tiny point): the tracked memory is exact, the times are of oversubscribed cores,
    which a notice says and each row records (num_cpus beside nproc and num_threads)."""
    if not device.startswith("cuda"):
        usable = len(available_cpus())
        if nproc > usable:
            warnings.warn(
                SettingChanged(
                    "nproc",
                    f"{{field}} {nproc} runs {nproc} ranks on {usable} CPU(s): their memory is exact (the tracker "
                    "counts tensors), their step times are of oversubscribed cores",
                ),
                stacklevel=3,
            )
        return
    first, count = int(device.split(":")[1]), torch.cuda.device_count()
    if first + nproc > count:
        raise ConfigError(
            "nproc",
            f"{nproc} needs {nproc} GPUs (one per rank, from {device}) but {count - first} are visible from "
            f"{device}; give --nproc {max(1, count - first)} or fewer, or make more GPUs visible (CUDA_VISIBLE_DEVICES)",
        )


def check_measurable(specs: Iterable[RunSpec]) -> None:
    """What measuring the points (not simulating them: `sbp estimate` runs a GPU's ranks as fake
    CPU tensors) needs of this machine, checked before the first runs: a GPU per rank (on a CPU,
    ranks beyond the cores are said once)."""
    for point in dict.fromkeys((spec.nproc, spec.device) for spec in specs):
        check_nproc(*point)


def check_sequence_parallel(method: str, nproc: int, sp: int, seq_len: int) -> None:
    """Refuse an sp that does not divide nproc, a method that cannot share a sequence over ranks
    (methods/registry.py), and for one that cuts it into equal shares a length they do not divide."""
    if nproc % sp:
        fits = [str(d) for d in range(1, nproc + 1) if nproc % d == 0]
        divisors = " or ".join([", ".join(fits[:-1]), fits[-1]] if len(fits) > 1 else fits)
        raise ConfigError(
            "sp", f"{{field}} {sp} does not divide --nproc {nproc}: give --sp {divisors}, or --nproc a multiple of {sp}"
        )
    reason = sequence_parallel_unsupported(method, sp, seq_len)
    if reason is not None:
        raise ConfigError("method" if not METHODS[method].sequence_parallel else "seq_len", reason)


def chunk_size_for(value, seq_len: int, field: str = "chunk_size") -> int | str:
    """An integer, "T/k": seq_len / k rounded up (the paper's timing runs use T/3), or "auto" (kept:
    RunSpec then asks the rule); None (unset) as is."""
    if value is None or is_int(value) or value == AUTO:
        return value
    text = str(value).replace(" ", "")
    if text.isdigit():
        return int(text)
    if text.upper().startswith("T/") and text[2:].isdigit() and int(text[2:]) >= 1:
        return math.ceil(seq_len / int(text[2:]))
    raise ConfigError(field, f'{value!r} is not a size: give a positive integer, "T/k" (e.g. "T/3") or "auto"')


def memory_limit_bytes(value) -> int | None:
    """A byte count (a Python caller's int), or a size with its unit such as "80GiB" / "24GB"."""
    if value is None or is_int(value):
        return value
    try:
        return parse_bytes(value, what="{field}")
    except ValueError as error:
        raise ConfigError("memory_limit", str(error)) from None


def point_specs(
    values: Mapping[str, Any],
    methods: Sequence[str] | None = None,
    *,
    defaults: Mapping[str, Any] | None = None,
    defaults_for: str | None = None,
    search: bool = False,
    named: Sequence[str] | None = None,
) -> list[RunSpec]:
    """One RunSpec per method from the settings someone gave (FIELD_NAMES keys; absent or None
    means "not given"), filled from `defaults`, then the device's defaults (DEVICE_DEFAULTS of
    defaults_for, else of the resolved device), then the objective's batch size. The model is
    checked here, before any process starts. named: the methods the user named (default:
    `methods`), refused here if they cannot run; others that cannot give rows saying why."""
    from ..models import load_config, weights_source

    given = {**(defaults or {}), **{k: v for k, v in values.items() if v is not None}}
    unknown = sorted(set(given) - set(FIELD_NAMES))
    if unknown:
        raise ConfigError(unknown[0], f"is not a setting; settings are {', '.join(FIELD_NAMES)}")
    sp = given.get("sp") if is_int(given.get("sp")) and given["sp"] >= 1 else default_of("sp")  # RunSpec refuses others
    names = method_names(methods, sp)
    for name in names:
        if name not in METHODS:
            raise ConfigError("method", f"unknown {{field}} {name!r}; choose from {', '.join(METHODS)}")
    check_sequence_parallel_methods(names, sp, named=methods if named is None else named)
    device = resolve_device(given.get("device", "auto"))
    for name, value in DEVICE_DEFAULTS[defaults_for or device_kind(device)].items():
        given.setdefault(name, value)
    objective = given.get("objective", default_of("objective"))
    given.setdefault("batch_size", default_of("batch_size", objective=objective))
    if given.get("repeats") == 0:  # memory only (a max-length probe): one step, its peak needs no
        given.setdefault("warmup", 0)  # warm-up (runner/point.py `_measure_cuda` says why)
    long_context_defaults(given)  # a long point: one memory step and one timed step
    settings = {name: given.pop(name) for name in METHOD_KNOBS if name in given}
    for name in CHUNK_SETTINGS:  # StreamBP's chunks (and the chunked heads'): chosen per point unless given
        settings.setdefault(name, AUTO)
    given["memory_limit"] = memory_limit_bytes(given.get("memory_limit"))
    given["device"] = device
    given.pop("method", None)
    specs = [RunSpec(method=name, settings=MethodSettings(**settings), **given) for name in names]
    # fail here, before any process starts, on a model that cannot be built or a method cannot run
    config = load_config(specs[0].model)
    check_model_family(specs[0].model, config, names)
    check_model_sizes(specs[0], config)
    if specs[0].weights:
        weights_source(specs[0].model)  # real weights where asked for: in the directory or the HF cache
    warn_beyond_context(specs[0].model, specs[0].seq_len, config)
    say_changed_values(specs[0], values, search=search)
    return specs


def exactness_specs(values: Mapping[str, Any], methods: Sequence[str] | None = None, **options) -> list[RunSpec]:
    """`sbp check`'s points (point_specs, with its options): bp's first, the reference, then one per
    method named (method_names: the default methods when none is) but bp. With nproc above 1 the
    compared methods run on ranks (runner/rank_gradients.py) against bp in one process, judged by
    the rules of the dtype (runner/exactness.py)."""
    sp = values.get("sp") or 1
    compared = tuple(m for m in method_names(methods, sp if is_int(sp) else 1) if m != "bp")
    if (values.get("nproc") or 1) == 1 and sp == 1:
        return point_specs(values, ("bp", *compared), named=methods or (), **options)
    reference = point_specs({**values, "nproc": 1, "sp": 1}, ("bp",), **options)
    ranked = point_specs(values, compared, named=methods or (), **options) if compared else []
    return [*reference, *ranked]


def check_sequence_parallel_methods(names: Sequence[str], sp: int, *, named: Sequence[str] | None) -> None:
    """Before any spec is made: the methods to run that cannot share a sequence over sp ranks, in
    one line; a method the user named (not through the defaults or `all`, where it gives a row
    saying why) that cannot run here: sequence-parallel only without --sp over 1, or its library
    not installed."""
    refused = [name for name in names if sp > 1 and not METHODS[name].sequence_parallel]
    if refused:
        raise ConfigError("method", sequence_parallel_refusal(refused, sp))
    for name in (n for n in names if n in (named or ())):
        reason = method_unavailable(name, sp)
        if reason:
            raise ConfigError("method", reason)


def say_changed_values(spec: RunSpec, values: Mapping[str, Any], *, search: bool = False) -> None:
    """A SettingChanged notice for each value given (`values`) that the point runs otherwise: a
    prompt over half of T is cut to half (data/preference.py prompt_length; the row records the
    prompt that ran), and an SFT point has none. search: `spec` is a max-length search's first
    probe, and the notice speaks of its probes."""
    from ..data import prompt_length

    given = values.get("prompt_len")
    if given is not None and spec.objective == "sft":
        warnings.warn(
            SettingChanged("prompt_len", f"{given} is not used: only grpo and dpo have a prompt"), stacklevel=3
        )
    elif given is not None and search:
        warnings.warn(
            SettingChanged("prompt_len", f"{given}: a probe under T={2 * given} runs with a prompt of half its T"),
            stacklevel=3,
        )
    elif given is not None:
        ran = prompt_length(spec.seq_len, given)
        if ran != given:
            warnings.warn(
                SettingChanged(
                    "prompt_len", f"{given} is over half of T={spec.seq_len}: runs with a {ran}-token prompt"
                ),
                stacklevel=3,
            )


def check_model_sizes(spec: RunSpec, config) -> None:
    """Refuse counts and sizes the model cannot have, before anything is built: more layers than
    it has (--num-layers keeps the first N), a LoRA rank over its hidden size (a rank-r adapter of a
    d x d weight is exact from r = d on)."""
    depth = getattr(config, "num_hidden_layers", None)
    if spec.num_layers is not None and isinstance(depth, int) and spec.num_layers > depth:
        raise ConfigError(
            "num_layers", f"{spec.num_layers} is more than {spec.model}'s {depth} layers; give {depth} or fewer"
        )
    if spec.sp > 1:
        check_heads_split(spec, config)
    hidden = getattr(config, "hidden_size", None)
    if spec.lora_rank and isinstance(hidden, int) and spec.lora_rank > hidden:
        raise ConfigError(
            "lora_rank", f"{spec.lora_rank} is over {spec.model}'s hidden size {hidden}; give {hidden} or less"
        )


def check_heads_split(spec: RunSpec, config) -> None:
    """Ulysses gives each of sp ranks H/sp query heads and h_kv/sp key/value heads (each repeated
    on sp/h_kv ranks where sp is above h_kv): refuse an sp the model's heads cannot split over."""
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return
    kv_heads = getattr(config, "num_key_value_heads", None) or heads

    def splits(p: int) -> bool:
        return heads % p == 0 and (kv_heads % p == 0 or p % kv_heads == 0)

    if not splits(spec.sp):
        fit = ", ".join(str(p) for p in range(1, spec.nproc + 1) if spec.nproc % p == 0 and splits(p))
        raise ConfigError(
            "sp",
            f"{{field}} {spec.sp} cannot split {spec.model}'s {heads} query and {kv_heads} key/value heads over its "
            f"ranks (Ulysses shares heads out); give one of {fit}",
        )


class BeyondContextWarning(UserWarning):
    """A sequence longer than the model's context: allowed (memory and time do not depend on what
    the positions mean), but said, since the model was never trained on such positions."""


def warn_beyond_context(model: str, seq_len: int, config) -> None:
    """One line (a BeyondContextWarning) when seq_len exceeds the config's max_position_embeddings.
    The text names the model, not T, so a sweep's many long points say it once per model."""
    context = getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and seq_len > context:
        warnings.warn(
            f"T past {model}'s context of {context:,} tokens (max_position_embeddings): allowed, as memory and "
            "time do not depend on it, but the model was never trained that long",
            BeyondContextWarning,
            stacklevel=3,
        )


# Methods that stream the model with sbpbench.core: they run a model only where StreamBP admits it
# (its detectors and the self-check of its architecture, core/architecture/admission.py).
STREAMED_METHODS = ("streambp",)


def check_model_family(model: str, config, methods: Sequence[str]) -> None:
    """Refuse, before anything runs, a model that is not a decoder-only causal LM (an encoder such
    as BERT, an encoder-decoder), or that StreamBP cannot stream exactly, saying why."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    others = "bp and ckpt run any decoder-only causal LM that transformers' AutoModelForCausalLM builds"
    encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES or getattr(config, "is_encoder_decoder", False)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or encoder:
        raise UnsupportedModelError(
            f"{model} has model_type {model_type!r}, not a decoder-only causal LM; StreamBP streams decoder-only "
            f"causal LMs that pass its checks; {others}"
        )
    streamed = [method for method in methods if method in STREAMED_METHODS]
    if streamed:
        from transformers import AutoModelForCausalLM

        from ..core import check_model

        try:
            check_model(model_class=AutoModelForCausalLM._model_mapping[type(config)], config=config)
        except UnsupportedModelError as error:
            raise UnsupportedModelError(
                f"{streamed[0]} cannot run {model}: {error}; {others}, e.g. --method bp ckpt"
            ) from None
