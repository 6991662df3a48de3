"""The knobs a method may read: MethodSettings, made from the settings table's method knobs
(sbpbench/settings, those with `read_by`). In a spec and its results row the knobs a method does
not read are None, so a method's key holds only what changes it (two `bp` rows never differ by a
StreamBP chunk size)."""

from __future__ import annotations

from dataclasses import asdict, field, fields, make_dataclass, replace

from ..settings import METHOD_KNOBS, SETTINGS

# What a method that reads a knob uses when it is unset (core's DEFAULT_*_CHUNK_SIZE equal the table's).
DEFAULTS = {name: SETTINGS[name].default for name in METHOD_KNOBS}


class _Knobs:
    """MethodSettings' behaviour. None: the method's default (DEFAULTS) if it reads the knob,
    absent if it does not. Checked by the run config (sbpbench.config) and, for library callers,
    by stream_backward itself."""

    def for_method(self, uses: tuple[str, ...]) -> MethodSettings:
        """The knobs in `uses` set (given or default), every other one None."""
        values = {f.name: None for f in fields(self)}
        for name in uses:
            given = getattr(self, name)
            values[name] = DEFAULTS[name] if given is None else given
        return replace(self, **values)

    def as_dict(self) -> dict:
        return asdict(self)


def _annotation(name: str) -> str:
    """A knob's field type: what its setting takes (an int knob may also hold "auto"), or None."""
    kind = SETTINGS[name].kind
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " | ".join([k.__name__ for k in kinds] + ["None"])


# Generated, not written out: its fields are exactly the table's method knobs, each `<kind> | None
# = None`, so a knob is declared once (in the table) and this class cannot drift from it. A frozen,
# keyword-only dataclass like the other specs: MethodSettings(chunk_size=256, checkpoints="cpu").
MethodSettings = make_dataclass(
    "MethodSettings",
    [(name, _annotation(name), field(default=None)) for name in METHOD_KNOBS],
    bases=(_Knobs,),
    namespace={"__doc__": _Knobs.__doc__, "__module__": __name__},
    frozen=True,
    kw_only=True,
)
