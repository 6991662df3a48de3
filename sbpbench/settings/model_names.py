"""The registry's model names as plain strings, and the check of a typed model name that needs no
torch and no network: the CLI runs it while it parses its options, before anything heavy loads.

A name under one of the registry's own namespaces (tiny/, small/) is never a Hub id, so a typo
there is answered from the registry. Any other name that is close to a registry name ("qwen3",
"Qwen/Qwen3-8b") and is neither a local directory nor in the Hugging Face cache is taken for a
typo too. A Hub id in the cache, or one not close to any registry name, is left to the lookup
in models/source.py, unless the Hub cannot be reached: then the answer is given here, at once.
"""

from __future__ import annotations

import difflib
from functools import cache
from pathlib import Path

# sbpbench/models/registry.py MODELS, in its order (tests/unit/test_model_names.py checks they agree)
MODEL_NAMES = (
    "Qwen/Qwen3-0.6B",
    "Qwen/Qwen3-1.7B",
    "Qwen/Qwen3-4B",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen3-14B",
    "Qwen/Qwen3-32B",
    "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen3-235B-A22B",
    "Qwen/Qwen2.5-7B",
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B",
    "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.3-70B-Instruct",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "google/gemma-3-1b-pt",
    "mistralai/Mistral-7B-v0.3",
    "mistralai/Mixtral-8x7B-v0.1",
    "openai/gpt-oss-20b",
    "openai/gpt-oss-120b",
    "deepseek-ai/DeepSeek-V3",
    "allenai/Olmo-3.1-32B-Instruct",
    "HuggingFaceTB/SmolLM3-3B",
    "microsoft/Phi-4-mini-instruct",
    "small/qwen3",
    "tiny/qwen3",
    "tiny/qwen2",
    "tiny/llama",
    "tiny/mistral",
    "tiny/gemma3",
    "tiny/qwen3-moe",
    "tiny/gpt-oss",
    "tiny/mixtral",
    "tiny/deepseek-v3",
    "tiny/llama4",
)
# The namespaces of the registry's own shapes: no Hub id is looked up under them.
LOCAL_NAMESPACES = ("small/", "tiny/")
# How alike (difflib's ratio, case folded) a name must be to a registry name to be called its typo.
# 0.85 takes "Qwen/Qwen3-8" and "Qwen/Qwen3-8b" for Qwen/Qwen3-8B, but leaves real Hub ids such as
# "Qwen/Qwen3-4B-Base" (0.84) and "Qwen/Qwen2.5-7B-Instruct" (0.77) to the Hub lookup.
NEAR_MISS_RATIO = 0.85


def closest_model(name: str, known: tuple[str, ...] = MODEL_NAMES, cutoff: float = NEAR_MISS_RATIO) -> str | None:
    """The registry name `name` is most likely a typo of, case folded, or None. A bare name (no
    ORG/) is also compared with the registry names' last parts: "qwen3" is tiny/qwen3's."""
    candidates = {known_name.lower(): known_name for known_name in known}
    if "/" not in name:
        for known_name in known:
            candidates.setdefault(known_name.split("/")[-1].lower(), known_name)
    close = difflib.get_close_matches(name.lower(), list(candidates), n=1, cutoff=cutoff)
    return candidates[close[0]] if close else None


def registry_typo(name: str, known: tuple[str, ...] = MODEL_NAMES) -> str | None:
    """For a name under the registry's own namespaces that is not a registry name: the message
    that says so (with the closest name, where one is close). None for any other name."""
    if name in known or not name.startswith(LOCAL_NAMESPACES):
        return None
    guess = closest_model(name, known, cutoff=0.6)
    hint = f"did you mean {guess}? " if guess else ""
    return f"unknown model {name!r}: {hint}`sbp models` lists the registry's {name.split('/')[0]}/ shapes"


def in_hf_cache(name: str) -> bool:
    """Whether the Hugging Face cache holds a config.json for the Hub id `name` (no network)."""
    from huggingface_hub import try_to_load_from_cache

    return is_hub_id(name) and isinstance(try_to_load_from_cache(name, "config.json"), str)


def is_hub_id(name: str) -> bool:
    """ORG/NAME or NAME as the Hub spells repository ids (not a path such as ./x, /x or a/b/c)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


# A TCP connection to the Hub answers in well under a second where there is a network; where there
# is none, name resolution fails at once. Either way a lookup never waits out the Hub client's retries.
REACHABLE_TIMEOUT_S = 3.0


@cache
def hub_reachable(timeout_s: float = REACHABLE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hub's endpoint opens within timeout_s (asked once per process)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def hub_unavailable() -> str:
    """Why no config.json can be fetched from the Hub now ("" when one can be)."""
    from huggingface_hub import is_offline_mode

    if is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    return "" if hub_reachable() else "the Hub could not be reached"


def not_cached(repo_id: str, reason: str, guess: str | None = None) -> str:
    """The one line for a Hub id whose config.json is neither in the cache nor to be had (`reason`)."""
    from huggingface_hub import constants

    where = f"{constants.HF_HUB_CACHE}" + (f"; {reason}" if reason else "")
    hint = f"; did you mean {guess}?" if guess else ""
    return (
        f"unknown model {repo_id!r}: not in the registry (`sbp models`{hint}) and its config.json is not in the Hugging "
        f"Face cache ({where}); download it with `hf download {repo_id} config.json`, or pass a local checkpoint "
        "directory"
    )


def check_model_name(name: str) -> None:
    """ValueError (one line) for a model name that is a typo of a registry name (naming the
    closest), or a Hub id whose config.json is not in the cache while the Hub cannot be reached;
    nothing for a registry name, a directory, a cached Hub id or a name the Hub may answer
    (models/source.py looks those up)."""
    if name in MODEL_NAMES or Path(name).expanduser().is_dir():
        return
    typo = registry_typo(name)
    if typo:
        raise ValueError(typo)
    if in_hf_cache(name):
        return
    guess = closest_model(name)
    if guess is not None:
        # `hf download` only for an ORG/NAME id; a bare word gets the registry and the id form
        download = (
            f"run `hf download {name} config.json` first"
            if "/" in name
            else "give a registry name (`sbp models`) or a Hub id ORG/NAME"
        )
        raise ValueError(
            f"unknown model {name!r}: did you mean {guess}? It is not in the registry (`sbp models`) nor in the "
            f"Hugging Face cache; {download}"
        )
    reason = hub_unavailable() if is_hub_id(name) else ""
    if reason:
        raise ValueError(not_cached(name, reason))
