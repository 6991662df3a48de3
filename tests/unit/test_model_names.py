"""A typed model name is checked without torch or the network: a typo of a registry name is
answered at once with the name meant, and a Hub id that is really in the HF cache still passes."""

from __future__ import annotations

import json

import huggingface_hub
import pytest

from sbpbench.models import MODELS
from sbpbench.settings.model_names import MODEL_NAMES, check_model_name, closest_model

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty HF cache for this process (huggingface_hub reads the constant), offline."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_config(cache, repo_id: str) -> None:
    """repo_id's config.json in the cache as huggingface_hub lays it out."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    (repo / "snapshots" / SHA).mkdir(parents=True)
    (repo / "snapshots" / SHA / "config.json").write_text(json.dumps({"model_type": "qwen3"}))


def test_the_torch_free_names_are_the_registry_s():
    """MODEL_NAMES, which the CLI checks against without importing torch, is the registry's list, in order."""
    assert MODEL_NAMES == tuple(MODELS)


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("tiny/qwen9", "tiny/qwen3"),
        ("small/qwen", "small/qwen3"),
        ("Qwen/Qwen3-8b", "Qwen/Qwen3-8B"),
        ("Qwen/Qwen3-8", "Qwen/Qwen3-8B"),
        ("Qwen3-8B", "Qwen/Qwen3-8B"),
        ("llama", "tiny/llama"),
    ],
)
def test_a_near_miss_is_refused_with_the_name_meant(typed, meant, hub_cache):
    """A typo of a registry name (not a directory, not in the cache) fails with "did you mean"."""
    with pytest.raises(ValueError, match=f"unknown model '{typed}': did you mean {meant}\\?"):
        check_model_name(typed)


def test_a_cached_hub_id_and_a_registry_name_pass(hub_cache, tmp_path):
    """A Hub id in the HF cache passes even when it is close to a registry name, as do the
    registry's names and a directory; real Hub ids unlike any registry name are not typos."""
    cache_config(hub_cache, "Qwen/Qwen3-8b")
    for name in ("Qwen/Qwen3-8b", "tiny/qwen3", "Qwen/Qwen3-8B", str(tmp_path)):
        check_model_name(name)
    assert closest_model("Qwen/Qwen3-4B-Base") is None and closest_model("Qwen/Qwen2.5-7B-Instruct") is None


def test_an_uncached_hub_id_offline_is_answered_here(hub_cache):
    """A Hub id unlike any registry name, absent from the cache while HF_HUB_OFFLINE is set: the
    lookup's one line (what to download), from the check itself."""
    with pytest.raises(ValueError, match="unknown model 'acme/absent': not in the registry .*HF_HUB_OFFLINE is set"):
        check_model_name("acme/absent")
