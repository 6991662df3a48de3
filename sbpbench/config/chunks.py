"""A spec's `auto` chunk sizes as the numbers its point runs with (the rule: methods/chunk_sizes.py).

A RunSpec keeps "auto" (so a max-length probe at another T, `MaxlenSpec.probe`, chooses afresh);
everything that runs or records the point reads `resolved_settings(spec)`: the row's chunk columns
and key hold the numbers before the point runs, and `auto_settings(spec)` names the ones the rule
chose (the row's `auto_settings` column).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from ..methods.chunk_sizes import auto_chunk_sizes
from ..methods.settings import MethodSettings
from ..settings import AUTO, CHUNK_SETTINGS
from .run import DTYPES, RunSpec


@cache
def _config(model: str):
    from ..models import load_config

    return load_config(model)


def auto_settings(spec: RunSpec) -> tuple[str, ...]:
    """The chunk settings of the spec left to the rule ("auto")."""
    return tuple(name for name in CHUNK_SETTINGS if getattr(spec.settings, name) == AUTO)


def resolved_settings(spec: RunSpec) -> MethodSettings:
    """spec.settings with every "auto" replaced by the rule's number for this point (memory budget:
    the spec's memory limit, else the rule's default; the model's depth does not enter)."""
    chosen = auto_settings(spec)
    if not chosen:
        return spec.settings
    sizes = auto_chunk_sizes(
        _config(spec.model),
        seq_len=spec.seq_len,
        batch_size=spec.batch_size,
        dtype_bytes=DTYPES[spec.dtype].itemsize,
        memory_bytes=spec.memory_limit,
    )
    return replace(spec.settings, **{name: getattr(sizes, name) for name in chosen})
