"""The model registry: exact shapes, no download, clear errors, local checkpoints."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest
import torch

from sbpbench.models import MODELS, REAL_MODELS, TINY_MODELS, build_model, count_parameters, load_config

GIB = 2**30


SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def _shipped_configs() -> dict[str, dict]:
    """Hub id -> the config.json shipped in sbpbench/models/configs/, read straight from the file."""
    folder = resources.files("sbpbench.models").joinpath("configs")
    files = (f for f in folder.iterdir() if f.name.endswith(".json"))
    return {f.name.removesuffix(".json").replace("__", "/"): json.loads(f.read_text()) for f in files}


def _causal_lm_part(values: dict) -> dict:
    """A config.json's values for its causal LM: the text_config of a multimodal one, else its own."""
    return values.get("text_config", values)


def test_the_real_names_are_the_shipped_config_files():
    """REAL_MODELS lists exactly the shipped config files, and every other shape starts from one of them."""
    shipped = _shipped_configs()
    assert sorted(REAL_MODELS) == sorted(shipped)
    assert {spec.base for spec in MODELS.values()} <= set(shipped)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_registered_shape_loads(name):
    """Each name loads with its shipped config.json's model_type and sizes, changed only by the registry's overrides."""
    spec = MODELS[name]
    expected = _causal_lm_part(_shipped_configs()[spec.base]) | spec.overrides
    config = load_config(name)
    assert config.model_type == expected["model_type"]
    for key in (*SIZES, "vocab_size"):
        assert getattr(config, key) == expected[key], key
    if "kv_lora_rank" not in expected:  # MLA (DeepSeek-V3) has no single head dim: its q/k and v dims differ
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        assert head_dim == expected.get("head_dim", expected["hidden_size"] // expected["num_attention_heads"])


@pytest.mark.parametrize(
    "name,gib",
    [("Qwen/Qwen3-8B", 30.5), ("Qwen/Qwen3-14B", 55.0)],
)
def test_bf16_weights_plus_grads_match_the_paper(name, gib):
    """Figure 3 of the paper states weights + grads in bf16: 30.5 GB (8B) and 55.0 GB (14B)."""
    assert count_parameters(name) * 2 * 2 / GIB == pytest.approx(gib, abs=0.05)


@pytest.mark.parametrize(
    "name,billions",
    [
        ("Qwen/Qwen3-0.6B", 0.596),
        ("Qwen/Qwen3-4B", 4.022),
        ("Qwen/Qwen3-32B", 32.76),
        ("meta-llama/Llama-3.1-8B", 8.030),
        ("meta-llama/Llama-3.2-1B", 1.236),
        ("mistralai/Mistral-7B-v0.3", 7.248),
        ("Qwen/Qwen2.5-7B", 7.616),
        ("google/gemma-3-1b-pt", 0.9999),
    ],
)
def test_parameter_counts_match_the_published_sizes(name, billions):
    """Parameter counts equal the model cards' (to 0.1%)."""
    assert count_parameters(name) / 1e9 == pytest.approx(billions, rel=1e-3)


# Totals in billions as each model card gives them, to its digits (configs/SOURCES.md says where).
# A multimodal config.json's total counts its vision tower and projector too.
PUBLISHED_BILLIONS = {
    "Qwen/Qwen3-30B-A3B": "30.5",
    "Qwen/Qwen3-235B-A22B": "235",
    "meta-llama/Llama-3.3-70B-Instruct": "70.6",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": "109",
    "mistralai/Mixtral-8x7B-v0.1": "46.7",
    "openai/gpt-oss-20b": "20.9",
    "openai/gpt-oss-120b": "116.8",
    "deepseek-ai/DeepSeek-V3": "671",
    "allenai/Olmo-3.1-32B-Instruct": "32",
    "HuggingFaceTB/SmolLM3-3B": "3",
    "microsoft/Phi-4-mini-instruct": "3.8",
}


def _whole_multimodal_model(name: str) -> torch.nn.Module:
    """The model a shipped multimodal config.json describes, vision tower included, on the meta device."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(AutoConfig.for_model(**_shipped_configs()[name]))


@pytest.mark.parametrize("name,billions", list(PUBLISHED_BILLIONS.items()))
def test_parameter_counts_match_the_model_cards_to_their_digits(name, billions):
    """The shipped config.json builds to its model card's total, within half a unit of the last digit given."""
    if "text_config" in _shipped_configs()[name]:
        total = sum(p.numel() for p in _whole_multimodal_model(name).parameters())
    else:
        total = count_parameters(name)
    digits = len(billions.partition(".")[2])
    assert abs(total / 1e9 - float(billions)) <= 0.5 * 10**-digits


def test_a_multimodal_config_builds_only_its_language_model():
    """Llama 4's registry shape is the whole file's model less its vision tower and projector."""
    name = "meta-llama/Llama-4-Scout-17B-16E-Instruct"
    whole = _whole_multimodal_model(name)
    language = sum(p.numel() for n, p in whole.named_parameters() if n.startswith("language_model."))
    assert load_config(name).model_type == "llama4_text"
    assert count_parameters(name) == language < sum(p.numel() for p in whole.parameters())


def test_an_unknown_name_says_where_it_was_looked_for_and_what_to_do():
    """A name neither the registry nor the HF cache has (offline: no download tried) is a ValueError
    that names both and says how to get its config."""
    with pytest.raises(
        ValueError, match=r"not in the registry .*Hugging Face cache.*hf download Qwen/Qwen9-1T config\.json"
    ):
        load_config("Qwen/Qwen9-1T")


@pytest.mark.parametrize(
    ("text", "words"), [('{"model_type": "qwen3", ', "is not valid JSON (line 1"), ("[1, 2]", "holds a JSON list")]
)
def test_a_broken_config_json_names_its_file(tmp_path, text, words):
    """A checkpoint directory whose config.json is not a JSON object: one line naming the file."""
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'} {re.escape(words)}") as error:
        load_config(str(tmp_path))
    assert "\n" not in str(error.value)


# query heads per KV head where a tiny shape cannot or does not keep its real model's ratio:
# Qwen2.5-7B's 7:1 needs a multiple of 7 heads; tiny/mistral is plain multi-head (the real one groups 4:1).
TINY_GQA_RATIO = {
    "tiny/qwen2": 2,
    "tiny/mistral": 1,
    "tiny/qwen3-moe": 2,
    "tiny/gpt-oss": 2,
    "tiny/mixtral": 2,
    "tiny/llama4": 2,
}


def _structure(model) -> tuple[set[str], set[str], bool]:
    """Parameter names (layer index as *), module classes, and whether the head is tied to the embedding."""
    names = {re.sub(r"\.layers\.\d+\.", ".layers.*.", n) for n, _ in model.named_parameters()}
    classes = {type(m).__name__ for m in model.modules()}
    return names, classes, model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_shapes_keep_their_family_features(name):
    """A tiny shape is its real model with only the overridden sizes changed: model_type, every other config
    value (RoPE, norms, tying, windows), module structure (biases, q/k norms), attention-layer kinds and GQA."""
    spec = TINY_MODELS[name]
    tiny, real = load_config(name), load_config(spec.base)
    assert tiny.model_type == real.model_type
    tiny_values, real_values = tiny.to_dict(), real.to_dict()
    changed = {k for k in tiny_values.keys() | real_values.keys() if tiny_values.get(k) != real_values.get(k)}
    assert changed <= set(spec.overrides) | {"layer_types"}, changed - set(spec.overrides)  # layer_types: per depth
    assert set(getattr(tiny, "layer_types", None) or ()) == set(getattr(real, "layer_types", None) or ())
    assert tiny.num_attention_heads % tiny.num_key_value_heads == 0
    real_ratio = real.num_attention_heads // real.num_key_value_heads
    assert tiny.num_attention_heads // tiny.num_key_value_heads == TINY_GQA_RATIO.get(name, real_ratio)
    tiny_model = build_model(name, device="meta")
    real_model = build_model(spec.base, device="meta", dtype=torch.bfloat16)
    assert _structure(tiny_model) == _structure(real_model)


def test_gemma3_tiny_shape_has_both_attention_kinds_within_test_lengths():
    """tiny/gemma3 alternates a sliding layer (window 8, shorter than the tests' sequences) and a full one."""
    gemma = load_config("tiny/gemma3")
    assert gemma.layer_types == ["sliding_attention", "full_attention"] and gemma.sliding_window == 8
    assert gemma.query_pre_attn_scalar == gemma.head_dim  # as in gemma-3-1b (256 = head_dim)


def test_seeded_random_weights():
    """Same seed, same weights."""
    a, b = build_model("tiny/llama", seed=1), build_model("tiny/llama", seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_local_checkpoint_directory_loads_real_weights_when_asked(tmp_path):
    """A directory written by save_pretrained gives random weights (seeded, as the registry's), and
    its own weights with weights=True, in the asked dtype."""
    saved = build_model("tiny/mistral", seed=7)
    saved.save_pretrained(tmp_path)
    loaded = build_model(str(tmp_path), dtype=torch.float64, weights=True)
    assert loaded.dtype == torch.float64
    for (name, p), q in zip(saved.named_parameters(), loaded.parameters()):
        torch.testing.assert_close(q.float(), p, msg=name)
    random = build_model(str(tmp_path), seed=8)
    assert not torch.equal(random.model.embed_tokens.weight, saved.model.embed_tokens.weight)
    assert torch.equal(random.model.embed_tokens.weight, build_model(str(tmp_path), seed=8).model.embed_tokens.weight)
