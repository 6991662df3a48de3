"""The self-check: a small float64 copy of a model's architecture through standard BP and StreamBP.

A list of names cannot say which models stream exactly: four families that looked like Llama came
out wrong when merely admitted (a logit scale in the head, a residual scaling, a float32 norm).
So before the first step of an architecture that is neither in the verified table (verified.py)
nor checked already in this process, StreamBP checks it: the small copy (small_copy.py), random
weights, float64 on the CPU, two rows (one right-padded), T = 41, at two chunk sizes that do not
divide T. Both steps run with every float32 computation of the model made float64 (an RMSNorm or a
router that upcasts, a float32 accumulator): those are per-position choices both methods make
alike, and in float32 their sums over positions would round differently by order alone. So the
loss and every parameter's gradient must equal standard BP's to 1e-10 of the largest reference
value. A step that raises is a refusal with its reason.

Standard BP is the model's own forward (its `logits`, and its auxiliary loss where it adds one)
with the cross-entropy computed in float64. The verdict is cached per architecture key (the class,
the config with every number reduced to set or unset, the library versions).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .parts import UnsupportedModelError
from .small_copy import small_config

CHECK_VERSION = "1"  # bump when what the check runs changes: cached verdicts then no longer count
TOLERANCE = 1e-10
SEQ_LEN, PADDED_LENGTH = 41, 36  # 5 pads: fewer than a window (8), so no pad sees only pads
CHUNK_SIZES = ((7, 5), (16, 9))  # (chunk_size, logits_chunk_size): neither divides T

# the step under test: (model, input_ids, labels, attention_mask, chunk_size, logits_chunk_size) -> loss
Stepper = Callable[..., torch.Tensor]
# config keys whose values never select code: names, bookkeeping, token ids, the dtype
_BOOKKEEPING = (
    "_name_or_path", "name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "id2label",
    "label2id", "_attn_implementation", "_experts_implementation", "bos_token_id", "eos_token_id", "pad_token_id",
    "tokenizer_class", "auto_map", "use_cache", "return_dict", "output_hidden_states", "output_attentions",
)  # fmt: skip


@dataclass(frozen=True)
class SelfCheck:
    """The verdict on one architecture."""

    architecture: str  # the class name
    key: str  # architecture_key
    exact: bool
    error: float | None  # the worst relative error against standard BP; None when the step raised
    where: str  # the tensor of the worst error, or the step's error

    def describe(self) -> str:
        if self.error is None:
            return f"{self.architecture}: refused ({self.where})"
        verdict = "exact" if self.exact else "differs from standard BP"
        return f"{self.architecture}: {verdict}, worst relative error {self.error:.1e} ({self.where})"

    def refusal(self) -> str:
        if self.error is None:
            return f"StreamBP cannot stream {self.architecture}: its self-check failed: {self.where}"
        return (
            f"StreamBP's self-check of {self.architecture} differs from standard BP by {self.error:.1e} at "
            f"{self.where}: this architecture does something StreamBP does not reproduce, so it is refused"
        )


def architecture_key(model_class: type, config) -> str:
    """The class and the config's code-selecting values (numbers reduced to zero, set or unset),
    with the versions of transformers and of this check: what the verdict depends on."""
    model_class = transformers_class(model_class)
    values = {k: _shape_of(v) for k, v in sorted(config.to_dict().items()) if k not in _BOOKKEEPING}
    text = json.dumps([model_class.__name__, values, transformers.__version__, CHECK_VERSION], sort_keys=True)
    return f"{model_class.__name__}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _shape_of(value):
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return "zero" if value == 0 else "set"
    if isinstance(value, dict):
        return {k: _shape_of(v) for k, v in sorted(value.items()) if k not in _BOOKKEEPING}
    if isinstance(value, (list, tuple)):
        return sorted({json.dumps(_shape_of(v), sort_keys=True) for v in value})
    return type(value).__name__


def self_check(model_class: type, config, stepper: Stepper, *, training: bool = True) -> SelfCheck:
    """Build the small copy of the architecture (`model_class` built from `config`) and compare
    `stepper` (StreamBP) with standard BP on it (module docstring), in training mode or not."""
    model_class = transformers_class(model_class)
    name = model_class.__name__
    key = architecture_key(model_class, config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only spin (15x slower on 2 busy cores)
    try:
        with _disable_current_modes():  # real tensors, whatever mode the caller runs in (the estimator's fakes)
            return _checked(name, key, model_class, config, stepper, training)
    finally:
        torch.set_num_threads(threads)


def transformers_class(model_class: type) -> type:
    """The transformers class a wrapped model's class derives from (FSDP2's FSDP<Name>), or itself."""
    for cls in model_class.__mro__:
        if cls.__module__.startswith("transformers.models."):
            return cls
    return model_class


def _checked(name: str, key: str, model_class: type, config, stepper: Stepper, training: bool) -> SelfCheck:
    try:
        small = _small_copy(model_class, config, training)
        ids, labels, mask = _batch(small.config.vocab_size)
        with Float64Throughout():
            reference_loss, reference = _standard_bp(small, ids, labels, mask)
        worst, where = 0.0, "loss"
        for chunk_size, logits_chunk_size in CHUNK_SIZES:
            small.zero_grad(set_to_none=True)
            with Float64Throughout():
                loss = stepper(small, ids, labels, mask, chunk_size, logits_chunk_size)
            grads = {n: p.grad for n, p in small.named_parameters() if p.requires_grad}
            for tensor_name, error in _errors(loss, reference_loss, grads, reference):
                if not error <= worst:  # NaN is the worst
                    worst, where = error, f"{tensor_name}, chunk {chunk_size}"
    except Exception as error:  # a refusal, whatever raised it: the step cannot run this architecture
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        return SelfCheck(name, key, False, None, f"{type(error).__name__}: {reason}")
    return SelfCheck(name, key, worst <= TOLERANCE, worst, where)


MAX_PARAMETERS = 10_000_000  # a small copy is a few hundred thousand; more means a size it could not make small


def _small_copy(model_class: type, config, training: bool) -> nn.Module:
    small_cfg = small_config(config)
    with torch.device("meta"):
        count = sum(p.numel() for p in model_class._from_config(small_cfg).parameters())
    if count > MAX_PARAMETERS:
        raise UnsupportedModelError(
            f"its small copy would have {count:,} parameters: the config has sizes the self-check cannot make small"
        )
    kwargs = {"dtype": torch.float64}
    if getattr(model_class, "_can_set_experts_implementation", lambda: False)():
        kwargs["experts_implementation"] = "eager"  # grouped_mm refuses float64
    state = torch.random.get_rng_state()
    torch.manual_seed(0)  # the same copy every time; the caller's random stream is left as it was
    try:
        with torch.device("cpu"):
            small = model_class._from_config(small_cfg, **kwargs)
    finally:
        torch.random.set_rng_state(state)
    small.to(torch.float64)  # modules a class keeps in float32 (a router, a bias) too: see Float64Throughout
    small.train(training)
    return small


def _batch(vocab_size: int):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, SEQ_LEN), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, PADDED_LENGTH:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, labels, mask


def _standard_bp(model: nn.Module, ids, labels, mask):
    """The model's own forward and loss, the cross-entropy in float64 (transformers' `labels=`
    loss upcasts to float32 even in a float64 model)."""
    model.zero_grad(set_to_none=True)
    output = model(input_ids=ids, attention_mask=mask, use_cache=False)
    logits = output.logits.double()
    loss = nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    aux = getattr(output, "aux_loss", None)
    if aux is not None:  # a router's load-balancing loss, as the model adds it to its own
        coefficient = getattr(model, "router_aux_loss_coef", None) or model.config.router_aux_loss_coef
        loss = loss + coefficient * aux
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _errors(loss, reference_loss, grads: dict, reference: dict):
    """(tensor, max |ours - reference| / max |reference|) for the loss and every reference gradient."""
    yield "loss", _relative(loss.detach().double(), reference_loss)
    scale = max((float(g.abs().max()) for g in reference.values() if g.numel()), default=0.0)
    floor = 4 * torch.finfo(torch.float64).eps * scale  # rounding noise on a gradient that is zero exactly
    for name, want in reference.items():
        got = grads.get(name)
        if got is None:
            yield name, math.inf
            continue
        diff = float((got.double() - want).abs().max())
        yield name, 0.0 if diff <= floor else _relative(got.double(), want)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = float((got - want).abs().max())
    scale = float(want.abs().max())
    return diff / scale if scale > 0 else diff


class Float64Throughout(TorchDispatchMode):
    """Every float32 value the model makes is made in float64 instead: a cast to float32 keeps
    float64, a float32 factory makes float64 (the small copy holds no float32 tensor to begin
    with: `_small_copy` makes every parameter and buffer float64)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs and kwargs.get("dtype") is torch.float32:
            kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **(kwargs or {}))


def refuse_unless_exact(check: SelfCheck) -> None:
    if not check.exact:
        raise UnsupportedModelError(check.refusal())
