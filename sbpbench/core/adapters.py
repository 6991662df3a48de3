"""Where StreamBP finds the parts of a HuggingFace causal LM, and which families it accepts.

The decoder layers themselves run unmodified; the family-specific part is only how to reach the
embedding, the layer list, the final norm and the lm_head, and which config features would make
the streamed computation differ from the model's own (those are refused, never approximated).
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


class UnsupportedModelError(ValueError):
    """The model cannot be streamed exactly; the message says why and what is supported."""


@dataclass(frozen=True)
class DecoderParts:
    """References into one causal LM; nothing here owns or changes the model."""

    model: nn.Module
    decoder: nn.Module  # the base model: embed -> layers -> norm
    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear
    final_logit_softcap: float | None

    @property
    def config(self):
        return self.model.config


def supported_families() -> str:
    return ", ".join(SUPPORTED_MODEL_TYPES.values())


def resolve_parts(model: nn.Module) -> DecoderParts:
    """Find the parts of a supported causal LM, or raise UnsupportedModelError."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"StreamBP does not support model_type {model_type!r}; supported families: "
            f"{supported_families()} (text-only causal LMs such as Qwen3ForCausalLM)"
        )
    decoder = model.get_decoder()
    lm_head = model.get_output_embeddings()
    if decoder is None or lm_head is None or not isinstance(lm_head, nn.Linear):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a causal LM with an lm_head; load it with AutoModelForCausalLM"
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
    )
    _check_all_trainable_parameters_covered(parts)
    return parts


def _check_all_trainable_parameters_covered(parts: DecoderParts) -> None:
    """A trainable parameter outside embed/layers/norm/lm_head would silently get no gradient."""
    covered = {id(p) for module in (parts.embed, parts.layers, parts.norm, parts.lm_head) for p in module.parameters()}
    missed = [name for name, p in parts.model.named_parameters() if p.requires_grad and id(p) not in covered]
    if missed:
        raise UnsupportedModelError(
            f"StreamBP would not compute gradients for {missed[:3]}; these parameters are outside the "
            "embedding, decoder layers, final norm and lm_head"
        )


def check_no_attention_dropout(parts: DecoderParts) -> None:
    dropout = getattr(parts.config, "attention_dropout", 0.0) or 0.0
    if parts.model.training and dropout > 0:
        raise UnsupportedModelError(
            f"attention_dropout={dropout} in training mode makes every re-forward differ; "
            "set config.attention_dropout = 0 or call model.eval()"
        )


def trainable(module: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]
