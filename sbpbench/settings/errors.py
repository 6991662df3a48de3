"""The error and the notice of a setting: each knows its field, so each front end names it its own way
(the CLI by its flag, an experiment file by its key, Python by the field)."""

from __future__ import annotations


class _NamesItsField:
    """A message about one setting that knows its field, so each front end names it its own way."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(self.naming(field))

    def naming(self, name: str) -> str:
        """The message with the field called `name` (a CLI flag, a TOML key)."""
        return self.problem.format(field=name) if "{field}" in self.problem else f"{name} {self.problem}"


class ConfigError(_NamesItsField, ValueError):
    """`field` is a RunSpec / MethodSettings / MaxlenSpec field name. str() reads
    "<field> <problem>" ("seq_len must be at least 2 (one token to predict), got 1"), or the
    problem with the name put in where it says {field} ("unknown objective 'ppo'; ...")."""


class SettingChanged(_NamesItsField, UserWarning):
    """A value the tool runs differently from how it was given (a prompt longer than half of T runs
    at half), said as a one-line warning; like ConfigError it knows the field, so the CLI names its
    flag and an experiment file's user sees the key."""
