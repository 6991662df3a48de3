"""Orchestration: each measured point in a process of its own (its model and batch from
sbpbench.workload), sweeps, the max-length searches, timeouts, and what they end with (outcome.py).

Its names are loaded on first use, so that the CLI can import outcome.py's lines without torch."""

from importlib import import_module

_NAMES = {
    "ExactnessSpec": ".exactness",
    "check_exactness": ".exactness",
    "run_isolated": ".isolated",
    "run_points": ".isolated",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_NAMES[name], __name__), name)
