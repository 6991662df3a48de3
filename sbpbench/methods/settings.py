"""The knobs a method may read: MethodSettings, one field per method knob of the settings table
(sbpbench/settings, those with `read_by`), in its order, made from the table: a knob declared there
is a field here, taking what its setting takes or None.

In a spec and its results row the knobs a method does not read are None, so a method's key holds
only what changes it (two `bp` rows never differ by a StreamBP chunk size). A spec holds them
resolved (config/run.py): integer chunk sizes and a Placement; as given they may also be "auto",
"T/k" or a placement's name.
"""

from __future__ import annotations

from dataclasses import field, fields, make_dataclass, replace

from ..core import Placement
from ..settings import METHOD_KNOBS, SETTINGS

# What a method that reads a knob uses when it is unset (core's DEFAULT_*_CHUNK_SIZE equal the
# table's), as a spec holds it: the placement parsed, here, once.
DEFAULTS = {name: SETTINGS[name].default for name in METHOD_KNOBS}
DEFAULTS["checkpoints"] = Placement.parse(DEFAULTS["checkpoints"])


class _Knobs:
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


def _annotation(name: str) -> str:
    """What a knob's field takes: its setting's kinds, or None."""
    kind = SETTINGS[name].kind
    return " | ".join([k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,))] + ["None"])


MethodSettings = make_dataclass(
    "MethodSettings",
    [(name, _annotation(name), field(default=None)) for name in METHOD_KNOBS],
    bases=(_Knobs,),
    frozen=True,
    kw_only=True,
    namespace={
        "__module__": __name__,  # make_dataclass's `module` is Python 3.12's: pickle finds the class here
        "__doc__": """A method's knobs, one field per knob of the settings table. None: the method's
    default (DEFAULTS) if it reads the knob, absent if it does not. Checked by the run config
    (sbpbench.config) and, for library callers, by core's StreamConfig.""",
    },
)


def _plain(value):
    return value.name if isinstance(value, Placement) else value
