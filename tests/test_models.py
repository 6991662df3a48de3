"""The model registry: exact shapes, no download, clear errors, local checkpoints."""

from __future__ import annotations

import pytest
import torch

from sbpbench.models import MODELS, REAL_MODELS, build_model, config_dict, count_parameters, load_config

GIB = 2**30


def test_every_registered_shape_loads():
    """Every name gives a config of a supported family."""
    for name in MODELS:
        assert load_config(name).model_type in {"qwen3", "qwen2", "llama", "mistral", "gemma3_text"}, name


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


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="known models: .*Qwen/Qwen3-8B"):
        load_config("Qwen/Qwen9-1T")


def test_tiny_shapes_keep_their_family_features():
    """Tiny shapes are derived from the real configs: Gemma keeps its sliding layers, Qwen2 its biases."""
    gemma = load_config("tiny/gemma3")
    assert gemma.layer_types == ["sliding_attention", "full_attention"] and gemma.sliding_window == 8
    assert config_dict("tiny/qwen2")["model_type"] == "qwen2"
    model = build_model("tiny/qwen2")
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert len(REAL_MODELS) == 12


def test_seeded_random_weights():
    """Same seed, same weights."""
    a, b = build_model("tiny/llama", seed=1), build_model("tiny/llama", seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_local_checkpoint_directory_loads_real_weights(tmp_path):
    """A directory written by save_pretrained loads with its weights, in the asked dtype."""
    saved = build_model("tiny/mistral", seed=7)
    saved.save_pretrained(tmp_path)
    loaded = build_model(str(tmp_path), dtype=torch.float64)
    assert loaded.dtype == torch.float64
    for (name, p), q in zip(saved.named_parameters(), loaded.parameters()):
        torch.testing.assert_close(q.float(), p, msg=name)
