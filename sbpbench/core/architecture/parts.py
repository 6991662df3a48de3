"""Where StreamBP finds the parts of a HuggingFace causal LM: the embedding, the decoder layers, the
final norm and the lm_head, by the structure every transformers decoder-only model shares, never
by its name.

The decoder layers run unmodified; which models they stream exactly is the detectors' and the
self-check's to say (detectors.py, self_check.py). A wrapper with `get_base_model()` (peft's
PeftModel) is unwrapped to the causal LM it wraps. LoRA and the other adapters that replace Linear
modules live inside the decoder layers and need nothing more. Prompt learning changes the decoder's
inputs and is refused; any other trainable parameter outside the parts (of the model as given,
wrapper included) is refused by the coverage check. core/README.md, "What is refused, and why",
lists every refusal of the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# what transformers' decoders call the norm after their last layer
FINAL_NORM_NAMES = ("norm", "final_layernorm", "norm_f", "final_norm")


class UnsupportedModelError(ValueError):
    """The model cannot be streamed exactly; the message says why."""


@dataclass(frozen=True)
class DecoderParts:
    """References into one causal LM; nothing here owns or changes the model."""

    model: nn.Module  # the causal LM; unwrapped when given inside a PeftModel
    decoder: nn.Module  # the base model: embed -> layers -> norm
    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear

    @property
    def config(self):
        return self.model.config

    @property
    def final_logit_softcap(self) -> float | None:
        """Gemma-style softcapping of the logits (tanh(logits / cap) x cap), for the peers whose
        fused heads take it; StreamBP's head runs the model's own (head_call.py)."""
        return getattr(self.config, "final_logit_softcapping", None)


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
    """Find the parts of a decoder-only causal LM (bare or under a PeftModel), or raise
    UnsupportedModelError naming the part that is missing."""
    wrapper, model = model, unwrap_model(model)
    if getattr(getattr(wrapper, "active_peft_config", None), "is_prompt_learning", False):
        raise UnsupportedModelError(
            "StreamBP does not support prompt learning (prompt/prefix tuning adds tokens or a cache the "
            "decoder never sees here); use LoRA or another adapter inside the layers"
        )
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; StreamBP streams decoder-only causal LMs")
    decoder = find_decoder(model)
    lm_head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if decoder is None or lm_head is None:
        raise UnsupportedModelError(f"{name} is not a causal LM with an lm_head; load it with AutoModelForCausalLM")
    if not isinstance(lm_head, nn.Linear):
        raise UnsupportedModelError(
            f"StreamBP needs the lm_head to be a torch.nn.Linear, got {type(lm_head).__name__} "
            "(adapters on the lm_head, e.g. LoRA target_modules or modules_to_save including it, are not supported)"
        )
    layers = getattr(decoder, "layers", None)
    norm = next(
        (getattr(decoder, n) for n in FINAL_NORM_NAMES if isinstance(getattr(decoder, n, None), nn.Module)), None
    )
    if not isinstance(layers, nn.ModuleList) or norm is None:
        missing = (
            "decoder.layers (a ModuleList)" if not isinstance(layers, nn.ModuleList) else "final norm (decoder.norm)"
        )
        raise UnsupportedModelError(
            f"{name} has no {missing}: StreamBP needs the embed -> layers -> final norm structure of "
            "transformers' decoder-only models"
        )
    parts = DecoderParts(
        model=model, decoder=decoder, embed=decoder.get_input_embeddings(), layers=layers, norm=norm, lm_head=lm_head
    )
    _check_all_trainable_parameters_covered(parts, wrapper)
    return parts


def find_decoder(model: nn.Module) -> nn.Module | None:
    """The base model (embed -> layers -> norm) inside a causal LM: what `get_decoder()` returns, or
    where that is the causal LM itself (a class whose base-model prefix names no attribute), the
    one child that holds the decoder layers."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is not None and isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        return decoder
    holders = [child for child in model.children() if isinstance(getattr(child, "layers", None), nn.ModuleList)]
    return holders[0] if len(holders) == 1 else decoder


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


def trainable(module: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]
