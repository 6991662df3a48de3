"""Where StreamBP finds the parts of a HuggingFace causal LM, and which families it accepts.

The decoder layers themselves run unmodified; the family-specific part is only how to reach the
embedding, the layer list, the final norm and the lm_head, and which config features would make
the streamed computation differ from the model's own (those are refused, never approximated).

A wrapper with `get_base_model()` (peft's PeftModel) is unwrapped to the causal LM it wraps. LoRA
and the other adapters that replace Linear modules live inside the decoder layers and need nothing
more. Prompt learning changes the decoder's inputs and is refused; any other trainable parameter
outside the parts (of the model as given, wrapper included) is refused by the coverage check.
core/README.md, "What is refused, and why", lists every refusal of the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# config.model_type -> family name shown to users. Qwen2.5 checkpoints are model_type "qwen2".
SUPPORTED_MODEL_TYPES = {
    "llama": "Llama",
    "qwen2": "Qwen2/Qwen2.5",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "gemma3_text": "Gemma-3 (text)",
}


@dataclass(frozen=True)
class KeyValueRecipe:
    """How a family's attention makes the keys/values it hands its attention function, as its
    transformers 5.x modeling file writes it: input_layernorm; k_proj and v_proj viewed as
    (B, c, h_kv, hd), transposed to (B, h_kv, c, hd); k_norm where the family has one, on the view
    before the transpose (Qwen3) or after it (Gemma-3); RoPE on the keys. kv_capture.py runs it."""

    key_norm: str | None = None  # None | "before transpose" | "after transpose"
    window_from_config: bool = False  # Mistral passes config.sliding_window; the others their attention's own


# config.model_type -> its recipe; a family without one captures keys/values through the whole layer
KEY_VALUE_RECIPES = {
    "llama": KeyValueRecipe(),
    "qwen2": KeyValueRecipe(),
    "qwen3": KeyValueRecipe(key_norm="before transpose"),
    "mistral": KeyValueRecipe(window_from_config=True),
    "gemma3_text": KeyValueRecipe(key_norm="after transpose"),
}


class UnsupportedModelError(ValueError):
    """The model cannot be streamed exactly; the message says why and what is supported."""


@dataclass(frozen=True)
class DecoderParts:
    """References into one causal LM; nothing here owns or changes the model."""

    model: nn.Module  # the causal LM; unwrapped when given inside a PeftModel
    decoder: nn.Module  # the base model: embed -> layers -> norm
    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear
    final_logit_softcap: float | None
    key_values: KeyValueRecipe | None = None  # the family's K/V recipe (kv_capture.py), if it has one

    @property
    def config(self):
        return self.model.config


def supported_families() -> str:
    return ", ".join(SUPPORTED_MODEL_TYPES.values())


def unwrap_model(model: nn.Module) -> nn.Module:
    """The causal LM under adapter wrappers: follows `get_base_model()` (peft's PeftModel, whose
    LoRA layers sit inside the base model's modules) without importing the wrapper's library."""
    seen = {id(model)}
    while callable(getattr(type(model), "get_base_model", None)):
        base = model.get_base_model()
        if not isinstance(base, nn.Module) or id(base) in seen:
            break
        seen.add(id(base))
        model = base
    return model


def resolve_parts(model: nn.Module) -> DecoderParts:
    """Find the parts of a supported causal LM (bare or under a PeftModel), or raise
    UnsupportedModelError."""
    wrapper, model = model, unwrap_model(model)
    if getattr(getattr(wrapper, "active_peft_config", None), "is_prompt_learning", False):
        raise UnsupportedModelError(
            "StreamBP does not support prompt learning (prompt/prefix tuning adds tokens or a cache the "
            "decoder never sees here); use LoRA or another adapter inside the layers"
        )
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"StreamBP does not support model_type {model_type!r}; supported families: "
            f"{supported_families()} (text-only causal LMs such as Qwen3ForCausalLM)"
        )
    decoder = model.get_decoder()
    lm_head = model.get_output_embeddings()
    if decoder is None or lm_head is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a causal LM with an lm_head; load it with AutoModelForCausalLM"
        )
    if not isinstance(lm_head, nn.Linear):
        raise UnsupportedModelError(
            f"StreamBP needs the lm_head to be a torch.nn.Linear, got {type(lm_head).__name__} "
            "(adapters on the lm_head, e.g. LoRA target_modules or modules_to_save including it, are not supported)"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError("StreamBP does not support attention logit softcapping")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("StreamBP needs causal attention; use_bidirectional_attention is set")
    parts = DecoderParts(
        model=model,
        decoder=decoder,
        embed=decoder.get_input_embeddings(),
        layers=decoder.layers,
        norm=decoder.norm,
        lm_head=lm_head,
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
        key_values=KEY_VALUE_RECIPES.get(model_type),
    )
    _check_all_trainable_parameters_covered(parts, wrapper)
    return parts


def _check_all_trainable_parameters_covered(parts: DecoderParts, wrapper: nn.Module) -> None:
    """A trainable parameter outside embed/layers/norm/lm_head would silently get no gradient.
    Checked on the model as given, so a wrapper's own parameters (a prompt encoder) count too."""
    covered = {id(p) for module in (parts.embed, parts.layers, parts.norm, parts.lm_head) for p in module.parameters()}
    missed = [name for name, p in wrapper.named_parameters() if p.requires_grad and id(p) not in covered]
    if missed:
        raise UnsupportedModelError(
            f"StreamBP would not compute gradients for {missed[:3]}; these parameters are outside the "
            "embedding, decoder layers, final norm and lm_head"
        )


def check_no_attention_dropout(parts: DecoderParts) -> None:
    """Dropout active in a layer draws new masks in every re-forward: refuse it, in the attention
    (config.attention_dropout) or in a module (e.g. LoRA's lora_dropout, an nn.Dropout)."""
    dropout = getattr(parts.config, "attention_dropout", 0.0) or 0.0
    if parts.model.training and dropout > 0:
        raise UnsupportedModelError(
            f"attention_dropout={dropout} in training mode makes every re-forward differ; "
            "set config.attention_dropout = 0 or call model.eval()"
        )
    for name, module in parts.layers.named_modules():
        if isinstance(module, nn.Dropout) and module.training and module.p > 0:
            raise UnsupportedModelError(
                f"dropout p={module.p} in training mode at layers.{name} makes every re-forward differ; "
                "use dropout 0 (for LoRA: lora_dropout=0) or call model.eval()"
            )


def trainable(module: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]
