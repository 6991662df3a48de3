"""Whether StreamBP streams a model: its parts, the detectors, then the verified table or the
self-check (core/README.md, "Which models stream").

A model is admitted when the detectors see nothing StreamBP cannot stream (detectors.py) and its
architecture is in the table of architectures CI verifies (verified.py) or passes the self-check
(self_check.py), run once per architecture and process. The verdicts of this process can be read
and seeded (`verdicts`, `remember`): a caller that keeps them between processes (sbpbench's runner,
in a file) seeds them before its first step. A verdict changes only whether the check runs, never
what a step computes.
"""

from __future__ import annotations

from .detectors import check_streamable
from .parts import DecoderParts
from .self_check import SelfCheck, Stepper, architecture_key, refuse_unless_exact, self_check
from .verified import VERIFIED

_CHECKED: dict[str, SelfCheck] = {}


def verdict(model_class: type, config, stepper: Stepper, *, training: bool = True) -> SelfCheck | None:
    """The self-check's verdict on an architecture (run now unless known), or None for one in the
    verified table."""
    key = architecture_key(model_class, config)
    if key in VERIFIED:
        return None
    if key not in _CHECKED:
        _CHECKED[key] = self_check(model_class, config, stepper, training=training)
    return _CHECKED[key]


def admit(parts: DecoderParts, stepper: Stepper) -> None:
    """UnsupportedModelError, before any work, unless the model streams exactly (module docstring)."""
    check_streamable(parts)
    check = verdict(type(parts.model), parts.config, stepper, training=parts.model.training)
    if check is not None:
        refuse_unless_exact(check)


def verdicts() -> dict[str, SelfCheck]:
    """The self-checks this process ran or was told, by architecture key."""
    return dict(_CHECKED)


def remember(check: SelfCheck) -> None:
    """A verdict reached elsewhere (another process, for the same key) taken as this process's."""
    _CHECKED[check.key] = check
