"""One max-length search (`sbp maxlen`, an experiment's maxlen point): the probes' settings and
how the search runs. Its first probe is base.seq_len; it never tries past seq_len_ceiling."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..settings import SEARCH_SETTINGS, SETTINGS, ConfigError, check, default_of, device_defaults
from ..settings.table import DEVICE_KINDS
from .run import RunSpec

MIN_SEQ_LEN: int = SETTINGS["seq_len"].minimum  # one token to predict


@dataclass(frozen=True)
class Resolution:
    """When the bracket is narrow enough: a percentage of the longest ok length, or tokens."""

    percent: float | None = None
    tokens: int | None = None

    @classmethod
    def parse(cls, text: str) -> Resolution:
        text = str(text).strip()
        try:
            if text.endswith("%"):
                percent = float(text[:-1])
                if 0 < percent < 100:
                    return cls(percent=percent)
            elif int(text) >= 1:
                return cls(tokens=int(text))
        except ValueError:
            pass
        raise ConfigError(
            "resolution", f"{text!r}: give a percentage in (0, 100) such as 1% or a token count such as 256"
        )

    def width(self, max_ok: int) -> int:
        """The widest bracket [max_ok, min_oom] that still answers the search."""
        if self.tokens is not None:
            return self.tokens
        return max(1, math.ceil(max_ok * self.percent / 100))

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent is not None else str(self.tokens)


DEFAULT_RESOLUTION = Resolution.parse(default_of("resolution"))
# The first probe, ceiling and budget when none is given (the settings table's): the paper's 80 GB
# GPU; on a CPU a 1 GiB cap on tracked tensors keeps a search within minutes.
SEARCH_DEFAULTS = {kind: device_defaults(kind, search=True) for kind in DEVICE_KINDS}


@dataclass(frozen=True, kw_only=True)
class MaxlenSpec:
    """A search; a field left out takes the settings table's default (a CPU search's)."""

    base: RunSpec  # every probe setting; base.seq_len is the first probe
    resolution: Resolution = DEFAULT_RESOLUTION
    seq_len_ceiling: int = default_of("seq_len_ceiling")  # longest length tried (">= ceiling" if that fits)
    multiple_of: int = default_of("multiple_of")  # probe lengths are multiples of this
    seed_from_estimate: bool = default_of("seed_from_estimate")  # start at the predicted max T (length_search.py)

    def __post_init__(self):
        if not isinstance(self.resolution, Resolution):
            object.__setattr__(self, "resolution", Resolution.parse(self.resolution))
        check("multiple_of", self.multiple_of)
        check("seed_from_estimate", self.seed_from_estimate)
        if not isinstance(self.seq_len_ceiling, int) or not MIN_SEQ_LEN <= self.base.seq_len <= self.seq_len_ceiling:
            raise ConfigError(
                "seq_len_ceiling",
                f"must be at least the first probe length seq_len ({self.base.seq_len}), got {self.seq_len_ceiling!r}",
            )

    @property
    def method(self) -> str:
        return self.base.method

    @property
    def start(self) -> int:
        return self.base.seq_len

    def probe(self, seq_len: int) -> RunSpec:
        return self.base.at_length(seq_len)


def search_specs(
    settings: Mapping[str, Any], methods: Sequence[str], *, simulate: bool = False, gpu_memory: str | None = None
) -> list[MaxlenSpec]:
    """One search per method from the settings someone gave (`sbp maxlen`'s options: a point's and
    a search's), filled with a search's defaults for the device kind it measures. simulate: the
    probes are predictions of a GPU (of gpu_memory, else the memory limit) on fake CPU tensors."""
    from .device import device_kind, resolve_device
    from .run import point_specs

    settings = dict(settings)
    kind = "cuda" if simulate else device_kind(resolve_device(settings.get("device", "auto")))
    search = {name: settings.pop(name) for name in SEARCH_SETTINGS if name in settings}
    defaults = {**SEARCH_DEFAULTS[kind], "repeats": 0}  # probes measure memory only
    if gpu_memory:
        settings["memory_limit"] = gpu_memory
    if simulate:
        settings["device"] = "cpu"  # fake CPU tensors stand in for the GPU's
    search.setdefault("seq_len_ceiling", defaults.pop("seq_len_ceiling"))
    return [
        MaxlenSpec(base=spec, **search)
        for spec in point_specs(settings, methods, defaults=defaults, defaults_for=kind, search=True)
    ]
