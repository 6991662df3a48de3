"""Which models StreamBP streams: by checks, never by a list of names (core/architecture/).

Every detector refuses the feature it names, in one line; the self-check of an architecture's
small float64 copy finds architectures exact or refuses them, never admits one that is wrong
(it catches the head a plain lm_head would get wrong); architectures of transformers beyond the
five deep-tested families are exact in fp64, in training mode, with padded rows.

`python -m tests.exactness.test_admission` rewrites the verified table (core/architecture/verified.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from sbpbench.core import StreamConfig, UnsupportedModelError, check_model, stream_backward
from sbpbench.core.architecture import head_call, self_check
from sbpbench.core.architecture.detectors import refusals
from sbpbench.core.architecture.parts import resolve_parts
from sbpbench.core.architecture.small_copy import small_config
from sbpbench.core.architecture.verified import VERIFIED
from sbpbench.core.stream import _self_check_step

from ..conftest import REPOSITORY, padded_batch, tiny_model


def _class_and_config(model_type: str, **overrides):
    config = AutoConfig.for_model(model_type, **overrides)
    return AutoModelForCausalLM._model_mapping[type(config)], config


def _small(model_type: str, **overrides) -> nn.Module:
    """The small copy of a model type's default config, random weights, float64."""
    model_class, config = _class_and_config(model_type, **overrides)
    return self_check._small_copy(model_class, config, training=True)


def _check(model_type: str, **overrides) -> self_check.SelfCheck:
    model_class, config = _class_and_config(model_type, **overrides)
    return self_check.self_check(model_class, config, _self_check_step)


# -- detectors: each builds the feature it refuses and reads its line ----------------------------------------------


def _refusal(model: nn.Module) -> str:
    reasons = refusals(resolve_parts(model))
    assert reasons, "no detector refused it"
    assert "\n" not in reasons[0]
    return reasons[0]


def test_a_mixer_that_carries_no_state_through_the_cache_is_refused_by_the_self_check():
    """MiniMax's lightning attention mixes positions outside the attention function and hands no
    state to transformers' cache: no detector sees it, the self-check finds it wrong and refuses it."""
    check = _check("minimax")
    assert not check.exact and check.error > 1e-3, check.describe()


def test_a_convolution_in_a_layer_is_refused():
    """A convolution inside a decoder layer whose mixer hands no state to the cache is refused."""
    model = tiny_model("tiny/llama")
    model.model.layers[0].mlp.conv = nn.Conv1d(4, 4, 3)
    assert "layers.0.mlp.conv is a Conv1d" in _refusal(model)
    assert "hands no state to transformers' cache" in _refusal(model)


