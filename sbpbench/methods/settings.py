"""The knobs a method may read: MethodSettings, one field per method knob of the settings table
(sbpbench/settings, those with `read_by`), in its order. tests/unit/test_settings.py checks that the
fields are the table's knobs and take the values it declares.

In a spec and its results row the knobs a method does not read are None, so a method's key holds
only what changes it (two `bp` rows never differ by a StreamBP chunk size). A spec holds them
resolved (config/run.py): integer chunk sizes and a Placement; as given they may also be "auto",
"T/k" or a placement's name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..core import Placement
from ..settings import METHOD_KNOBS, SETTINGS

# What a method that reads a knob uses when it is unset (core's DEFAULT_*_CHUNK_SIZE equal the
# table's), as a spec holds it: the placement parsed, here, once.
DEFAULTS = {name: SETTINGS[name].default for name in METHOD_KNOBS}
DEFAULTS["checkpoints"] = Placement.parse(DEFAULTS["checkpoints"])


@dataclass(frozen=True, kw_only=True)
class MethodSettings:
    """A method's knobs. None: the method's default (DEFAULTS) if it reads the knob, absent if it
    does not. Checked by the run config (sbpbench.config) and, for library callers, by
    stream_backward itself."""

    chunk_size: int | str | None = None  # StreamBP's positions per layer chunk (given: N, "T/k" or "auto")
    logits_chunk_size: int | str | None = None  # positions per head chunk (given: N or "auto")
    fp32_grad_accumulation: bool | None = None  # StreamBP: sum bf16 chunk gradients in fp32
    mlp_tile_size: int | None = None  # tiled: positions per MLP tile
    offload_checkpoints: bool | None = None  # tiled: layer checkpoints in host memory
    checkpoints: Placement | str | None = None  # StreamBP's placement (given: its name)
    chunk_attention: str | None = None  # StreamBP's kernel for a chunk's attention over its prefix

    def for_method(self, uses: tuple[str, ...]) -> MethodSettings:
        """The knobs in `uses` set (given or default), every other one None."""
        values = {f.name: None for f in fields(self)}
        for name in uses:
            given = getattr(self, name)
            values[name] = DEFAULTS[name] if given is None else given
        return replace(self, **values)

    def as_dict(self) -> dict:
        """The knobs as a results row holds them: a placement by its name."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}


def _plain(value):
    return value.name if isinstance(value, Placement) else value
