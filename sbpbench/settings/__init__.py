"""Every setting a user can give, declared once (name, value type, choices, help, flag), and
ConfigError, the error of a bad one. Imports nothing heavy: the CLI builds its options and help
from it without loading torch or transformers."""

from .choices import DTYPE_NAMES, EVERY_METHOD, METHOD_NAMES, OBJECTIVES, PROTOCOLS, STEPS
from .errors import ConfigError
from .table import POINT_SETTINGS, SEARCH_SETTINGS, SETTINGS, Setting

__all__ = [
    "DTYPE_NAMES",
    "EVERY_METHOD",
    "METHOD_NAMES",
    "OBJECTIVES",
    "POINT_SETTINGS",
    "PROTOCOLS",
    "SEARCH_SETTINGS",
    "SETTINGS",
    "STEPS",
    "ConfigError",
    "Setting",
]