def test_key_values_shared_across_layers_are_refused():
    """Gemma-3n's num_kv_shared_layers: a layer's backward would need another layer's keys."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(small_config(AutoConfig.for_model("gemma3n_text")))
    for name, parameter in model.model.named_parameters():  # its per-layer input embeddings: refused otherwise
        parameter.requires_grad_(name.startswith(("layers.", "embed_tokens.", "norm.")))
    assert "shared across layers" in _refusal(model)


def test_bidirectional_attention_is_refused():
    """A bidirectional config, or an attention module that is not causal, is refused."""
    assert "use_bidirectional_attention" in _refusal(tiny_model("tiny/qwen3", use_bidirectional_attention=True))
    model = tiny_model("tiny/qwen3")
    model.model.layers[1].self_attn.is_causal = False
    assert "layers.1.self_attn is not causal" in _refusal(model)


@pytest.mark.parametrize("key", ["attention_dropout", "hidden_dropout", "resid_pdrop"])
def test_dropout_in_training_is_refused_and_eval_is_not(key):
    """Any dropout the config sets is refused in training mode (each re-forward would draw anew)."""
    model = tiny_model("tiny/qwen3")
    setattr(model.config, key, 0.1)
    model.train()
    assert f"{key}=0.1 in training mode" in _refusal(model)
    model.eval()
    assert not refusals(resolve_parts(model))


def test_capacity_limited_and_noisy_routing_are_refused():
    """Experts with a capacity drop tokens by the batch; router jitter in training draws anew."""
    model = tiny_model("tiny/qwen3")
    model.config.capacity_factor = 1.25
    assert "capacity_factor=1.25" in _refusal(model)
    mixtral = _small("mixtral", router_jitter_noise=0.1)
    assert "router_jitter_noise=0.1 in training mode" in _refusal(mixtral)


def test_more_than_one_attention_call_per_layer_is_refused():
    """Differential attention calls its attention function twice per layer: refused at the step."""
    model = _small("diffllama")
    batch = padded_batch(model, batch_size=1, seq_len=9)
    with pytest.raises(UnsupportedModelError, match="called its attention function 2 times on one chunk"):
        stream_backward(model, batch.input_ids, batch.labels)


def test_an_attention_argument_streambp_does_not_know_is_refused():
    """An attention module handing its function an unknown argument (a position bias) is refused."""
    model = tiny_model("tiny/llama")
    attention = model.model.layers[0].self_attn
    forward = attention.forward
    attention.forward = lambda *args, **kwargs: forward(*args, position_bias=torch.zeros(1), **kwargs)
    batch = padded_batch(model, batch_size=1, seq_len=9)
    with pytest.raises(UnsupportedModelError, match="position_bias, which StreamBP does not know"):
        stream_backward(model, batch.input_ids, batch.labels)


def test_a_norm_run_before_the_layers_too_is_refused():
    """NanoChat runs its final norm before the layers as well: refused, never streamed wrong."""
    check = _check("nanochat")
    assert not check.exact and "final norm runs 2 times" in check.where


# -- the self-check ------------------------------------------------------------------------------------------------


def test_the_self_check_refuses_a_head_it_would_get_wrong(monkeypatch):
    """With the logits taken from a plain lm_head instead of the model's own head, Cohere's logit
    scale is lost: the self-check finds the difference and refuses, as a longer list of names
    would not have."""
    monkeypatch.setattr(
        head_call.ModelHead, "logits", lambda self, hidden: self.parts.lm_head(self.call(self.parts.norm)(hidden))
    )
    for model_type in ("cohere", "cohere2"):
        check = _check(model_type)
        assert not check.exact and check.error > 1, check.describe()
        assert "differs from standard BP" in check.refusal()


def test_check_model_refuses_before_any_work_and_caches_its_verdict(monkeypatch):
    """check_model runs the detectors, then the self-check once per architecture in the process."""
    runs = []
    real = self_check.self_check
    monkeypatch.setattr(
        "sbpbench.core.architecture.admission.self_check", lambda *a, **k: runs.append(1) or real(*a, **k)
    )
    monkeypatch.setattr("sbpbench.core.architecture.admission._CHECKED", {})
    model_class, config = _class_and_config("starcoder2")
    first = check_model(model_class=model_class, config=config)
    second = check_model(model_class=model_class, config=config)
    assert first is second and first.exact and len(runs) == 1
    model = tiny_model("tiny/qwen3")
    model.config.capacity_factor = 1.0
    with pytest.raises(UnsupportedModelError, match="capacity_factor"):
        check_model(model)


def test_a_refused_architecture_stops_the_step(monkeypatch):
    """stream_backward refuses a model whose self-check failed, before any gradient is written."""
    model = _small("cohere")
    monkeypatch.setattr("sbpbench.core.architecture.admission.VERIFIED", {})
    monkeypatch.setattr("sbpbench.core.architecture.admission._CHECKED", {})
    monkeypatch.setattr(
        head_call.ModelHead, "logits", lambda self, hidden: self.parts.lm_head(self.call(self.parts.norm)(hidden))
    )
    batch = padded_batch(model, batch_size=1, seq_len=9)
    with pytest.raises(UnsupportedModelError, match="self-check of CohereForCausalLM differs"):
        stream_backward(model, batch.input_ids, batch.labels, config=StreamConfig(chunk_size=4))
    assert all(p.grad is None for p in model.parameters())


# Architectures of transformers 5.24 beyond the five deep-tested families, exact in fp64 by the
# self-check. The fast tier runs one of each feature (Mamba-2 aside, see below); the slow tier all of them.
FEATURES = {
    "gemma2": "attention soft-capping",
    "gpt_oss": "learnable sinks, sliding windows, MoE",
    "llama4_text": "chunked attention, NoPE layers, MoE",
    "deepseek_v3": "MLA (key and value head dims differ), dense first layers, MoE",
    "cohere": "logit scale in the head, parallel attention and MLP",
    "granite": "logits scaling, residual and embedding multipliers",
    "smollm3": "NoPE layers",
    "phi3": "fused qkv and gate-up projections",
    "qwen3_5_text": "GatedDeltaNet layers: conv tail and recurrent state carried",
    "nemotron_h": "Mamba-2, attention and MLP blocks",
}
MORE = (
    "olmo2", "olmo3", "starcoder2", "glm4", "ernie4_5", "exaone4", "arcee", "apertus", "helium", "cohere2",
    "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "jetmoe", "ernie4_5_moe", "glm4_moe", "minimax_m2",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "bitnet", "flex_olmo", "afmoe", "vaultgemma", "ministral3", "gemma",
    "granitemoeshared", "solar_open", "youtu", "mellum", "minicpm3", "cwm", "jais2", "hyperclovax",
    "qwen3_next", "qwen3_5_moe_text", "granitemoehybrid",
)  # fmt: skip


# Mamba-2's pure-torch scan takes over 10 s on 2 cores: Nemotron-H runs in the slow tier.
SLOW_FEATURES = {"nemotron_h"}


@pytest.mark.parametrize(
    "model_type",
    [
        *(pytest.param(t, marks=pytest.mark.slow) if t in SLOW_FEATURES else t for t in FEATURES),
        *(pytest.param(t, marks=pytest.mark.slow) for t in MORE),
    ],
)
def test_an_architecture_streams_exactly(model_type):
    """The small copy's loss and every gradient equal standard BP's to 1e-10 in fp64, at two chunk sizes."""
    check = _check(model_type)
    assert check.exact, check.describe()


@pytest.mark.slow
def test_the_verified_table_is_what_the_self_check_finds():
    """Every registry model whose self-check is exact is in the verified table, with nothing else;
    docs/exactness.md's table of architectures is what the self-check finds now. The errors they
    record are rounding noise, which moves between torch releases (1.4e-16 on one, 0.0 on another):
    only the architectures are compared, each exact (verified_table keeps exact ones)."""
    found = verified_table()
    assert _classes(found) == _classes(VERIFIED), "rewrite it: python -m tests.exactness.test_admission"
    docs = (REPOSITORY / "docs" / "exactness.md").read_text()
    assert _without_errors(_docs_rows()) in _without_errors(docs), "rewrite it the same way"


def _classes(table: dict[str, tuple[str, float]]) -> dict[str, str]:
    return {key: name for key, (name, _) in table.items()}


def _without_errors(markdown: str) -> str:
    """The text with each table row's last cell (the worst error) dropped."""
    return "\n".join(line.rsplit("|", 2)[0] if line.startswith("| `") else line for line in markdown.splitlines())


