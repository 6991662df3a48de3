"""Experiment files: declarative TOML (no code runs) loaded into the dataclasses the CLI uses.

An experiment is a list of points, each a `sbp run` grid (RunSpec per method x seq_len x batch)
or a `sbp maxlen` search (MaxlenSpec per method). Layout:

    name = "paper_table1"            # default results file: results/<name>.csv
    kind = "grid"                    # grid | maxlen: the default for every point
    description = "..."
    reference = "experiments/reference/streambp_paper.csv"   # optional: the paper's numbers
    [defaults]                       # any point key, for every point
    dtype = "bf16"
    [[points]]                       # one or more; each merges [defaults]
    model = "Qwen/Qwen3-4B"
    methods = ["ckpt", "streambp"]
    seq_lens = [6000, 9000]

Every key is checked (name, type, allowed values); a mistake is reported as
`<file>: <table> <key>: <what is wrong>; <what is allowed>`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import tomllib

from ..data import DEFAULT_PROMPT_LEN, OBJECTIVES
from ..measure.units import parse_bytes
from ..methods import METHODS, STEPS, MethodSettings
from ..models.registry import MODELS
from ..runner.maxlen import Resolution
from ..runner.search import MaxlenSpec
from ..runner.spec import DEFAULT_TIMEOUT_S, DTYPES, PROTOCOLS, RunSpec, resolve_device

KINDS = ("grid", "maxlen")


@dataclass(frozen=True)
class Key:
    kind: type | tuple[type, ...]  # what TOML value it takes (list: a list of these)
    help: str
    choices: tuple[str, ...] = ()
    is_list: bool = False


# Every key a [defaults] table or a [[points]] entry may hold.
POINT_KEYS: dict[str, Key] = {
    "kind": Key(str, "grid or maxlen", KINDS),
    "model": Key(str, "a registry name (`sbp models`) or a local checkpoint directory"),
    "methods": Key(str, "methods to run", tuple(METHODS), is_list=True),
    "seq_lens": Key(int, "grid: tokens per row, prompt included", is_list=True),
    "batch_sizes": Key(int, "grid: rows per batch", is_list=True),
    "batch_size": Key(int, "rows per batch (grpo: the group, dpo: chosen + rejected)"),
    "objective": Key(str, "training objective", tuple(OBJECTIVES)),
    "prompt_len": Key(int, "grpo/dpo prompt tokens"),
    "lora_rank": Key(int, "0: full fine-tuning"),
    "lora_alpha": Key(int, "LoRA alpha"),
    "step": Key(str, "bp: forward+backward; train: + AdamW", STEPS),
    "dtype": Key(str, "model dtype", tuple(DTYPES)),
    "device": Key(str, "auto, cpu, cuda or cuda:N"),
    "protocol": Key(str, "gradient buffers before the step", PROTOCOLS),
    "chunk_size": Key((int, str), 'StreamBP layer chunk: tokens, or "T/3" for a third of seq_len'),
    "logits_chunk_size": Key(int, "StreamBP logits chunk"),
    "fp32_grad_accumulation": Key(bool, "StreamBP: sum bf16 chunk gradients in fp32"),
    "num_layers": Key(int, "keep the first N decoder layers"),
    "warmup": Key(int, "discarded steps before measuring"),
    "repeats": Key(int, "timed steps (0: memory only)"),
    "memory_limit": Key(str, 'cap, e.g. "80GiB"'),
    "timeout": Key((int, float), "seconds per point"),
    "seed": Key(int, "seed for weights and batch"),
    "resolution": Key(str, 'maxlen: "1%" of the answer, or tokens such as "256"'),
    "start": Key(int, "maxlen: first probe length"),
    "max_seq": Key(int, "maxlen: longest length tried"),
    "multiple_of": Key(int, "maxlen: probe lengths are multiples of this"),
}
TOP_KEYS = {"name", "kind", "description", "reference", "defaults", "points"}
REQUIRED = ("model",)
GRID_ONLY = ("seq_lens", "batch_sizes")
MAXLEN_ONLY = ("resolution", "start", "max_seq", "multiple_of")


class ExperimentError(ValueError):
    """A mistake in an experiment file: the message names the file, the table and the key."""


@dataclass(frozen=True)
class Experiment:
    name: str
    path: Path
    description: str
    reference: str | None
    points: tuple[RunSpec | MaxlenSpec, ...]  # in file order: grid specs, then each search

    @property
    def grid(self) -> list[RunSpec]:
        return [p for p in self.points if isinstance(p, RunSpec)]

    @property
    def searches(self) -> list[MaxlenSpec]:
        return [p for p in self.points if isinstance(p, MaxlenSpec)]


def _type_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "true/false"}[k] for k in kinds)


def _check_value(where: str, name: str, value, key: Key):
    def fits(item) -> bool:
        kinds = key.kind if isinstance(key.kind, tuple) else (key.kind,)
        if isinstance(item, bool) and bool not in kinds:
            return False
        return isinstance(item, kinds)

    items = value if key.is_list else [value]
    if key.is_list and (not isinstance(value, list) or not value):
        raise ExperimentError(f"{where} {name}: expected a non-empty list of {_type_name(key.kind)}s, got {value!r}")
    for item in items:
        if not fits(item):
            raise ExperimentError(f"{where} {name}: expected {_type_name(key.kind)} ({key.help}), got {item!r}")
        if key.choices and item not in key.choices:
            raise ExperimentError(f"{where} {name}: unknown value {item!r}; allowed: {', '.join(key.choices)}")


def _check_table(where: str, table) -> dict:
    if not isinstance(table, dict):
        raise ExperimentError(f"{where}: expected a table of keys, got {table!r}")
    for name, value in table.items():
        if name not in POINT_KEYS:
            raise ExperimentError(f"{where}: unknown key {name!r}; allowed: {', '.join(POINT_KEYS)}")
        _check_value(where, name, value, POINT_KEYS[name])
    return table


def _check_model(where: str, name: str) -> None:
    from ..models.build import is_local_checkpoint

    if name not in MODELS and not is_local_checkpoint(name):
        raise ExperimentError(
            f"{where} model: unknown model {name!r}; allowed: {', '.join(MODELS)}, or a local checkpoint directory"
        )


def _chunk_size(value, seq_len: int) -> int:
    """An integer, or "T/k": seq_len / k rounded up (the paper's timing runs use T/3)."""
    if isinstance(value, int):
        return value
    text = value.replace(" ", "")
    if text.startswith("T/") and text[2:].isdigit() and int(text[2:]) >= 1:
        return math.ceil(seq_len / int(text[2:]))
    raise ValueError(f'chunk_size {value!r}: give an integer or "T/k", e.g. "T/3"')


def _run_spec(values: dict, *, method: str, seq_len: int, batch_size: int, device: str) -> RunSpec:
    limit = values.get("memory_limit")
    return RunSpec(
        model=values["model"],
        method=method,
        seq_len=seq_len,
        batch_size=batch_size,
        objective=values.get("objective", "sft"),
        prompt_len=values.get("prompt_len", DEFAULT_PROMPT_LEN),
        lora_rank=values.get("lora_rank", 0),
        lora_alpha=values.get("lora_alpha", 128),
        step=values.get("step", "bp"),
        dtype=values.get("dtype", "bf16" if device.startswith("cuda") else "fp32"),
        device=device,
        settings=MethodSettings(
            chunk_size=_chunk_size(values.get("chunk_size", MethodSettings().chunk_size), seq_len),
            logits_chunk_size=values.get("logits_chunk_size", MethodSettings().logits_chunk_size),
            fp32_grad_accumulation=values.get("fp32_grad_accumulation", True),
        ),
        num_layers=values.get("num_layers"),
        protocol=values.get("protocol", "steady"),
        warmup=values.get("warmup", 1),
        repeats=values.get("repeats", 3),
        memory_limit_bytes=parse_bytes(limit) if limit else None,
        seed=values.get("seed", 0),
        timeout_s=float(values.get("timeout", DEFAULT_TIMEOUT_S)),
    )


def _expand(values: dict, kind: str, device: str) -> list[RunSpec | MaxlenSpec]:
    methods = values.get("methods", list(METHODS))
    if kind == "grid":
        if "seq_lens" not in values:
            raise ValueError("a grid point needs seq_lens, e.g. seq_lens = [2048, 4096]")
        batch_sizes = values.get("batch_sizes", [values.get("batch_size", 1)])
        return [
            _run_spec(values, method=m, seq_len=t, batch_size=b, device=device)
            for b, t, m in product(batch_sizes, values["seq_lens"], methods)
        ]
    start, ceiling = values.get("start", 1024), values.get("max_seq", 262_144)
    return [
        MaxlenSpec(
            # probes measure memory only: timed steps would add nothing to the answer
            base=_run_spec(
                {"repeats": 0, **values}, method=m, seq_len=start, batch_size=values.get("batch_size", 1), device=device
            ),
            resolution=Resolution.parse(values.get("resolution", "1%")),
            start=start,
            ceiling=ceiling,
            multiple_of=values.get("multiple_of", 8),
        )
        for m in methods
    ]


def load_experiment(path: str | Path, *, device: str | None = None) -> Experiment:
    """Read and check an experiment file. device overrides every point's (e.g. "cpu" to check a
    GPU experiment's file on a machine without one)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no experiment file {path}; see experiments/*.toml")
    try:
        document = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ExperimentError(f"{path}: not valid TOML: {error}") from None
    for name in document:
        if name not in TOP_KEYS:
            raise ExperimentError(f"{path}: unknown top-level key {name!r}; allowed: {', '.join(sorted(TOP_KEYS))}")
    for name in ("name", "description", "reference", "kind"):
        if name in document and not isinstance(document[name], str):
            raise ExperimentError(f"{path}: {name}: expected a string, got {document[name]!r}")
    kind = document.get("kind", "grid")
    if kind not in KINDS:
        raise ExperimentError(f"{path}: kind: unknown value {kind!r}; allowed: {', '.join(KINDS)}")
    defaults = _check_table(f"{path}: [defaults]", document.get("defaults", {}))
    entries = document.get("points")
    if not isinstance(entries, list) or not entries:
        raise ExperimentError(f"{path}: no [[points]]; add at least one [[points]] table with a model")
    points: list[RunSpec | MaxlenSpec] = []
    for number, entry in enumerate(entries, start=1):
        where = f"{path}: [[points]] #{number}"
        values = {**defaults, **_check_table(where, entry)}
        for name in REQUIRED:
            if name not in values:
                raise ExperimentError(f"{where}: missing key {name!r} ({POINT_KEYS[name].help})")
        _check_model(where, values["model"])
        point_kind = values.get("kind", kind)
        misplaced = [k for k in (MAXLEN_ONLY if point_kind == "grid" else GRID_ONLY) if k in entry]
        if misplaced:
            raise ExperimentError(f"{where}: key {misplaced[0]!r} does not apply to a {point_kind} point")
        point_device = resolve_device(device or values.get("device", "auto"))
        try:
            points += _expand(values, point_kind, point_device)
        except ValueError as error:
            raise ExperimentError(f"{where}: {error}") from None
    return Experiment(
        name=document.get("name", path.stem),
        path=path,
        description=document.get("description", ""),
        reference=document.get("reference"),
        points=tuple(points),
    )
