"""One training step's model, batch, gradients and optimizer with no memory behind the model.

The model is built from its config on the meta device (LoRA adapters included), then every
parameter, buffer and tensor attribute is replaced by a *CPU* fake tensor of the same shape,
strides and dtype, under a FakeTensorMode (fake CUDA tensors abort a CPU-only torch build once
autograd runs). Built on meta first because peft moves its adapters with `module.to(...)`, which
fails on fake parameters (the fake mode holds weak references, so they cannot be swapped). The
batch is real: it is small, and the step's Python reads its values (token counts, which chunks
hold targets), which fake tensors cannot give. The step itself is the measured one
(methods/step.py); the model matches workload/build.py's (same config, overrides, LoRA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from transformers import AutoModelForCausalLM

from ..config import DTYPES, RunSpec
from ..methods.step import TrainingStep
from ..models import apply_lora, implementations, load_config
from ..workload.build import make_spec_batch, training_step


class CheaperKeyFakeTensorMode(FakeTensorMode):
    """FakeTensorMode whose dispatch-cache key describes a plain fake tensor in one tuple.

    Every op under a FakeTensorMode (torch/_subclasses/fake_tensor.py, torch 2.13) looks up its
    output metadata in a cache keyed by the op and its arguments' metadata; torch builds that key
    field by field through `extract_tensor_metadata` and `TensorMetadata._flatten_into`, about half
    of a fake op's cost here. For a dense fake tensor of this mode with static shapes, the tuple below
    holds the same information: torch's other fields (layout strided, not sparse, memory format a
    function of shape and strides, is_quantized a function of the dtype) are implied by it. Anything
    else (symbolic shapes, sparse or constant tensors, real tensors, dicts) takes torch's own path,
    which also decides when an op is not cached. Keys differ from torch's, so the cache entries are
    made and read by this mode only; the outputs they give are torch's, so byte counts are unchanged."""

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:
        if type(args) not in (list, tuple):
            super()._prep_args_for_hash(result, args, state, id_hashed_objects)
            return
        key = [type(args), f"length_{len(args)}"]
        for arg in args:
            if isinstance(arg, FakeTensor):
                if (
                    arg.fake_mode is not self
                    or arg.constant is not None
                    or arg.layout != torch.strided
                    or arg._has_symbolic_sizes_strides
                ):
                    break
                key.append(FakeTensor)  # a marker: no other argument adds this class to a key
                key.append(
                    (
                        arg.dtype,
                        tuple(arg.shape),
                        arg.stride(),
                        arg.fake_device,
                        arg.storage_offset(),
                        arg.untyped_storage().nbytes(),
                        arg.requires_grad,
                        arg.is_conj(),
                        arg.is_neg(),
                        arg.is_inference(),
                    )
                )
            elif isinstance(arg, torch.Tensor) or type(arg) not in _PLAIN_ARGS:
                break
            else:
                key.append(type(arg))
                key.append(arg)
        else:
            result.extend(key)
            return
        super()._prep_args_for_hash(result, args, state, id_hashed_objects)  # lists, symbols, bypasses


# argument types added to a key as (type, value), as torch does; lists and tuples recurse through torch's path
_PLAIN_ARGS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


@dataclass
class FakeStep:
    """The measured step (methods/step.py) over a fake model and a real batch, and the fake mode
    it must run under."""

    mode: FakeTensorMode
    step: TrainingStep


def _fake_model(spec: RunSpec, mode: FakeTensorMode) -> torch.nn.Module:
    """build_model_and_batch's model (config, depth override, LoRA) with fake CPU tensors."""
    overrides = {"num_hidden_layers": spec.num_layers} if spec.num_layers else {}
    config = load_config(spec.model, **overrides)  # never a checkpoint's weights
    if "experts_implementation" in implementations(config, DTYPES[spec.dtype]):
        raise ValueError(
            f"{spec.model} routes tokens to experts one expert at a time outside bf16, buffers sized by where the router "
            "sends each token, which fake tensors cannot know; predict it in bf16 (--dtype bf16: grouped experts, "
            "buffers routing does not size)"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=DTYPES[spec.dtype], **implementations(config, DTYPES[spec.dtype])
        )
    if spec.lora_rank:
        model = apply_lora(model, rank=spec.lora_rank, alpha=spec.lora_alpha)
    fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by identity (tied weights stay one tensor)

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            made = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            made = nn.Parameter(made, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else made
            fakes[id(t)] = (t, made)  # keeps t alive, so its id cannot be reused meanwhile
        return fakes[id(t)][1]

    with mode:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is not None:
                        table[name] = fake(t)
            for name, value in list(vars(module).items()):  # plain tensor attributes, e.g. a RoPE's inv_freq copy
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    setattr(module, name, fake(value))
    return model


def build_fake_step(spec: RunSpec, *, foreach_optimizer: bool = False) -> FakeStep:
    """The point's model (fake), batch (real) and optimizer, gradients per spec.protocol.

    foreach_optimizer: AdamW's multi-tensor implementation, PyTorch's default for CUDA
    parameters (CPU parameters get the per-tensor loop); it allocates whole-group temporaries.
    With spec.sp > 1: rank 0's step of P ranks sharing each sequence, sharded (sequence_parallel.py),
    built and run inside `fake_ranks`."""
    if spec.device != "cpu":
        raise ValueError(f"a simulated point is built on fake CPU tensors; give device 'cpu', got {spec.device!r}")
    mode = CheaperKeyFakeTensorMode(allow_non_fake_inputs=True)
    model = _fake_model(spec, mode)
    if spec.sp > 1:  # one rank of P sharing the sequence, in sequence_parallel.fake_ranks
        from .sequence_parallel import sharded_sequence_step

        return FakeStep(mode, sharded_sequence_step(spec, model, mode, foreach_optimizer=foreach_optimizer))
    batch = make_spec_batch(spec, model.config)
    step = training_step(spec, model, batch, foreach_optimizer=foreach_optimizer, allocation=mode)
    return FakeStep(mode=mode, step=step)
