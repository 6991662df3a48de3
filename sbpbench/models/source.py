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

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # a sharded checkpoint's shard list


def is_local_checkpoint(name: str) -> bool:
    return Path(name).expanduser().is_dir() and (Path(name).expanduser() / "config.json").is_file()


def is_hub_id(name: str) -> bool:
    """ORG/NAME or NAME as the Hub spells repository ids (not a path such as ./x, /x or a/b/c)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


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
    values = json.loads(file.read_text())
    refuse_remote_code(name, values)
    return values


def _hub_config_file(repo_id: str, *, download: bool, known: tuple[str, ...]) -> Path:
    """config.json of a Hub id: the cache first, then the Hub (when allowed)."""
    from huggingface_hub import constants, hf_hub_download, is_offline_mode, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return Path(cached)
    reason = "HF_HUB_OFFLINE is set" if is_offline_mode() else ""
    if download and not reason and not hub_reachable():
        reason = "the Hub could not be reached"  # said at once: huggingface_hub would retry for 30 s
    if download and not reason:
        try:
            return Path(hf_hub_download(repo_id, "config.json"))
        except OSError as error:  # every huggingface_hub error: not found, gated, no network
            reason = _download_failure(error)
    where = f"{constants.HF_HUB_CACHE}" + (f"; {reason}" if reason else "")
    close = difflib.get_close_matches(repo_id, known, n=1)
    raise ValueError(
        f"unknown model {repo_id!r}: not in the registry (`sbp models`{f'; did you mean {close[0]}?' if close else ''}) "
        f"and its config.json is not in the Hugging Face cache ({where}); download it with `hf download {repo_id} "
        "config.json`, or pass a local checkpoint directory"
    )


# A TCP connection to the Hub answers in well under a second where there is a network; where there
# is none, name resolution fails at once. Either way a lookup never waits out the Hub client's retries.
REACHABLE_TIMEOUT_S = 3.0


def hub_reachable(timeout_s: float = REACHABLE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hub's endpoint opens within timeout_s."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def near_miss(name: str, known: tuple[str, ...], prefixes: tuple[str, ...]) -> str | None:
    """For a name in one of the registry's own namespaces (`prefixes`, e.g. "tiny/", which no Hub id
    of ours uses) that is not a registry name: the closest registry name, or "" when none is close.
    None for any other name (a Hub id or a path, looked up as such)."""
    if not name.startswith(prefixes):
        return None
    close = difflib.get_close_matches(name, known, n=1)
    return close[0] if close else ""


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
