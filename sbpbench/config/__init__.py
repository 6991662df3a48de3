"""Run configuration: the typed specs every command, experiment file and Python caller builds
(RunSpec, MaxlenSpec) with the settings table's defaults and checks, device resolution, experiment
files. The model and batch a spec describes are built in sbpbench.workload."""

from ..settings import ConfigError
from .device import resolve_device
from .maxlen import MaxlenSpec, Resolution
from .run import (
    DEVICE_DEFAULTS,
    DTYPES,
    FIELD_NAMES,
    RunSpec,
    exactness_specs,
    point_specs,
)

__all__ = [
    "DEVICE_DEFAULTS",
    "DTYPES",
    "FIELD_NAMES",
    "ConfigError",
    "MaxlenSpec",
    "Resolution",
    "RunSpec",
    "exactness_specs",
    "point_specs",
    "resolve_device",
]
