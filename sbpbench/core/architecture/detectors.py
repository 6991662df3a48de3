"""What makes a causal LM impossible to stream exactly, read from its config and its modules.

Each detector names one feature and says, in one line, why StreamBP refuses it: a computation
that couples positions outside the attention call, or that differs from one re-forward to the
next. What the detectors do not see, the self-check does (self_check.py): a small copy of the
architecture through standard BP and StreamBP in float64. The behaviour the attention function
sees at run time (its arguments, one call per layer) is checked where it runs (attention.py).

StreamBP reruns each layer: once in the checkpoint pass, once in the layer backward (more under
the recompute placements). It splits the sequence: every computation must be per position, or
inside the attention call, whose keys and values it carries across chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn

from .parts import DecoderParts, UnsupportedModelError

# transformers' names for attention layers whose masks StreamBP builds itself (layer_types)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# config values that route tokens by capacity: a token dropped depends on every other token routed with it
_CAPACITY_KEYS = ("capacity_factor", "expert_capacity", "moe_capacity_factor", "train_capacity_factor")
# config values of randomness in training that no re-forward can repeat (besides dropout)
_NOISE_KEYS = ("router_jitter_noise", "input_jitter_noise", "jitter_noise", "router_noise")

Detector = Callable[[DecoderParts], Iterator[str]]


def refusals(parts: DecoderParts) -> list[str]:
    """Every reason this model cannot be streamed exactly (empty: the detectors see none)."""
    return [reason for detect in DETECTORS for reason in detect(parts)]


def check_streamable(parts: DecoderParts) -> None:
    """UnsupportedModelError with the first reason a detector gives, before any work."""
    reasons = refusals(parts)
    if reasons:
        raise UnsupportedModelError(reasons[0])


# what a mixer's forward calls on its cache to carry a state (transformers 5.x's linear-attention cache)
STATE_CALLS = ("update_conv_state", "update_recurrent_state")


def carries_state(layer: nn.Module) -> bool:
    """A submodule of the layer hands its state to the cache it is given (its class's forward calls
    the cache's state updates): StreamBP carries that state across chunks (carried_state.py)."""
    for module in layer.modules():
        forward = type(module).forward
        while hasattr(forward, "__wrapped__"):
            forward = forward.__wrapped__
        names = getattr(getattr(forward, "__code__", None), "co_names", ())
        if any(name in names for name in STATE_CALLS):
            return True
    return False


def _convolutions(parts: DecoderParts) -> Iterator[str]:
    """A convolution in a decoder layer mixes neighbouring positions outside the attention call,
    unless the layer's mixer carries its tail through the cache (carries_state)."""
    for index, layer in enumerate(parts.layers):
        for name, module in layer.named_modules():
            if isinstance(module, nn.modules.conv._ConvNd) and not carries_state(layer):
                yield (
                    f"layers.{index}.{name} is a {type(module).__name__}: it mixes neighbouring positions outside the "
                    "attention call and hands no state to transformers' cache, so StreamBP cannot split it into chunks"
                )
                return


def _shared_key_values(parts: DecoderParts) -> Iterator[str]:
    """Keys and values one layer computes and later layers reuse (Gemma-3n, Gemma-4): a layer's
    backward would need another layer's buffers."""
    shared = getattr(parts.config, "num_kv_shared_layers", 0) or 0
    flagged = [name for name, m in parts.layers.named_modules() if getattr(m, "is_kv_shared_layer", False)]
    if shared or flagged:
        yield (
            "key/value states are shared across layers (num_kv_shared_layers): a layer's backward would need "
            "another layer's keys and values"
        )


def _bidirectional(parts: DecoderParts) -> Iterator[str]:
    """Attention that sees later positions cannot be streamed last chunk first."""
    if getattr(parts.config, "use_bidirectional_attention", False):
        yield "StreamBP needs causal attention; use_bidirectional_attention is set"
        return
    for name, module in parts.layers.named_modules():
        if getattr(module, "is_causal", True) is False:
            yield f"layers.{name} is not causal (is_causal=False): StreamBP needs causal attention"
            return


def _dropout_in_training(parts: DecoderParts) -> Iterator[str]:
    """Dropout active in a layer draws new masks in every re-forward: in the attention
    (config.attention_dropout and its like), or in a module (e.g. LoRA's lora_dropout, an nn.Dropout)."""
    if not parts.model.training:
        return
    config = parts.config
    for key, value in sorted(vars(config).items()):
        if (key.endswith("dropout") or key.endswith("pdrop")) and isinstance(value, float) and value > 0:
            yield f"{key}={value} in training mode makes every re-forward differ; set config.{key} = 0 or call model.eval()"
            return
    for name, module in parts.layers.named_modules():
        if isinstance(module, nn.Dropout) and module.training and module.p > 0:
            yield (
                f"dropout p={module.p} in training mode at layers.{name} makes every re-forward differ; "
                "use dropout 0 (for LoRA: lora_dropout=0) or call model.eval()"
            )
            return


def _routing_that_depends_on_other_tokens(parts: DecoderParts) -> Iterator[str]:
    """Capacity-limited experts drop tokens by what else is routed in the same batch, and router
    noise in training is drawn anew in every re-forward."""
    config = parts.config
    for key in _CAPACITY_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            yield (
                f"{key}={value}: experts with a capacity drop tokens by what else is routed with them, which a "
                "chunk does not see; StreamBP needs dropless routing"
            )
            return
    if parts.model.training:
        for key in _NOISE_KEYS:
            value = getattr(config, key, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                yield f"{key}={value} in training mode makes every re-forward route differently; set it to 0"
                return


DETECTORS: tuple[Detector, ...] = (
    _convolutions,
    _shared_key_values,
    _bidirectional,
    _dropout_in_training,
    _routing_that_depends_on_other_tokens,
)


def _engine_hook(hook) -> bool:
    """A hook of the data-parallel engine itself (FSDP2's, DeepSpeed's), not the caller's."""
    home = getattr(hook, "__module__", None) or getattr(getattr(hook, "func", None), "__module__", None) or ""
    return home.startswith(("torch.distributed", "deepspeed"))


def caller_hooks(module: nn.Module) -> int:
    """The forward pre-hooks and hooks on `module` that its caller registered."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return sum(1 for hook in hooks if not _engine_hook(hook))


def check_hooks_run(parts: DecoderParts, call: Callable[[nn.Module], Callable]) -> None:
    """Module hooks on the layers are honoured where each chunk runs through the layer's __call__.
    Under a sharded engine the chunks run hook-free (`call(layer)` is not the layer): a caller's hook
    would act in the checkpoint pass and not in the backward, so it is refused."""
    for index, layer in enumerate(parts.layers):
        if call(layer) is not layer and caller_hooks(layer):
            raise UnsupportedModelError(
                f"a forward hook on layers.{index} would not run in StreamBP's hook-free chunks under a sharded "
                "engine (FSDP2, DeepSpeed); remove it or train on one process"
            )
