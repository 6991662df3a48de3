"""Experiment files: declarative TOML (no code runs) loaded into the specs the CLI builds.

An experiment is a list of points, each a `sbp run` grid (RunSpec per method x seq_len x
batch_size) or a `sbp maxlen` search (MaxlenSpec per method). Keys are the specs' field names
(`sbp run --help` flags with dashes as underscores); method, seq_len and batch_size may be lists
(the grid's axes). Layout:

    name = "paper_table1"            # default results file: results/<name>.csv
    kind = "grid"                    # grid | maxlen: the default for every point
    description = "..."
    reference = "experiments/reference/streambp_paper.csv"   # optional: the paper's numbers
    [defaults]                       # any point key, for every point
    dtype = "bf16"
    [[points]]                       # one or more; each merges [defaults]
    title = "Table 1"                # optional: what this entry measures
    model = "Qwen/Qwen3-4B"
    method = ["ckpt", "streambp"]
    seq_len = [6000, 9000]

A maxlen point's seq_len is its first probe. Every key is checked (name, type, allowed values)
and every value by the spec itself; a mistake is reported as
`<file>: <table> <key>: <what is wrong>; <what is allowed>`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from itertools import product
from pathlib import Path

from ..methods import method_names
from ..settings import (
    EVERY_METHOD,
    METHOD_NAMES,
    SEARCH_SETTINGS,
    SETTINGS,
    ConfigError,
    IgnoredKnob,
    Setting,
    ignored_knobs,
)
from .device import device_kind, resolve_device
from .maxlen import SEARCH_DEFAULTS, MaxlenSpec
from .run import RunSpec, point_specs

KINDS = ("grid", "maxlen")


# Every key a [defaults] table or a [[points]] entry may hold: the settings (sbpbench/settings)
# and the point's kind.
POINT_KEYS: dict[str, Setting] = {
    "kind": Setting(str, "grid or maxlen", KINDS),
    "title": Setting(str, "what the entry measures, in a few words (`sbp sweep --dry-run` groups by it)"),
    **SETTINGS,
}
TOP_KEYS = {"name", "kind", "description", "reference", "defaults", "points"}
REQUIRED = ("model",)
MAXLEN_ONLY = SEARCH_SETTINGS
RENAMED = {
    "methods": "method",
    "seq_lens": "seq_len",
    "batch_sizes": "batch_size",
    "max_seq": "seq_len_ceiling",
    "start": "seq_len",
    "timeout": "timeout_s",
}  # keys of the first experiment-file format


class ExperimentError(ValueError):
    """A mistake in an experiment file: the message names the file, the table and the key."""


@dataclass(frozen=True)
class Experiment:
    name: str
    path: Path
    description: str
    reference: str | None
    points: tuple[RunSpec | MaxlenSpec, ...]  # in file order: grid specs, then each search
    titles: tuple[str, ...] = ()  # each point's entry title ("" where the entry has none)
    # each point's device as its file names it ("auto" where it names none), whatever the override:
    # what a dry run prices, on a machine that cannot resolve it
    devices: tuple[str, ...] = ()

    @property
    def grid(self) -> list[RunSpec]:
        return [p for p in self.points if isinstance(p, RunSpec)]

    @property
    def searches(self) -> list[MaxlenSpec]:
        return [p for p in self.points if isinstance(p, MaxlenSpec)]


def _type_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "true/false"}[k] for k in kinds)


def _check_value(where: str, name: str, value, key: Setting):
    def fits(item) -> bool:
        kinds = key.kind if isinstance(key.kind, tuple) else (key.kind,)
        if isinstance(item, bool) and bool not in kinds:
            return False
        return isinstance(item, kinds)

    items = value if isinstance(value, list) and key.may_list else [value]
    if isinstance(value, list) and key.may_list and not value:
        raise ExperimentError(f"{where} {name}: expected {_type_name(key.kind)} or a non-empty list of them, got []")
    for item in items:
        if key.size and isinstance(item, (int, float)) and not isinstance(item, bool):
            raise ExperimentError(f'{where} {name}: {item!r} has no unit: write "{item}GiB" (2^30 bytes) or "{item}GB"')
        if not fits(item):
            raise ExperimentError(f"{where} {name}: expected {_type_name(key.kind)} ({key.help}), got {item!r}")
        if key.choices and item not in key.choices:
            raise ExperimentError(f"{where} {name}: unknown value {item!r}; allowed: {', '.join(key.choices)}")


def _check_table(where: str, table) -> dict:
    if not isinstance(table, dict):
        raise ExperimentError(f"{where}: expected a table of keys, got {table!r}")
    for name, value in table.items():
        if name not in POINT_KEYS:
            hint = f"; it is now called {RENAMED[name]!r}" if name in RENAMED else f"; allowed: {', '.join(POINT_KEYS)}"
            raise ExperimentError(f"{where}: unknown key {name!r}{hint}")
        _check_value(where, name, value, POINT_KEYS[name])
    return table


def _check_model(where: str, name: str) -> None:
    """A registry name, a local checkpoint directory or a Hub id whose config.json can be read."""
    from ..models import config_dict

    try:
        config_dict(name)
    except (OSError, ValueError) as error:
        raise ExperimentError(f"{where} model: {str(error).splitlines()[0]}") from None


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _expand(values: dict, kind: str, overrides: dict, defaults_for: str | None = None) -> list[RunSpec | MaxlenSpec]:
    settings = {k: v for k, v in values.items() if k not in ("kind", "title", "method", *MAXLEN_ONLY)}
    settings.update(overrides)
    methods = _as_list(values.get("method", []))  # none named: the default methods (point_specs)
    if kind == "grid":
        if "seq_len" not in values:
            raise ConfigError("seq_len", "is needed by a grid point, e.g. seq_len = [2048, 4096]")
        return [
            spec
            for batch_size, seq_len in product(_as_list(values.get("batch_size", [None])), _as_list(values["seq_len"]))
            for spec in point_specs(
                {**settings, "seq_len": seq_len, "batch_size": batch_size}, methods, defaults_for=defaults_for
            )
        ]
    for axis in ("seq_len", "batch_size"):
        if isinstance(values.get(axis), list):
            raise ConfigError(axis, "takes one value in a maxlen point (seq_len: the first probe)")
    defaults = SEARCH_DEFAULTS[defaults_for or device_kind(resolve_device(settings.get("device", "auto")))]
    settings.setdefault("seq_len", defaults["seq_len"])
    # probes measure memory only: timed steps would add nothing to the answer
    return [
        MaxlenSpec(
            base=base,
            seq_len_ceiling=values.get("seq_len_ceiling", defaults["seq_len_ceiling"]),
            **{name: values[name] for name in MAXLEN_ONLY if name in values and name != "seq_len_ceiling"},
        )
        for base in point_specs({"repeats": 0, **settings}, methods, defaults_for=defaults_for, search=True)
    ]


def ignored_keys(path: str | Path) -> list[IgnoredKnob]:
    """The knobs an experiment file sets (in [defaults] or an entry) that some of an entry's methods do
    not read (settings.ignored_knobs), each once with every method that ignores it; [] where the file
    does not read, and an entry naming a method that is none is passed over (load_experiment says why)."""
    try:
        document = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []
    defaults, entries = document.get("defaults", {}), document.get("points")
    if not isinstance(defaults, dict) or not isinstance(entries, list):
        return []
    found: dict[str, IgnoredKnob] = {}
    for entry in (entry for entry in entries if isinstance(entry, dict)):
        values = {**defaults, **entry}
        named = _as_list(values.get("method", []))
        if not all(name in METHOD_NAMES or name == EVERY_METHOD for name in named):
            continue
        for knob in ignored_knobs(method_names(named), values):
            earlier = found.get(knob.knob)
            ignoring = (*earlier.ignored_by, *knob.ignored_by) if earlier else knob.ignored_by
            found[knob.knob] = knob._replace(ignored_by=tuple(dict.fromkeys(ignoring)))
    return list(found.values())


SHIPPED = Path(__file__).resolve().parents[2] / "experiments"  # the checkout's, beside the package


def missing_experiment_hint(path: Path) -> str:
    """What to do about an experiment file that is not there: a relative path is read from the
    current folder, and the shipped files live in the checkout's experiments/."""
    where = "" if path.is_absolute() else f" (a path relative to this folder, {Path.cwd()})"
    if (SHIPPED / path.name).is_file():
        return f"{where}; the shipped file is {SHIPPED / path.name}"
    return f"{where}; see experiments/*.toml in the sbpbench checkout"