def _docs_rows() -> str:
    """docs/exactness.md's table: each architecture of FEATURES and MORE with its self-check's error."""
    lines = ["| model_type | class | what it adds | worst error |", "|---|---|---|---:|"]
    for model_type in (*FEATURES, *MORE):
        check = _check(model_type)
        lines.append(f"| `{model_type}` | {check.architecture} | {FEATURES.get(model_type, '-')} | {check.error:.0e} |")
    return "\n".join(lines)


def verified_table() -> dict[str, tuple[str, float]]:
    """Architecture key -> (class, worst error) of every registry model the self-check finds exact."""
    from sbpbench.models import MODELS, load_config

    table = {}
    for name in MODELS:
        config = load_config(name)
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
        check = self_check.self_check(model_class, config, _self_check_step)
        if check.exact:
            table[check.key] = (check.architecture, float(f"{check.error:.1e}"))
    return dict(sorted(table.items()))


def _write_verified_table() -> None:
    path = REPOSITORY / "sbpbench" / "core" / "architecture" / "verified.py"
    text = path.read_text()
    head = text[: text.index("VERIFIED: dict")]
    rows = "".join(f'    "{key}": ("{name}", {error!r}),\n' for key, (name, error) in verified_table().items())
    path.write_text(f"{head}VERIFIED: dict[str, tuple[str, float]] = {{\n{rows}}}\n")
    docs = REPOSITORY / "docs" / "exactness.md"
    text = docs.read_text()
    begin, end = "<!-- verified: begin -->\n", "<!-- verified: end -->"
    docs.write_text(text[: text.index(begin) + len(begin)] + _docs_rows() + "\n" + text[text.index(end) :])
    print(f"wrote {path.relative_to(REPOSITORY)} and {docs.relative_to(REPOSITORY)}")


if __name__ == "__main__":
    _write_verified_table()
