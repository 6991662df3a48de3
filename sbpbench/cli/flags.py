"""A setting's command-line flags, from the settings table: what options.py declares and what
errors.py names in a ConfigError's message ("--seq must be at least 2")."""

from __future__ import annotations

from ..settings import SETTINGS


def flags_of(name: str) -> tuple[str, ...]:
    """A setting's flags: the spellings it keeps from before, else its name with dashes (a bool:
    --name/--no-name)."""
    setting = SETTINGS[name]
    if setting.flags:
        return setting.flags
    dashed = name.replace("_", "-")
    return (f"--{dashed}/--no-{dashed}",) if setting.kind is bool else (f"--{dashed}",)


# setting -> the flag a user typed, for messages ("--seq must be at least 2")
FLAGS: dict[str, str] = {name: flags_of(name)[0].split("/")[0] for name in SETTINGS}