def load_experiment(
    path: str | Path, *, device: str | None = None, threads: int | None = None, defaults_for: str | None = None
) -> Experiment:
    """Read and check an experiment file. device overrides every point's (e.g. "cpu" to check a
    GPU experiment's file on a machine without one); so does threads. defaults_for: the kind of
    device ("cuda", "cpu") whose defaults fill what the file leaves out, when not the points' own
    (a GPU experiment priced on a machine without one)."""
    overrides = {name: value for name, value in (("device", device), ("threads", threads)) if value is not None}
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no experiment file {path}{missing_experiment_hint(path)}")
    try:
        document = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ExperimentError(f"{path}: not valid TOML: {error}") from None
    except UnicodeDecodeError as error:  # a binary file given by mistake
        raise ExperimentError(f"{path}: not valid TOML: byte {error.start} is not UTF-8 text") from None
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
    titles: list[str] = []
    devices: list[str] = []
    for number, entry in enumerate(entries, start=1):
        where = f"{path}: [[points]] #{number}"
        values = {**defaults, **_check_table(where, entry)}
        for name in REQUIRED:
            if name not in values:
                raise ExperimentError(f"{where}: missing key {name!r} ({POINT_KEYS[name].help})")
        _check_model(where, values["model"])
        point_kind = values.get("kind", kind)
        misplaced = [k for k in MAXLEN_ONLY if k in entry] if point_kind == "grid" else []
        if misplaced:
            raise ExperimentError(f"{where}: key {misplaced[0]!r} does not apply to a {point_kind} point")
        try:
            expanded = _expand(values, point_kind, overrides, defaults_for)
        except ConfigError as error:
            raise ExperimentError(f"{where} {error.field}: {error.naming(error.field)}") from None
        except ValueError as error:
            raise ExperimentError(f"{where}: {error}") from None
        points += expanded
        titles += [values.get("title", "")] * len(expanded)
        devices += [str(values.get("device", "auto")).strip().lower()] * len(expanded)
    return Experiment(
        name=document.get("name", path.stem),
        path=path,
        description=document.get("description", ""),
        reference=document.get("reference"),
        points=tuple(points),
        titles=tuple(titles),
        devices=tuple(devices),
    )
