"""Models outside the registry: a local checkpoint directory, or any Hub id (ORG/NAME) whose
config.json is in the Hugging Face cache (huggingface_hub's layout: models--ORG--NAME/refs/main
names the snapshot, snapshots/<sha>/config.json), fetched from the Hub only when missing and
HF_HUB_OFFLINE is not set. Only config.json is read unless real weights are asked for, and then
only from the cache or the directory: memory and time need the shape, not the values.

Never code from a repository: a config.json that maps to it (auto_map, trust_remote_code) is refused.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from ..core import UnsupportedModelError
from ..settings.model_names import hub_unavailable, is_hub_id, not_cached

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # a sharded checkpoint's shard list


def is_local_checkpoint(name: str) -> bool:
    return Path(name).expanduser().is_dir() and (Path(name).expanduser() / "config.json").is_file()


def checkpoint_config(name: str, *, download: bool = True, known: tuple[str, ...] = ()) -> dict:
    """The config.json values of a local checkpoint directory or a Hub id (download: fetch a Hub
    config.json the cache lacks, unless HF_HUB_OFFLINE is set). FileNotFoundError / ValueError say
    what to pass instead (the closest of the `known` names, for a typo); UnsupportedModelError if
    the model needs its repository's code."""
    path = Path(name).expanduser()
    if path.is_dir():
        file = path / "config.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"model {name}: the directory holds no config.json; pass a checkpoint directory (save_pretrained "
                "writes one), a registry name (`sbp models`) or a Hub id ORG/NAME"
            )
    elif is_hub_id(name):
        file = _hub_config_file(name, download=download, known=known)
    else:
        raise FileNotFoundError(
            f"model {name}: no such directory; pass an existing checkpoint directory (with config.json), a registry "
            "name (`sbp models`) or a Hub id ORG/NAME"
        )
    values = read_config_json(file)
    refuse_remote_code(name, values)
    return values


def read_config_json(file: Path) -> dict:
    """A config.json's values; ValueError naming the file where it is not a JSON object."""
    try:
        values = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        where = (
            f" (line {error.lineno}, column {error.colno}: {error.msg})"
            if isinstance(error, json.JSONDecodeError)
            else ""
        )
        raise ValueError(
            f"{file} is not valid JSON{where}; fix it, or write it again (save_pretrained, `hf download`)"
        ) from None
    if not isinstance(values, dict):
        raise ValueError(
            f"{file} holds a JSON {type(values).__name__}, not the object of a config.json; write it again"
        )
    return values


def _hub_config_file(repo_id: str, *, download: bool, known: tuple[str, ...]) -> Path:
    """config.json of a Hub id: the cache first, then the Hub (when allowed)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return Path(cached)
    reason = hub_unavailable() if download else ""  # said at once: huggingface_hub would retry for 30 s
    if download and not reason:
        try:
            return Path(hf_hub_download(repo_id, "config.json"))
        except OSError as error:  # every huggingface_hub error: not found, gated, no network
            reason = _download_failure(error)
    close = difflib.get_close_matches(repo_id, known, n=1)
    raise ValueError(not_cached(repo_id, reason, guess=close[0] if close else None))


def _download_failure(error: OSError) -> str:
    """Why the Hub did not give a config.json, in a few words (its own messages run to paragraphs)."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    reasons = (  # subclasses first: a gated repository is also "not found", an unreachable Hub a missing entry
        (GatedRepoError, "the repository is gated: accept its license on the Hub, then `hf auth login`"),
        (RepositoryNotFoundError, "no such repository on the Hub (a private one needs `hf auth login`)"),
        (LocalEntryNotFoundError, "the Hub could not be reached"),
        (EntryNotFoundError, "the repository has no config.json"),
    )
    return next((why for kind, why in reasons if isinstance(error, kind)), type(error).__name__)


def refuse_remote_code(name: str, values: dict) -> None:
    if values.get("auto_map") or values.get("trust_remote_code"):
        raise UnsupportedModelError(
            f"{name} needs code from its repository (auto_map in its config.json) and sbpbench never runs remote "
            "code; pass a model whose model_type transformers implements itself (`sbp models` lists some)"
        )


def checkpoint_weights(name: str) -> Path:
    """Where real weights of `name` are (for from_pretrained): the local checkpoint directory, or
    the cached snapshot of a Hub id. Never downloads them; FileNotFoundError says how to get them."""
    if is_local_checkpoint(name):
        folder, where = Path(name).expanduser(), f"the directory {name}"
    else:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
        folder, where = (Path(cached).parent if isinstance(cached, str) else None), "the Hugging Face cache"
    missing = _missing_weights(folder)
    if missing:
        raise FileNotFoundError(
            f"--weights: {missing} of {name} are not in {where}; download them (`hf download {name}`) or pass a local "
            "checkpoint directory, or drop --weights for random weights (memory and time are the same)"
        )
    return folder


def _missing_weights(folder: Path | None) -> str:
    """'' if `folder` holds a whole checkpoint's weights, else what is missing."""
    if folder is None or not any(next(folder.glob(p), None) for p in WEIGHT_PATTERNS):
        return "the weights (*.safetensors, *.bin)"
    for index in (folder / name for name in _INDEXES):
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            absent = [s for s in shards if not (folder / s).is_file()]
            if absent:
                return f"{len(absent)} of {len(shards)} weight shards ({absent[0]}, ...)"
    return ""
