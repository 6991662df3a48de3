"""A setting's command-line flags, from the settings table: what options.py declares and what
errors.py names in a ConfigError's message ("--seq must be at least 2"; a knob without a flag of
its own: "--set mlp_tile_size must be at least 1")."""

from __future__ import annotations

from ..settings import SETTINGS
from ..settings.table import has_flag


def flags_of(name: str) -> tuple[str, ...]:
    """A setting's flags: the spellings it keeps from before, else its name with dashes (a bool:
    --name/--no-name)."""
    setting = SETTINGS[name]
    if setting.flags:
        return setting.flags
    dashed = name.replace("_", "-")
    return (f"--{dashed}/--no-{dashed}",) if setting.kind is bool else (f"--{dashed}",)


# setting -> what a user typed, for messages ("--seq must be at least 2", "--set mlp_tile_size ...")
FLAGS: dict[str, str] = {
    name: flags_of(name)[0].split("/")[0] if has_flag(name) else f"--set {name}" for name in SETTINGS
}
