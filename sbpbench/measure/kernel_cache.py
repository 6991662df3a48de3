"""StreamBP's measured attention-kernel choices, kept on disk between processes.

core/kernels/kernel_choice.py times the candidate kernels for a chunk's attention on the first call of a
shape class and asks a cache for earlier answers; core keeps them in memory. The runner measures
each point in a fresh process, so it installs this cache: one JSON object, key -> kernel name,
under `$SBP_CACHE_DIR` or `$XDG_CACHE_HOME/sbpbench` (default ~/.cache/sbpbench). A key names the
device, the torch and cuDNN versions, the candidates installed and the shape class, so a cache
copied to another machine answers nothing wrong. A file that is not such an object is ignored with
a warning and rewritten on the next choice; a write merges what other processes wrote since and
replaces the file atomically.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

FILE_NAME = "attention-kernels.json"


def default_cache_path() -> Path:
    root = os.environ.get("SBP_CACHE_DIR")
    if root:
        return Path(root) / FILE_NAME
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "sbpbench" / FILE_NAME


class JsonChoiceCache:
    """get/put as core's ChoiceCache; the file is read once, on first use, and written per new choice."""

    def __init__(self, path: Path | None = None):
        self.path = path if path is not None else default_cache_path()
        self._choices: dict[str, str] | None = None

    def _load(self) -> dict[str, str]:
        if self._choices is None:
            self._choices = {}
            try:
                data = json.loads(self.path.read_text())
            except FileNotFoundError:
                return self._choices
            except (OSError, ValueError) as error:
                warnings.warn(f"ignoring the attention-kernel cache {self.path}: {error}", stacklevel=3)
                return self._choices
            if isinstance(data, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
                self._choices = data
            else:
                warnings.warn(
                    f"ignoring the attention-kernel cache {self.path}: not an object of kernel names", stacklevel=3
                )
        return self._choices

    def get(self, key: str) -> str | None:
        return self._load().get(key)

    def put(self, key: str, name: str) -> None:
        self._choices = None  # read again: another process may have added choices since
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # said once already, when first read
            choices = self._load()
        choices[key] = name
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(choices, indent=1, sort_keys=True) + "\n")
            partial.replace(self.path)
        except OSError as error:  # the choice still holds for this process
            warnings.warn(f"could not write the attention-kernel cache {self.path}: {error}", stacklevel=2)
