"""Every setting a user can give, declared once (name, value type, default, check, choices, help,
flag, the methods that read it), and ConfigError, the error of a bad one. Imports nothing heavy:
the CLI builds its options and help from it without loading torch or transformers."""

from .choices import DTYPE_NAMES, EVERY_METHOD, METHOD_NAMES, OBJECTIVES, PROTOCOLS, STEPS
from .errors import ConfigError, SettingChanged
from .table import (
    AUTO,
    CHUNK_SETTINGS,
    EXACTNESS_DEFAULTS,
    METHOD_KNOBS,
    POINT_SETTINGS,
    SEARCH_SETTINGS,
    SETTINGS,
    IgnoredKnob,
    Setting,
    check,
    default_of,
    device_defaults,
    ignored_knobs,
    knobs_read_by,
)

__all__ = [
    "AUTO",
    "CHUNK_SETTINGS",
    "DTYPE_NAMES",
    "EVERY_METHOD",
    "EXACTNESS_DEFAULTS",
    "METHOD_KNOBS",
    "METHOD_NAMES",
    "OBJECTIVES",
    "POINT_SETTINGS",
    "PROTOCOLS",
    "SEARCH_SETTINGS",
    "SETTINGS",
    "STEPS",
    "ConfigError",
    "IgnoredKnob",
    "Setting",
    "SettingChanged",
    "check",
    "default_of",
    "device_defaults",
    "ignored_knobs",
    "knobs_read_by",
]
